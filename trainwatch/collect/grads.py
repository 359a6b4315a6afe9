"""Per-parameter gradient norms in a few batched kernels, no host sync.

One ``torch._foreach_norm`` per device over every gradient the step uses; the
result stays on the device until the step's single readback.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

import torch

from trainwatch.collect.tensors import all_plain, local_part, real_parts
from trainwatch.layers import ParamInfo

_STRIDED = {torch.strided}
_LAYOUT = attrgetter("layout")
_REQUIRES_GRAD = attrgetter("requires_grad")
_DEVICE = attrgetter("device")


def _foreach_norm_fp32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    try:
        return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    except (TypeError, RuntimeError):
        # Older torch (no dtype argument), or complex weights (a spectral layer's):
        # a complex tensor's norm is that of its real and imaginary parts, so a
        # NaN/Inf in either shows (``.float()`` would drop the imaginary one).
        return list(torch._foreach_norm([real_parts(t).float() for t in tensors], 2))


def _dense(grad: torch.Tensor) -> torch.Tensor:
    # A DTensor shard (FSDP2's fully_shard): the norm of this rank's shard,
    # which is what this rank holds and applies.
    grad = local_part(grad)
    if grad.layout == torch.strided:
        return grad.detach()
    return grad.detach().coalesce().values()  # sparse gradients (nn.Embedding(sparse=True))


def gradient_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm of each gradient as fp32, one 1-D tensor in input order.

    fp32 so that fp16 gradients cannot overflow inside the norm itself.
    """
    if not grads:
        return torch.zeros(0)
    if (
        all_plain(grads)
        and set(map(_LAYOUT, grads)) == _STRIDED
        and not any(map(_REQUIRES_GRAD, grads))
        and len(set(map(_DEVICE, grads))) == 1
    ):
        # The usual step: told in C loops, with no Python per gradient.
        return torch.stack(_foreach_norm_fp32(list(grads)))
    strided = torch.strided
    # Gradients are plain strided tensors outside autograd: taken as they are
    # (a detach per gradient would be one more op per parameter per step).
    plain = torch.Tensor
    dense = [
        g if type(g) is plain and g.layout == strided and not g.requires_grad else _dense(g)
        for g in grads
    ]
    if len({g.device for g in dense}) == 1:
        return torch.stack(_foreach_norm_fp32(dense))
    # Several devices (model parallel): keep input order across device groups.
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    order: list[tuple[torch.device, int]] = []
    for grad in dense:
        group = by_device.setdefault(grad.device, [])
        order.append((grad.device, len(group)))
        group.append(grad)
    stacked = {dev: torch.stack(_foreach_norm_fp32(g)).cpu() for dev, g in by_device.items()}
    return torch.stack([stacked[dev][i] for dev, i in order])


def layer_norms(
    present: Sequence[ParamInfo], norms: Sequence[float], layers: Sequence[str]
) -> tuple[dict[str, float], float]:
    """Per-layer norm = sqrt(sum of its parameters' squared norms), and the total."""
    squares: dict[int, float] = {}
    for info, norm in zip(present, norms):
        squares[info.layer_index] = squares.get(info.layer_index, 0.0) + norm * norm
    per_layer = {layers[i]: sq**0.5 for i, sq in squares.items()}
    total = sum(squares.values()) ** 0.5 if squares else 0.0
    return per_layer, total


def weight_norms(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The weights' own L2 norms as fp32, one 1-D tensor in input order.

    A loop without an optimizer shows its hand-written update through them
    (see ``HandUpdates``). Taken beside the gradients' norms, which go through
    the gradient layouts (``SmallGradientNorms``) as an optimizer's step's do,
    so that the rules read per-layer sums in C loops there too. The usual
    model's weights (plain strided tensors on one device) are told in C loops;
    under ``no_grad`` they are read as they are: a detach per weight would be
    one more op per parameter.
    """
    if not weights:
        return torch.zeros(0)
    with torch.no_grad():
        if set(map(_LAYOUT, weights)) == _STRIDED and len(set(map(_DEVICE, weights))) == 1:
            return torch.stack(_foreach_norm_fp32(list(weights)))
        plain = [w if w.layout == torch.strided else _dense(w) for w in weights]
        return gradient_norms(plain)
