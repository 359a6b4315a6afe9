"""Keeping PyTorch's transformer fast paths as they would be without trainwatch.

In eval mode, with gradients off or none of its tensors requiring grad,
``nn.TransformerEncoderLayer`` runs one fused kernel, and so does
``nn.MultiheadAttention`` for self-attention. Both refuse it when a torch
function mode is on the stack, and the layer also when any module in it has
a forward hook or pre-hook of its own; the slow path's result differs in the
last bits. A frozen eval-mode teacher called in the training step, or a
transformer's validation under ``no_grad``, would then compute other numbers
whenever trainwatch had a per-module hook inside a layer (the frozen output
layer look, the call-order learning pass...) or one of its function modes on
the stack (the broadcast audit, the class-target look...): the run watched
would not be the run unwatched.

While either holds, and only then (a model holding no such layer never has
it), a global forward pre-hook and an always-called forward hook stand around
every module call. At such a layer's call that would take the fast path but
for trainwatch, they take trainwatch's own hooks out of the layer's subtree
(the user's stay) and trainwatch's modes off the stack for the call, and put
them back after. Nothing of ours is lost that would have run: in the fast
path the layer's submodules are not called and no op but the fused one is
dispatched; the layer's own forward hooks of ours are called by the guard
itself. A layer in training mode, or one whose weights train under grad,
takes the slow path anyway, and is left alone: its submodules' hooks see it.

Every per-module forward hook trainwatch places goes through :func:`hook_module`,
and every function mode through :func:`mode_entered` / :func:`mode_left`.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode

from trainwatch.collect import structure
from trainwatch.compiled import compiling
from trainwatch.hooks import KwargsHookHandle

_LAYER = nn.TransformerEncoderLayer
_ATTENTION = nn.MultiheadAttention
_LAYER_FORWARD = _LAYER.forward
_ATTENTION_FORWARD = _ATTENTION.forward

# Keys (handle ids, unique in the process) of the hooks placed through
# hook_module and not removed since: only those are ever put back.
_LIVE: set[int] = set()
# Of those, the ones that may sit inside a transformer layer.
_IN_LAYER: set[int] = set()
# Modes of ours on the stack while some watched model holds a fast-path layer.
_MODES_ON: set[int] = set()
# Roots of the watched models, with how many monitors watch each and whether it
# holds a fast-path layer at the structure generation it was last asked at.
_ROOTS: dict[int, tuple[weakref.ref[nn.Module], int, int, bool]] = {}
# The global hooks' handles while the guard stands.
_handles: list[Any] = []
# The layer calls in progress whose fast path the guard kept: (module, the
# hooks taken out as (table, items before), the modes taken off).
_calls: list[tuple[nn.Module, list[tuple[dict[int, Any], list[tuple[int, Any]]]], list[Any]]] = []


class _Handle:
    """A hook's handle that also tells the guard the hook is gone."""

    __slots__ = ("_handle",)

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    @property
    def id(self) -> int:
        return self._handle.id

    def remove(self) -> None:
        key = self._handle.id
        self._handle.remove()
        _LIVE.discard(key)
        if key in _IN_LAYER:
            _IN_LAYER.discard(key)
            _update()


def layer_members(root: nn.Module) -> set[int]:
    """Ids of the modules in ``root`` that are, or sit inside, a ``TransformerEncoderLayer``."""
    members: set[int] = set()
    for module in root.modules():
        if isinstance(module, _LAYER) and id(module) not in members:
            members.update(map(id, module.modules()))
    return members


def hook_module(
    module: nn.Module, hook: Any, *, pre: bool = False, in_layer: bool, **options: Any
) -> _Handle:
    """``module.register_forward_(pre_)hook(hook, **options)``, kept off the fast
    path's check when ``in_layer`` (``module`` is, or sits inside, a transformer layer)."""
    register = module.register_forward_pre_hook if pre else module.register_forward_hook
    handle = register(hook, **options)
    _LIVE.add(handle.id)
    if in_layer or isinstance(module, _LAYER):
        _IN_LAYER.add(handle.id)
        _update()
        for layer, taken, _ in _calls:
            if any(sub is module for sub in layer.modules()):
                # Placed during a layer's call the guard keeps (a look pausing on it):
                # out of its tables until the call is over, like ours before it.
                for name in ("_forward_pre_hooks", "_forward_hooks"):
                    table = getattr(module, name)
                    if handle.id in table:
                        taken.append((table, list(table.items())))
                        del table[handle.id]
                break
    return _Handle(handle)


def watch_root(root: nn.Module) -> None:
    """A watched model's root: its function modes keep the fast paths of its layers."""
    held = _ROOTS.get(id(root))
    if held is not None and held[0]() is root:
        _ROOTS[id(root)] = (held[0], held[1] + 1, -1, False)
    else:
        _ROOTS[id(root)] = (weakref.ref(root), 1, -1, False)


def forget_root(root: nn.Module) -> None:
    held = _ROOTS.pop(id(root), None)
    if held is not None and held[1] > 1 and held[0]() is root:
        _ROOTS[id(root)] = (held[0], held[1] - 1, -1, False)


def _roots_hold_layers() -> bool:
    """Whether a watched model holds a fast-path layer (one walk per tree change)."""
    generation = structure.generation()
    found = False
    for key, (ref, count, seen, holds) in list(_ROOTS.items()):
        root = ref()
        if root is None:
            del _ROOTS[key]
            continue
        if seen != generation:
            holds = any(isinstance(m, (_LAYER, _ATTENTION)) for m in root.modules())
            _ROOTS[key] = (ref, count, generation, holds)
        found = found or holds
    return found


