"""Sees whether backward added onto gradients that a step had already used.

After a step uses a parameter's gradient the tracker remembers that tensor and
its version counter. Every reset leaves a trace the tracker can see without
reading any value: ``zero_grad()`` either replaces ``.grad`` (``None``, then a
new tensor) or zeroes it in place (the version counter moves). If instead the
next backward accumulates into the same tensor with the same version, the old
values are still in it; if nothing resets it before the step that uses it,
that step applies stale gradients again: the missing ``zero_grad`` bug.

Deciding at the *use* (the next step of the same optimizer), not at the
accumulation, keeps the tracker silent on a GAN, where the generator's
backward legitimately adds onto the discriminator's old gradients that are
reset before the discriminator's next step.

Legacy code that zeroes through ``p.grad.data.zero_()`` leaves no version
trace, so each suspect also gets one device-side max|g| taken just before the
accumulation: stale *and* non-zero is the bug. It runs only for suspects,
so healthy training pays nothing for it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils.hooks import RemovableHandle


def _never(_: object = None) -> bool:
    return False


_swap_mode = getattr(torch.__future__, "get_swap_module_params_on_conversion", _never)
try:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass as _wrapper_subclass
except ImportError:  # pragma: no cover - other torch versions
    _wrapper_subclass = _never


def _swappable(tensor: torch.Tensor) -> bool:
    """Whether ``module.to()`` may swap this tensor, which fails if it has a weak reference.

    It swaps every tensor in swap mode, and wrapper subclasses (DTensor) always.
    """
    return _swap_mode() or _wrapper_subclass(tensor)


class _SameTensor:
    """Recognises one gradient tensor later, without keeping it alive.

    A weak reference is exact, but PyTorch refuses to swap a tensor that has
    one (``torch.utils.swap_tensors``: ``module.to()`` in swap mode, and for
    wrapper subclasses such as DTensor), so such tensors are recognised by
    their id and their C++ tensor instead. Only a gradient set to ``None`` and
    then replaced by hand with a new one that lands at both of the old
    addresses could pass for the old one.
    """

    __slots__ = ("ref", "key")

    def __init__(self, tensor: torch.Tensor) -> None:
        if _swappable(tensor):
            self.ref: weakref.ref[torch.Tensor] | None = None
            self.key: tuple[int, int] | None = (id(tensor), tensor._cdata)
        else:
            self.ref, self.key = weakref.ref(tensor), None

    def __call__(self, tensor: torch.Tensor | None) -> bool:
        """Whether ``tensor`` is the tensor this was made from."""
        if tensor is None:
            return False
        if self.ref is not None:
            return self.ref() is tensor
        return self.key == (id(tensor), tensor._cdata)


def _rewire_hooks(param: torch.Tensor) -> None:
    """Reconnect a swapped parameter's tensor hooks (ours and the user's).

    ``torch.utils.swap_tensors`` (``module.to()`` in swap mode) keeps a
    tensor's Python tables of hooks but not the autograd hooks that call
    them: after the swap no hook of that parameter fires. Assigning each
    table back to the tensor wires it to autograd again; every handle stays valid.
    """
    hooks = param._backward_hooks
    if hooks is not None:
        param._backward_hooks = hooks
    after = getattr(param, "_post_accumulate_grad_hooks", None)
    if after is not None:
        param._post_accumulate_grad_hooks = after


class _ParamState:
    __slots__ = (
        "param",
        "impl",
        "armed",
        "reset",
        "accumulated",
        "grad",
        "version",
        "content",
        "seen",
    )

    def __init__(self, param: torch.Tensor) -> None:
        # Held strongly (the monitor's layer map holds it too): a weak
        # reference would stop module.to() from swapping it.
        self.param = param
        self.impl = param._cdata  # changes only when the parameter is swapped
        self.seen = False  # backward reached it since the last step boundary
        self.armed = False
        self.reset = False
        self.accumulated = False
        self.grad: _SameTensor | None = None  # the gradient the last step used
        self.version = -1
        self.content: torch.Tensor | None = None

    def holds_used_grad(self, grad: torch.Tensor | None) -> bool:
        return self.grad is not None and self.grad(grad)


class _BeforeAccumulate:
    """Tensor hook: runs before backward adds the new gradient into ``.grad``."""

    __slots__ = ("tracker", "key")

    def __init__(self, tracker: GradResetTracker, key: int) -> None:
        self.tracker = weakref.ref(tracker)
        self.key = key

    def __call__(self, grad: torch.Tensor) -> None:
        tracker = self.tracker()
        if tracker is not None and tracker.enabled:
            try:
                tracker.before_accumulate(self.key)
            except Exception as exc:  # never break the user's backward
                tracker.fail(exc)
        return None


class _AfterAccumulate:
    __slots__ = ("tracker",)

    def __init__(self, tracker: GradResetTracker) -> None:
        self.tracker = weakref.ref(tracker)

    def __call__(self, param: torch.Tensor) -> None:
        tracker = self.tracker()
        if tracker is not None and tracker.enabled:
            try:
                tracker.after_accumulate(param)
            except Exception as exc:
                tracker.fail(exc)


class GradResetTracker:
    def __init__(self, on_error: Callable[[str, BaseException], None]) -> None:
        self._states: dict[int, _ParamState] = {}
        self._handles: list[RemovableHandle] = []
        self._on_error = on_error
        self.enabled = True
        # Set by any accumulation; the monitor uses it to attribute a loss to
        # the step that is being built rather than the one just finished.
        self.backward_seen = False

    # -- lifecycle -------------------------------------------------------
    def attach(self, params: Iterable[torch.Tensor]) -> None:
        for param in params:
            if id(param) in self._states or not param.requires_grad:
                continue
            self._states[id(param)] = _ParamState(param)
            self._handles.append(param.register_hook(_BeforeAccumulate(self, id(param))))
            self._handles.append(param.register_post_accumulate_grad_hook(_AfterAccumulate(self)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._states.clear()

    def fail(self, exc: BaseException) -> None:
        self.enabled = False
        self._on_error("accumulation tracker", exc)

    # -- hooks -----------------------------------------------------------
    def before_accumulate(self, key: int) -> None:
        state = self._states.get(key)
        if state is None or not state.armed or state.reset:
            return
        grad = state.param.grad
        if not state.holds_used_grad(grad) or grad._version != state.version:
            state.reset = True
            state.content = None
            return
        if not state.accumulated:
            state.accumulated = True
            if grad.layout == torch.strided and grad.numel() > 0:
                state.content = torch.linalg.vector_norm(grad.detach().float(), ord=math.inf)

    def after_accumulate(self, param: torch.Tensor) -> None:
        self.backward_seen = True
        state = self._states.get(id(param))
        if state is None:
            return
        state.seen = True
        if not state.armed or state.reset:
            return
        grad = param.grad
        if grad is not None:
            state.grad = _SameTensor(grad)
            state.version = grad._version

    # -- step boundary ---------------------------------------------------
    def suspects(
        self, params: Iterable[torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Parameters about to be used with stale values still in their gradient.

        Each comes with a device scalar (max|g| before the first stale
        accumulation) that must be non-zero for the suspicion to hold; None
        where it could not be taken (sparse gradients): then the version
        evidence alone decides.
        """
        if not self.enabled:
            return []
        found = []
        for param in params:
            state = self._states.get(id(param))
            if state is None or not state.armed or state.reset or not state.accumulated:
                continue
            if state.holds_used_grad(param.grad):
                found.append((param, state.content))
        return found

    def reached(self, param: torch.Tensor) -> bool:
        """Backward accumulated into this parameter since the last step boundary."""
        state = self._states.get(id(param))
        return state is not None and state.seen

    def arm(self, params: Iterable[torch.Tensor]) -> None:
        """A step has just used these gradients: start watching for a reset."""
        self.backward_seen = False
        if not self.enabled:
            return
        for param in params:
            state = self._states.get(id(param))
            if state is None:
                continue
            if param._cdata != state.impl:
                # Swapped by module.to() since the last step: that step's
                # backward went unseen; from the next one on it is seen again.
                _rewire_hooks(param)
                state.impl = param._cdata
            state.seen = False
            grad = param.grad
            state.reset = False
            state.accumulated = False
            state.content = None
            if grad is None:
                state.armed = False
                state.grad = None
            else:
                state.armed = True
                state.grad = _SameTensor(grad)
                state.version = grad._version
