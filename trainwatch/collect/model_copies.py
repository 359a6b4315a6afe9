"""Copies of the watched model kept beside it, looked at only once gradients jumped.

A DQN keeps a target network, a copy of its Q-network that computes the TD
targets and is set to the Q-network's weights every N steps
(``target.load_state_dict(q.state_dict())``, a copy into each parameter's
``.data``, a Polyak update with tau 1.0, or ``copy.deepcopy(q)`` made anew).
The step after such a sync the targets jump, and the gradients with them:
healthy, and no explosion. What tells a sync apart is the copy itself: it stays
still between syncs, and right after one it lies within a step or two of the
model's own moves. A copy that moves every step (an EMA, a mean teacher) or
that lies far behind (a frozen reference model, a target synced long ago)
explains no jump.

Copies are found by a scan of live objects for modules of the model's class
with its parameter shapes and none of its parameters, and remembered (weakly).
A few values per parameter tensor, evenly spread, stand for the weights: the
distances compared are taken over the same values, so the sample's scale
cancels out.
"""

from __future__ import annotations

import gc
import math
import weakref
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from trainwatch.collect.tensors import local_part
from trainwatch.compiled import unwrap

# Values per parameter tensor that stand for it.
_SAMPLED = 256
# Right after a sync the copy is the model's weights of one step back (two
# where the step is read back a step late): within this many of the model's
# next moves (a CartPole DQN under Adam or SGD: 0.54-0.67 of one, read at once;
# 1.07-1.31, a step late). A copy synced 200 steps back lies 70-500 of them
# away; a frozen reference model, hundreds of steps' worth.
_WITHIN_STEPS = 3.0
# And within this share of the weights' norm: a healthy update moves them by
# about 1e-3 of it (a sync's jump, with its larger update, 3e-3..5e-3 in a
# CartPole DQN); one at a learning rate raised 100x under Adam by about their
# own norm, which leaves a copy synced long before just as near in steps.
WITHIN_NORM = 0.05
# Steps after a scan that found no copy near the model before the next scan: a
# model with none whose gradients jump again and again scans the heap once in
# so many.
_RESCAN_AFTER = 100


class ModelCopies:
    """The copies of one model: found on request, remembered weakly."""

    def __init__(self, model: Callable[[], nn.Module | None]) -> None:
        self._model = model
        self._found: list[weakref.ref[nn.Module]] = []
        # The step of the last scan that found no copy near the model.
        self._none_since: int | None = None

    def look(self, step: int) -> CopiesLook | None:
        """The model and the copies near it now, to be judged at the model's next
        step (None: no copy near it). The copies remembered are looked at first:
        the heap is scanned only when none of them is near (a copy made anew
        at each sync, the old ones kept alive elsewhere)."""
        model = _inner(self._model())
        if model is None:
            return None
        weights = sample_weights(model.parameters())
        near = WITHIN_NORM * float(torch.linalg.vector_norm(weights))
        copies = _near(weights, near, (ref() for ref in self._found))
        if not copies:
            if self._none_since is not None and step - self._none_since < _RESCAN_AFTER:
                return None
            found = _scan(model)
            self._found = [weakref.ref(copy) for copy in found]
            copies = _near(weights, near, found)
            self._none_since = None if copies else step
        if not copies:
            return None
        return CopiesLook(model, weights, copies)


class CopiesLook:
    """The model's weights and its copies' at a step where gradients jumped."""

    def __init__(
        self, model: nn.Module, weights: torch.Tensor, copies: list[tuple[nn.Module, torch.Tensor]]
    ) -> None:
        self._model = weakref.ref(model)
        self._weights = weights
        self._copies = [(weakref.ref(copy), values) for copy, values in copies]

    def synced(self) -> SyncedCopy | None:
        """At the model's next step: the copy that stayed still and lies within a
        few of the model's own moves of where the model was (a sync just
        before the jump), if one does."""
        model = self._model()
        if model is None:
            return None
        weights = self._weights
        moved = weight_distance(sample_weights(model.parameters()), weights)
        for ref, values in self._copies:
            copy = ref()
            if copy is None or not torch.equal(sample_weights(copy.parameters()), values):
                continue  # gone, or moved since (an EMA moves every step)
            if weight_distance(values, weights) <= _WITHIN_STEPS * moved:
                return SyncedCopy(copy, values)
        return None


class SyncedCopy:
    """A copy found set to the model's weights: still until its next sync."""

    def __init__(self, copy: nn.Module, values: torch.Tensor) -> None:
        self._copy = weakref.ref(copy)
        self._values = values
        self.name = type(copy).__name__

    def unchanged(self) -> bool:
        copy = self._copy()
        return copy is not None and torch.equal(sample_weights(copy.parameters()), self._values)


def _inner(model: nn.Module | None) -> nn.Module | None:
    """The module a copy would be made of: not a compile or data-parallel wrapper."""
    if model is None:
        return None
    model = unwrap(model)
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        model = unwrap(model.module)
    return model


def _near(
    weights: torch.Tensor, near: float, copies: Iterable[nn.Module | None]
) -> list[tuple[nn.Module, torch.Tensor]]:
    """The copies within ``near`` of the model's weights, each with its values."""
    found = []
    for copy in copies:
        if copy is not None:
            values = sample_weights(copy.parameters())
            if weight_distance(values, weights) <= near:
                found.append((copy, values))
    return found


def _scan(model: nn.Module) -> list[nn.Module]:
    """Live modules of the model's class, with its parameter shapes, sharing none of
    its parameters (a compile wrapper's inner module shares them all)."""
    kind = type(model)
    params = list(model.parameters())
    if not params:
        return []
    found = []
    for obj in gc.get_objects():
        if type(obj) is kind and obj is not model and is_copy(list(obj.parameters()), params):
            found.append(obj)
    return found


def is_copy(params: Sequence[torch.Tensor], of: Sequence[torch.Tensor]) -> bool:
    """Whether ``params`` are a copy of ``of``: the same shapes in the same order, none
    of them shared (a compile wrapper's inner module, a part, shares them)."""
    if len(params) != len(of) or any(a.shape != b.shape for a, b in zip(params, of)):
        return False
    own = {id(p) for p in of}
    return not any(id(p) in own for p in params)


def sample_weights(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """A few values of each tensor, evenly spread, as one float tensor on the host
    (a copy: the weights move on)."""
    parts = []
    for param in params:
        flat = local_part(param.detach()).reshape(-1)
        if flat.is_meta or flat.numel() == 0:
            continue
        picked = flat[:: max(1, flat.numel() // _SAMPLED)][:_SAMPLED]
        parts.append(picked.to("cpu", torch.float32))
    return torch.cat(parts) if parts else torch.zeros(0)


def weight_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    return float(torch.linalg.vector_norm(a - b))
