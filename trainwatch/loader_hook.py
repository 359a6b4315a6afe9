"""A new pass over a ``DataLoader``, told to the open monitors that want it.

A loop that switches to another loader at a phase boundary (a curriculum's
second data phase, a fine-tuning set with a collate of its own) gives batches
of another make from that pass's first batch on, and nothing in the model
shows it. ``loss_on_padding`` looks at the labels of that batch (see
:meth:`trainwatch.monitor.Monitor.data_restarted`). While such a monitor is
open, ``DataLoader.__iter__`` is wrapped (once for all monitors): each pass
started with gradients on tells every such monitor whose model is in training
mode (a validation loader runs under ``no_grad`` or in eval mode). A loop pays
one Python call a pass over its data, never one a step. The wrapper comes off
when the last of those monitors closes, unless something wrapped the method
since (``trainwatch run``, which wraps it for the training loader's order, puts
its own back at its end).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.data import DataLoader

_users: weakref.WeakSet[Any] = weakref.WeakSet()
_wrapped: Any = None  # DataLoader.__iter__ as it was when the wrapper went on


def _iter(loader: DataLoader, *args: Any, **kwargs: Any) -> Any:
    if torch.is_grad_enabled():
        for monitor in list(_users):
            try:
                monitor.loader_started()
            except Exception:  # the monitor reports its own failures; the data goes on
                pass
    return _wrapped(loader, *args, **kwargs)


def install(monitor: Any) -> None:
    """Tell ``monitor`` (its ``loader_started()``) of each pass started while it is open.
    The wrapper goes on once: where another wraps it since, ours stays beneath theirs."""
    global _wrapped
    _users.add(monitor)
    if _wrapped is None:
        _wrapped = DataLoader.__iter__
        DataLoader.__iter__ = _iter  # type: ignore[method-assign]


def release(monitor: Any) -> None:
    """``monitor`` closed: the wrapper comes off once no monitor wants it."""
    global _wrapped
    _users.discard(monitor)
    if not _users and installed():
        DataLoader.__iter__ = _wrapped  # type: ignore[method-assign]
        _wrapped = None


def installed() -> bool:
    return DataLoader.__dict__.get("__iter__") is _iter