def mode_entered(mode: Any) -> None:
    """One of trainwatch's function modes was pushed."""
    if _ROOTS and _roots_hold_layers():
        _MODES_ON.add(id(mode))
        _update()


def mode_left(mode: Any) -> None:
    """One of trainwatch's function modes was popped."""
    if id(mode) in _MODES_ON:
        _MODES_ON.discard(id(mode))
        _update()


def _update() -> None:
    """Stand the guard while it has anything to keep off a fast path; else take it down."""
    wanted = bool(_IN_LAYER or _MODES_ON or _calls)  # a call in progress gets its _after
    if wanted and not _handles:
        _handles.append(register_module_forward_pre_hook(_before))
        try:
            after = register_module_forward_hook(_after, with_kwargs=True, always_call=True)
            _handles.append(KwargsHookHandle(after))
        except TypeError:  # torch < 2.6: global hooks see positional arguments only
            _handles.append(register_module_forward_hook(_after, always_call=True))
    elif not wanted and _handles:
        for handle in _handles:
            handle.remove()
        _handles.clear()


def _ours(mode: Any) -> bool:
    return type(mode).__module__.startswith("trainwatch.")


def _no_grad_needed(tensors: Iterable[Any]) -> bool:
    return not torch.is_grad_enabled() or not any(
        t is not None and t.requires_grad for t in tensors
    )


def _layer_fast(layer: nn.TransformerEncoderLayer, args: tuple) -> bool:
    """Whether ``layer`` would take its fast path here but for trainwatch's hooks and modes."""
    src = args[0] if args else None
    attn = layer.self_attn
    if (
        layer.training
        or type(src) is not torch.Tensor
        or src.dim() != 3
        or not attn.batch_first
        or attn.in_proj_bias is None
        or not attn._qkv_same_embed_dim
        or not layer.activation_relu_or_gelu
        or layer.norm1.eps != layer.norm2.eps
        or attn.num_heads % 2 == 1
        or torch.is_autocast_enabled()
        or not torch.backends.mha.get_fastpath_enabled()
    ):
        return False
    return _no_grad_needed((src, *layer.parameters()))


def _attention_fast(attn: nn.MultiheadAttention, args: tuple) -> bool:
    """Whether ``attn`` would take its fast path here but for trainwatch's modes."""
    if len(args) < 3:
        return False
    query, key, value = args[:3]
    if (
        attn.training
        or type(query) is not torch.Tensor
        or query is not key
        or key is not value
        or query.dim() != 3
        or not attn.batch_first
        or attn.in_proj_bias is None
        or not attn._qkv_same_embed_dim
        or attn.bias_k is not None
        or attn.add_zero_attn
        or attn.num_heads % 2 == 1
        or torch.is_autocast_enabled()
        or not torch.backends.mha.get_fastpath_enabled()
    ):
        return False
    return _no_grad_needed((query, *attn.parameters()))


def _before(module: nn.Module, args: tuple) -> None:
    """(A global pre-hook sees no keyword arguments: a layer called with its input
    by keyword is left alone.)"""
    forward = getattr(type(module), "forward", None)
    if (forward is not _LAYER_FORWARD and forward is not _ATTENTION_FORWARD) or compiling():
        return  # any other module, or a subclass with a forward of its own
    try:
        _keep(module, args, forward is _LAYER_FORWARD)
    except Exception:  # never break the user's forward: the call runs as it would have
        pass


def _keep(module: Any, args: tuple, is_layer: bool) -> None:
    fast = _layer_fast(module, args) if is_layer else _attention_fast(module, args)
    if not fast:
        return
    stack = _get_current_function_mode_stack()
    if not all(map(_ours, stack)):
        return  # a mode of the user's is on: no fast path, whatever ours do
    taken: list[tuple[dict[int, Any], list[tuple[int, Any]]]] = []
    if is_layer and _IN_LAYER:
        for sub in module.modules():
            for name in ("_forward_pre_hooks", "_forward_hooks"):
                table = getattr(sub, name)
                if table and any(key in _LIVE for key in table):
                    taken.append((table, list(table.items())))
                    for key in [key for key in table if key in _LIVE]:
                        del table[key]
    modes = [_pop_mode() for _ in stack]
    _calls.append((module, taken, modes))


def _after(module: nn.Module, args: tuple, *rest: Any) -> None:
    """Puts back what :func:`_before` took for this call; on the normal way out
    (``rest`` is kwargs and output), calls our forward hooks of the layer itself,
    which PyTorch no longer sees; on an exception's, PyTorch calls them after."""
    if not _calls or _calls[-1][0] is not module:
        return
    if len(rest) == 1 and sys.exc_info()[1] is None:
        rest = ({}, rest[0])  # torch < 2.6: no keyword arguments, and no exception
    _, taken, modes = _calls.pop()
    for mode in reversed(modes):
        _push_mode(mode)
    own: list[tuple[int, Any]] = []
    for table, before in taken:
        if table is module._forward_hooks and len(rest) == 2:
            own = [(key, hook) for key, hook in before if key in _LIVE and key not in table]
        now = dict(table)
        kept = [
            (key, now.pop(key) if key in now else hook)
            for key, hook in before
            if key in now or key in _LIVE
        ]
        table.clear()
        table.update(kept)
        table.update(now)  # added during the call
    if own:
        kwargs, output = rest
        for key, hook in own:
            if key in module._forward_hooks_with_kwargs:
                hook(module, args, kwargs, output)
            else:
                hook(module, args, output)
    if not _calls:
        _update()  # what the guard stood for may have gone during the call
