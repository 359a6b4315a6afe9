"""The watched model's forward passes, seen from its outermost call alone.

A global module hook runs on every ``nn.Module.__call__`` in the process and
takes every call off PyTorch's fast path (``Module._call_impl`` returns
``forward(*args)`` directly only while no hook of any kind exists), so a
healthy step would cost more with every layer. Healthy steps therefore see
the model from two hooks on the model alone: a forward pre-hook and an
always-called forward hook on the root module, and on a ``torch.compile``
wrapper of it (whose own call runs eagerly around the compiled graph). Every
collector that needs a pass (its start, its output, its inputs) subscribes
here; per-module hooks are installed only on the steps that need them.

A pass's inputs are handed over as its call received them: a forward may
empty a list or dict it is given (``items.pop(0)``, ``batch.pop("labels")``),
and a collector that re-runs the pass (a NaN/Inf replay, the first batch
``stalled_training`` keeps) must not run it on what the call left behind.
The containers among the arguments are copied as the pass begins, where
there are any (``received``); tensors and plain values cost one set of their
types.

Hooks on an instance live in the module's own hook tables, which ``pickle``,
``torch.save`` and ``copy.deepcopy`` would carry along (an EMA copy would
report into this monitor; ``torch.load(weights_only=True)`` would refuse
trainwatch's classes). A reduction registered with ``copyreg`` for the
model's class leaves trainwatch's hooks out of every copy: the copy is what
it would be without trainwatch. A class whose reduction the user registered
already keeps the user's.
"""

from __future__ import annotations

import copyreg
import sys
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from trainwatch.collect import quiet
from trainwatch.collect.received import PLAIN_TYPES, as_received, plain_in_tuples
from trainwatch.compiled import transform_level, unwrap
from trainwatch.errors import TrainingHealthError
from trainwatch.fast_paths import forget_root, hook_module, layer_members, watch_root
from trainwatch.hooks import WeakHook

# Per-instance hook tables of nn.Module: the hooks themselves, and the tables
# keyed by a hook's id that say how to call it.
_HOOK_TABLES = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


class PassListener(Protocol):
    """A collector that wants the model's forward passes."""

    def pass_starts(self, module: nn.Module) -> None: ...

    def pass_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """``args`` and ``kwargs`` as the call received them: a list or dict the
        forward emptied (``items.pop(0)``) comes as it was when the pass began."""


def _without_trainwatch_hooks(obj: nn.Module) -> Any:
    """``obj``'s ordinary reduction, with trainwatch's hooks left out of its hook tables."""
    reduced = object.__reduce_ex__(obj, 4)
    state = reduced[2] if len(reduced) > 2 else None
    if not isinstance(state, dict):
        return reduced
    ours = {
        key
        for key, hook in {
            **state.get("_forward_pre_hooks", {}),
            **state.get("_forward_hooks", {}),
        }.items()
        if isinstance(hook, WeakHook)
    }
    if not ours:
        return reduced
    state = dict(state)
    for table in _HOOK_TABLES:
        found = state.get(table)
        if found is not None:
            state[table] = type(found)((k, v) for k, v in found.items() if k not in ours)
    return (reduced[0], reduced[1], state, *reduced[3:])


# Classes given the reduction above, with how many hooked instances need it.
_reduced_classes: dict[type, int] = {}


def _hide_hooks_of(cls: type) -> bool:
    if cls in _reduced_classes:
        _reduced_classes[cls] += 1
        return True
    if cls in copyreg.dispatch_table:
        return False  # the user's own reduction stays
    copyreg.pickle(cls, _without_trainwatch_hooks)
    _reduced_classes[cls] = 1
    return True


def _release_class(cls: type) -> None:
    count = _reduced_classes.get(cls, 0) - 1
    if count > 0:
        _reduced_classes[cls] = count
        return
    _reduced_classes.pop(cls, None)
    if copyreg.dispatch_table.get(cls) is _without_trainwatch_hooks:
        del copyreg.dispatch_table[cls]


