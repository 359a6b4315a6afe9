"""A monitor's side of ``clip_grad_norm_``: the step gathered before the clip.

``trainwatch.clip_hook`` wraps the function ``clip_grad_norm_`` rescales
through and tells the monitor owning the clipped gradients, before and after
the clip. Before: the optimizer holding them is gathered there and then (its
step keeps that gathering), so the norms and the rules see what backward
made, not the clip threshold. After: where the step's backward left
gradients the tracker noted, they are noted again as clipped, and at the
step a gradient reset or rewritten since the clip has the step gathered
again, so a ``zero_grad()`` between the clip and the step is still seen.

A step taken with a closure after the clip (Lightning's manual optimization
steps through ``optimizer.step(closure)`` once the loop has clipped) keeps
that gathering over the closure: unless the closure runs the model again, it
is the step's own, read before the clip, with the pass that made the
gradients. Gathered a second time instead, after the clip and with no pass
since, the step would lose what its pass found and read as one whose pass no
hook saw.

Asked only by a loop that clips (or by the monitor's pre-step hook once such
a gathering is held): a loop that never clips never reaches this.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from trainwatch import clip_hook
from trainwatch.weak import weak_getter

if TYPE_CHECKING:
    from trainwatch.rules.rule_set import RuleSet
    from trainwatch.step_pipeline import PendingStep, StepPipeline


class ClipGathering:
    """Gathers the step before ``clip_grad_norm_`` rescales its gradients."""

    def __init__(
        self,
        pipeline: StepPipeline,
        rules: RuleSet,
        optimizers: list[Optimizer],
        pending: dict[int, PendingStep],
        gathered_at_pass: dict[int, int],
        collect_before_step: Callable[..., None],
    ) -> None:
        self._pipeline = pipeline
        self._rules = rules
        # The monitor's own containers, shared: the watched optimizers, the
        # steps gathered ahead of their step, and the passes seen at each such gathering.
        self._optimizers = optimizers
        self._pending = pending
        self._gathered_at_pass = gathered_at_pass
        # The monitor's collect_before_step, held weakly (the monitor owns this object).
        self._collect = weakref.WeakMethod(collect_before_step)
        # Optimizers gathered before clipping on a step whose backward's gradients
        # were noted (not found reset as it began): at the step, a reset since
        # the clip is looked for.
        self.reset_after_clip: set[int] = set()
        self._holder: tuple[int, int, int] | None = None  # (id(param), len, index)
        # Steps gathered before clipping, kept over the closure step that followed.
        self.kept_over_closure: dict[int, PendingStep] = {}
        # The latest clip's max_norm (None: no clip seen), read as an alert is built.
        self.max_norm: Any = None
        pipeline.held.clip_max_norm = weak_getter(self, "max_norm", None)

    def gather_before_clipping(self, param: torch.Tensor) -> None:
        """Gathers the step of the optimizer holding ``param``, held for its step:
        not when gathered already for these passes (a framework's hook before its
        own clipping), nor while a GradScaler has not unscaled the gradients."""
        index = self._optimizer_holding(param)
        if index is None:
            return
        if index in self._pending and self._gathered_at_pass.get(index) == (
            self._pipeline.passes.passes
        ):
            return
        optimizer = self._optimizers[index]
        if not clip_hook.grads_unscaled(self._pipeline.scaler, optimizer):
            return
        collect = self._collect()
        if collect is None:
            return
        collect(optimizer, hold=True)
        if index in self._pending and self._pipeline.tracker.left is not None:
            self.reset_after_clip.add(index)
        else:
            self.reset_after_clip.discard(index)  # left by a step the scaler skipped

    def note_clipped(self, param: torch.Tensor) -> None:
        """The clip rescaled the gradients backward left: noted as they are now."""
        if self._optimizer_holding(param) in self.reset_after_clip:
            self._pipeline.tracker.note_left()

    def regather_if_reset(self, index: int, step: int) -> None:
        """At the step: the step gathered before clipping is taken again where every
        gradient it uses was set to None or written since the clip, so the step
        sees what it really applies (a second clip in place leaves them non-zero,
        and the rules tell the two apart as after backward)."""
        self.reset_after_clip.discard(index)
        params = self._pipeline.optimizer_params(index)
        if self._pipeline.tracker.rewritten_since_backward(params):
            self._pipeline.hand_loss_again(self._pending.get(index))
            self._pending[index] = self._pipeline.gather(index, step, again=True)

    def keep_over_closure(self, index: int, step: int) -> None:
        """``step(closure)`` begins on the step gathered before clipping: kept for
        the step to end with, where no pass ran since (a reset since the clip is
        looked for first, as at a step without a closure)."""
        if self._gathered_at_pass.get(index) != self._pipeline.passes.passes:
            return
        if index in self.reset_after_clip:
            self.regather_if_reset(index, step)
        pending = self._pending.get(index)
        if pending is not None:
            self.kept_over_closure[index] = pending

    def take_kept(self, index: int) -> PendingStep | None:
        """The step gathered before clipping and kept over its closure, where the
        closure ran no pass (one that did made gradients of its own: gathered anew)."""
        pending = self.kept_over_closure.pop(index, None)
        if pending is None or self._gathered_at_pass.get(index) != self._pipeline.passes.passes:
            return None
        return pending

    def forget(self, index: int) -> None:
        """The optimizer at ``index`` was let go: nothing of it is looked for."""
        self.reset_after_clip.discard(index)
        self.kept_over_closure.pop(index, None)

    def _optimizer_holding(self, param: torch.Tensor) -> int | None:
        """Which optimizer holds ``param`` (remembered: a loop clips the same ones)."""
        known = self._holder
        count = len(self._optimizers)
        if known is not None and known[0] == id(param) and known[1] == count:
            return known[2]
        # Asked only as clip_grad_norm_ runs: the loop clips, hints say no more.
        for rule in self._rules:
            rule.loop_clips = True
        for index, opt in enumerate(self._optimizers):
            if any(p is param for group in opt.param_groups for p in group["params"]):
                self._holder = (id(param), count, index)
                return index
        return None
