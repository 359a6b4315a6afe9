"""A model trained on by an optimizer its monitor was never given.

Under ``tw.watch(model, opt)`` a loop that later builds a new optimizer for
the same model (a second training phase, a new head) and never hands it to
``monitor.add_optimizer`` trains on unwatched: the watched optimizer's step
hooks, which mark every step, stop running, and every step after that goes
unseen, bugs and all. The existing checks of a stopped optimizer run at the
step boundaries of the model's other optimizers, of which there are none.

Seen instead where the model's passes already notice backward passes that
no step followed (the non-finite probe counts them for ``amp_skipped_steps``,
and from enough of them on tells the pipeline at every pass): a look at the
weights every :data:`WINDOW` passes (or two steps' worth of passes, where a
step takes more), while no watched step comes. Weights that moved in
:data:`MOVED_LOOKS` windows in a row were updated by something the monitor
does not watch. Gradient accumulation, a saliency or attribution phase
(backward, no update), a GAN's generator whose optimizer steps less often
and a run that ended leave the weights where they are; an L-BFGS step's
own evaluations are no gap between steps. Healthy steps pay nothing: the
probe's count starts over at every step, so no look comes.

Before the watched optimizer's first step the looks wait for
:data:`BEFORE_FIRST_STEP` passes: meta-learning adapts the weights in an
inner loop of its own (Reptile's inner SGD, K steps per task) before the
outer, watched optimizer first steps, and an optimizer adopted then would
count every inner step as the model's.

A move is a change of values, seen from a few values spread over each
parameter (a write through ``.data`` or a new ``.data`` bumps no version
counter; an in-place write of the same values, such as a state dict loaded
again or a clamp that clamps nothing, bumps one and changes nothing). A
parameter the model's own forward writes (an ``nn.Embedding`` with
``max_norm`` renormalises the rows it looks up, changing them the first time
each is looked up after a step) is no evidence: the pass a look comes in
tells those from their version counters, moved between its start and end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from trainwatch.collect.passes import ModelPasses
from trainwatch.collect.tensors import local_part

# Passes between two looks at the weights (at least two steps' worth of passes).
WINDOW = 10
# Looks in a row that found the weights moved before they are told of: one
# write (a checkpoint loaded before an attribution phase) is no training.
MOVED_LOOKS = 2
# The model's passes with no look while its watched optimizer never stepped yet:
# many inner-loop steps (Reptile's K, up to a hundred) come before the first.
BEFORE_FIRST_STEP = 256
# Values spread over each parameter, compared from look to look.
_SAMPLED_VALUES = 16

_VERSION = attrgetter("_version")


@dataclass(slots=True)
class _Note:
    """The weights as one look found them."""

    steps: int  # the monitor's steps taken then
    passes: int  # the model's passes then
    params: list[torch.Tensor]  # the model's trainable ones
    versions: list[int]  # theirs, as the look's pass began
    looked_at: tuple[int, ...]  # ids of those no forward writes, whose values are kept
    values: list[torch.Tensor]  # a few of each one's values, as bytes, one copy per device


def _sampled_bytes(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """A few values spread over each parameter, copied together (one small copy per
    device), as bytes: a NaN weight left alone is no change."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for param in params:
        local = local_part(param.detach())
        if local.layout != torch.strided or local.numel() == 0 or local.is_meta:
            continue
        flat = local.reshape(-1)
        stride = max(1, flat.numel() // _SAMPLED_VALUES)
        by_device.setdefault(flat.device, []).append(flat[::stride][:_SAMPLED_VALUES])
    return [torch.cat(values).view(torch.uint8) for values in by_device.values()]


def _note(params: list[torch.Tensor], steps: int, passes: int, skipped: set[int]) -> _Note:
    looked_at = [p for p in params if id(p) not in skipped]
    return _Note(
        steps,
        passes,
        params,
        list(map(_VERSION, params)),
        tuple(map(id, looked_at)),
        _sampled_bytes(looked_at),
    )


def _moved(then: _Note, now: _Note) -> bool:
    """Whether the weights' values changed between two looks (or the weights are others)."""
    return (
        then.looked_at != now.looked_at
        or len(then.values) != len(now.values)
        or not all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(then.values, now.values)
        )
    )


class UnwatchedUpdates:
    """Looks at the weights while backward passes go by with no watched step."""

    def __init__(self, passes: ModelPasses) -> None:
        self._passes = passes
        self._note: _Note | None = None
        self._moved = 0  # looks in a row that found the weights moved
        # ids of the parameters the model's own forward writes (embedding_renorm_).
        self._written_in_forward: set[int] = set()
        self.done = False  # told: no more looks

    def look(
        self,
        passes: int,
        steps: int,
        per_step: int,
        params: Callable[[], list[torch.Tensor]],
    ) -> bool:
        """Whether the weights moved across :data:`MOVED_LOOKS` windows in a row with
        no watched step (``steps``: the monitor's steps taken; ``passes``: the
        model's; ``per_step``: passes a step usually takes; ``params``: the
        model's trainable ones now)."""
        if steps == 0 and passes < BEFORE_FIRST_STEP:
            return False
        note = self._note
        if note is not None and note.steps != steps:
            note = None  # a watched step came: the gap closed
            self._moved = 0
        if note is None:
            self._take_note(params(), steps, passes)
            return False
        if passes - note.passes < max(WINDOW, 2 * per_step):
            return False
        moved = _moved(note, self._take_note(params(), steps, passes))
        self._moved = self._moved + 1 if moved else 0
        if self._moved < MOVED_LOOKS:
            return False
        self._moved = 0
        return True

    def _take_note(self, params: list[torch.Tensor], steps: int, passes: int) -> _Note:
        """Notes the weights; inside a pass, its end tells which ones its forward wrote."""
        self._note = note = _note(params, steps, passes, self._written_in_forward)
        if self._passes.in_pass and not self._passes.listens(self):
            self._passes.subscribe("forward writes", self, starts=False)
        return note

    def pass_starts(self, module: nn.Module) -> None:
        return None

    def pass_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """The pass a note was taken in ended: a parameter whose version counter
        moved since is written by the model's own forward, and looked at no more."""
        self._passes.unsubscribe(self)
        note = self._note
        if note is None:
            return
        written = {id(p) for p, then in zip(note.params, note.versions) if p._version != then}
        if written - self._written_in_forward:
            self._written_in_forward |= written
            self._note = _note(note.params, note.steps, note.passes, self._written_in_forward)

    def restart(self) -> None:
        """Look again from scratch (the optimizer found is watched now)."""
        self._note = None
        self._moved = 0

    def detach(self) -> None:
        self.restart()
        self._passes.unsubscribe(self)
        self.done = True


class RemoveAtNextPass:
    """Takes a hook off at the model's next pass: one that cannot go where it
    runs (a global optimizer hook, while PyTorch iterates over its table)."""

    def __init__(self, passes: Any, handle: RemovableHandle) -> None:
        self._passes = passes
        self._handle = handle

    def pass_starts(self, module: nn.Module) -> None:
        self._handle.remove()
        self._passes.unsubscribe(self)

    def pass_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        return None


def holds_any(optimizer: Any, known: Callable[[torch.Tensor], bool]) -> bool:
    """Whether ``optimizer`` holds some parameter ``known`` accepts (the model's)."""
    groups: Sequence[Any] = getattr(optimizer, "param_groups", ())
    return any(known(p) for group in groups for p in group["params"])
