"""Which parameters an open monitor already watches, so no model gets hooked twice.

Parameters are held strongly, never through a weak reference: PyTorch refuses
to swap a tensor that has one (``torch.utils.swap_tensors``, which
``module.to()`` uses in swap mode and for tensor subclasses), so a weak
reference here would make a watched model impossible to move. A monitor's
own layer map holds its parameters anyway; entries go when the monitor
closes or is garbage-collected.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

# id(param) -> (param, owner), the owner held weakly.
_WATCHED: dict[int, tuple[torch.Tensor, weakref.ref[Any]]] = {}
# Counts every change of who watches what (a monitor opened, closed or collected,
# parameters claimed, an optimizer added to a monitor): a decision taken from it
# (which monitor tells a parameter an optimizer holds outside its model) is kept
# while this stays the same, and taken again once it moved.
changes = 0


def changed() -> None:
    """Something a decision of who watches what rests on changed (see ``changes``)."""
    global changes
    changes += 1


def owner_of(param: torch.Tensor) -> Any | None:
    entry = _WATCHED.get(id(param))
    if entry is None:
        return None
    tensor, owner = entry[0], entry[1]()
    if tensor is not param or owner is None or getattr(owner, "closed", True):
        del _WATCHED[id(param)]
        changed()
        return None
    return owner


def owners() -> list[Any]:
    """The open monitors that watch some parameters now."""
    found: dict[int, Any] = {}
    for _, ref in list(_WATCHED.values()):
        owner = ref()
        if owner is not None and not getattr(owner, "closed", True):
            found[id(owner)] = owner
    return list(found.values())


def claim(params: Iterable[torch.Tensor], owner: Any) -> None:
    ref = weakref.ref(owner)
    for param in params:
        _WATCHED[id(param)] = (param, ref)
    changed()


def release(owner: Any) -> None:
    for key in [k for k, (_, ref) in _WATCHED.items() if ref() is owner or ref() is None]:
        del _WATCHED[key]
    changed()


def forget_collected() -> None:
    """Drop the entries of monitors that were garbage-collected without closing."""
    for key in [k for k, (_, ref) in _WATCHED.items() if ref() is None]:
        del _WATCHED[key]
    changed()
