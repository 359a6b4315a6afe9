"""Which ops with a zero derivative stand between a layer and the model's output.

``round``, ``floor``, ``ceil``, ``trunc`` and ``sign`` have a derivative of
exactly zero wherever one is defined, and autograd says so: a quantiser
written with them and no straight-through estimator (``torch.round(w / s) *
s`` as a layer's weight, ``torch.sign(w)`` as a binarised one, a rounded
activation) gives what it rounds a gradient of exact zeros, step after step,
while the layer runs and its bias may still learn. Dead units or a mask of
zeros give the same zeros with no such op in the graph, so the op is looked
for in the graph itself. The graph's structure outlives its backward (only
saved tensors are freed): while ``zero_gradient`` has a zero streak not yet
told, the nodes the model's latest pass with gradients hangs its output from
are kept (a listener on the passes only then), and walked once, as the alert
is built. A healthy step pays nothing.

The same look tells which of those parameters the model returns as they are
(a learned prior's ``mu`` handed to the loss): such an output is a leaf,
with no node of the pass's graph for backward to enter by, and its exactly
zero gradient is the loss sending that output nothing (a KL term weighed by
0 while it is annealed in), not a layer cut inside the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

from trainwatch.collect.custom_functions import nearest, postorder
from trainwatch.collect.passes import ModelPasses
from trainwatch.collect.tensors import tensor_leaves
from trainwatch.layers import LayerMap

# Autograd's nodes for the ops whose derivative is zero, with the op the user wrote.
ZERO_DERIVATIVE = {
    "RoundBackward0": "torch.round",
    "RoundBackward1": "torch.round",  # round(decimals=...)
    "FloorBackward0": "torch.floor",
    "CeilBackward0": "torch.ceil",
    "TruncBackward0": "torch.trunc",  # torch.fix too
    "SignBackward0": "torch.sign",
    "SgnBackward0": "torch.sgn",
}


def zero_derivative_ops(
    roots: Sequence[Any], targets: dict[str, list[torch.Tensor]]
) -> dict[str, list[str]] | None:
    """Per layer of ``targets`` (the parameters of it whose gradient is zero), the
    ops with a zero derivative nearest them on every path from ``roots``; a
    layer with a path free of them, or not in this graph, is left out. None: the
    graph is too large to walk, or, none found, it holds autograd Functions (a
    compiled region, a custom Function) whose insides it does not show."""
    order = postorder(roots)
    if order is None:
        return None
    blocking = {id(node): type(node).__name__ in ZERO_DERIVATIVE for node in order}
    owners = {id(p): owner for owner, params in targets.items() for p in params}
    target_owner: dict[int, str] = {}
    for node in order:
        variable = getattr(node, "variable", None)  # an AccumulateGrad's parameter
        if isinstance(variable, torch.Tensor) and id(variable) in owners:
            target_owner[id(node)] = owners[id(variable)]
    found: dict[str, list[str]] = {}
    for owner in targets:
        ops: list[str] = []
        for node in nearest(order, roots, blocking, target_owner, owner):
            op = ZERO_DERIVATIVE[type(node).__name__]
            if op not in ops:
                ops.append(op)
        if ops:
            found[owner] = ops
    if not found and any(isinstance(node, BackwardCFunction) for node in order):
        return None
    return found


class ZeroDerivativeLook:
    """Keeps the latest pass's graph while asked, for ``zero_gradient``'s alerts."""

    def __init__(self, passes: ModelPasses, layers: Callable[[], LayerMap | None]) -> None:
        self._passes = passes
        self._layers = layers  # the pipeline's map, rebuilt when the model changes
        self.wanted = False
        # The nodes the latest pass with gradients hangs its output from, and the
        # parameters it returned as they are, by their position among its tensors.
        self._roots: list[Any] | None = None
        self._returned: list[tuple[int, torch.Tensor]] = []

    def want(self, wanted: bool) -> None:
        """Keep each pass's graph (until the next pass) from now on, or no more."""
        if wanted == self.wanted:
            return
        self.wanted = wanted
        if wanted:
            self._passes.subscribe("zero-derivative look", self, starts=False)
        else:
            self.detach()

    def pass_starts(self, module: Any) -> None:  # (not subscribed to starts)
        pass

    def pass_ends(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            tensors = [t for _, t in tensor_leaves(output)]
            roots = [t.grad_fn for t in tensors if t.grad_fn is not None]
            returned = [
                (position, t)
                for position, t in enumerate(tensors)
                if t.grad_fn is None and t.requires_grad
            ]
            if roots or returned:
                self._roots, self._returned = roots, returned

    def ops(self, wanted: dict[str, list[str]]) -> dict[str, list[str]] | None:
        """Per layer of ``wanted`` (by name, with the names of its parameters whose
        gradient is zero), the ops with a zero derivative on every path from the
        latest pass's output to those parameters (``zero_derivative_ops``). None
        where there is no graph to look at (no pass with gradients seen since
        asked, or one too large to walk)."""
        roots, layers = self._roots, self._layers()
        if not roots or layers is None:
            return None
        names = {name: owner for owner, params in wanted.items() for name in params}
        targets: dict[str, list[torch.Tensor]] = {}
        for param in layers.parameters():
            owner = names.get(layers.info(param).name)
            if owner is not None:
                targets.setdefault(owner, []).append(param)
        try:
            return zero_derivative_ops(roots, targets)
        except Exception:  # a graph that cannot be walked claims nothing; the alert stands
            return None

    def returned(self, names: list[str]) -> list[int]:
        """The output positions under which the latest pass returned the parameters
        ``names`` as they are, where it returned every one of them so and its graph
        reaches none of them through its other outputs (one read inside the model
        too may have a zero gradient there of its own). Empty where some is not
        returned so, or there is no pass to look at."""
        returned, layers = self._returned, self._layers()
        if not returned or layers is None:
            return []
        by_id = {id(t): position for position, t in returned}
        positions = []
        targets = set()
        for param in layers.parameters():
            if layers.info(param).name in names:
                if id(param) not in by_id:
                    return []
                positions.append(by_id[id(param)])
                targets.add(id(param))
        if len(positions) != len(names):
            return []
        try:
            order = postorder(self._roots or [])
        except Exception:  # a graph that cannot be walked claims nothing
            return []
        if order is None or any(id(getattr(n, "variable", None)) in targets for n in order):
            return []
        return sorted(positions)

    def detach(self) -> None:
        self.wanted = False
        self._roots = None
        self._returned = []
        if self._passes.listens(self):
            self._passes.unsubscribe(self)
