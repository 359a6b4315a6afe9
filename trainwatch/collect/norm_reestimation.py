"""Batch norm re-estimating statistics reset since it last trained: no evaluation.

After pruning, quantisation or a hand-written weight average (SWA), and for
AdaBN's domain adaptation, a loop resets a batch norm's running statistics
(``reset_running_stats()``, or ``reset_parameters()``) and forwards batches in
training mode under ``no_grad``: the default momentum re-estimates them from
those batches. Training mode is the point there; ``model.eval()`` would make
the passes do nothing. An evaluation that forgot ``model.eval()`` pours its
batches into statistics that training gathered. What tells them apart is
what the statistics hold: a re-estimation's hold only the batches of its
no-grad passes, counted from zero (``num_batches_tracked`` 1 after the first
pass, one more after each), with no training pass and no optimizer step of
the process since the reset. Statistics at zero that were never reset (a copy
of a model taken before its training, only its weights followed since) were
never estimated: no re-estimation, unless no step came since the model was
watched (a model just built, its statistics estimated before its training).

Told without a sync on the usual no-grad pass. The count is read (one
readback) only at a batch norm's first look and after its statistics were
written outside its forward: a reset, ``load_state_dict`` or a write by hand
bumps the running variance's version counter, an eager forward's update of it
does not. Between such writes the count grows by the count buffer's own
version counter, which each forward's ``+= 1`` bumps by one. A compiled
forward writes the running variance too: once seen doing so, a module is left
to the counters alone, a reset made after that no longer seen (its
re-estimation told as an evaluation, as before), so no pass of it pays a
readback.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from trainwatch.process_steps import ANY_OPTIMIZER_STEPS, PROCESS_STEPS


@dataclass
class _Look:
    """What one batch norm's statistics were at its last look."""

    module: weakref.ref[nn.Module]
    variance: weakref.ref[torch.Tensor]  # its running_var buffer (a new one: written)
    variance_version: int
    counter_version: int  # of num_batches_tracked
    count: int  # num_batches_tracked's value
    from_reset: bool  # re-estimating statistics reset since it last trained
    steps: tuple[int, int]  # the process's optimizer and monitor steps at the reset
    forward_writes: bool = False  # its forward writes running_var (compiled)


class NormReestimation:
    """Which batch norms in training mode, in a no-grad pass, re-estimate their
    statistics from a reset (see the module's docstring)."""

    def __init__(self) -> None:
        self._looks: dict[int, _Look] = {}
        # The process's optimizer and monitor steps when the model was watched:
        # statistics estimated before any step since are a model's just built.
        self._born = _steps()

    def clear(self) -> None:
        """The model's tree changed: looks at modules gone are dropped (a module
        still there is read once more at its next look)."""
        self._looks = {}

    def from_reset(self, module: nn.Module, pass_over: bool) -> bool:
        """Whether ``module`` (a batch norm in training mode, in a no-grad pass)
        re-estimates statistics reset since it last trained.

        ``pass_over``: the pass has run, so the count includes it (one batch
        since the reset); before it (a look at the pass's start), none.
        """
        counter = getattr(module, "num_batches_tracked", None)
        variance = getattr(module, "running_var", None)
        if not isinstance(counter, torch.Tensor) or not isinstance(variance, torch.Tensor):
            return False
        limit = 1 if pass_over else 0  # batches this pass may have added
        steps = _steps()
        look = self._looks.get(id(module))
        if look is not None and look.module() is not module:
            look = None  # another module, at the id of one gone
        grown = counter._version - look.counter_version if look is not None else 0
        # Still re-estimating: nothing trained since the last look, which found it so.
        going_on = look is not None and look.from_reset and grown <= limit and look.steps == steps
        written = (
            look is None
            or look.variance() is not variance
            or (look.variance_version != variance._version and not look.forward_writes)
        )
        if not written:
            look.count += grown
            look.counter_version += grown
            look.variance_version = variance._version
            look.from_reset = going_on or (
                look.count <= limit and _reset(counter, look.count, steps == self._born)
            )
            if look.from_reset and not going_on:
                look.steps = steps
            return look.from_reset
        count = _count(counter)
        if count is None:
            return False
        forward_writes = (
            look is not None
            and look.variance() is variance
            and count == look.count + grown
            and grown > 0
        )
        from_reset = going_on or (
            count <= limit and not forward_writes and _reset(counter, count, steps == self._born)
        )
        self._looks[id(module)] = _Look(
            weakref.ref(module),
            weakref.ref(variance),
            variance._version,
            counter._version,
            count,
            from_reset,
            look.steps if going_on else steps,
            forward_writes,
        )
        return from_reset


def _steps() -> tuple[int, int]:
    """The optimizer steps of the process and the steps of its monitors, now."""
    return ANY_OPTIMIZER_STEPS.count, PROCESS_STEPS.taken


def _reset(counter: torch.Tensor, count: int, before_training: bool) -> bool:
    """Whether statistics holding no batch yet but this pass's (``count``, the
    value of ``counter``, at 0 or 1) were reset, not merely never estimated.

    The batch count was written more often than the batches it holds, beyond
    the reset a batch norm makes when built: it counted batches and was set
    back to zero since (``reset_running_stats()``, ``reset_parameters()``, a
    fresh state loaded). Statistics never estimated (a copy of a model taken
    before its training, only its weights followed since: an EMA copy) show no
    such write: no re-estimation, unless no step of the process came since the
    model was watched (``before_training``: a model just built, its statistics
    estimated before its training).
    """
    return before_training or counter._version - count >= 2


def _count(counter: torch.Tensor) -> int | None:
    """``num_batches_tracked``'s value: the one readback (None: unreadable)."""
    try:
        return int(counter.item())
    except Exception:  # a meta or fake tensor: nothing to read
        return None
