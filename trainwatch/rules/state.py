"""A rule's state as plain data, for checkpoints: a resumed run keeps its streaks.

Lightning saves a callback's state inside the checkpoint, which recent PyTorch
loads with ``weights_only=True``: only plain containers and scalars pass. So
a rule's small state objects (slotted classes of its own module) are written
as tagged dicts and rebuilt from that module when loaded.
"""

from __future__ import annotations

import sys
from typing import Any

_TAG = "__trainwatch_object__"


def plain(value: Any) -> Any:
    """``value`` as nested dicts, lists, tuples, sets and scalars."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(item) for item in value)
    if isinstance(value, (set, frozenset)):
        return {plain(item) for item in value}
    slots = getattr(type(value), "__slots__", None)
    if slots:
        fields = {name: plain(getattr(value, name)) for name in slots if hasattr(value, name)}
        return {_TAG: type(value).__name__, "fields": fields}
    raise TypeError(f"cannot save a {type(value).__name__} in a rule's state")


def rebuilt(value: Any, module: str) -> Any:
    """The inverse of :func:`plain`; objects come from the rule's own ``module``."""
    if isinstance(value, dict):
        if _TAG in value:
            cls = getattr(sys.modules[module], value[_TAG])
            obj = cls.__new__(cls)
            for name, item in value["fields"].items():
                setattr(obj, name, rebuilt(item, module))
            return obj
        return {key: rebuilt(item, module) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(rebuilt(item, module) for item in value)
    if isinstance(value, set):
        return {rebuilt(item, module) for item in value}
    return value
