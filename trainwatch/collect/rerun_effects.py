"""What a re-run of the model's forward changes, undone: training goes on bit for bit.

trainwatch runs a model's forward again now and then, outside training:
stalled_training's first batch, a NaN replay, an op trace. A forward may
change state as it runs, on purpose and on every call: MoCo moves its key
encoder (``param_k.data = param_k.data * m + param_q.data * (1 - m)``, or
``mul_``/``add_`` in place) and writes its keys into a queue tensor at a
pointer it moves, a cross-batch memory appends to a deque, an EMA is
updated in place, a buffer counts the calls. Run again for trainwatch,
each would happen once more for real and the training that follows would
no longer be the one the script runs without it.

:class:`UndoneEffects` is entered around such a re-run and puts back, on
exit:

- every module's attributes and its weights', buffers' and parts' tables,
  by reference (a forward's ``setattr`` of a counter, of an
  ``nn.Parameter``, a rebound queue), and the contents of the containers
  those attributes hold (lists, dicts, deques, sets, nested), with the
  attributes of the plain objects of the model's own code they hold (a
  memory bank kept in an object of its own) and modules kept outside the
  tables (a teacher set with ``object.__setattr__``); a container or an
  object is put back in place, and only where the re-run changed it (a
  reference to it held elsewhere sees it as it was);
- the names the forward's own module rebinds (``global counter``), and the
  containers, objects' attributes and tensors those names hold (as bound,
  not looked into further);
- the random generators among all of these (a VAE's ``self.gen``, a numpy
  ``Generator`` or ``random.Random`` the model holds, one in its code's
  globals) and among the call's arguments (``forward(x, generator=g)``, one
  level into their containers): each one's state, so a re-run's draws move
  none of them (the global generators are forked by ``rng.forked_rngs``);
- what the user's forward pre-hooks on the modules reach (their closures,
  the object of a bound method, their code's globals), looked into as the
  modules' attributes are: those hooks run in a re-run, since they feed the
  call (torch's ``prune``, an input cast), while the user's forward and
  backward hooks, which watch it, are held off for it (see ``rerun_hooks``);
- every tensor among all of these (weights, buffers, gradients, plain
  tensor attributes) given other storage (``.data =``, ``set_``,
  ``resize_``) or another ``requires_grad``: its own storage back;
- every in-place or ``out=`` write into one of those tensors' storage,
  whatever view it goes through (``queue[ptr:ptr + n] = k``): the part
  written is copied once before it is written (a ``TorchDispatchMode`` live
  only for the re-run), its values and its version counter put back after,
  so a graph that saved it still runs its backward. Storage the re-run made
  itself (its activations, written in place by an in-place ReLU) is never
  copied.

What cannot be put back is not done: a write into a tensor of theirs that
cannot be copied (no plain storage) stops the re-run before it is made, and
``lasting`` says so (its caller runs that model no more). What a forward or
a pre-hook does beyond the model and its own module (a file, a print,
another module's state) is not seen.

Costs nothing on a healthy step: built and torn down around the re-run
alone. Every per-module, per-weight save and restore runs in C loops; the
dispatch mode costs a set look-up per op of the re-run.
"""

from __future__ import annotations

import functools
import types
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Iterable
from itertools import chain, compress, filterfalse, repeat
from operator import attrgetter, is_, is_not, itemgetter, methodcaller, not_
from typing import Any

import torch
from torch import nn

from trainwatch.collect.rerun_hooks import HeldOffWatchers, hook_code, user_pre_hooks
from trainwatch.compiled import OutOfGraphDispatchMode
from trainwatch.rng import generator_kinds, generator_states, generators_in, put_generator_states

