"""Which layers have never been called in a forward pass since watching began.

A layer that is defined but never called (an unused pooler, a head kept for
another task) gets no gradient, exactly like a layer cut out of the graph by a
``.detach()``. The first is usually deliberate, the second a bug: telling them
apart keeps ``zero_gradient`` from crying wolf on the first. One global
pre-forward hook does it; it takes itself off as soon as every layer has been
seen, so a model whose layers all run pays for it during the first pass only.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle


class _SeenHook:
    """Global, not per module, so hooks never travel with a saved or copied model."""

    __slots__ = ("tracker",)

    def __init__(self, tracker: CallTracker) -> None:
        self.tracker = weakref.ref(tracker)

    def __call__(self, module: nn.Module, args: Any) -> None:
        tracker = self.tracker()
        if tracker is not None:
            tracker.seen(module)
        return None


class CallTracker:
    def __init__(self) -> None:
        self._waiting: dict[int, str] = {}  # id(module) -> qualified name
        self._keep: dict[int, nn.Module] = {}  # keeps the ids valid
        self._handle: RemovableHandle | None = None
        self._open = True

    def track(self, model: nn.Module, layers: Iterable[str]) -> None:
        """Wait for a first call of each named layer (pass only new ones after a rebuild)."""
        if not self._open:
            return
        wanted = set(layers)
        for name, module in model.named_modules():
            if name in wanted and id(module) not in self._waiting:
                self._waiting[id(module)] = name
                self._keep[id(module)] = module
        if self._waiting and self._handle is None:
            self._handle = register_module_forward_pre_hook(_SeenHook(self))

    def seen(self, module: nn.Module) -> None:
        name = self._waiting.pop(id(module), None)
        if name is None:
            return
        del self._keep[id(module)]
        if not self._waiting:
            self._unhook()

    def never_called(self) -> frozenset[str]:
        return frozenset(self._waiting.values())

    def _unhook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def detach(self) -> None:
        self._open = False
        self._unhook()
        self._waiting.clear()
        self._keep.clear()
