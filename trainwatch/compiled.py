"""How trainwatch lives with ``torch.compile``: out of the graphs, beside the model.

- **Hooks step aside while dynamo traces them** (:func:`compiling`). A hook
  traced into a graph would either break it (``.item()``, weak references,
  Python state) or be frozen into it. So inside a compiled region every
  trainwatch hook is a no-op: no graph break, no recompile, no per-module
  check there.
- **A compiled wrapper counts as the model it wraps** (:func:`unwrap`).
  ``torch.compile(model)`` returns an ``OptimizedModule`` whose own call runs
  eagerly around the compiled ``model.forward``: hooks on that call see the
  model's real inputs and outputs, so the model-level checks keep working
  (:func:`wrappers_of` finds a wrapper made after the model was watched).
- **Names are the user's** (:func:`user_name`): the wrapper's ``_orig_mod.``
  segment never reaches an alert.
- **trainwatch's own re-runs are eager** (:func:`eager`): when a pass is
  replayed to locate a NaN, compiled code runs as plain Python (where the
  hooks are live) instead of the graph that hid the module that made it.
- **dynamo is never imported by trainwatch** (:class:`OutOfGraphDispatchMode`):
  the dispatch modes of its replays stay out of a graph as PyTorch's own
  wrapper would keep them, without importing ``torch._dynamo`` (and sympy:
  a second or two) in a script that compiles nothing.
- **One warning kept quiet** (:class:`CompiledHookWarning`): PyTorch warns at
  every call of an ``OptimizedModule`` while any global module hook exists,
  because that hook will also see the wrapper. trainwatch expects exactly
  that, so the warning says nothing to its users.
"""

from __future__ import annotations

import gc
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


def _is_compiling_function() -> Any:
    compiler = getattr(torch, "compiler", None)
    found = getattr(compiler, "is_compiling", None)
    if found is None:  # pragma: no cover - torch < 2.3
        return lambda: False
    return found


# Bound once: dynamo recognises the function itself and folds it to True
# while tracing; eagerly it costs about 0.2 us a call.
compiling = _is_compiling_function()


def _no_transform() -> None:
    return None


# The level of the torch.func transform (vmap, grad, jacrev) running now, None
# outside one: a C function, bound once. Inside a transform a module's call is
# traced by functorch (per-sample gradients, DP-SGD): its outputs are wrapped
# tensors without storage, its parameters may be stand-ins (functional_call),
# and a backward it makes (torch.func.grad) is its own, not the loop's.
transform_level = getattr(
    getattr(torch._C, "_functorch", None), "maybe_current_level", _no_transform
)

_ORIG_MOD = "_orig_mod"


_wrapper: type[nn.Module] | None = None


def wrapper_class() -> type[nn.Module] | None:
    """``OptimizedModule``, if dynamo is loaded (without dynamo there is no wrapper).

    Asked on every module call the global hooks see: found once, then kept.
    """
    global _wrapper
    if _wrapper is None:
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        _wrapper = getattr(eval_frame, "OptimizedModule", None)
    return _wrapper


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside a ``torch.compile`` wrapper (the module itself when not wrapped)."""
    wrapper = _wrapper if _wrapper is not None else wrapper_class()
    while wrapper is not None and type(module) is wrapper:
        module = module._orig_mod
    return module


def is_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is a ``torch.compile`` wrapper (an ``OptimizedModule``)."""
    wrapper = _wrapper if _wrapper is not None else wrapper_class()
    return wrapper is not None and type(module) is wrapper


def wrappers_of(module: nn.Module) -> list[nn.Module]:
    """The live ``torch.compile`` wrappers around ``module`` (one scan of live objects).

    For a model compiled after it was watched: its passes run inside the
    wrapper's eager call. Only asked when a step had gradients but no pass
    was seen, so a healthy step never pays for it.
    """
    wrapper = wrapper_class()
    if wrapper is None:
        return []
    return [
        obj
        for obj in gc.get_objects()
        if type(obj) is wrapper and unwrap(obj) is module  # type: ignore[arg-type]
    ]