_STATE = attrgetter("__dict__")
_PARAMETERS = attrgetter("_parameters")
_BUFFERS = attrgetter("_buffers")
_MODULES = attrgetter("_modules")
_DATA = attrgetter("data")
_DTYPE = attrgetter("dtype")
_GRAD = attrgetter("grad")
_IS_LEAF = attrgetter("is_leaf")
_REQUIRES_GRAD = attrgetter("requires_grad")
_STORAGE = methodcaller("untyped_storage")
_POINTER = methodcaller("data_ptr")
_CLEAR = methodcaller("clear")
_IS_SET_TO = torch.Tensor.is_set_to
_ALL = slice(None)
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_MODULE_NAME = attrgetter("__module__")
_PLAIN = {dict}
_consume = deque(maxlen=0).extend  # runs a C loop (a ``map``) for its effects

# What nn.Module keeps in its own ``__dict__``: its tables (restored as tables)
# and its hooks' (a forward registering a hook is no state of the model's).
_MODULE_OWN = frozenset(nn.Module().__dict__)
# Values that hold nothing a forward could change in place. Tuples too, but
# only as a module's own attributes (a convolution's ``kernel_size``): a tuple
# met inside a container is looked into.
_ATOMS = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        torch.dtype,
        torch.device,
        torch.Size,
        torch.memory_format,
        torch.layout,
        type,
        types.FunctionType,
        types.BuiltinFunctionType,
        types.MethodType,
        types.ModuleType,
    }
)
_ATTRIBUTE_ATOMS = _ATOMS | {tuple}
# Containers whose contents are saved and put back in place.
_SEQUENCES = (list, deque)
_MAPPINGS = (dict, OrderedDict, defaultdict, Counter)
_CONTAINERS = frozenset({*_SEQUENCES, *_MAPPINGS, set})
# Levels of containers and objects looked into, and values looked at in all:
# bounds, so a self-referencing structure or a list of many tensors stays cheap.
_MAX_DEPTH = 6
_MAX_VALUES = 10_000
# Module code that is trainwatch's or torch's own: its globals and objects are
# not the model's state.
_NOT_OWN_CODE = ("torch", "trainwatch")

# Ops that write into a tensor their schema does not mark as written: the
# batch-norm kernels update the running statistics they are given.
_UNMARKED_WRITES = {
    "aten::native_batch_norm": (3, 4),
    "aten::cudnn_batch_norm": (3, 4),
    "aten::miopen_batch_norm": (3, 4),
}
# The ops (each an ``OpOverload``) met so far that write into no argument: most
# of a forward's, passed on with one set look-up each.
_READS: set[Any] = set()
# And those that do: the arguments each writes into, as (position, name, is a list).
_WRITES: dict[Any, tuple[tuple[int, str, bool], ...]] = {}

_set_versions = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)


# What the forward does that a re-run cannot undo (told to the user).
_NO_STORAGE = "writes in place into a tensor of its state with no plain storage to copy"
_NOT_PUT_BACK = "writes into a tensor of its state whose values failed to go back"


class LastingEffect(RuntimeError):
    """Raised inside a re-run before a write that could not be put back."""