class ModelPasses:
    """Start and end of each outermost forward pass of one model, for its collectors."""

    def __init__(self, on_error: Callable[[str, BaseException], None]) -> None:
        self._on_error = on_error
        self._listeners: list[tuple[str, PassListener, bool]] = []  # (name, it, wants starts)
        # What each pass calls, rebuilt on every (un)subscribe: a pass iterates a
        # tuple of bound methods, and a listener with nothing to do as a pass
        # starts is not called then.
        self._starts: tuple[tuple[str, PassListener, Callable[..., None]], ...] = ()
        self._ends: tuple[tuple[str, PassListener, Callable[..., None]], ...] = ()
        self._hooked: list[tuple[weakref.ref[nn.Module], list[Any], type | None]] = []
        self._hook_ids: set[int] = set()  # the hooked modules (held by _hooked's refs)
        # The wrapper and the model both run eagerly when compiled code falls
        # back to Python: only the outermost of them is the pass.
        self._depth = 0
        self.passes = 0  # outermost passes seen so far
        # Given the exception escaping a hooked module's forward (None: not wanted).
        self.on_raise: Callable[[BaseException], None] | None = None
        # The arguments of the pass in progress (a loss computed in forward reads its labels).
        self.inputs: tuple[Any, dict[str, Any]] | None = None
        # Where the pass in progress was handed a mutable container (a list its forward
        # may empty): its number (``passes``) and the arguments as the call received
        # them, handed to the listeners as it ends (see ``received``).
        self._received: tuple[int, tuple[Any, dict[str, Any]]] | None = None
        # id of the module whose call in progress was started by hand (``started``):
        # its own pre-hook, if PyTorch still runs it, is that same call.
        self._started_by_hand: int | None = None
        # Parts followed for their calls without gradients alone (see hook), by id,
        # and the one whose such call is the pass in progress.
        self._nograd_only: set[int] = set()
        self._nograd_pass: nn.Module | None = None

    def hook(self, module: nn.Module, *, nograd_only: bool = False) -> None:
        """Watch ``module``'s calls as the model's passes (the root, or its compile wrapper).

        ``nograd_only``: a part of a model that is called whole otherwise, whose calls
        on their own without gradients are passes (an evaluation through
        ``model.encode``); its calls inside the model's passes and its calls with
        gradients cost two early returns each, and are no passes.
        """
        if any(ref() is module for ref, _, _ in self._hooked):
            return
        enter, leave = ("enter_nograd", "leave_nograd") if nograd_only else ("enter", "leave")
        # A part inside a transformer layer of the model first hooked (its root)
        # would take the layer off its fast path (see fast_paths).
        root = self._hooked[0][0]() if self._hooked else None
        in_layer = root is not None and id(module) in layer_members(root)
        starts, ends = WeakHook(self, enter), WeakHook(self, leave)
        handles = [
            hook_module(module, starts, pre=True, in_layer=in_layer, with_kwargs=True),
            hook_module(module, ends, in_layer=in_layer, with_kwargs=True, always_call=True),
        ]
        if not nograd_only:
            watch_root(module)
        cls = type(module) if _hide_hooks_of(type(module)) else None
        self._hooked.append((weakref.ref(module), handles, cls))
        self._hook_ids.add(id(module))
        if nograd_only:
            self._nograd_only.add(id(module))

    def _unhook(self, module: nn.Module) -> None:
        for entry in self._hooked:
            ref, handles, cls = entry
            if ref() is module:
                for handle in handles:
                    handle.remove()
                if cls is not None:
                    _release_class(cls)
                forget_root(module)
                self._hooked.remove(entry)
                self._hook_ids.discard(id(module))
                self._nograd_only.discard(id(module))
                return

    def widen(self) -> int:
        """Also watch the children (with parameters) of every module watched so far.

        For loops that call parts of the model (``gan.generator(z)``,
        ``model.encoder(x)``) and never the model itself: each outermost call
        of a part is then a pass. Returns how many modules were added.
        """
        added = 0
        for ref, _, _ in list(self._hooked):
            module = ref()
            if module is None:
                continue
            for child in unwrap(module).children():
                if isinstance(child, torch.jit.ScriptModule):
                    continue  # TorchScript takes no hooks
                if id(child) in self._nograd_only and self.hooks(child):
                    self._unhook(child)  # followed for its evaluations: now for every call
                if not self.hooks(child) and next(child.parameters(), None) is not None:
                    self.hook(child)
                    added += 1
        return added

    def hooks(self, module: nn.Module) -> bool:
        return any(ref() is module for ref, _, _ in self._hooked)

    @property
    def in_pass(self) -> bool:
        """Whether one of the model's passes is in progress."""
        return self._depth > 0

    def subscribe(self, name: str, listener: PassListener, *, starts: bool = True) -> None:
        """``starts``: False for a listener whose ``pass_starts`` does nothing."""
        self._listeners.append((name, listener, starts))
        self._dispatch()

    def listens(self, listener: PassListener) -> bool:
        return any(item is listener for _, item, _ in self._listeners)

    def listener_names(self) -> list[str]:
        return [name for name, _, _ in self._listeners]

    def unsubscribe(self, listener: PassListener) -> None:
        self._listeners = [entry for entry in self._listeners if entry[1] is not listener]
        self._dispatch()

    def redispatch(self) -> None:
        """A listener's ``pass_starts`` or ``pass_ends`` is another method now."""
        self._dispatch()

    def _dispatch(self) -> None:
        self._starts = tuple(
            (name, item, item.pass_starts) for name, item, starts in self._listeners if starts
        )
        self._ends = tuple((name, item, item.pass_ends) for name, item, _ in self._listeners)

    def started(self, module: nn.Module, args: Any) -> None:
        """A call of ``module`` already in progress is a pass (hooked during it).

        Whether PyTorch still runs the pre-hooks added during a call depends on
        how the call came in; when it does, that pre-hook is this same call.
        """
        if self._depth or id(module) not in self._hook_ids:
            return
        self.enter(module, args)
        self._started_by_hand = id(module) if self._depth == 1 else None
        if self._depth == 1 and id(module) in self._nograd_only:
            self._nograd_pass = module

    def enter_nograd(self, module: nn.Module, args: Any, kwargs: Any = None) -> None:
        """A call of a part followed for its evaluations: a pass when it runs on its
        own without gradients."""
        if self._depth or torch.is_grad_enabled():
            return
        self.enter(module, args, kwargs)
        if self._depth == 1:
            self._nograd_pass = module

    def leave_nograd(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._nograd_pass is module:
            self._nograd_pass = None
            self.leave(module, args, kwargs, output)

    def enter(self, module: nn.Module, args: Any, kwargs: Any = None) -> None:
        if self._started_by_hand is not None:
            started, self._started_by_hand = self._started_by_hand, None
            if started == id(module) and self._depth == 1:
                return  # the pre-hook of the call started by hand
        if (
            (quiet.anywhere and quiet.replaying())
            or id(module) not in self._hook_ids
            or transform_level() is not None
        ):
            # trainwatch's own re-run of the model, a copy that took the hooks
            # along (a class whose own __deepcopy__ bypasses the reduction), or
            # a call inside a torch.func transform (per-sample gradients)
            return
        if self._depth:
            self._depth += 1
            return
        self._depth = 1
        self.passes += 1
        # The usual arguments (tensors, numbers) told by their types' set, made in
        # C; a call handed a list or a dict, or a tuple that may hold one, has its
        # containers copied before its forward can empty or rewrite them
        # (``items.pop(0)``, ``batch.pop("labels")``, ``state[0] = h``).
        if kwargs:  # model(**batch) comes with no args
            if args and not set(map(type, args)) <= PLAIN_TYPES and not plain_in_tuples(args):
                self._keep_received(args, kwargs)
            elif set(map(type, kwargs.values())) <= PLAIN_TYPES or plain_in_tuples(kwargs.values()):
                self.inputs = (args, kwargs)
            else:
                self._keep_received(args, kwargs)
        elif set(map(type, args)) <= PLAIN_TYPES or plain_in_tuples(args):
            self.inputs = (args, {})
        else:
            self._keep_received(args, {})
        for name, listener, starts in self._starts:
            try:
                starts(module)
            except TrainingHealthError:
                raise  # halt_on: trainwatch doing its job
            except Exception as exc:  # never break the user's forward
                self._fail(name, listener, exc)

    def leave(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """Always called, even when the forward raised (the depth must come back down)."""
        if (
            (quiet.anywhere and quiet.replaying())
            or id(module) not in self._hook_ids
            or transform_level() is not None
        ):
            return
        self._started_by_hand = None
        if output is None and self.on_raise is not None:
            self._raised(module)
        if self._depth > 1:
            self._depth -= 1
            return
        self._depth = 0
        self.inputs = None
        if self._received is not None:
            # The arguments as this call received them; a copy left by an earlier
            # pass whose end went unseen is dropped. (Not told by the args tuple: a
            # module with full backward hooks hands its forward hooks a new one.)
            received, self._received = self._received, None
            if received[0] == self.passes:
                args, kwargs = received[1]
        for name, listener, ends in self._ends:
            try:
                ends(module, args, kwargs, output)
            except TrainingHealthError:
                raise
            except Exception as exc:
                self._fail(name, listener, exc)

    def _keep_received(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A pass handed something other than tensors and plain values begins: its
        mutable containers copied before its forward can empty them."""
        self.inputs = given = as_received(args, kwargs)
        if given[0] is not args or given[1] is not kwargs:
            self._received = (self.passes, given)

    def _raised(self, module: nn.Module) -> None:
        """The forward raised, or returned None: PyTorch calls this hook from its ``except``.

        The exception being handled is this call's when its traceback starts
        at this module's own call frame.
        """
        exc = sys.exc_info()[1]
        tb = exc.__traceback__ if exc is not None else None
        if tb is None or tb.tb_frame.f_locals.get("self") is not module:
            return
        try:
            self.on_raise(exc)  # type: ignore[misc]
        except Exception as failure:  # the user's error is what they must see
            self.on_raise = None
            self._on_error("error note", failure)

    def fail(self, exc: BaseException) -> None:
        """The pass hooks themselves failed: they come off, the rest carries on."""
        self.detach()
        self._on_error("model passes", exc)

    def _fail(self, name: str, listener: PassListener, exc: BaseException) -> None:
        self.unsubscribe(listener)
        self._on_error(name, exc)

    def detach(self) -> None:
        for ref, handles, cls in self._hooked:
            for handle in handles:
                handle.remove()
            if cls is not None:
                _release_class(cls)
            module = ref()
            if module is not None:
                forget_root(module)
        self._hooked.clear()
        self._hook_ids.clear()
        self._nograd_only.clear()
        self._nograd_pass = None
        self._listeners.clear()
        self._dispatch()
        self._depth = 0
        self._received = None
