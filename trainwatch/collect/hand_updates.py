"""Whether the weights moved between two step boundaries when no optimizer is watched.

Without an optimizer a step boundary (``monitor.step()``, or the end of a
backward pass under ``trainwatch run``) is not proof of an update: several
backward passes in a row may be legitimate gradient accumulation. Gradients
left unreset are the missing-``zero_grad`` bug only when the weights changed
in between: an update used those gradients, and backward then added onto them.

Where each backward's end is a step boundary (``trainwatch run``), one such
finding is not yet proof of harm: a GAN's generator loss adds onto the
discriminator's gradients after the discriminator's update, and they are
reset before its next one. The harm is the next update applying them, so
there it takes a second finding with no reset in between: the weights moved
again while the gradients still held the used values.

A hand-written update through ``p.data`` does not bump the parameter's version
counter, so the change is seen in the values: one norm per weight, taken in
one batched kernel beside the gradient norms and read back with them. Only
this path pays for it; with an optimizer, its step hooks mark the update.

The same norms show a model nobody updates at all: under ``trainwatch run`` a
loss module with parameters of its own (learned task weights) left out of
the optimizer is a model without an optimizer, so its boundaries are taken
for hand-written updates. Its gradients are never reset and its weights never
move, boundary after boundary, while other models' optimizers step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainwatch.layers import LayerMap, ParamInfo


class HandUpdates:
    def __init__(self) -> None:
        self._layers: LayerMap | None = None
        self._weights: list[torch.Tensor] = []
        self._names: list[str] = []
        self._previous: dict[str, float] = {}
        self._suspected: set[str] = set()
        self.suspected_since: int | None = None  # the boundary that first found them
        # Boundaries in a row with unreset gradients and no weight moved, since
        # watching began (None: some weight moved once: updates do happen).
        self.never_moved: int | None = 0

    def watched(self, layers: LayerMap) -> tuple[list[torch.Tensor], list[str]]:
        """The model's weights and their names (rebuilt only when the model's tree is)."""
        if layers is not self._layers:
            self._layers = layers
            self._weights = layers.parameters()
            self._names = [layers.info(p).name for p in self._weights]
        return self._weights, self._names

    def keep_moved(
        self,
        stale: list[ParamInfo],
        names: Sequence[str],
        norms: Sequence[float],
        confirm: bool = False,
        step: int | None = None,
    ) -> list[ParamInfo]:
        """Of the parameters with unreset gradients, those whose weights changed since
        the previous step boundary; then this step's norms become the reference.

        ``confirm``: only those already found so at an earlier boundary, their
        gradients not reset since (a later update applied the used values);
        ``suspected_since`` keeps ``step``, that first boundary's, where the
        backward added onto used gradients: the bug's own step.
        """
        previous, self._previous = self._previous, dict(zip(names, norms))
        if self.never_moved is not None and previous:
            if previous != self._previous:  # compared in C: some weight moved
                self.never_moved = None
            elif stale:
                self.never_moved += 1
        if not stale and not self._suspected:
            return stale
        current = self._previous
        moved = [
            info
            for info in stale
            if info.name in previous and previous[info.name] != current.get(info.name)
        ]
        if not confirm:
            return moved
        suspected = self._suspected
        # A reset (not stale any more) clears the suspicion; stale ones keep it.
        still = {info.name for info in stale} & suspected
        self._suspected = still | {info.name for info in moved}
        if not still:
            self.suspected_since = step if moved else None
        return [info for info in moved if info.name in suspected]
