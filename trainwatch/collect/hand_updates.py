"""Whether the weights moved between two step boundaries when no optimizer is watched.

Without an optimizer a step boundary (``monitor.step()``, or the end of a
backward pass under ``trainwatch run``) is not proof of an update: several
backward passes in a row may be legitimate gradient accumulation. Gradients
left unreset are the missing-``zero_grad`` bug only when the weights changed
in between: an update used those gradients, and backward then added onto them.

A hand-written update through ``p.data`` does not bump the parameter's version
counter, so the change is seen in the values: one norm per weight, taken in
the same batched kernel as the gradient norms and read back with them. Only
this path pays for it; with an optimizer, its step hooks mark the update.
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

    def watched(self, layers: LayerMap) -> tuple[list[torch.Tensor], list[str]]:
        """The model's weights and their names (rebuilt only when the model's tree is)."""
        if layers is not self._layers:
            self._layers = layers
            self._weights = layers.parameters()
            self._names = [layers.info(p).name for p in self._weights]
        return self._weights, self._names

    def keep_moved(
        self, stale: list[ParamInfo], names: Sequence[str], norms: Sequence[float]
    ) -> list[ParamInfo]:
        """Of the parameters with unreset gradients, those whose weights changed since
        the previous step boundary; then this step's norms become the reference."""
        previous, self._previous = self._previous, dict(zip(names, norms))
        if not stale:
            return stale
        current = self._previous
        return [
            info
            for info in stale
            if info.name in previous and previous[info.name] != current.get(info.name)
        ]
