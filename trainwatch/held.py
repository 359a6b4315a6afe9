"""Whether a script still holds the objects one of trainwatch's own structures holds.

``trainwatch run`` gives each model it finds a monitor, and the monitor holds the
model and its optimizers. A loop that trains a throwaway copy per task (Reptile,
FOMAML: ``copy.deepcopy(meta_model)`` and a fresh optimizer, a few steps, then
dropped) would keep every copy alive through its monitor. Python tells only how
many references an object has, not whose: so the references inside the monitor
are counted (a walk over its own objects, about a millisecond for a small model),
and an object with no other reference is held by the monitor alone.

The walk enters trainwatch's own objects and the plain containers and closures
they hold, never a module, tensor, optimizer or another library's object: a
reference it does not count is taken for the script's, so in doubt an object
counts as still held. Asked only when a new model is found, never per step.
"""

from __future__ import annotations

import collections
import gc
import sys
import types

# Objects walked before the walk gives up (and the objects count as held).
WALK_LIMIT = 50_000
_CONTAINERS = (
    list,
    tuple,
    dict,
    set,
    frozenset,
    collections.deque,
    types.CellType,
    types.MethodType,
    types.FunctionType,
)
_OURS = __name__.rsplit(".", 1)[0] + "."


def held_only_by(root: object, targets: list[object], stop: tuple[type, ...] = ()) -> bool:
    """Whether every reference to each of ``targets`` is one from inside ``root``'s
    own objects (instances of ``stop`` besides ``root`` are not entered).

    ``targets``: distinct objects, in a list no one else holds.
    """
    counted = _references_inside(root, {id(t) for t in targets}, stop)
    if counted is None:
        return False
    for target in targets:
        # Not counted: the list's, this loop's name and getrefcount's argument.
        if sys.getrefcount(target) - 3 > counted.get(id(target), 0):
            return False
    return True


def _references_inside(root: object, wanted: set[int], stop: tuple[type, ...]) -> dict | None:
    """References to each of ``wanted`` (by id) from the objects reachable from
    ``root`` through enterable objects; None when the walk grew past its limit."""
    counted: dict[int, int] = {}
    seen = {id(root)}
    todo = [root]
    kinds: dict[type, bool] = {}  # whether objects of a type are entered
    while todo:
        for ref in _referents(todo.pop()):
            key = id(ref)
            if key in seen:
                continue
            if key in wanted:
                counted[key] = counted.get(key, 0) + 1
                continue
            kind = type(ref)
            enter = kinds.get(kind)
            if enter is None:
                enter = kinds[kind] = _entered(kind, stop)
            if enter:
                seen.add(key)
                todo.append(ref)
                if len(seen) > WALK_LIMIT:
                    return None
    return counted


def _referents(obj: object) -> list[object]:
    """What ``obj`` refers to; of a function, one of trainwatch's only, its closure
    and defaults (not its globals: the whole program)."""
    if type(obj) is types.FunctionType:
        if not str(obj.__module__).startswith(_OURS):
            return []  # the script's own (an optimizer's closure): its references are its
        return [*(obj.__closure__ or ()), *(obj.__defaults__ or ()), obj.__kwdefaults__]
    return gc.get_referents(obj)


def _entered(kind: type, stop: tuple[type, ...]) -> bool:
    """Plain containers and closures, and trainwatch's own objects but ``stop``'s."""
    if issubclass(kind, _CONTAINERS):
        return True
    return kind.__module__.startswith(_OURS) and not issubclass(kind, stop)