class UndoneEffects:
    """Around a re-run of ``modules`` (the model's ``modules()``): whatever the
    re-run changes in their state is put back on exit (see the module's doc).

    ``arguments``: the values the re-run's call is given (positional and
    keyword): a generator among them (``forward(x, generator=g)``), or in a
    container among them, is put back too.

    ``lasting``: after exit, what could not be undone and was therefore not
    done ("" when nothing): the re-run was stopped before it.
    """

    def __init__(self, modules: Iterable[nn.Module], arguments: Iterable[Any] = ()) -> None:
        self.modules = list(modules)
        self.arguments = arguments
        self.lasting = ""
        self._mode: _CopyBeforeWrite | None = None

    # -- entering ------------------------------------------------------------------
    def __enter__(self) -> UndoneEffects:
        subs = self.modules
        found = _Found(subs)
        try:
            found.look()
        except Exception:  # an attribute that cannot be looked into: the tables still are
            found.tensors, found.containers, found.objects = [], [], []
        subs = found.modules
        states = list(map(_STATE, subs))
        self._states, self._saved = states, list(map(dict.copy, states))
        weights, buffers = list(map(_PARAMETERS, subs)), list(map(_BUFFERS, subs))
        tables = [*weights, *buffers, *map(_MODULES, subs)]
        if not all(map(isinstance, tables, repeat(dict))):
            # A TorchScript part: its tables are wrappers of C++ ones, which a
            # Python forward cannot register into; its weights run as they are.
            weights = [table for table in weights if isinstance(table, dict)]
            buffers = [table for table in buffers if isinstance(table, dict)]
            tables = [table for table in tables if isinstance(table, dict)]
        self._tables, self._entries = tables, list(map(dict.copy, tables))
        # The tensors of the model's state, by reference: each one's storage
        # (an alias, no copy), ``requires_grad`` and, for the weights, gradient.
        params = _present(chain.from_iterable(map(dict.values, weights)))
        # Gradients of the leaves alone: a tensor ``torch.func.functional_call`` put
        # in a weight's place has none (and reading one warns).
        leaves = list(compress(params, map(_IS_LEAF, params)))
        grads = list(map(_GRAD, leaves))
        tensors = [*params, *_present(chain.from_iterable(map(dict.values, buffers)))]
        tensors += _present(grads)
        tensors += found.tensors
        self._params, self._grads = leaves, grads
        self._tensors = tensors
        self._aliases = _aliases(tensors)
        self._flags = list(map(_REQUIRES_GRAD, tensors))
        self._containers = found.containers
        self._contents = _contents(found.containers)
        self._objects = found.objects
        self._object_states = list(map(dict.copy, map(_STATE, found.objects)))
        self._globals = found.global_dicts
        self._global_values = list(map(dict.copy, found.global_dicts))
        generators = found.generators
        generators += generators_in(self.arguments, found.generator_kinds)
        self._generators = list({id(g): g for g in generators}.values())
        self._generator_states = generator_states(self._generators)
        storages, opaque = _storages(tensors)
        self._watchers = HeldOffWatchers(subs)
        try:
            self._watchers.take()
            self._mode = _CopyBeforeWrite(storages, opaque)
            self._mode.__enter__()
        except BaseException:
            self._mode = None
            self._watchers.put_back()
            raise
        return self

    # -- exiting -------------------------------------------------------------------
    def __exit__(self, *exc: Any) -> None:
        mode, self._mode = self._mode, None
        if mode is None:
            return
        try:
            mode.__exit__(None, None, None)
        finally:
            self._watchers.put_back()
        self.lasting = mode.lasting
        with torch.no_grad():
            mode.put_back()
            _rebind(self._tensors, self._aliases)
        _put_flags(self._tensors, self._flags)
        _put_grads(self._params, self._grads)
        _put_contents(self._containers, self._contents)
        _put_objects(self._objects, self._object_states)
        _put_globals(self._globals, self._global_values)
        put_generator_states(self._generators, self._generator_states)
        _restore(self._states, self._saved, self._tables, self._entries)


def call_arguments(args: Any, kwargs: Any) -> list[Any]:
    """A call's arguments, positional and keyword, as one list (for ``arguments``)."""
    values = list(args) if isinstance(args, (tuple, list)) else [args]
    if isinstance(kwargs, dict):
        values += kwargs.values()
    return values


def generators_held(modules: Iterable[nn.Module]) -> list[Any]:
    """The random generators the modules' state reaches, found as a re-run finds
    them (their attributes, nested; their code's globals): for a caller that
    reads their states before any re-run comes (a NaN replay rewinds them)."""
    found = _Found(list(modules))
    try:
        found.look()
    except Exception:  # an attribute that cannot be looked into: none told
        return []
    return list({id(g): g for g in found.generators}.values())


