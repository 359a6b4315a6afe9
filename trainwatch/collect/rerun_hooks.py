"""The model's hooks in trainwatch's re-runs: those that feed a call run, those that watch do not.

A user's module hook runs at every call of its module, trainwatch's re-runs
included (stalled_training's first batch, the eval-mode look at a module
drawing random numbers, a NaN replay, an op trace). A forward hook that
keeps an activation for a penalty (``feats.append(output)``, cleared after
the loss reads it) would find one more, stale, activation in its list after
a re-run, and the training that follows would not be the one the script
runs without trainwatch; one that logs, counts or times the call would log,
count or time a call training never made.

Hooks differ by when they run:

- a forward *pre*-hook runs before the forward and feeds it: it may replace
  the call's inputs (a cast) or write the weights the forward reads (torch's
  ``prune`` computes ``weight = weight_orig * weight_mask`` there, the old
  ``weight_norm`` and ``spectral_norm`` recompute ``weight`` there). Held
  off, the re-run would compute something else than training does, or fail.
  Every forward pre-hook runs; what the user's write into the Python state
  they reach (their closures, the object a bound method belongs to, their
  module's globals) is put back with the rest of the model's state
  (:class:`~trainwatch.collect.rerun_effects.UndoneEffects`);
- a forward hook (a *post*-hook) runs once the output is made, and a
  backward hook once its gradient is: they watch (features kept, statistics
  logged, calls counted, timers read). What they do beyond the model cannot
  be put back (a print, a line in a log, a counter in a library's object),
  so the user's are held off for the re-run: taken out of the hook tables of
  the modules re-run, and of the global ones, and put back, in their order,
  as the re-run ends. A forward hook that returns a new output is held off
  too: the re-run then computes the layer without it, as trainwatch's own
  measurements allow (stalled_training compares re-runs with each other).

Gradient hooks on tensors watch too (a gradient logger, a counter, a
gradient-reversal layer's hook counting its calls): a NaN replay runs a
backward, and the user's hooks on the model's weights (``p.register_hook``,
``register_post_accumulate_grad_hook``) would log, count or step once more,
and those its forward registers on its activations (``h.register_hook(fn)``
inside ``forward``) would fire for the replay's tensors.
:class:`HeldOffTensorHooks` takes the former out of the weights' tables for
the replay, and does not register the latter (a ``TorchFunctionMode`` live
for the replay alone sees each registration). A hook that changes the
gradient (a reversal, a clamp) is held off too: the replay computes the
gradient without it, whose finiteness is what it looks at.

Hooks whose code is torch's own stay, whatever their kind: they are the
model's machinery (quantisation-aware training fake-quantises a layer's
output in a forward hook; FSDP and composable checkpointing pair a pre-hook
with a post-hook), and so do trainwatch's (quiet during a re-run, and a NaN
replay locates its NaN through them).

Costs nothing on a healthy step: the tables are looked at when a re-run
begins, and only tables holding a hook are touched.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Iterable
from itertools import repeat
from operator import attrgetter
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_globals
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from trainwatch.collect.mode_stack import enter as enter_mode
from trainwatch.collect.mode_stack import leave as leave_mode

# The per-module tables of hooks that watch a call: forward hooks, backward
# hooks and backward pre-hooks. (The tables saying how to call a forward hook,
# keyed by its id, are only read for the hooks in ``_forward_hooks``.)
_WATCHING = ("_forward_hooks", "_backward_hooks", "_backward_pre_hooks")
# Their process-wide counterparts (``register_module_forward_hook``...).
_GLOBAL_WATCHING = ("_global_forward_hooks", "_global_backward_hooks", "_global_backward_pre_hooks")
_STATE = attrgetter("__dict__")
# The code whose hooks are the model's machinery or trainwatch's own.
_LIBRARIES = ("torch", "trainwatch")
# A tensor's tables of gradient hooks (None until one is registered).
_TENSOR_TABLES = ("_backward_hooks", "_post_accumulate_grad_hooks")
# The methods registering a gradient hook on a tensor.
_REGISTERING = frozenset(
    {torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook}
)
# (a table, its entries as they were, the keys taken out of it)
_Taken = list[tuple[dict[Any, Any], list[tuple[Any, Any]], set[Any]]]


def hook_code(hook: Any) -> str:
    """The name of the code module that defines ``hook`` ("" where none is told):
    a function's, a bound method's function's, a ``functools.partial``'s
    function's, or a callable object's class's."""
    try:
        while isinstance(hook, functools.partial):
            hook = hook.func
        hook = getattr(hook, "__func__", hook)
        name = getattr(hook, "__module__", None)
        if not isinstance(name, str):
            name = getattr(type(hook), "__module__", None)
    except Exception:  # an object whose attributes cannot be read: none told
        return ""
    return name if isinstance(name, str) else ""


