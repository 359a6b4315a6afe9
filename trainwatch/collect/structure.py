"""Notices when any module or parameter is (re)assigned after watching starts.

A head replaced after ``tw.watch`` must still be named and checked. PyTorch's
global registration hooks fire on every such assignment; each open monitor
polls a shared counter once per step, so this costs nothing while the model
stays the same.
"""

from __future__ import annotations

from typing import Any

from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils.hooks import RemovableHandle

_generation = 0
_users = 0
_handles: list[RemovableHandle] = []


def _bump(*_: Any) -> None:
    global _generation
    _generation += 1


def generation() -> int:
    """A count that moves whenever a module or parameter is assigned while a monitor is open."""
    return _generation


class StructureWatch:
    def __init__(self) -> None:
        global _users
        if _users == 0:
            _handles.append(register_module_module_registration_hook(_bump))
            _handles.append(register_module_parameter_registration_hook(_bump))
        _users += 1
        self._seen = _generation
        self._open = True

    def changed(self) -> bool:
        if self._seen == _generation:
            return False
        self._seen = _generation
        return True

    def detach(self) -> None:
        global _users
        if not self._open:
            return
        self._open = False
        _users -= 1
        if _users == 0:
            for handle in _handles:
                handle.remove()
            _handles.clear()