class _Found:
    """What the modules' state reaches beyond their tables: tensors, containers,
    plain objects of the model's own code, modules kept outside the tables,
    random generators; and the globals of the modules whose code defines their
    ``forward``. The user's forward pre-hooks on the modules run in the re-run
    (see ``rerun_hooks``): what each reaches is looked into the same way (its
    closure's values, the object of a bound method, a ``partial``'s
    arguments), and the globals of its code are saved as the forward's are.

    The modules' attributes are looked into level by level (containers within
    containers, objects' attributes), each level's values sorted in C loops:
    only containers and objects take Python, and at most ``_MAX_VALUES``
    values are looked at, no container longer than that looked into. The
    globals are taken as they are bound, not looked into (a dataset's list of
    samples in the script's globals stays cheap), but for a module bound
    there.
    """

    def __init__(self, subs: list[nn.Module]) -> None:
        self.modules = subs  # the modules of the model, and those found kept outside it
        self.tensors: list[torch.Tensor] = []
        self.containers: list[Any] = []
        self.objects: list[Any] = []
        self.global_dicts: list[dict[str, Any]] = []
        self.generators: list[Any] = []
        self.generator_kinds = generator_kinds()
        self._seen = set(map(id, subs))
        self._budget = _MAX_VALUES
        self._hooks = user_pre_hooks(subs)
        forwards = map(getattr, map(type, subs), repeat("forward"), repeat(None))
        spaces = list(map(getattr, forwards, repeat("__globals__"), repeat(None)))
        spaces += map(_hook_globals, self._hooks)
        own = set(map(_MODULE_NAME, set(map(type, subs))))
        own.update(map(hook_code, self._hooks))
        for space in dict(zip(map(id, spaces), spaces)).values():
            if isinstance(space, dict) and not _library(space.get("__name__")):
                self.global_dicts.append(space)
                own.add(space.get("__name__"))
        self._code = set(filterfalse(_library, own))

    def look(self) -> None:
        """Everything the modules' own attributes and their pre-hooks reach, then
        their code's globals."""
        reached = _attributes(self.modules)
        for hook in self._hooks:
            reached += _hook_reach(hook)
        self._levels(_not_atoms(reached, _ATTRIBUTE_ATOMS))
        bound: list[Any] = []
        for space in self.global_dicts:
            names = list(space)
            plain = map(not_, map(methodcaller("startswith", "__"), names))
            bound += compress(map(space.__getitem__, names), plain)
        self._levels(self._next(_not_atoms(bound, _ATTRIBUTE_ATOMS), descend=False))

    def _levels(self, level: list[Any]) -> None:
        for _ in range(_MAX_DEPTH):
            if not level or self._budget <= 0:
                return
            level = level[: self._budget]
            self._budget -= len(level)
            level = self._next(level)

    def _next(self, level: list[Any], descend: bool = True) -> list[Any]:
        """Takes in ``level``'s tensors, containers and objects; what they hold (with
        ``descend``; else only what the modules among them hold)."""
        seen = self._seen
        fresh = list(compress(level, map(not_, map(seen.__contains__, map(id, level)))))
        seen.update(map(id, fresh))
        is_tensor = list(map(isinstance, fresh, repeat(torch.Tensor)))
        self.tensors += compress(fresh, is_tensor)
        held: list[Any] = []
        for value in compress(fresh, map(not_, is_tensor)):
            kind = type(value)
            if kind in _CONTAINERS:
                self.containers.append(value)
                if descend and len(value) <= _MAX_VALUES:
                    held += value.values() if isinstance(value, dict) else value
            elif kind is tuple:
                if descend and len(value) <= _MAX_VALUES:
                    held += value
            elif isinstance(value, nn.Module):
                found = [sub for sub in value.modules() if sub is value or id(sub) not in seen]
                seen.update(map(id, found))
                self.modules += found
                held += _attributes(found)
            elif isinstance(value, self.generator_kinds):
                self.generators.append(value)
            elif kind.__module__ in self._code and type(getattr(value, "__dict__", None)) is dict:
                self.objects.append(value)
                if descend:
                    held += value.__dict__.values()
        return _not_atoms(held, _ATOMS)


