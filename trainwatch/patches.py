"""A class's method replaced while ``trainwatch run`` lasts, and put back after.

The run sees what no hook of PyTorch's reports by wrapping a method of a
class every instance goes through: ``DataLoader.__iter__`` (which loader
feeds training), ``Optimizer.__init__`` (a model built after the others
settled), ``BaseProcess.start`` (ranks the script spawns). At the run's end
the method is put back, unless something replaced ours since: theirs stays,
as whatever it wraps would otherwise be lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class MethodPatch:
    """``cls.name`` replaced by ``wrap(original)`` until :meth:`remove`."""

    __slots__ = ("_cls", "_name", "original", "_ours")

    def __init__(self, cls: type, name: str, wrap: Callable[[Any], Any]) -> None:
        self._cls: type | None = cls
        self._name = name
        self.original = getattr(cls, name)
        self._ours = wrap(self.original)
        setattr(cls, name, self._ours)

    def remove(self) -> None:
        cls, self._cls = self._cls, None
        if cls is not None and cls.__dict__.get(self._name) is self._ours:
            setattr(cls, self._name, self.original)
