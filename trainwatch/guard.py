"""Failure containment: a part of trainwatch that fails is switched off, once.

Whatever goes wrong inside trainwatch is reported through ``on_error`` the
first time, that part stays off, and the user's training carries on. A
``TrainingHealthError`` is trainwatch doing its job and passes through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainwatch.errors import TrainingHealthError


class Guard:
    def __init__(self, on_error: Callable[[str, BaseException], None]) -> None:
        self.on_error = on_error
        self.disabled: set[str] = set()

    def run(self, component: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or None once ``component`` has failed."""
        if component in self.disabled:
            return None
        try:
            return fn(*args)
        except TrainingHealthError:
            raise
        except Exception as exc:
            self.fail(component, exc)
            return None

    def fail(self, component: str, exc: BaseException) -> None:
        """``component`` failed: switch it off and report it."""
        self.disabled.add(component)
        self.on_error(component, exc)
