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
take them all off at once, any number of times.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

from trainwatch.compiled import compiling
from trainwatch.errors import TrainingHealthError


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
            getattr(target, self.method)(*self.bound, *args)
        except TrainingHealthError:
            raise
        except Exception as exc:  # never break the user's training
            target.fail(exc)
        return None


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
