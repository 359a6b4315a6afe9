"""Under FSDP2, per-layer gradient norms of the whole layer, not of this rank's shard.

``fully_shard`` leaves each rank a shard of every gradient, so the norm a rank
measures is its shard's. A whole layer's norm is the square root of the sum,
over ranks, of its squared shard norms: that takes a collective, so it is
taken at a cadence, every ``distributed.gather_every`` steps, as one
all-reduce of one vector holding every layer's squared norm (inside the halt
check's all-reduce when that falls on the same step), never one per layer.

The gradient-scale rules keep judging this rank's shard norms at every step:
FSDP's reduce-scatter hands each rank a piece of the gradient averaged over
all ranks, so a layer that explodes or vanishes does so in every shard of it,
and a shard's norm never exceeds its layer's. What is reported (``grad_norms()``,
``total_grad_norm``, TensorBoard) is the whole-layer norms of the latest
reduced step only: a shard norm is never shown as a layer's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from trainwatch.record import StepRecord

# (step, optimizer, whole-layer norms, total norm), handed to the monitor.
Deliver = Callable[[int, "int | None", dict[str, float], float], None]


def fully_sharded(module: nn.Module) -> bool:
    """Whether FSDP shards ``module``'s parameters (a module or a part under ``fully_shard``)."""
    return any(type(part).__name__.startswith("FSDP") for part in module.modules())


class WholeLayerNorms:
    """This rank's per-layer norms of one landed step, summed with the other ranks'.

    The vector has a fixed size on every rank whatever happened here (one
    number per layer, twice, plus two), so a rank with nothing to give, or
    whose trainwatch failed, still matches the collective: it gives zeros and
    the other ranks, counting contributors, report nothing for that step.
    """

    def __init__(
        self,
        every: int,
        layers: Sequence[str],
        deliver: Deliver,
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self.every = every
        self.layers = list(layers)
        self.size = 2 + 2 * len(self.layers)
        self._index = {name: i for i, name in enumerate(self.layers)}
        self._deliver = deliver
        self._on_error = on_error
        self.broken = False
        # The latest landed step's (step, optimizer, shard norms per layer).
        self._noted: tuple[int, int | None, dict[str, float]] | None = None
        self._given: tuple[int, int | None] | None = None

    def due(self, step: int) -> bool:
        """At the end of 0-based ``step``: the same answer on every rank."""
        return self.every > 0 and (step + 1) % self.every == 0

    def note(self, record: StepRecord) -> None:
        """A step landed on this rank: keep its shard norms (no work until the cadence)."""
        self._noted = (record.step, record.optimizer, record.layer_norms)

    def payload(self) -> torch.Tensor:
        """``[1, step, squared norm per layer..., 1 per layer present here...]`` in fp64,
        or zeros when this rank has nothing to give."""
        values = [0.0] * self.size
        noted, self._noted, self._given = self._noted, None, None
        if noted is None or self.broken:
            return torch.tensor(values, dtype=torch.float64)
        try:
            step, optimizer, norms = noted
            width = len(self.layers)
            for name, norm in norms.items():
                i = self._index.get(name)
                if i is not None:  # a layer added since the vector was sized is left out
                    values[2 + i] = norm * norm
                    values[2 + width + i] = 1.0
            values[0], values[1] = 1.0, float(step)
            self._given = (step, optimizer)
        except Exception as exc:
            self._fail(exc)
            values = [0.0] * self.size
        return torch.tensor(values, dtype=torch.float64)

    def land(self, reduced: Sequence[float], world: int) -> None:
        """The vector summed over ``world`` ranks: the whole-layer norms, to the monitor."""
        given, self._given = self._given, None
        if given is None or self.broken:
            return
        step, optimizer = given
        # Every rank gave the same step, or the sums would mix steps.
        if reduced[0] != world or reduced[1] != world * step:
            return
        try:
            width = len(self.layers)
            squares = reduced[2 : 2 + width]
            present = reduced[2 + width :]
            norms = {
                name: math.sqrt(squares[i])
                for i, name in enumerate(self.layers)
                if present[i] > 0.0
            }
            total = math.sqrt(sum(squares))
            self._deliver(step, optimizer, norms, total)
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.broken = True
        self._on_error("whole-layer norms", exc)