def user_name(qualified: str) -> str:
    """A qualified module or parameter name without the wrappers' ``_orig_mod`` segments.

    ``encoder._orig_mod.fc1.weight`` (a submodule compiled on its own) is
    ``encoder.fc1.weight``; ``_orig_mod`` alone is the model itself, ``""``.
    """
    if _ORIG_MOD not in qualified:
        return qualified
    return ".".join(part for part in qualified.split(".") if part != _ORIG_MOD)


@contextmanager
def eager() -> Iterator[None]:
    """Run compiled functions and modules as plain Python inside this block.

    trainwatch's replays use it, so the modules of a compiled model run
    (and are seen) one by one. A no-op when dynamo is not loaded (nothing
    can be compiled) or on a torch without ``set_stance`` (< 2.6), where a
    replay of a compiled model simply finds no finer location.
    """
    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    if "torch._dynamo" not in sys.modules or set_stance is None:
        yield
        return
    with set_stance("force_eager"):
        yield


class OutOfGraphDispatchMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` whose ``__torch_dispatch__`` dynamo never traces,
    kept so without importing dynamo.

    PyTorch hands every subclass's ``__torch_dispatch__`` to
    ``torch._disable_dynamo``, whose first call imports ``torch._dynamo`` (and
    sympy: a second or two). trainwatch's modes run only in its own re-runs of
    a forward (stalled_training's first batch, a NaN located), so in a script
    that never compiles anything (a hand-written update, no ``torch.optim``)
    that import was trainwatch's alone, paid inside a ``monitor.step()``.
    While dynamo is not loaded nothing can trace the method, which runs as
    written; a mode entered once dynamo is loaded has it wrapped, as PyTorch
    wraps it (once per class).
    """

    _out_of_graph = False  # set on each subclass, in its own dict, once it is wrapped

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # the wrap PyTorch makes at class creation: made in __enter__ instead

    def __enter__(self) -> Any:
        kind = type(self)
        if "torch._dynamo" in sys.modules and not kind.__dict__.get("_out_of_graph", False):
            raw = kind.__dict__.get("__torch_dispatch__")
            if raw is not None and not isinstance(raw, classmethod):
                disable = sys.modules["torch._dynamo"].disable
                kind.__torch_dispatch__ = disable(raw, recursive=True)  # type: ignore[method-assign]
            kind._out_of_graph = True
        return super().__enter__()


_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"

# The one filter entry trainwatch adds, as ``warnings.filterwarnings`` would make it
# (a case-insensitive pattern matched at the message's start, any module and line).
_ENTRY = ("ignore", re.compile(_WARNING, re.I), UserWarning, None, 0)

_holders = 0
# The filter lists the entry was put in. Inside a ``warnings.catch_warnings``
# block ``warnings.filters`` is a copy, and the list before it comes back on exit:
# the entry is taken out of each list it was put in, and of the one in place.
_lists: list[list[Any]] = []


def _holds(filters: list[Any]) -> bool:
    return any(entry is _ENTRY for entry in filters)


class CompiledHookWarning:
    """Silences PyTorch's warning about global hooks around ``torch.compile(module)``.

    trainwatch's hooks are global on purpose (nothing is stored on the model,
    so it saves, pickles and deep-copies as usual), and they recognise the
    wrapper as the model it wraps, which is what the warning is about. The
    filter is held while any holder is open, and only this message is
    filtered; a user's own ``-W error`` still applies to everything else.

    The entry is put into and taken out of the filter list directly, never
    through ``warnings.filterwarnings`` or ``_filters_mutated``: those bump the
    filters' version, which empties every module's ``__warningregistry__`` at
    its next warning, so a once-per-line warning the script already showed
    would show again. Without the bump no registry is touched, and none needs
    to be: an ``ignore`` is never recorded in one, so no mark stands for this
    message while the entry is in, and a mark made before (the warning shown
    once already) keeps it hidden, as the entry would.
    """

    def __init__(self) -> None:
        global _holders
        self._open = True
        filters = warnings.filters
        if not _holds(filters):
            # First holder, or the filters were reset or replaced since.
            filters.insert(0, _ENTRY)
            _lists.append(filters)
        _holders += 1

    def detach(self) -> None:
        global _holders
        if not self._open:
            return
        self._open = False
        _holders -= 1
        if _holders > 0:
            return
        for filters in (*_lists, warnings.filters):
            if _holds(filters):
                filters[:] = [entry for entry in filters if entry is not _ENTRY]
        _lists.clear()