def _attributes(modules: list[nn.Module]) -> list[Any]:
    """The values of the modules' own attributes, nn.Module's bookkeeping left out."""
    items = list(chain.from_iterable(map(dict.items, map(_STATE, modules))))
    plain = map(not_, map(_MODULE_OWN.__contains__, map(_FIRST, items)))
    return list(map(_SECOND, compress(items, plain)))


def _hook_reach(hook: Any) -> list[Any]:
    """What a hook holds: the values of its closure, the object of a bound method
    (or the callable object itself), a ``functools.partial``'s arguments."""
    reached: list[Any] = []
    try:
        while isinstance(hook, functools.partial):
            reached += hook.args
            reached += hook.keywords.values()
            hook = hook.func
        owner = getattr(hook, "__self__", None)
        if owner is not None and not isinstance(owner, types.ModuleType):
            reached.append(owner)
        function = getattr(hook, "__func__", hook)
        if not isinstance(function, types.FunctionType):
            if not isinstance(function, (types.BuiltinFunctionType, types.MethodType)):
                reached.append(function)  # a callable object: its attributes
            return reached
        cells = function.__closure__ or ()
    except Exception:  # a hook whose attributes cannot be read: what was reached
        return reached
    for cell in cells:
        try:
            reached.append(cell.cell_contents)
        except ValueError:  # a cell not yet filled
            continue
    return reached


def _hook_globals(hook: Any) -> dict[str, Any] | None:
    """The globals of the code that defines ``hook`` (None for a callable object)."""
    try:
        while isinstance(hook, functools.partial):
            hook = hook.func
        return getattr(getattr(hook, "__func__", hook), "__globals__", None)
    except Exception:
        return None


def _not_atoms(values: list[Any], atoms: frozenset[type]) -> list[Any]:
    """``values`` but those that hold nothing to change, in C loops."""
    return list(compress(values, map(not_, map(atoms.__contains__, map(type, values)))))


def _present(values: Iterable[Any]) -> list[Any]:
    """``values`` but the Nones (a table's entry for a weight or buffer set to None)."""
    values = list(values)
    return list(compress(values, map(is_not, values, repeat(None))))


def _library(name: Any) -> bool:
    """Whether the code module ``name`` is torch's or trainwatch's own."""
    if not isinstance(name, str):
        return True
    head = name.split(".", 1)[0]
    return head in _NOT_OWN_CODE


