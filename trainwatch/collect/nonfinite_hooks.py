"""The hooks a non-finite check runs from: module calls and gradients, held weakly.

Module hooks are global and pick out the watched model's modules by identity
(nothing is stored on the modules, so a model saves, pickles and deep-copies
as usual); they exist only in deferred mode and during a replay. Gradient
hooks are tensor hooks on tensors autograd made in that pass, so they go
with the graph. Each holds the probe weakly and reports a failure once
instead of breaking the user's forward or backward.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules import module as module_globals
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from trainwatch.collect.nonfinite_locate import ForwardCall
from trainwatch.compiled import compiling, unwrap

if TYPE_CHECKING:
    from trainwatch.collect.nonfinite import NonfiniteProbe


class CallHooks:
    """Global pre- and post-forward hooks that pick out the watched model's modules.

    Global, not per module: hooks stored on the modules would travel with
    ``torch.save(model)``, ``pickle`` and ``copy.deepcopy(model)`` (an EMA or
    teacher copy would then report into this monitor). Every other module
    call in the process pays one dict lookup and a type check.
    """

    __slots__ = ("index", "probe")

    def __init__(self, probe: NonfiniteProbe, index: dict[int, int]) -> None:
        self.probe = weakref.ref(probe)
        self.index = index

    def _position(self, module: nn.Module) -> int | None:
        position = self.index.get(id(module))
        if position is None:
            # torch.compile(model)'s wrapper runs eagerly around the compiled
            # model: it stands for the model (or submodule) it wraps.
            inner = unwrap(module)
            if inner is not module:
                position = self.index.get(id(inner))
        return position

    def before(self, module: nn.Module, args: Any) -> None:
        if compiling():
            return None  # inside a compiled graph: see the module from outside only
        position = self._position(module)
        if position is None:
            return None
        probe = self.probe()
        if probe is not None and probe.enabled and not probe.suspended:
            try:
                probe.before_call(position, args)
            except Exception as exc:  # never break the user's forward
                probe.fail(exc)
        return None

    def after(self, module: nn.Module, args: Any, *rest: Any) -> None:
        if compiling():
            return None
        position = self._position(module)
        if position is None:
            return None
        probe = self.probe()
        if probe is not None and probe.enabled and not probe.suspended:
            kwargs, output = rest if len(rest) == 2 else ({}, rest[0])
            try:
                probe.after_call(position, module, args, kwargs, output)
            except Exception as exc:
                probe.fail(exc)
        return None


class _KwargsHookHandle:
    """Removes a global forward hook registered ``with_kwargs`` completely.

    PyTorch's handle forgets the hook's entry in the global ``with_kwargs``
    table, and one stale entry there makes ``torch.compile(module)`` warn
    about global hooks at every call, long after trainwatch has closed.
    """

    __slots__ = ("handle",)

    def __init__(self, handle: RemovableHandle) -> None:
        self.handle = handle

    def remove(self) -> None:
        self.handle.remove()
        table = getattr(module_globals, "_global_forward_hooks_with_kwargs", None)
        if table is not None:
            table.pop(self.handle.id, None)


def register_global_hooks(hooks: CallHooks) -> list[Any]:
    handles: list[Any] = [register_module_forward_pre_hook(hooks.before)]
    try:
        handle = register_module_forward_hook(hooks.after, with_kwargs=True, always_call=True)
        handles.append(_KwargsHookHandle(handle))
    except TypeError:  # torch < 2.6: global hooks see positional arguments only
        handles.append(register_module_forward_hook(hooks.after, always_call=True))
    return handles


class GradOutHook:
    """Tensor hook on the model's output: keeps the gradient that enters the model.

    It is what a backward replay needs, and a non-finite one means the loss
    (or its backward) made the NaN/Inf before it reached the model.
    """

    __slots__ = ("position", "probe")

    def __init__(self, probe: NonfiniteProbe, position: int) -> None:
        self.probe = weakref.ref(probe)
        self.position = position

    def __call__(self, grad: torch.Tensor) -> None:
        probe = self.probe()
        if probe is not None and probe.enabled and not probe.suspended:
            try:
                probe.on_grad_entering(self.position, grad)
            except Exception as exc:
                probe.fail(exc)
        return None


class GradHook:
    """Tensor hook: the gradient of a module's output ("out") or input ("in")."""

    __slots__ = ("call", "probe", "side")

    def __init__(self, probe: NonfiniteProbe, call: ForwardCall, side: str) -> None:
        self.probe = weakref.ref(probe)
        self.call = call
        self.side = side

    def __call__(self, grad: torch.Tensor) -> None:
        probe = self.probe()
        if probe is not None and probe.enabled:
            try:
                probe.on_grad(self.call, self.side, grad)
            except Exception as exc:
                probe.fail(exc)
        return None