def users_hook(hook: Any) -> bool:
    """Whether ``hook`` is the user's (or another library's): not torch's, not trainwatch's."""
    return hook_code(hook).split(".", 1)[0] not in _LIBRARIES


def user_pre_hooks(modules: Iterable[nn.Module]) -> list[Any]:
    """The user's forward pre-hooks on ``modules``: they run in a re-run, and what
    they reach is put back after it."""
    states = map(_STATE, modules)
    tables = filter(None, map(dict.get, states, repeat("_forward_pre_hooks")))
    return [hook for table in tables for hook in table.values() if users_hook(hook)]


class HeldOffWatchers:
    """The user's forward and backward hooks on ``modules`` (and the global ones),
    out of their tables between :meth:`take` and :meth:`put_back`."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.modules = list(modules)
        self._taken: _Taken = []

    def take(self) -> None:
        states = list(map(_STATE, self.modules))
        tables = [
            t for name in _WATCHING for t in filter(None, map(dict.get, states, repeat(name)))
        ]
        tables += filter(None, (getattr(module_globals, name, None) for name in _GLOBAL_WATCHING))
        self._taken = _take_users(tables)

    def put_back(self) -> None:
        """Each table as it was, in its order; a hook the re-run added stays, after
        them, and one it removed (not held off) stays removed."""
        taken, self._taken = self._taken, []
        _put_back(taken)


class HeldOffTensorHooks:
    """Around a re-run's forward and backward: the user's gradient hooks on
    ``tensors`` (the model's weights) out of their tables, and those the re-run
    registers on a tensor (its forward's ``h.register_hook(fn)``) not registered
    (the handle it gets back removes nothing). Put back on exit, in their order."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self._taken: _Taken = []
        self._mode: _UnregisteredHooks | None = None

    def __enter__(self) -> HeldOffTensorHooks:
        tables = [
            t
            for name in _TENSOR_TABLES
            for t in filter(None, map(getattr, self.tensors, repeat(name), repeat(None)))
        ]
        self._taken = _take_users(tables)
        self._mode = _UnregisteredHooks()
        enter_mode(self._mode)
        return self

    def __exit__(self, *exc: Any) -> None:
        mode, self._mode = self._mode, None
        try:
            if mode is not None:
                leave_mode(mode)
        finally:
            taken, self._taken = self._taken, []
            _put_back(taken)


class _UnregisteredHooks(TorchFunctionMode):
    """Sees each gradient hook registered on a tensor while it is live: the user's
    are not registered."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _REGISTERING:
            hook = args[1] if len(args) > 1 else kwargs.get("hook")
            if users_hook(hook):
                return RemovableHandle(OrderedDict())  # its remove() finds nothing
        return func(*args, **kwargs)


def _take_users(tables: Iterable[Any]) -> _Taken:
    """The user's hooks taken out of ``tables``; what :func:`_put_back` needs."""
    taken: _Taken = []
    for table in tables:
        if not isinstance(table, dict):
            continue  # a TorchScript part's: it takes no hooks
        held = {key for key, hook in table.items() if users_hook(hook)}
        if not held:
            continue
        taken.append((table, list(table.items()), held))
        for key in held:
            del table[key]
    return taken


def _put_back(taken: _Taken) -> None:
    """Each table as it was, in its order; a hook added since stays, after them,
    and one removed since (not held off) stays removed."""
    for table, before, held in reversed(taken):
        now = dict(table)
        kept = [
            (key, now.pop(key) if key in now else hook)
            for key, hook in before
            if key in now or key in held
        ]
        table.clear()
        table.update(kept)
        table.update(now)
