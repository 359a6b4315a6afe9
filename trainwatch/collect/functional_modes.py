"""Dropout and batch norm called as functions, seen in a no-grad pass made in training mode.

Graph networks and many research models call ``F.dropout(x, p,
training=self.training)`` or ``F.batch_norm(..., training=self.training)``
with no ``Dropout`` or ``BatchNorm`` module anywhere, so no module type says
that the model behaves differently in training mode. The calls themselves
say it: in training mode they drop units or normalise with the batch's own
statistics (and overwrite the running ones); in eval mode they do neither.

A look is a ``TorchFunctionMode`` over one whole no-grad pass of a model in
training mode, with global module hooks that keep the stack of the model's
modules running, so each call is put on the innermost of them. It runs only
on sampled passes: the first few no-grad passes of such a model, then one in
``every``. Passes with gradients (training) never get one. Once a module is
seen calling one of these functions, the plain ``.training`` check covers it
like any ``Dropout`` module, and no further look is needed.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode

from trainwatch.collect import quiet
from trainwatch.collect.broadcast import _stack_is_ours_to_use
from trainwatch.collect.mode_stack import enter as enter_mode
from trainwatch.collect.mode_stack import leave as leave_mode
from trainwatch.collect.modes import Listed
from trainwatch.compiled import user_name
from trainwatch.hooks import HookGroup, WeakHook


def _argument(func: Callable[..., Any], name: str, position: int, default: Any) -> Callable:
    """Reads one argument of a call to ``func``, by name or by position.

    A Python function's own signature gives the position and default; a
    builtin's (which has none to inspect) are the ones given here.
    """
    try:
        parameter = inspect.signature(func).parameters[name]
        position = list(inspect.signature(func).parameters).index(name)
        if parameter.default is not inspect.Parameter.empty:
            default = parameter.default
    except (TypeError, ValueError, KeyError):
        pass

    def read(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if name in kwargs:
            return kwargs[name]
        return args[position] if len(args) > position else default

    return read


def _dropout(func: Callable[..., Any], train_name: str = "training") -> Callable:
    """Drops units when its training flag is on and ``p > 0``."""
    read_p = _argument(func, "p", 1, 0.5)
    read_training = _argument(func, train_name, 2, False)

    def acts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return bool(read_training(args, kwargs)) and float(read_p(args, kwargs)) > 0.0

    return acts


def _batch_norm(func: Callable[..., Any], stats: int, train_name: str = "training") -> Callable:
    """Normalises with the batch's statistics and overwrites the running ones when training."""
    read_stats = _argument(func, "running_mean", stats, None)
    read_training = _argument(func, train_name, 5, False)

    def acts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return bool(read_training(args, kwargs)) and read_stats(args, kwargs) is not None

    return acts


def _attention(func: Callable[..., Any], position: int, training: bool) -> Callable:
    """Drops attention weights when ``dropout_p > 0`` (and its training flag, if any, is on)."""
    read_p = _argument(func, "dropout_p", position, 0.0)
    read_training = _argument(func, "training", 13, True) if training else None

    def acts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if read_training is not None and not read_training(args, kwargs):
            return False
        return float(read_p(args, kwargs)) > 0.0

    return acts


# function -> (kind, label, does this call behave as in training mode?)
_MODE_FUNCTIONS: dict[Any, tuple[str, str, Callable[[tuple, dict], bool]]] = {
    F.dropout: ("dropout", "F.dropout", _dropout(F.dropout)),
    F.dropout1d: ("dropout", "F.dropout1d", _dropout(F.dropout1d)),
    F.dropout2d: ("dropout", "F.dropout2d", _dropout(F.dropout2d)),
    F.dropout3d: ("dropout", "F.dropout3d", _dropout(F.dropout3d)),
    F.alpha_dropout: ("dropout", "F.alpha_dropout", _dropout(F.alpha_dropout)),
    F.feature_alpha_dropout: (
        "dropout",
        "F.feature_alpha_dropout",
        _dropout(F.feature_alpha_dropout),
    ),
    torch.dropout: ("dropout", "torch.dropout", _dropout(torch.dropout, "train")),
    torch.feature_dropout: (
        "dropout",
        "torch.feature_dropout",
        _dropout(torch.feature_dropout, "train"),
    ),
    torch.alpha_dropout: (
        "dropout",
        "torch.alpha_dropout",
        _dropout(torch.alpha_dropout, "train"),
    ),
    F.scaled_dot_product_attention: (
        "dropout",
        "F.scaled_dot_product_attention(dropout_p)",
        _attention(F.scaled_dot_product_attention, 4, training=False),
    ),
    F.multi_head_attention_forward: (
        "dropout",
        "F.multi_head_attention_forward(dropout_p)",
        _attention(F.multi_head_attention_forward, 10, training=True),
    ),
    F.batch_norm: ("norm", "F.batch_norm", _batch_norm(F.batch_norm, 1)),
    torch.batch_norm: ("norm", "torch.batch_norm", _batch_norm(torch.batch_norm, 3)),
    F.instance_norm: (
        "norm",
        "F.instance_norm",
        _batch_norm(F.instance_norm, 1, "use_input_stats"),
    ),
}


