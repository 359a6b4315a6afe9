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


class _ParamState:
    __slots__ = ("armed", "reset", "accumulated", "grad_ref", "version", "content", "seen")

    def __init__(self) -> None:
        self.seen = False  # backward reached it since the last step boundary
        self.armed = False
        self.reset = False
        self.accumulated = False
        self.grad_ref: weakref.ref[torch.Tensor] | None = None
        self.version = -1
        self.content: torch.Tensor | None = None


class _BeforeAccumulate:
    """Tensor hook: runs before backward adds the new gradient into ``.grad``."""

    __slots__ = ("tracker", "param")

    def __init__(self, tracker: GradResetTracker, param: torch.Tensor) -> None:
        self.tracker = weakref.ref(tracker)
        self.param = weakref.ref(param)

    def __call__(self, grad: torch.Tensor) -> None:
        tracker, param = self.tracker(), self.param()
        if tracker is not None and param is not None and tracker.enabled:
            try:
                tracker.before_accumulate(param)
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
            self._states[id(param)] = _ParamState()
            self._handles.append(param.register_hook(_BeforeAccumulate(self, param)))
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
    def before_accumulate(self, param: torch.Tensor) -> None:
        state = self._states.get(id(param))
        if state is None or not state.armed or state.reset:
            return
        grad = param.grad
        if grad is None or grad is not _deref(state.grad_ref) or grad._version != state.version:
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
            state.grad_ref = weakref.ref(grad)
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
            if param.grad is not None and param.grad is _deref(state.grad_ref):
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
            state.seen = False
            grad = param.grad
            state.reset = False
            state.accumulated = False
            state.content = None
            if grad is None:
                state.armed = False
                state.grad_ref = None
            else:
                state.armed = True
                state.grad_ref = weakref.ref(grad)
                state.version = grad._version


def _deref(ref: weakref.ref[torch.Tensor] | None) -> torch.Tensor | None:
    return ref() if ref is not None else None
