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

The weights' in-place writes are seen from their version counters (an
optimizer's update under ``no_grad``), a write through ``.data`` or a new
``.data`` from a few values of three parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from trainwatch.collect.tensors import local_part

# Passes between two looks at the weights (at least two steps' worth of passes).
WINDOW = 10
# Looks in a row that found the weights moved before they are told of: one
# write (a checkpoint loaded before an attribution phase) is no training.
MOVED_LOOKS = 2
# Values of each sampled parameter compared (a write through ``.data``).
_SAMPLED_VALUES = 16

_VERSION = attrgetter("_version")


@dataclass(slots=True)
class _Note:
    """The weights as one look found them."""

    steps: int  # the monitor's steps taken then
    passes: int  # the model's passes then
    params: list[torch.Tensor]  # the model's trainable ones
    versions: list[int]
    sampled: list[torch.Tensor]  # a few of them
    values: list[torch.Tensor | None]  # their first values, copied


def _first_values(param: torch.Tensor) -> torch.Tensor | None:
    local = local_part(param.detach())
    if local.layout != torch.strided or local.numel() == 0:
        return None
    return local.reshape(-1)[:_SAMPLED_VALUES].clone()


def _note(params: list[torch.Tensor], steps: int, passes: int) -> _Note:
    sampled = [params[0], params[len(params) // 2], params[-1]] if params else []
    return _Note(
        steps,
        passes,
        params,
        list(map(_VERSION, params)),
        sampled,
        [_first_values(p) for p in sampled],
    )


def _moved(note: _Note) -> bool:
    """Whether any weight was written since ``note``: a version counter moved (C
    compares), or one of the sampled values changed (a write through ``.data``)."""
    if list(map(_VERSION, note.params)) != note.versions:
        return True
    for param, then in zip(note.sampled, note.values):
        now = _first_values(param)
        if then is not None and now is not None and not torch.equal(then, now):
            return True
    return False


class UnwatchedUpdates:
    """Looks at the weights while backward passes go by with no watched step."""

    def __init__(self) -> None:
        self._note: _Note | None = None
        self._moved = 0  # looks in a row that found the weights moved
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
        note = self._note
        if note is not None and note.steps != steps:
            note = None  # a watched step came: the gap closed
            self._moved = 0
        if note is None:
            self._note = _note(params(), steps, passes)
            return False
        if passes - note.passes < max(WINDOW, 2 * per_step):
            return False
        moved = _moved(note)
        self._note = _note(params(), steps, passes)
        self._moved = self._moved + 1 if moved else 0
        if self._moved < MOVED_LOOKS:
            return False
        self._moved = 0
        return True

    def restart(self) -> None:
        """Look again from scratch (the optimizer found is watched now)."""
        self._note = None
        self._moved = 0

    def detach(self) -> None:
        self.restart()
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
