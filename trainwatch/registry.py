"""Which parameters an open monitor already watches, so no model gets hooked twice."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

# id(param) -> (param, owner). Weak both ways: a dropped model or a monitor
# that was garbage-collected frees its entries.
_WATCHED: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[Any]]] = {}


def owner_of(param: torch.Tensor) -> Any | None:
    entry = _WATCHED.get(id(param))
    if entry is None:
        return None
    tensor, owner = entry[0](), entry[1]()
    if tensor is not param or owner is None or getattr(owner, "closed", True):
        del _WATCHED[id(param)]
        return None
    return owner


def claim(params: Iterable[torch.Tensor], owner: Any) -> None:
    ref = weakref.ref(owner)
    for param in params:
        _WATCHED[id(param)] = (weakref.ref(param), ref)


def release(owner: Any) -> None:
    for key in [k for k, (_, ref) in _WATCHED.items() if ref() is owner or ref() is None]:
        del _WATCHED[key]
