"""Callables that reach an object without keeping it alive.

Collectors call back into the monitor that made them (an error to report,
the step count); holding it strongly would keep a monitor dropped without
``close()`` alive, and with it every hook it put on the model.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def weak_callback(method: Any) -> Callable[..., None]:
    """A bound method that does not keep its object alive; a no-op once it is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        target = ref()
        if target is not None:
            target(*args)

    return call


def weak_method(method: Any, default: Any) -> Callable[..., Any]:
    """A bound method that does not keep its object alive and returns its answer;
    ``default`` once the object is gone."""
    ref = weakref.WeakMethod(method)

    def ask(*args: Any) -> Any:
        target = ref()
        return default if target is None else target(*args)

    return ask


def weak_getter(target: Any, name: str, default: Any) -> Callable[[], Any]:
    """Reads an attribute of an object without keeping the object alive."""
    ref = weakref.ref(target)

    def get() -> Any:
        obj = ref()
        return default if obj is None else getattr(obj, name)

    return get