class _CallMode(TorchFunctionMode):
    def __init__(self, look: FunctionalLook) -> None:
        super().__init__()
        self.look = weakref.ref(look)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _MODE_FUNCTIONS:
            look = self.look()
            if look is not None:
                try:
                    look.saw(func, args, kwargs)
                except Exception as exc:  # never break the user's forward
                    look.fail(exc)
        return out


class FunctionalLook:
    """One sampled no-grad pass, watched for dropout and batch-norm calls acting as in training."""

    def __init__(self, first: int, every: int, on_error: Callable[[str, BaseException], None]):
        self.first = first
        self.every = every
        self._on_error = on_error
        self._candidates = 0  # no-grad passes in training mode seen so far
        self._mode = _CallMode(self)
        self._depth: int | None = None  # the mode stack's depth with ours on top
        self._hooks = HookGroup()
        self._names: dict[int, tuple[str, weakref.ref[nn.Module]]] = {}
        self._stack: list[int] = []
        self._skip_dropout = False
        self.found: list[Listed] = []
        self.broken = False
        # Read after every pass of the model (an attribute, not a call): a look is on.
        self.active = False
        # Our mode is still on the stack under one entered after it: popped at a
        # later step boundary, when it is on top again.
        self.pending = False

    def due(self) -> bool:
        """Counts a candidate pass; whether this one is looked at."""
        n = self._candidates
        self._candidates += 1
        return not self.broken and (n < self.first or (self.every > 0 and n % self.every == 0))

    def start(self, model: nn.Module, skip_dropout: bool) -> None:
        """Watch the pass that begins now (called from the model's own pre-hook)."""
        if self.active or not _stack_is_ours_to_use():
            return
        self._skip_dropout = skip_dropout
        self.found = []
        self._stack = []
        self._names = {
            id(module): (user_name(name), weakref.ref(module))
            for name, module in model.named_modules()
        }
        self._hooks.add(module_hooks.register_module_forward_pre_hook(WeakHook(self, "enter")))
        self._hooks.add(
            module_hooks.register_module_forward_hook(WeakHook(self, "leave"), always_call=True)
        )
        self._stack.append(id(model))
        enter_mode(self._mode)
        self._depth = torch._C._len_torch_function_stack()
        self.active = True

    def finish(self) -> list[Listed]:
        """The pass is over: every hook and the mode come off; the modules seen calling."""
        self._hooks.remove_all()
        self.active = False
        self.release()
        if self.pending:
            # A mode entered inside the pass is still on top: popping now would
            # pop it instead of ours. Ours stays, inert, until a step boundary
            # finds it on top again; no look runs after that.
            self.broken = True
        self._names = {}
        self._stack = []
        found, self.found = self.found, []
        return found

    def release(self) -> None:
        """Pop our mode if it is on top of the stack (``__exit__`` pops whatever is)."""
        if self._depth is not None and leave_mode(self._mode):
            self._depth = None
        self.pending = self._depth is not None

    # -- inside the pass -------------------------------------------------------
    def enter(self, module: nn.Module, args: Any) -> None:
        if id(module) in self._names:
            self._stack.append(id(module))

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack and self._stack[-1] == id(module):
            self._stack.pop()

    def saw(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.active or self.broken or quiet.replaying():
            return  # trainwatch's own re-run of a module is not the user's pass
        kind, label, acts = _MODE_FUNCTIONS[func]
        if (self._skip_dropout and kind == "dropout") or not acts(args, kwargs):
            return
        if not self._stack or self._stack[-1] not in self._names:
            return
        name, ref = self._names[self._stack[-1]]
        if all(item.ref() is not ref() for item in self.found):
            self.found.append(Listed(name, kind, label, ref))

    def fail(self, exc: BaseException) -> None:
        """A look failed: looks end (the mode comes off at the pass's end), the rest goes on."""
        self.broken = True
        self._hooks.remove_all()
        self._on_error("functional mode look", exc)

    def detach(self) -> None:
        self.broken = True
        self.finish()
