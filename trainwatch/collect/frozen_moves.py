"""Whether the frozen parameters an optimizer holds are moved by the training code.

MoCo's own recipe keeps its momentum (key) encoder inside the model, frozen
(``requires_grad=False``), and builds the optimizer from
``model.parameters()``: the optimizer holds the key encoder, skips it (no
gradient), and the loop moves it by hand every step, ``param_k.data =
m * param_k.data + (1 - m) * param_q.data``. That is no forgotten freeze.

What counts is the values: the float64 sum of each frozen parameter is compared
across the first step boundaries an optimizer holds it. A write that leaves the
values as they were is no move, whatever it does to the storage or the version
counter: open_clip's ``logit_scale.clamp_(0, math.log(100))`` after every step
bumps the counter of a scale frozen by mistake without ever changing it. A
momentum or EMA copy moves on every step, and so at two boundaries or more; a
parameter whose values changed once only (a clamp pulling a frozen value into
range once, a checkpoint loaded after the attach) is watched a few boundaries
more for a second change before its verdict. Once decided, nothing is looked at.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainwatch.collect.tensors import local_part
from trainwatch.layers import ParamInfo

# Step boundaries (the attach counts as one) over which frozen parameters are
# watched before their verdict.
LOOKS = 3
# While some parameter has changed once only, the boundaries watched at most: an
# EMA updated after the optimizer's step first shows at the second boundary after
# the attach, its second move at the next; an update every second or third step
# shows twice by this one.
LAST_LOOK = 6


def weight_sums(params: Sequence[torch.Tensor]) -> list[float]:
    """Each weight's float64 sum, read back at once.

    A write through ``.data`` in place (DINO's ``p.data.mul_(m).add_(...)``, a
    hand-written ``p.data.sub_(lr * g)``) moves neither the storage nor the
    parameter's own version counter, and a momentum step is small: a sum sees
    it where a norm's rounding may not. A shard (FSDP2) is summed on this rank.
    """
    if not params:
        return []
    with torch.no_grad():
        return torch.stack(
            [local_part(p.detach()).sum(dtype=torch.float64) for p in params]
        ).tolist()


class _Watch:
    __slots__ = ("looks", "sums", "changes")

    def __init__(self) -> None:
        self.looks = 0
        # Per name, the sum at the last boundary and whether the optimizer was to
        # apply a gradient to it then (frozen since backward ran, it still held one:
        # its change since is the update's).
        self.sums: dict[str, tuple[float, bool]] = {}
        self.changes: dict[str, int] = {}


def _same(before: float, now: float) -> bool:
    """Equal sums, a NaN equal to a NaN (a parameter left alone reads so)."""
    return before == now or (before != before and now != now)


class FrozenMoves:
    def __init__(self) -> None:
        self._watching: dict[int | None, _Watch] = {}
        self._decided: dict[int | None, frozenset[str]] = {}

    def look(
        self,
        optimizer: int | None,
        params: Sequence[torch.Tensor],
        frozen: Sequence[ParamInfo],
    ) -> frozenset[str] | None:
        """The frozen parameters of ``optimizer`` moved by hand (names); None while
        the first boundaries are still being watched."""
        decided = self._decided.get(optimizer)
        if decided is not None:
            return decided
        watch = self._watching.setdefault(optimizer, _Watch())
        sums = _sums(params, frozen)
        before = watch.sums
        for name, now in sums.items():
            seen = before.get(name)
            if seen is not None and not seen[1] and not _same(seen[0], now[0]):
                watch.changes[name] = watch.changes.get(name, 0) + 1
        watch.sums = sums
        watch.looks += 1
        once = 1 in watch.changes.values()
        if watch.looks < LOOKS or (once and watch.looks < LAST_LOOK):
            return None
        del self._watching[optimizer]
        moved = frozenset(name for name, count in watch.changes.items() if count > 1)
        self._decided[optimizer] = moved
        return moved


def _sums(
    params: Sequence[torch.Tensor], frozen: Sequence[ParamInfo]
) -> dict[str, tuple[float, bool]]:
    """Each frozen parameter's float64 sum (see :func:`weight_sums`), and whether it
    holds a gradient."""
    pairs = [
        (info.name, p)
        for info, p in zip(frozen, (p for p in params if not p.requires_grad))
        if p.layout == torch.strided and p.numel()
    ]
    totals = weight_sums([p for _, p in pairs])
    return {name: (total, p.grad is not None) for (name, p), total in zip(pairs, totals)}
