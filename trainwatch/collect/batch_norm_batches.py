"""The batch size each step fed the model's batch norm in training mode, for the
last epochs or so.

Batch norm in training mode normalises each batch by its own mean and variance.
Over a handful of samples those are mostly noise, and that step's gradients
jump 100x or more while every other step is healthy: a ``DataLoader`` left at
``drop_last=False`` ends each epoch on what remains (2500 samples in batches of
64: a last batch of 4). An exploding gradient at such a step is that batch, not a
learning rate too high, and ``drop_last=True`` is the fix: see
trainwatch.rules.gradient_scale.

Seen from the model's passes (collect.passes), only on a model that holds a
batch-norm layer: as a pass ends with that layer in training mode, the first
dimension of its first positional input is compared with the last one seen.
Only a change (the epoch's short last batch, and the full one after it) is
noted, with the step it came at, so a healthy pass reads no step. The changes
are read only as an exploding gradient's alert is built, so a step told a step
late (the lagged readback on a GPU) still finds its own batch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from trainwatch.compiled import user_name

# Changes of batch size kept (two an epoch for a short last batch).
KEPT = 64
# Steps seen at the usual batch size before a batch counts as much smaller.
_SEEN = 8
# A batch at most this fraction of the usual one is much smaller.
SMALL = 0.25


def _gone() -> None:
    return None


class BatchNormBatches:
    """Where the batch size of the model's passes, with its first batch-norm layer in
    training mode, changed: ``(step, size)`` pairs, oldest first."""

    def __init__(self, step_of: Callable[[], int]) -> None:
        self._step_of = step_of
        self._norm: Callable[[], nn.Module | None] = _gone  # the first batch-norm layer
        self._rows: int | None = None  # the batch size of the last pass noted
        self.changes: list[tuple[int, int]] = []
        self.layer: str | None = None  # that layer's qualified name; None: it has none

    def find(self, root: nn.Module) -> bool:
        """Look for ``root``'s first batch-norm layer (on watching, and when the model's
        tree changed); whether it has one, and so wants its passes."""
        for name, module in root.named_modules():
            if isinstance(module, _BatchNorm):
                self._norm = weakref.ref(module)
                self.layer = user_name(name)
                return True
        self._norm, self.layer = _gone, None
        return False

    def pass_starts(self, module: nn.Module) -> None:
        pass  # subscribed for the ends alone

    def pass_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        norm = self._norm()
        if args and norm is not None and norm.training:
            shape = getattr(args[0], "shape", None)
            if shape and shape[0] != self._rows:
                self._changed(shape[0])

    def _changed(self, rows: int) -> None:
        self._rows = rows
        step = self._step_of()
        changes = self.changes
        if changes and changes[-1][0] == step:
            changes.pop()  # two sizes in one step (an evaluation in training mode): the last
        changes.append((step, rows))
        if len(changes) > KEPT:
            del changes[0]

    def small_at(self, step: int) -> tuple[int, int, str] | None:
        """``(its batch size, the usual one, the layer)`` where step ``step``'s batch,
        through batch norm in training mode, was at most :data:`SMALL` of the size
        the kept steps ran at most; None otherwise, or where not known."""
        changes = self.changes
        if self.layer is None or not changes or changes[0][0] > step:
            return None
        rows = next(size for since, size in reversed(changes) if since <= step)
        steps: dict[int, int] = {}
        ends = [since for since, _ in changes[1:]] + [max(self._step_of(), step + 1)]
        for (since, size), end in zip(changes, ends):
            steps[size] = steps.get(size, 0) + max(end - since, 1)
        usual = max(steps, key=steps.__getitem__)
        if steps[usual] < _SEEN or rows > SMALL * usual:
            return None
        return rows, usual, self.layer
