"""Whether a hand-written update applied gradients zeroed before it.

Without an optimizer, ``model.zero_grad(set_to_none=False)`` or
``p.grad.zero_()`` between ``loss.backward()`` and ``p -= lr * p.grad``
makes every update apply zeros. With an optimizer its step hooks see the
gradients wiped before the step (``zero_gradient``'s ``reset_before_step``);
a hand-written update has no hook, and gradients zeroed before
``monitor.step()`` are as often zeroed after the update (the healthy loop).
The weights tell the two apart, between two step boundaries:

- written: some trainable weight's version counter or storage moved (an
  in-place update, even of zeros, moves the counter);
- moved: some weight's float64 sum changed (a write through ``.data`` moves
  no counter; an update of zeros moves no value).

Written and not moved is an update that applied nothing. Under
``monitor.step()``, which comes after the update, the step's gradients are
still there: such an update counts only where every one was zeroed in place
since backward (an update applying live gradients at a learning rate of 0 is
``stalled_training``'s story). Under ``trainwatch run`` each backward's end
is a step boundary, before the loop's update, so the update between two
boundaries is judged at the second, dated at the first; a boundary with
nothing written since the one before (a micro-batch of an accumulation)
says nothing either way; half-precision weights, where a small update can
round away whole, are not judged there. An update through ``.data`` that
applies zeros writes no counter and is not seen here (``stalled_training``
tells it later).

Looked at only on the first boundaries, where the sums are read (one sync):
once the weights were seen moving at ``MOVES_ENOUGH`` boundaries the loop
updates them and the look ends, and so it does after ``UNWRITTEN_AT_MOST``
boundaries in a row with nothing written (a model only evaluated with
gradients, or one nobody updates). Under ``monitor.step()`` only boundaries
whose gradients were rewritten since backward are looked at: a loop that
resets them before its next backward pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter, methodcaller

import torch
from torch.nn.parameter import is_lazy

from trainwatch.collect.frozen_moves import weight_sums
from trainwatch.collect.tensors import local_part
from trainwatch.record import ZeroedUpdateReport

_VERSION = attrgetter("_version")
_GRAD = attrgetter("grad")
_DATA_PTR = methodcaller("data_ptr")
# Weights fine enough that no real update rounds away in every element of every one.
_FINE = (torch.float32, torch.float64)
# Boundaries the weights were seen moving at before the look ends: the loop updates them.
MOVES_ENOUGH = 3
# Boundaries in a row with nothing written before the look ends (none of them an update).
UNWRITTEN_AT_MOST = 50


class ZeroedUpdates:
    """The trainable weights' marks at the latest boundary looked at, and the
    updates in a row since that applied nothing."""

    def __init__(self, patience: int) -> None:
        self._patience = max(1, patience)
        self.looking = True
        self._at: int | None = None  # the boundary the marks are from
        # The weights (by id), their version counters, storages and float64 sums.
        self._ids: list[int] = []
        self._marks: tuple[list[int], list[int]] = ([], [])
        self._sums: list[float] = []
        self._moves = 0
        self._unwritten = 0
        self._since: int | None = None  # the first update of the row that applied nothing
        self._row = 0

    def start(self, params: Sequence[torch.Tensor]) -> None:
        """The weights as watching begins: the first boundary compares with them
        (``monitor.step()`` comes after the first update already)."""
        self._take(self._plain(params), -1)

    def look(
        self,
        step: int,
        params: Sequence[torch.Tensor],
        at_backward_end: bool,
        reset: frozenset[str],
        names: Sequence[str],
    ) -> ZeroedUpdateReport | None:
        """The boundary ``step`` (``params``: the model's parameters; ``names``: theirs;
        ``reset``: the names of those whose gradient was rewritten since backward);
        a report once ``patience`` updates in a row applied nothing, else None."""
        params, names = self._trainable(params, names)
        if not params:
            return None
        if at_backward_end and not all(p.dtype in _FINE for p in params):
            # Half-precision weights: an update below their resolution rounds away
            # whole, and the gradients it applied are not there to tell.
            self.looking = False
            return None
        gradients = list(map(_GRAD, params))
        held = [name for name, grad in zip(names, gradients) if grad is not None]
        if not at_backward_end and (not held or not reset.issuperset(held)):
            # Gradients kept for the update (or only some zeroed): no reset before it.
            self._at = None
            self._row = 0
            return None
        previous = self._at
        ids, marks, sums = self._ids, self._marks, self._sums
        self._take(params, step)
        if previous is None or previous != step - 1 or ids != self._ids:
            return None  # nothing to compare with
        written = marks != self._marks
        if any(not _same(a, b) for a, b in zip(sums, self._sums)):
            self._unwritten = self._row = 0  # moved: an update with live gradients
            self._moves += 1
            if self._moves >= MOVES_ENOUGH:
                self.looking = False
            return None
        if not written:
            # No update since the previous boundary (a micro-batch; a write through
            # .data of zeros, which nothing shows): neither way.
            self._unwritten += 1
            if self._unwritten >= UNWRITTEN_AT_MOST:
                self.looking = False
            return None
        self._unwritten = 0
        if not at_backward_end and not _all_zero(gradients):
            self._row = 0  # zeroed in part only: a clip, or live gradients at lr 0
            return None
        if not self._row:
            self._since = max(previous if at_backward_end else step, 0)
        self._row += 1
        if self._row < self._patience:
            return None
        self.looking = False  # told once
        return ZeroedUpdateReport(self._since or 0, self._row, at_backward_end, names)

    def _take(self, params: list[torch.Tensor], step: int) -> None:
        self._ids = list(map(id, params))
        local = list(map(local_part, params))
        self._marks = (list(map(_VERSION, params)), list(map(_DATA_PTR, local)))
        self._sums = weight_sums(params)
        self._at = step

    @staticmethod
    def _plain(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Trainable weights with values to sum (not lazy, not on the meta device)."""
        return [
            p
            for p in params
            if p.requires_grad and not is_lazy(p) and p.device.type != "meta" and p.numel()
        ]

    def _trainable(
        self, params: Sequence[torch.Tensor], names: Sequence[str]
    ) -> tuple[list[torch.Tensor], list[str]]:
        kept = self._plain(params)
        wanted = set(map(id, kept))
        return kept, [name for p, name in zip(params, names) if id(p) in wanted]


def _same(before: float, now: float) -> bool:
    """Equal sums, a NaN equal to a NaN (a weight left alone reads so)."""
    return before == now or (before != before and now != now)


def _all_zero(gradients: list[torch.Tensor | None]) -> bool:
    """Every gradient held is exactly zero (read back at once); a sparse one or
    none held: not known to be."""
    held = [g for g in gradients if g is not None]
    if not held or any(g.layout != torch.strided for g in held):
        return False
    with torch.no_grad():
        # The largest magnitude of each, in one batched kernel (a NaN stays a NaN).
        local = [local_part(g.detach()) for g in held]
        return not any(torch.stack(torch._foreach_norm(local, float("inf"))).tolist())
