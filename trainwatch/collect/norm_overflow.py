"""Gradients whose norm overflowed while every one of them is finite.

The step's trigger for a NaN/Inf is a non-finite gradient norm, an fp32 sum
of squares. Finite gradients overflow it too once their elements pass about
1e19 (a corrupt target of 1e21 under a squared error makes such gradients):
no NaN/Inf anywhere, and nothing for a replay to locate. Asked only once the
trigger fired, so the usual step pays nothing: one batched reduction of the
gradients, read back together.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from trainwatch.collect.nonfinite_locate import NORM_OVERFLOW, NonfiniteFinding
from trainwatch.collect.tensors import local_part
from trainwatch.layers import ParamInfo


def norm_overflow(
    params: Iterable[torch.Tensor],
    info: Callable[[torch.Tensor], ParamInfo],
    clip_norm: float | None = None,
) -> NonfiniteFinding | None:
    """The largest gradient element, when every gradient of ``params`` is finite;
    None when some gradient holds a NaN/Inf (or is not plainly readable: sparse).

    ``clip_norm``: the total norm of a ``clip_grad_norm_`` in progress, kept
    with the finding to say what the clip does to these gradients.
    """
    held = []
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if grad.layout != torch.strided:
            return None
        grad = local_part(grad.detach())
        if grad.numel():
            held.append((param, grad))
    if not held:
        return None
    device = held[0][1].device
    # Each gradient's largest magnitude (its inf-norm, one batched kernel): NaN/Inf
    # exactly when the gradient holds one.
    largest = torch._foreach_norm([g for _, g in held], math.inf)
    tops = torch.stack([t.float().to(device) for t in largest]).tolist()
    if not all(map(math.isfinite, tops)):
        return None
    where = max(range(len(tops)), key=tops.__getitem__)
    param, grad = held[where]
    found = info(param)
    finding = NonfiniteFinding(-1, "backward", NORM_OVERFLOW, dtype=str(grad.dtype))
    finding.parameter, finding.owner = found.name, found.owner
    finding.largest, finding.clip_norm = tops[where], clip_norm
    return finding
