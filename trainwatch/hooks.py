"""How trainwatch hooks into a model: one weak adapter, one group of handles.

Every hook trainwatch registers (module, tensor, optimizer, autograd
callback) is a :class:`WeakHook`. It

- holds its collector weakly, so a monitor dropped without ``close()`` is
  collected, and its hooks go quiet with it;
- steps aside while dynamo traces it (a hook traced into a graph would break
  it or be frozen into it);
- returns None (a forward hook's return value would replace the output);
- hands any failure to the collector's ``fail(exc)``, which reports it once
  and switches that collector off: the user's forward, backward or
  optimizer step never sees it. ``TrainingHealthError`` is trainwatch doing
  its job and passes through.

A :class:`HookGroup` keeps every handle one collector registered, so it can
take them all off at once, any number of times. Forward hooks on a module go
through :func:`trainwatch.fast_paths.hook_module`, which keeps them out of the
way of a transformer layer's eval-mode fast path.

Hooks on the tensors a pass makes (its output, where backward enters the
model) go with the pass's graph: :func:`hook_pass_tensor` adds them without
a handle, and says where (``PlacedHook``) for the rare one to take out.
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from typing import Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from trainwatch.compiled import compiling
from trainwatch.errors import TrainingHealthError

# Keys of the hooks hook_pass_tensor adds to a tensor's hook table: negative, so
# they never meet the ids of torch's own handles (counted up from zero).
_PASS_HOOK_KEYS = itertools.count(-1, -1)
_has_torch_function = torch._C._has_torch_function_unary


class Failing(Protocol):
    def fail(self, exc: BaseException) -> None: ...


class WeakHook:
    """Calls ``target.<method>(*bound, *hook_args)`` while ``target`` lives."""

    __slots__ = ("ref", "method", "bound")

    def __init__(self, target: Failing, method: str, *bound: Any) -> None:
        self.ref = weakref.ref(target)
        self.method = method
        self.bound = bound

    def __call__(self, *args: Any) -> None:
        if compiling():
            return None
        target = self.ref()
        if target is None:
            return None
        try:
            if self.bound:
                getattr(target, self.method)(*self.bound, *args)
            else:  # most hooks: no arguments of their own to put first
                getattr(target, self.method)(*args)
        except TrainingHealthError:
            raise
        except Exception as exc:  # never break the user's training
            target.fail(exc)
        return None


# Where hook_pass_tensor put a hook: the tensor's hook table, weakly (it lives
# while the tensor or its graph does, so it also says whether the hook can
# still fire), and the hook's key in it. A plain tuple: one is made per pass.
PlacedHook = tuple[weakref.ref[OrderedDict[int, Any]], int]


def take_out(placed: PlacedHook) -> None:
    """Remove a hook :func:`hook_pass_tensor` placed, if its table is still there."""
    table = placed[0]()
    if table is not None:  # else its graph is gone: backward ran, or never will
        table.pop(placed[1], None)


def hook_pass_tensor(tensor: torch.Tensor, hook: Any) -> PlacedHook | None:
    """Call ``hook(grad)`` when backward reaches ``tensor``, a non-leaf this pass made.

    The hook lives in the tensor's own table, which autograd keeps with the
    tensor's node: both go when the pass's graph goes, so no handle is needed.
    ``Tensor.register_hook`` would also build a removable handle (a weak
    reference and an id) at every pass, about 4 us, for nothing. A tensor
    subclass, or one under a function mode, takes ``register_hook`` as usual.

    Returns where the hook sits, or None where ``register_hook`` took it.
    """
    table = tensor._backward_hooks
    if table is None:
        grad_fn = tensor.grad_fn
        if type(tensor) is not torch.Tensor or grad_fn is None or _has_torch_function(tensor):
            tensor.register_hook(hook)
            return None
        table = OrderedDict()
        tensor._backward_hooks = table
        grad_fn._register_hook_dict(tensor)
    key = next(_PASS_HOOK_KEYS)
    table[key] = hook
    return weakref.ref(table), key


class KwargsHookHandle:
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
        table = getattr(torch.nn.modules.module, "_global_forward_hooks_with_kwargs", None)
        if table is not None:
            table.pop(self.handle.id, None)


class HookGroup(list):
    """The handles of one collector's hooks, removed together; removing twice is fine.

    A list, so asking whether it holds any costs no Python call.
    """

    def add(self, handle: Any) -> Any:
        self.append(handle)
        return handle

    def remove_all(self) -> None:
        handles = list(self)
        self.clear()
        for handle in handles:
            handle.remove()
