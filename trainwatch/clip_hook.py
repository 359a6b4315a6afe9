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
clips. A loop that never clips pays nothing; one that does pays one Python
call per clip. The wrapper comes off when the last monitor closes.

``clip_grad_value_`` and FSDP1's ``FullyShardedDataParallel.clip_grad_norm_``
go through no such function: their loops are still read after clipping.
Torch before 2.6 has no ``_clip_grads_with_norm_``: nothing is wrapped there.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from trainwatch import registry
from trainwatch.errors import TrainingHealthError

try:
    from torch.nn.utils import clip_grad as _clip_grad
except ImportError:  # pragma: no cover - every supported torch has it
    _clip_grad = None  # type: ignore[assignment]

_NAME = "_clip_grads_with_norm_"
_original: Any = None
_users: weakref.WeakSet[Any] = weakref.WeakSet()


def _before_clipping(parameters: Any) -> None:
    if isinstance(parameters, torch.Tensor):
        parameters = (parameters,)
    for param in parameters:
        if isinstance(param, torch.Tensor) and param.grad is not None:
            owner = registry.owner_of(param)
            if owner is not None:
                owner.before_clipping(param)
            return


def _clip_grads_with_norm_(
    parameters: Any, max_norm: Any, total_norm: Any, foreach: Any = None
) -> None:
    original = _original
    if _users:
        try:
            _before_clipping(parameters)
        except TrainingHealthError:
            raise
        except Exception:  # a monitor reports its own failures; clipping goes on
            pass
    elif original is not None:
        _restore()
    if original is None:  # pragma: no cover - restored under a concurrent call
        original = getattr(_clip_grad, _NAME)
    return original(parameters, max_norm, total_norm, foreach)


def install(monitor: Any) -> None:
    """Wrap the clipping function while ``monitor`` is open (once for all monitors)."""
    global _original
    _users.add(monitor)
    if _original is not None or _clip_grad is None:
        return
    current = getattr(_clip_grad, _NAME, None)
    if current is None or current is _clip_grads_with_norm_:
        return
    _original = current
    setattr(_clip_grad, _NAME, _clip_grads_with_norm_)


def release(monitor: Any) -> None:
    """``monitor`` closed: the wrapper comes off once no monitor is open."""
    _users.discard(monitor)
    if not _users:
        _restore()


def _restore() -> None:
    global _original
    if _original is None:
        return
    if getattr(_clip_grad, _NAME, None) is _clip_grads_with_norm_:
        setattr(_clip_grad, _NAME, _original)
    _original = None


def installed() -> bool:
    return _original is not None
