"""A pass's arguments as its call received them, where the forward may consume them.

A forward may empty a container it is handed: a queue of ragged items read
with ``items.pop(0)`` or ``popleft()``, a Hugging Face-style
``batch.pop("labels")``. By the time the pass ends, the list or dict its
hooks were given is empty (or lacks its labels), and whatever re-runs the
pass from it (a NaN/Inf replay, a replay of its backward,
``stalled_training``'s first batch) would run the model on what the call
left behind: it could not find again what the call did.

A random generator the call is handed (``forward(x, generator=g)``) is
copied in its state then: the pass draws from it, and a replay must draw
what the pass drew.

A list may also sit inside a tuple the call is handed: a recurrent block
called as ``block((x, [h, c]))`` whose forward writes its new state into
that list (``state[0] = h``), or a loop that moves the list on once the call
returns. A replay at the pass's end, or at the step boundary, would then run
on the state the call left behind (its own NaN, already made), and blame
the data.

So the mutable containers among a pass's arguments are copied as the call
begins, their items as they are then (tensors are not cloned: the pass
holds them anyway), nested containers included, inside tuples too. A
healthy pass must not pay for it: the usual arguments (tensors, None,
numbers, strings) are told from the rest by a set of their types made in C
and compared with ``PLAIN_TYPES`` (no call a profiler sees), and only a
call handed something else is walked here. A tuple is not among them (it
may hold a list); one holding plain values alone is told so by two more such
sets (``plain_in_tuples``), and the call is not walked.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import MutableMapping, MutableSequence, MutableSet
from itertools import chain
from operator import is_
from typing import Any

import torch
from torch import nn

from trainwatch.rng import generator_as_now, generator_kinds

# Arguments a forward cannot change as containers (a tensor changed in place is
# another matter: each re-run copies the tensors it is handed). Not tuples: one
# may hold a list (``(x, [h, c])``), so a call handed one is looked into.
PLAIN_TYPES = frozenset(
    {
        torch.Tensor,
        nn.Parameter,
        type(None),
        bool,
        int,
        float,
        str,
        torch.Size,
        torch.dtype,
        torch.device,
    }
)

_MUTABLE = (MutableMapping, MutableSequence, MutableSet)
# Items that hold no container (a tuple may).
_LEAVES = PLAIN_TYPES
# An argument that is plain, or a tuple that may hold only plain values.
_PLAIN_OR_TUPLE = PLAIN_TYPES | {tuple}
_IS_TUPLE = tuple.__instancecheck__
# Containers whose own ``copy()`` is a shallow copy made in C.
_COPIED_IN_C = frozenset({list, dict, set, deque})
# The random generators a call may be handed (numpy's where it is loaded already).
_GENERATORS = generator_kinds()
# Deep enough for a dict of lists of dicts; a bound for a self-referencing container.
_MAX_DEPTH = 6


def as_received(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(args, kwargs)`` with every mutable container in them copied as it is now.

    ``args`` and ``kwargs`` themselves come back as they are where nothing
    in them was copied. C loops around the one Python call per argument.
    """
    given = tuple(map(_as_received, args))
    if all(map(is_, given, args)):
        given = args
    if kwargs:
        values = list(map(_as_received, kwargs.values()))
        if not all(map(is_, values, kwargs.values())):
            kwargs = dict(zip(kwargs, values))
    return given, kwargs


def plain_in_tuples(values: Any) -> bool:
    """Whether ``values`` (a call's arguments, not all of ``PLAIN_TYPES``) are plain
    values and tuples of them (``model(x, (h, c))``): nothing to copy. Told in C
    loops; a list among them is told at the first."""
    if not set(map(type, values)) <= _PLAIN_OR_TUPLE:
        return False
    return set(map(type, chain.from_iterable(filter(_IS_TUPLE, values)))) <= PLAIN_TYPES


def _as_received(value: Any, depth: int = 0) -> Any:
    """``value``, or a copy of it where it is (or holds) a mutable container."""
    if isinstance(value, torch.Tensor) or depth >= _MAX_DEPTH:
        return value
    if isinstance(value, tuple):
        if set(map(type, value)) <= _LEAVES:
            return value
        items = [_as_received(item, depth + 1) for item in value]
        if all(map(is_, items, value)):
            return value
        try:
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        except Exception:  # a tuple subclass built some other way
            return value
    if not isinstance(value, _MUTABLE):
        return generator_as_now(value) if isinstance(value, _GENERATORS) else value
    try:
        # The usual list or dict: copied in C, its items looked into only where
        # one may hold a container itself.
        copied = value.copy() if type(value) in _COPIED_IN_C else copy.copy(value)
        if isinstance(value, MutableMapping):
            if not set(map(type, value.values())) <= _LEAVES:
                for key, item in value.items():
                    inner = _as_received(item, depth + 1)
                    if inner is not item:
                        copied[key] = inner
        elif isinstance(value, MutableSequence):
            if not set(map(type, value)) <= _LEAVES:
                for index, item in enumerate(value):
                    inner = _as_received(item, depth + 1)
                    if inner is not item:
                        copied[index] = inner
    except Exception:  # uncopyable: the pass's own, as it will be left
        return value
    return copied
