"""On CPU, the norms of many small gradients in a few kernels instead of one each.

``torch._foreach_norm`` on CPU runs one reduction per tensor, and for a small
tensor (a bias, a LayerNorm weight, a 64x64 weight) the kernel's fixed cost,
about 2 us, is nearly all of it: a model of many small layers pays it for
every parameter at every step. Small gradients of one shape are stacked and
reduced together instead, one copy and one kernel per shape, which is a
cost set by the model's distinct shapes, not its depth. Shapes met only
once, and large gradients, still go through ``_foreach_norm``.

Large gradients are not reduced some faster-looking way (``dot`` with
itself reads a large fp32 tensor as fast or faster): right after backward
every distinct kernel a step adds runs cold, and on a 670k-parameter MLP
(one thread) the two dots, their stack, root and concatenation cost about
85 us more than one ``_foreach_norm`` over every gradient and its stack
(about 580 against 490 us, medians over 200 steps each, read right after
backward). Fewer ops win.

The gradient that entered the model's output (the probe's) rides along:
handed over as ``entering``, its norms come last, after every parameter's,
from the same ``_foreach_norm``, so a NaN/Inf the model's own ReLU kept from
every parameter still turns the step's norms non-finite, at no op of its own.

The norms come back in the plan's order, not the input's: a reordering op
would cost as much as a group saves, and every reader pairs norms with the
parameters they belong to, so the caller reorders its parameter list instead
(:attr:`NormPlan.order`, computed once per layout of the step's gradients).

The per-layer norms leave out the parameters outside the model that another
monitor tells (a head watched as a model of its own, one optimizer over both:
see trainwatch.outside_owners): a layout holding parameters outside the model
is a :class:`SharedGradientLayout`, which asks once, and again only when who
watches what changed. A layout of the model's own parameters asks nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import accumulate, groupby, starmap
from operator import attrgetter, itemgetter

import torch

from trainwatch import registry
from trainwatch.collect.grads import gradient_norms, layer_norms
from trainwatch.collect.tensors import set_grad_enabled
from trainwatch.layers import ParamInfo
from trainwatch.record import StepRecord

_LAYER_INDEX = attrgetter("layer_index")
_IN_MODEL = attrgetter("in_model")
_RUN = itemgetter(1)  # one of groupby's runs

# A gradient up to this many elements is stacked with those of its shape.
SMALL = 1 << 14
# Fewer gradients of one shape than this are not worth a group of their own.
_MIN_GROUP = 4
# No gradient entering the model to check (shared, never written).
_NO_ENTERING: list[torch.Tensor] = []


class NormPlan:
    """How one layout of gradients (their shapes, in order) is reduced."""

    __slots__ = ("groups", "rest", "order", "identity", "_picks")

    def __init__(self, grads: Sequence[torch.Tensor]) -> None:
        by_shape: dict[tuple[torch.Size, torch.dtype], list[int]] = {}
        rest: list[int] = []
        plain = torch.Tensor
        cpu = torch.device("cpu")
        for index, grad in enumerate(grads):
            if grad.device != cpu or type(grad) is not plain or grad.layout != torch.strided:
                # A GPU's _foreach_norm is a few batched kernels already; shards
                # and sparse gradients are read the general way.
                by_shape, rest = {}, list(range(len(grads)))
                break
            if grad.dim() > 0 and grad.numel() <= SMALL and not grad.is_complex():
                by_shape.setdefault((grad.shape, grad.dtype), []).append(index)
            else:
                rest.append(index)
        groups = []
        for members in by_shape.values():
            if len(members) >= _MIN_GROUP:
                groups.append(members)
            else:
                rest.extend(members)
        rest.sort()
        self.groups = groups
        self.rest = rest
        # The norms come out as the groups' members, then the rest.
        self.order = [index for members in groups for index in members]
        self.order += rest
        self.identity = not groups  # the input's own order, one foreach
        # Per group, planned once: its members' getter (a group has at least
        # _MIN_GROUP, so the getter gives a tuple) and the dimensions reduced.
        dims = [tuple(range(1, grads[members[0]].dim() + 1)) for members in groups]
        self._picks = [(itemgetter(*members), d) for members, d in zip(groups, dims)]

    def norms(
        self, grads: Sequence[torch.Tensor], entering: list[torch.Tensor] = _NO_ENTERING
    ) -> torch.Tensor:
        """fp32 norms in :attr:`order`, then ``entering``'s; raises when the gradients
        no longer fit the plan."""
        pieces = []
        # create_graph=True gradients: nothing recorded (by grad mode, at every step).
        grad = torch.is_grad_enabled()
        if grad:
            set_grad_enabled(False)
        try:
            for members_of, dims in self._picks:
                stacked = torch.stack(members_of(grads))
                if stacked.dim() != len(dims) + 1:
                    raise RuntimeError("a gradient changed shape since the plan")
                pieces.append(torch.linalg.vector_norm(stacked, 2, dim=dims, dtype=torch.float32))
            rest = list(map(grads.__getitem__, self.rest)) + entering
            if rest:
                pieces.append(torch.stack(torch._foreach_norm(rest, 2, dtype=torch.float32)))
        finally:
            if grad:
                set_grad_enabled(True)
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


# Layouts kept: one per optimizer usually (a GAN's two alternate every step).
_KEPT = 8


class GradientLayout:
    """One layout of a step's gradients (these parameters, in this order), kept across
    steps: how their norms are taken, the order they come in, and how they add up
    per layer.

    It holds its parameters' records, so the ids that key it cannot be reused
    by others while it is kept.
    """

    __slots__ = ("present", "plan", "_sums", "__weakref__")

    def __init__(self, present: list[ParamInfo], plan: NormPlan | None) -> None:
        self.plan = plan
        self.present = present if plan is None else list(map(present.__getitem__, plan.order))
        self._sums: LayerSums | None = None

    def layer_norms(
        self, norms: Sequence[float], layers: Sequence[str]
    ) -> tuple[dict[str, float], float]:
        """Per-layer norms (the root of the sum of its parameters' squared norms) and the total."""
        sums = self._sums
        if sums is None or sums.layers is not layers:
            sums = self._sums = LayerSums(self.present, layers)
        found = sums.of(norms)
        return found if found is not None else layer_norms(self.present, norms, layers)


class SharedGradientLayout(GradientLayout):
    """A layout holding parameters outside the model, some of which another monitor
    may tell: those are left out of the per-layer norms and the total.

    Which ones is asked of ``told_elsewhere`` (the optimizer's index -> their
    names) as the sums are first built, and again once ``registry.changes``
    moved (a monitor opened or closed, an optimizer added to one) or the layer
    map was rebuilt: a compare a step, on such steps only.
    """

    __slots__ = ("_optimizer", "_told_elsewhere", "_changes", "_kept")

    def __init__(
        self,
        present: list[ParamInfo],
        plan: NormPlan | None,
        optimizer: int | None,
        told_elsewhere: Callable[[int | None], frozenset[str]],
    ) -> None:
        super().__init__(present, plan)
        self._optimizer = optimizer
        self._told_elsewhere = told_elsewhere
        self._changes = -1
        self._kept: list[int] | None = None  # positions of those told here (None: all)

    def layer_norms(
        self, norms: Sequence[float], layers: Sequence[str]
    ) -> tuple[dict[str, float], float]:
        sums = self._sums
        if sums is None or sums.layers is not layers or self._changes != registry.changes:
            self._changes = registry.changes
            elsewhere = self._told_elsewhere(self._optimizer)
            present = self.present
            kept = [
                i for i, info in enumerate(present) if info.in_model or info.name not in elsewhere
            ]
            self._kept = kept if len(kept) < len(present) else None
            sums = self._sums = LayerSums(present, layers, self._kept)
        found = sums.of(norms)
        if found is not None:
            return found
        # Non-finite norms: the general way, over those told here.
        kept = self._kept
        if kept is None or len(norms) != len(self.present):
            return layer_norms(self.present, norms, layers)
        return layer_norms([self.present[i] for i in kept], [norms[i] for i in kept], layers)


class LayerSums:
    """Per-layer norms of one layout in C loops: its norms put in layer order by one
    ``itemgetter``, each layer a slice of that, each slice one ``math.hypot``.

    A healthy step's per-layer sums then cost no Python per layer. Non-finite
    norms go the general way (``hypot`` calls a NaN beside an Inf infinite).
    ``kept``: the positions summed (None: all); the others belong to no layer
    this monitor tells.
    """

    __slots__ = ("layers", "_count", "_order", "_slices", "_names")

    def __init__(
        self, present: Sequence[ParamInfo], layers: Sequence[str], kept: list[int] | None = None
    ) -> None:
        # Built in C loops too (once per layout, at any depth): the positions
        # sorted by layer, then one slice per run of a layer's positions.
        self.layers = layers
        self._count = len(present)
        indices = list(map(_LAYER_INDEX, present))
        order = sorted(range(len(indices)) if kept is None else kept, key=indices.__getitem__)
        ordered = list(map(indices.__getitem__, order))
        ends = list(accumulate(map(len, map(list, map(_RUN, groupby(ordered))))))
        self._order = order
        self._slices = list(map(slice, [0, *ends[:-1]], ends))
        self._names = list(map(layers.__getitem__, dict.fromkeys(ordered)))

    def of(self, norms: Sequence[float]) -> tuple[dict[str, float], float] | None:
        if len(norms) != self._count or not norms:
            return None
        ordered = tuple(map(norms.__getitem__, self._order))
        total = math.hypot(*ordered)
        if not math.isfinite(total):
            return None
        values = list(starmap(math.hypot, map(ordered.__getitem__, self._slices)))
        return dict(zip(self._names, values)), total


class SmallGradientNorms:
    """The layouts of gradients seen lately, kept across steps."""

    def __init__(self) -> None:
        self._layouts: dict[tuple[int, ...], GradientLayout] = {}
        # Told the ``present`` of each layout not kept (a new set of parameters
        # with gradients: perhaps a layer's first), so a step of a kept one pays
        # nothing for it.
        self.on_new_layout: Callable[[Sequence[ParamInfo]], None] | None = None
        # The names of an optimizer's parameters outside the model that another
        # monitor tells (see SharedGradientLayout); None: none is ever left out.
        self.told_elsewhere: Callable[[int | None], frozenset[str]] | None = None

    def norms(
        self,
        record: StepRecord,
        grads: list[torch.Tensor],
        entering: list[torch.Tensor] = _NO_ENTERING,
    ) -> torch.Tensor:
        """The fp32 norms of ``grads`` (``record.present``'s), in the order of the
        layout's ``present``, which becomes ``record.present`` (``record.layout``: the
        layout, for the per-layer sums); then those of ``entering``, the gradients
        that entered the model (not part of any layout: new tensors every step)."""
        present = record.present
        layouts = self._layouts
        key = tuple(map(id, present))  # a layout: these parameters, in this order
        layout = layouts.get(key)
        if layout is None:
            if len(layouts) >= _KEPT:
                layouts.clear()
            made = NormPlan(grads)
            plan = None if made.identity else made
            told_elsewhere = self.told_elsewhere
            if told_elsewhere is not None and not all(map(_IN_MODEL, present)):
                layout = SharedGradientLayout(present, plan, record.optimizer, told_elsewhere)
            else:
                layout = GradientLayout(present, plan)
            layouts[key] = layout
            if self.on_new_layout is not None:
                self.on_new_layout(present)
        plan = layout.plan
        if plan is not None:
            try:
                norms = plan.norms(grads, entering)
            except RuntimeError:  # a parameter's .data replaced by another shape
                layouts.clear()
                return gradient_norms(grads + entering)
        else:
            norms = gradient_norms(grads + entering)
        # One list for every step of this layout: records read it, none writes it.
        record.present = layout.present
        record.layout = layout
        return norms
