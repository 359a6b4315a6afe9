"""On CPU, the norms of many small gradients in a few kernels instead of one each.

``torch._foreach_norm`` on CPU runs one reduction per tensor, and for a small
tensor (a bias, a LayerNorm weight, a 64x64 weight) the kernel's fixed cost,
about 2 us, is nearly all of it: a model of many small layers pays it for
every parameter at every step. Small gradients of one shape are stacked and
reduced together instead, one copy and one kernel per shape, which is a
cost set by the model's distinct shapes, not its depth. Large gradients
(copying them would cost more than the launch it saves) and shapes met only
once still go through ``_foreach_norm``.

The norms come back in the plan's order, not the input's: a reordering op
would cost as much as a group saves, and every reader pairs norms with the
parameters they belong to, so the caller reorders its parameter list instead
(:attr:`NormPlan.order`, computed once per layout of the step's gradients).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainwatch.collect.grads import gradient_norms
from trainwatch.record import StepRecord

# A gradient up to this many elements is stacked with those of its shape.
SMALL = 1 << 14
# Fewer gradients of one shape than this are not worth a group of their own.
_MIN_GROUP = 4


class NormPlan:
    """How one layout of gradients (their shapes, in order) is reduced."""

    __slots__ = ("groups", "rest", "order", "identity")

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
        self.identity = not groups  # nothing stacked: the input's own order

    def norms(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """fp32 norms in :attr:`order`; raises when the gradients no longer fit the plan."""
        pieces = []
        with torch.no_grad():  # create_graph=True gradients: nothing recorded
            for members in self.groups:
                stacked = torch.stack(list(map(grads.__getitem__, members)))
                dims = tuple(range(1, stacked.dim()))
                pieces.append(torch.linalg.vector_norm(stacked, 2, dim=dims, dtype=torch.float32))
            if self.rest:
                rest = list(map(grads.__getitem__, self.rest))
                pieces.append(torch.stack(torch._foreach_norm(rest, 2, dtype=torch.float32)))
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


# Layouts kept: one per optimizer usually (a GAN's two alternate every step).
_KEPT = 8


class SmallGradientNorms:
    """The plans of the layouts of gradients seen lately, kept across steps."""

    def __init__(self) -> None:
        self._plans: dict[tuple[int, ...], NormPlan | None] = {}

    def norms(self, record: StepRecord, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """The fp32 norms of ``grads`` (``record.present``'s), reordering ``record.present``
        to the norms' order where a plan stacks some of them."""
        present = record.present
        plans = self._plans
        key = tuple(map(id, present))  # a layout: these parameters, in this order
        if key in plans:
            plan = plans[key]
        else:
            if len(plans) >= _KEPT:
                plans.clear()
            made = NormPlan(grads)
            plan = plans[key] = None if made.identity else made
        if plan is not None:
            try:
                norms = plan.norms(grads)
            except RuntimeError:  # a parameter's .data replaced by another shape
                self._plans.clear()
            else:
                record.present = list(map(present.__getitem__, plan.order))
                return norms
        return gradient_norms(grads)
