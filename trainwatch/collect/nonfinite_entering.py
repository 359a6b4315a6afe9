"""The gradient where backward enters the model, and what it says when asked.

The probe keeps, per pass, the gradient each output of the model was handed
(references, never read on a healthy step on their own). Their norms ride
with the parameters' gradient norms at the step, in the same kernel, so
non-finite numbers ask even where the model's own ReLU kept the NaN/Inf
from every parameter. They are read only when the step's numbers ask:
non-finite gradients (was it the loss? an fp16 overflow?), every gradient
exactly zero (did the loss send anything back?), some exactly zero (did one
output get nothing?), or a backward no step used (its flag).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from trainwatch.collect.nonfinite_locate import NonfiniteFinding
from trainwatch.collect.nonfinite_loss_backward import look_at_loss
from trainwatch.collect.tensors import finite_exact, real_parts

if TYPE_CHECKING:
    from trainwatch.collect.nonfinite import NonfiniteProbe


def on_inexact_grad_entering(
    probe: NonfiniteProbe, candidate: Any, position: int, grad: torch.Tensor
) -> None:
    """``on_grad_entering`` for a pass whose outputs hold a complex tensor: a complex
    gradient is kept as the real view of its two parts, so the step's norms it rides
    with, and every look here, take a NaN/Inf in either part as they take a real
    one's (a norm in fp32 refuses a complex tensor). ``as_handed`` gives it back."""
    probe.on_grad_entering(candidate, position, real_parts(grad) if grad.is_complex() else grad)


def as_handed(grad: torch.Tensor, output: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient as backward handed it to the output: one kept as the real view of
    a complex gradient's parts (see :func:`on_inexact_grad_entering`) is that complex
    gradient again. ``output``: the output it entered, where known (a replay's)."""
    if grad.is_complex() or grad.dim() == 0 or grad.shape[-1] != 2 or grad.stride(-1) != 1:
        return grad
    if output is not None:
        return torch.view_as_complex(grad) if output.is_complex() else grad
    base = grad._base
    return torch.view_as_complex(grad) if base is not None and base.is_complex() else grad


def entering_all_zero(probe: NonfiniteProbe) -> bool:
    """Whether the gradient that entered the model in the step's last backward was
    exactly zero everywhere (a loss that sent nothing back). Asked only on a step
    whose every gradient is zero: one small reduction per output, read at once."""
    grads = [g for g in probe._this_pass.grad_entering if g is not None and g.is_floating_point()]
    return bool(grads) and not any(bool(g.detach().any()) for g in grads)


def outputs_without_signal(probe: NonfiniteProbe) -> list[int]:
    """The output positions whose entering gradient in the step's last backward
    was exactly zero, where another output's was not: a loss that weighs one
    task by zero. Asked only on a step with some gradient exactly zero."""
    entering = probe._this_pass.grad_entering
    zero, sent = [], False
    for position, g in enumerate(entering):
        if g is None or not g.is_floating_point():
            continue
        if bool(g.detach().any()):
            sent = True
        else:
            zero.append(position)
    return zero if sent else []


def outputs_unreached(probe: NonfiniteProbe) -> list[int]:
    """The output positions (of those needing a gradient) that the step's last
    backward never reached, where it reached another: an output the loss left
    out on this step. Host-side only (no read of any tensor)."""
    entering = probe._this_pass.grad_entering
    unreached = [position for position, g in enumerate(entering) if g is None]
    return unreached if len(unreached) < len(entering) else []


def entering_flag(probe: NonfiniteProbe) -> torch.Tensor | float:
    """Whether the gradient that entered the model in the last backward was non-finite:
    a device flag when verdicts wait for the step, else a host float."""
    grads = [g for g in probe._this_pass.grad_entering if g is not None and g.is_floating_point()]
    if probe.at_step and grads:
        sums = torch.stack([g.detach().sum(dtype=torch.float64) for g in grads])
        return sums.isfinite().all().logical_not().float()
    return float(entering_bad(probe))


def entering_bad(probe: NonfiniteProbe) -> bool:
    """Whether the gradient that entered the model in the last backward was non-finite."""
    if not probe._this_pass.bad:
        bad = next(
            (
                g
                for g in probe._this_pass.grad_entering
                if g is not None and g.is_floating_point() and not finite_exact(g, masks=False)
            ),
            None,
        )
        if bad is not None:
            probe._this_pass.bad = True
            if probe._this_step.entering_origin is None:
                origin = probe._this_step.entering_origin = _entering_origin(bad)
                # The loss the training code holds says whether it, or its
                # backward, made the NaN/Inf.
                look_at_loss(probe, origin)
    return probe._this_pass.bad


def _entering_origin(grad: torch.Tensor) -> NonfiniteFinding:
    """The gradient non-finite where it enters the model, as it is: an Inf in fp16
    is the loss's gradient past fp16's range, a NaN more likely the loss itself."""
    grad = as_handed(grad).detach()
    return NonfiniteFinding(
        module=0,
        direction="backward",
        cause="loss",
        kind="nan" if bool(torch.isnan(grad).any()) else "inf",
        count=int((~torch.isfinite(grad)).sum()),
        shape=tuple(grad.shape),
        dtype=str(grad.dtype),
        device=str(grad.device),
    )