def _aliases(tensors: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Each tensor's ``.data``: its storage and layout now, held without a copy."""
    try:
        return list(map(_DATA, tensors))
    except Exception:
        found: list[torch.Tensor | None] = []
        for tensor in tensors:
            try:
                found.append(tensor.data)
            except Exception:
                found.append(None)
        return found


def _storages(tensors: list[torch.Tensor]) -> tuple[set[int], set[int]]:
    """The storages (their addresses) ``tensors`` live in, and the ids of those
    without a plain storage of their own (a write into one cannot be put back)."""
    try:
        pointers = set(map(_POINTER, map(_STORAGE, tensors)))
        pointers.discard(0)
        return pointers, set()
    except Exception:
        pointers, opaque = set(), set()
        for tensor in tensors:
            try:
                pointer = tensor.untyped_storage().data_ptr()
            except Exception:
                opaque.add(id(tensor))
                continue
            if pointer:
                pointers.add(pointer)
        return pointers, opaque


def _contents(containers: list[Any]) -> list[Any]:
    """A shallow copy of each container (a dict's items in their order)."""
    return [
        list(value) if type(value) in _SEQUENCES else type(value).copy(value)
        for value in containers
    ]


def _put_contents(containers: list[Any], contents: list[Any]) -> None:
    """Each container the re-run changed holds again what it held, in place (one it
    left alone is not touched: another thread may be filling it)."""
    for value, saved in zip(containers, contents):
        if _same_items(value, saved):
            continue
        kind = type(value)
        if kind is list:
            value[_ALL] = saved
        elif kind is deque:
            value.clear()
            value.extend(saved)
        elif kind is OrderedDict:
            value.clear()
            value.update(saved)
        else:  # dict, defaultdict, Counter, set: C-level clear and update
            base = set if kind is set else dict
            base.clear(value)
            base.update(value, saved)


def _put_objects(objects: list[Any], states: list[dict[str, Any]]) -> None:
    """Each object whose attributes the re-run changed gets them back."""
    for value, saved in zip(objects, states):
        now = value.__dict__
        if not _same_items(now, saved):
            now.clear()
            now.update(saved)


def _same_items(value: Any, saved: Any) -> bool:
    """Whether ``value`` holds the very objects ``saved`` does, in the same order
    (compared by identity, in C: a tensor's ``==`` is elementwise)."""
    if len(value) != len(saved):
        return False
    if isinstance(value, dict):
        return not any(map(is_not, chain(value, value.values()), chain(saved, saved.values())))
    if isinstance(value, set):
        return all(map(saved.__contains__, value))
    return not any(map(is_not, value, saved))


def _put_globals(spaces: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    """The names a forward rebound or added in its module's globals, as they were.
    Only those: the rest of the module is left alone."""
    for space, before in zip(spaces, saved):
        names = list(space)
        now = list(map(space.__getitem__, names))
        was = list(map(before.get, names, repeat(_MISSING)))
        if len(names) == len(before) and not any(map(is_not, now, was)):
            continue
        for name in compress(names, map(is_, was, repeat(_MISSING))):
            del space[name]
        for name, value in before.items():
            if space.get(name, _MISSING) is not value:
                space[name] = value


_MISSING = object()


def _rebind(tensors: list[torch.Tensor], aliases: list[torch.Tensor | None]) -> None:
    """Each tensor given other storage (``.data =``, ``set_``) gets its own back."""
    try:
        same = list(map(_IS_SET_TO, tensors, aliases))
        same = list(map(bool.__and__, same, map(is_, map(_DTYPE, tensors), map(_DTYPE, aliases))))
    except Exception:
        same = [False] * len(tensors)
    if all(same):
        return
    for tensor, alias, kept in zip(tensors, aliases, same):
        if kept or alias is None:
            continue
        try:
            if not (tensor.is_set_to(alias) and tensor.dtype == alias.dtype):
                tensor.data = alias
        except Exception:
            continue


def _put_flags(tensors: list[torch.Tensor], flags: list[bool]) -> None:
    now = list(map(_REQUIRES_GRAD, tensors))
    if now == flags:
        return
    for tensor, flag, current in zip(tensors, flags, now):
        if flag != current:
            try:
                tensor.requires_grad_(flag)
            except RuntimeError:
                continue


def _put_grads(params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    if not any(map(is_not, map(_GRAD, params), grads)):
        return
    for param, grad in zip(params, grads):
        if param.grad is not grad:
            param.grad = grad


def _restore(
    states: list[dict[str, Any]],
    saved: list[dict[str, Any]],
    tables: list[dict[str, Any]],
    entries: list[dict[str, Any]],
) -> None:
    """Each module's attributes, and its weights', buffers' and parts' dicts, as
    saved: what the re-run added goes, what it changed or removed comes back.
    What it added is held until every module is restored, so nothing freed on
    the way (a ``__del__``, a weakref callback) meets a module half restored."""
    added = list(map(dict.copy, states))
    added_entries = list(map(dict.copy, tables))
    _consume(map(dict.clear, states))
    _consume(map(dict.update, states, saved))
    _consume(map(_CLEAR, tables))
    if set(map(type, tables)) <= _PLAIN:
        _consume(map(dict.update, tables, entries))
    else:  # an OrderedDict among them: its own update keeps its order
        for table, entry in zip(tables, entries):
            table.update(entry)
    del added, added_entries


# -- the writes ----------------------------------------------------------------------
def _written_arguments(func: Any) -> tuple[tuple[int, str, bool], ...]:
    """The arguments ``func`` writes into (see ``_WRITES``), read off its schema once;
    an op that writes none joins ``_READS``."""
    written = _WRITES.get(func)
    if written is not None:
        return written
    schema = getattr(func, "_schema", None)
    found = []
    if schema is not None:  # (a higher-order op has none: it runs as it is)
        unmarked = _UNMARKED_WRITES.get(schema.name, ())
        for position, argument in enumerate(schema.arguments):
            alias = argument.alias_info
            if (alias is not None and alias.is_write) or position in unmarked:
                listed = isinstance(argument.type, torch.ListType)
                found.append((position, argument.name, listed))
    if not found:
        _READS.add(func)
        return ()
    written = _WRITES[func] = tuple(found)
    return written


class _CopyBeforeWrite(OutOfGraphDispatchMode):
    """Live for a re-run only: before an op writes into storage the model's state
    had before the re-run, the part it writes is copied (each view once);
    :meth:`put_back` writes the copies back and sets the version counters as
    they were, the latest copy first."""

    supports_higher_order_operators = True  # run as they are (they write nothing)

    def __init__(self, storages: set[int], opaque: set[int]) -> None:
        super().__init__()
        self.storages = storages
        self.opaque = opaque
        self.lasting = ""
        # (tensor written, its storage as it was, a copy of its values, its version)
        self._copies: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]] = []
        self._copied: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func not in _READS:
            self._before(func, args, kwargs)
        return func(*args, **kwargs)

    def _before(self, func: Any, args: Any, kwargs: Any) -> None:
        for position, name, listed in _written_arguments(func):
            value = args[position] if position < len(args) else kwargs.get(name)
            if value is None:
                continue
            for tensor in value if listed else (value,):
                if isinstance(tensor, torch.Tensor) and id(tensor) not in self._copied:
                    self._copy(tensor)

    def _copy(self, tensor: torch.Tensor) -> None:
        try:
            pointer = tensor.untyped_storage().data_ptr()
        except Exception:
            if id(tensor) in self.opaque:
                self._refuse(_NO_STORAGE)
            return
        if pointer not in self.storages:
            return  # storage the re-run made: its own activations
        try:
            alias = tensor.data
            copy = alias.clone()
            version = None if tensor.is_inference() else tensor._version
        except Exception:
            self._refuse("writes in place into a tensor of its state that cannot be copied")
            return
        self._copied.add(id(tensor))
        self._copies.append((tensor, alias, copy, version))

    def _refuse(self, what: str) -> None:
        self.lasting = self.lasting or what
        raise LastingEffect(what)

    def put_back(self) -> None:
        """Each part written holds its values again, the earliest copy last; then
        each tensor's storage and version counter are as they were."""
        copies, self._copies = self._copies, []
        self._copied = set()
        for _, alias, copy, _ in reversed(copies):
            try:
                if alias.is_inference():
                    with torch.inference_mode():
                        alias.copy_(copy)
                else:
                    alias.copy_(copy)
            except Exception:
                self.lasting = self.lasting or _NOT_PUT_BACK
        for tensor, alias, _, _ in copies:
            try:
                if not (tensor.is_set_to(alias) and tensor.dtype == alias.dtype):
                    tensor.data = alias  # ``set_``, ``resize_``: its own storage back
            except Exception:
                continue
        kept = [(tensor, version) for tensor, _, _, version in reversed(copies)]
        _put_versions([t for t, v in kept if v is not None], [v for _, v in kept if v is not None])


def _put_versions(tensors: list[torch.Tensor], versions: list[int]) -> None:
    """The version counters as they were: in order, so the earliest read wins
    where two views share one counter."""
    if not tensors or _set_versions is None:
        return
    for tensor, version in zip(tensors, versions):
        try:
            _set_versions((tensor,), (version,))
        except TypeError:  # torch before 2.4: one tensor and one version
            _set_versions(tensor, version)
