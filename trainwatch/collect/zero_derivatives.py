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

The same graph tells a group of layers not fed from one whose own units are dead:
an exactly zero gradient from the first step in every layer of a group, while
the model around it learns, reaches the group already zero where some path from
the output gets to it past no activation (a branch multiplied by zero, an expert
given an empty capacity buffer), and may be made zero by its own activations
where every path passes one (a ReLU stuck at 0).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
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
# Autograd's nodes for activations whose derivative is exactly zero where a unit is
# dead or saturated: a layer reached only through them may be dead on its own.
UNIT_ACTIVATIONS = frozenset(
    {
        "ReluBackward0",
        "ThresholdBackward0",
        "HardtanhBackward0",  # relu6, hardtanh
        "ClampBackward0",
        "ClampBackward1",
        "ClampMinBackward0",
        "ClampMinBackward1",
        "ClampMaxBackward0",
        "ClampMaxBackward1",
        "GeluBackward0",
        "SiluBackward0",
        "MishBackward0",
        "HardswishBackward0",
        "HardsigmoidBackward0",
        "SigmoidBackward0",
        "TanhBackward0",
        "EluBackward0",  # elu, selu, celu
        "SoftplusBackward0",
        "LeakyReluBackward0",
        "LogSigmoidBackward0",
    }
)


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


def reached_past_the_units(roots: Sequence[Any], params: Collection[torch.Tensor]) -> bool | None:
    """Whether some path from ``roots`` reaches one of ``params`` without passing an
    activation (``UNIT_ACTIVATIONS``), an op with a zero derivative or an autograd
    Function (whose insides the graph does not show). Where one does, the exactly
    zero gradient of a group of layers all silent was zero before it reached them
    (their output multiplied by zero, an expert given an empty buffer and a zero
    combine weight), not made zero by their own dead units. None: the graph is too
    large to walk."""
    order = postorder(roots)
    if order is None:
        return None
    wanted = {id(p) for p in params}
    passes: dict[int, bool] = {}  # the node lets a gradient through, whatever its value
    free: dict[int, bool] = {}  # reaches one of ``params`` through passing nodes only
    for node in order:  # children first
        name = type(node).__name__
        passes[id(node)] = not (
            name in ZERO_DERIVATIVE
            or name in UNIT_ACTIVATIONS
            or isinstance(node, BackwardCFunction)
        )
        variable = getattr(node, "variable", None)  # an AccumulateGrad's parameter
        free[id(node)] = (isinstance(variable, torch.Tensor) and id(variable) in wanted) or any(
            child is not None and free[id(child)] and passes[id(child)]
            for child, _ in node.next_functions
        )
    return any(free[id(root)] and passes[id(root)] for root in roots)


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

    def reached_past_the_units(self, names: Collection[str]) -> bool | None:
        """Whether the latest pass's output reaches one of the parameters ``names``
        by a path free of activations and ops with a zero derivative
        (``reached_past_the_units``); None where there is no graph to look at."""
        roots, layers = self._roots, self._layers()
        if not roots or layers is None:
            return None
        params = [p for p in layers.parameters() if layers.info(p).name in names]
        try:
            return reached_past_the_units(roots, params)
        except Exception:  # a graph that cannot be walked claims nothing
            return None

    def detach(self) -> None:
        self.wanted = False
        self._roots = None
        self._returned = []
        if self._passes.listens(self):
            self._passes.unsubscribe(self)
