"""The step's gradients gathered just before ``clip_grad_norm_`` rescales them.

A plain loop clips between backward and ``optimizer.step()``; the optimizer's
step pre-hook, where trainwatch otherwise reads the gradients, comes after
that. Clipped norms hide what the rules look for: a norm that jumped 1000x
reads as the clip threshold, and a NaN born in one layer makes the total
non-finite, which ``clip_grad_norm_`` spreads to every gradient (it scales
each by ``max_norm / total``).

``torch.nn.utils.clip_grad_norm_`` measures the total, then calls the module
function ``torch.nn.utils.clip_grad._clip_grads_with_norm_`` (looked up at
call time) to rescale. While a monitor is open that function is wrapped: the
monitor owning the first parameter with a gradient gathers that parameter's
optimizer step there, as the Lightning callback does before Lightning
clips. Once clipped, that monitor is told again: where the step's backward
left gradients it noted (not the usual step), it notes them as clipped, so a
``zero_grad()`` between the clip and the step is still seen at the step. A
loop that never clips pays nothing; one that does pays two Python calls per
clip. The wrapper comes off when the last monitor closes.

``clip_grad_value_`` and FSDP1's ``FullyShardedDataParallel.clip_grad_norm_``
go through no such function: their loops are still read after clipping.
Torch before 2.6 has no ``_clip_grads_with_norm_``: nothing is wrapped there.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch.nn.utils import clip_grad as _clip_grad

from trainwatch import registry
from trainwatch.errors import TrainingHealthError

_NAME = "_clip_grads_with_norm_"
_ORIGINAL: Any = getattr(_clip_grad, _NAME, None)  # None: torch before 2.6
_users: weakref.WeakSet[Any] = weakref.WeakSet()


def _before_clipping(parameters: Any, max_norm: Any) -> tuple[Any, torch.Tensor] | None:
    """The monitor owning the first parameter with a gradient, told (with the clip's
    ``max_norm``); it and that parameter, to be told again once clipped."""
    if isinstance(parameters, torch.Tensor):
        parameters = (parameters,)
    for param in parameters:
        if isinstance(param, torch.Tensor) and param.grad is not None:
            owner = registry.owner_of(param)
            if owner is None:
                return None
            owner.before_clipping(param, max_norm)
            return owner, param
    return None


def _clip_grads_with_norm_(
    parameters: Any, max_norm: Any, total_norm: Any, foreach: Any = None
) -> None:
    if not isinstance(parameters, (torch.Tensor, list, tuple)):
        parameters = list(parameters)  # read twice: by the monitor, then to clip
    told = None
    try:
        told = _before_clipping(parameters, max_norm)
    except TrainingHealthError:
        raise
    except Exception:  # the monitor reports its own failures; clipping goes on
        pass
    result = _ORIGINAL(parameters, max_norm, total_norm, foreach)
    if told is not None:
        try:
            told[0].after_clipping(told[1])
        except Exception:  # the monitor reports its own failures
            pass
    return result


def total_in_progress() -> float | None:
    """The total norm ``clip_grad_norm_`` measured, while the step it is about to
    rescale is gathered (None: no clip in progress), to say what the clip does to
    gradients found non-finite or overflowing. Read from the wrapper's own frame
    further down the stack: a clip pays nothing for it, and only such a step asks.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _clip_grads_with_norm_.__code__:
            total = frame.f_locals.get("total_norm")
            return float(total) if isinstance(total, torch.Tensor) else None
        frame = frame.f_back
    return None


def install(monitor: Any) -> None:
    """Wrap the clipping function while ``monitor`` is open (once for all monitors)."""
    _users.add(monitor)
    if _ORIGINAL is not None and getattr(_clip_grad, _NAME) is _ORIGINAL:
        setattr(_clip_grad, _NAME, _clip_grads_with_norm_)


def release(monitor: Any) -> None:
    """``monitor`` closed: the wrapper comes off once no monitor is open."""
    _users.discard(monitor)
    if not _users and installed():
        setattr(_clip_grad, _NAME, _ORIGINAL)


def installed() -> bool:
    return getattr(_clip_grad, _NAME, None) is _clip_grads_with_norm_


def grads_unscaled(scaler: Any, optimizer: Any) -> bool:
    """Whether ``optimizer``'s gradients are free of ``scaler``'s loss scale
    (no enabled GradScaler, or its ``unscale_`` ran for this optimizer's step)."""
    if scaler is None or not getattr(scaler, "_enabled", False):
        return True
    states = getattr(scaler, "_per_optimizer_states", None)
    state = states.get(id(optimizer)) if isinstance(states, dict) else None
    stage = state.get("stage") if isinstance(state, dict) else None
    return getattr(stage, "name", None) == "UNSCALED"
