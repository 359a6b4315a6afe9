"""Whether the frozen parameters an optimizer holds are moved by the training code.

MoCo's own recipe keeps its momentum (key) encoder inside the model, frozen
(``requires_grad=False``), and builds the optimizer from
``model.parameters()``: the optimizer holds the key encoder, skips it (no
gradient), and the loop moves it by hand every step, ``param_k.data =
m * param_k.data + (1 - m) * param_q.data``. That is no forgotten freeze. A
parameter written that way gets a new storage (``.data =``) or a new version
(an in-place ``lerp_``/``copy_``) or, written in place through ``.data``, new
values only: the storage, version counter and float64 sum of each frozen parameter
are compared across the first step boundaries an optimizer holds it; a few
boundaries decide, and from then on nothing is looked at.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainwatch.collect.tensors import local_part
from trainwatch.layers import ParamInfo

# Step boundaries (the attach counts as one) over which frozen parameters are
# watched before their verdict.
LOOKS = 3


class _Watch:
    __slots__ = ("looks", "prints", "moved")

    def __init__(self) -> None:
        self.looks = 0
        self.prints: dict[str, tuple[int, int, float, bool]] = {}
        self.moved: set[str] = set()


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
        pairs = [
            (info.name, p)
            for info, p in zip(frozen, (p for p in params if not p.requires_grad))
            if p.layout == torch.strided and p.numel()
        ]
        # Their sums too, in float64 (on these few boundaries only): a write
        # through ``.data`` in place (DINO's ``p.data.mul_(m).add_(...)``) moves
        # neither the storage nor the parameter's own version counter, and a
        # momentum step is small (a sum sees it where a norm's rounding may not).
        # A shard (FSDP2) is summed on this rank.
        with torch.no_grad():
            sums = (
                torch.stack(
                    [local_part(p.detach()).sum(dtype=torch.float64) for _, p in pairs]
                ).tolist()
                if pairs
                else []
            )
        # (storage, version, sum, whether the optimizer will apply a gradient to
        # it: frozen since backward ran, it still holds one, and its move is the update's)
        prints = {
            name: (p.data_ptr(), p._version, total, p.grad is not None)
            for (name, p), total in zip(pairs, sums)
        }
        before = watch.prints
        for name, now in prints.items():
            seen = before.get(name)
            if seen is not None and not seen[3] and seen[:3] != now[:3]:
                watch.moved.add(name)
        watch.prints = prints
        watch.looks += 1
        if watch.looks < LOOKS:
            return None
        del self._watching[optimizer]
        verdict = self._decided[optimizer] = frozenset(watch.moved)
        return verdict
