"""The note that names the module an exception escaped from.

A shape mismatch's message names two shapes but not the layer
(``mat1 and mat2 shapes cannot be multiplied (32x768 and 512x256)``). The
traceback already holds the answer: every module call leaves a frame of
``nn.Module._call_impl`` (or of the module's ``forward``) whose ``self`` is
the module and whose locals are its arguments. Reading them after the
exception costs a healthy step nothing. The answer is added as a PEP 678
note, printed under the traceback; the exception's type, message and
traceback stay what they were.

An error raised inside backward has no module frames: autograd's nodes keep
no link to the module that made them unless anomaly mode recorded the
forward's stack, so such errors get no note.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from types import FrameType, TracebackType
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainwatch.compiled import user_name
from trainwatch.ddp_sync import reducer_names
from trainwatch.errors import TrainingHealthError
from trainwatch.graph_reuse_note import NOTE_PREFIX as GRAPH_NOTE_PREFIX
from trainwatch.graph_reuse_note import graph_reuse_note

NOTE_PREFIX = "trainwatch: raised in "
_CALL_IMPL = nn.Module._call_impl.__code__
_MAX_REPR = 200  # characters of the module's repr kept on the note's line
_MAX_ITEMS = 8  # arguments (and items of a list argument) described
# DDP's error for parameters its reducer waited for in vain lists their indices.
_DDP_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")


def already_noted(exc: BaseException) -> bool:
    """True once some monitor has named the module (several ways in may see one error)."""
    return _has_note(exc, NOTE_PREFIX)


def _has_note(exc: BaseException, prefix: str) -> bool:
    return any(
        isinstance(note, str) and note.startswith(prefix) for note in getattr(exc, "__notes__", ())
    )


def note_raise(exc: BaseException, roots: Iterable[nn.Module]) -> str | None:
    """Add the note naming the innermost module of ``roots`` that was running; return it.

    Names are qualified as in the root's ``named_modules()``. Nothing is
    added when no module of ``roots`` was running (an error in the loss, in
    backward, in the data loader) or when a note was added already, except
    for backward through a freed graph, whose note says what usually carries
    a graph across steps (:mod:`trainwatch.graph_reuse_note`).
    """
    if not isinstance(exc, Exception) or isinstance(exc, TrainingHealthError):
        return None  # Ctrl-C, SystemExit, and trainwatch's own halt name no module
    if already_noted(exc):
        return None
    roots = list(roots)
    names: dict[int, str] = {}
    for root in roots:
        for name, module in root.named_modules():
            names.setdefault(id(module), user_name(name))
    found = innermost_call(exc.__traceback__, names)
    if found is None:
        # Raised in backward (no module frame): a graph freed by an earlier
        # backward is the one error whose cause the message itself gives away.
        reuse = graph_reuse_note(exc, roots)
        if reuse is not None and not _has_note(exc, GRAPH_NOTE_PREFIX):
            _add_note(exc, reuse)
        return reuse
    module, frame = found
    note = (
        f"{NOTE_PREFIX}{_display_name(names[id(module)])} = {one_line_repr(module)}, "
        f"called with {describe_call(frame)}"
    )
    _add_note(exc, note)
    if isinstance(module, DistributedDataParallel):
        named = _ddp_indices_named(exc, module, names[id(module)])
        if named is not None:
            _add_note(exc, named)
    return note


def _ddp_indices_named(exc: BaseException, ddp: DistributedDataParallel, where: str) -> str | None:
    """DDP's parameter indices as names, where its reducer's order can be known."""
    found = _DDP_INDICES.search(str(exc))
    if found is None:
        return None
    ordered = reducer_names(ddp)
    indices = [int(index) for index in found.group(2).split()]
    if ordered is None or not indices or max(indices) >= len(ordered):
        return None
    prefix = f"{where}.module." if where else "module."
    shown = ", ".join(prefix + ordered[index] for index in indices[:_MAX_ITEMS])
    more = f" and {len(indices) - _MAX_ITEMS} more" if len(indices) > _MAX_ITEMS else ""
    return (
        f"trainwatch: DDP's parameter indices {found.group(2).strip()} (rank {found.group(1)}) "
        f"are {shown}{more}"
    )


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10: PEP 678's attribute, which the runner prints itself
        exc.__notes__ = [*getattr(exc, "__notes__", ()), note]  # type: ignore[attr-defined]


def innermost_call(
    tb: TracebackType | None, names: dict[int, str]
) -> tuple[nn.Module, FrameType] | None:
    """The innermost module of ``names`` whose call is on ``tb``, and the frame holding its inputs.

    The frame is the module's ``_call_impl`` (its ``args`` and ``kwargs`` are
    the call's, whatever ``forward`` later rebinds), or its ``forward`` when
    that was called directly. Frames of other methods (a LightningModule's
    ``backward``) are not calls of the module.
    """
    found: tuple[nn.Module, FrameType] | None = None
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        if code is _CALL_IMPL or code.co_name == "forward":
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in names:
                # A forward frame beneath its own module's _call_impl frame
                # adds nothing: the call's frame holds the inputs as given.
                beneath_its_call = (
                    code is not _CALL_IMPL
                    and found is not None
                    and found[0] is owner
                    and found[1].f_code is _CALL_IMPL
                )
                if not beneath_its_call:
                    found = (owner, frame)
        tb = tb.tb_next
    return found


def one_line_repr(module: nn.Module) -> str:
    """``repr(module)`` on one line, cut short for containers."""
    text = " ".join(repr(module).split()).replace("( ", "(").replace(" )", ")")
    return text if len(text) <= _MAX_REPR else text[: _MAX_REPR - 1] + "…"


def describe_call(frame: FrameType) -> str:
    """The call's arguments: tensors as shape and dtype (``(32, 768) float32``)."""
    local = frame.f_locals
    if frame.f_code is _CALL_IMPL:
        args: Sequence[Any] = local.get("args", ())
        kwargs: dict[str, Any] = local.get("kwargs", {}) or {}
    else:
        args, kwargs = _forward_arguments(frame)
    parts = [describe_value(value) for value in list(args)[:_MAX_ITEMS]]
    parts += [f"{key}={describe_value(value)}" for key, value in list(kwargs.items())[:_MAX_ITEMS]]
    return ", ".join(parts) if parts else "no arguments"


def _forward_arguments(frame: FrameType) -> tuple[list[Any], dict[str, Any]]:
    code, local = frame.f_code, frame.f_locals
    count = code.co_argcount + code.co_kwonlyargcount
    names = [name for name in code.co_varnames[:count] if name != "self"]
    args = [local[name] for name in names[: code.co_argcount - 1] if name in local]
    kwargs = {name: local[name] for name in names[code.co_argcount - 1 :] if name in local}
    extra = count
    if code.co_flags & 0x04:  # *args
        args.extend(local.get(code.co_varnames[extra], ()))
        extra += 1
    if code.co_flags & 0x08:  # **kwargs
        kwargs.update(local.get(code.co_varnames[extra], {}))
    return args, kwargs


def describe_value(value: Any) -> str:
    """Tensors as shape, dtype and (off the CPU) device; containers of them item by item."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        where = "" if value.device.type == "cpu" else f" on {value.device}"
        return f"{tuple(value.shape)} {dtype}{where}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe_value(item) for item in value[:_MAX_ITEMS])
        more = ", …" if len(value) > _MAX_ITEMS else ""
        return f"[{inner}{more}]" if isinstance(value, list) else f"({inner}{more})"
    if isinstance(value, dict):  # a batch passed as one mapping
        items = list(value.items())
        inner = ", ".join(f"{key}: {describe_value(item)}" for key, item in items[:_MAX_ITEMS])
        return "{" + inner + (", …" if len(items) > _MAX_ITEMS else "") + "}"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    return type(value).__name__


def _display_name(name: str) -> str:
    return name if name else "the model itself"
