"""Whether a library's code is further up the stack: what runs a call decides
how it is read (a trainer's loop, ``torch.distributions``). Asked only on rare
paths (a model's first call, an audited step), never per step."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def called_from(parts: tuple[str, ...], depth: int = 64) -> bool:
    """Whether a frame among the ``depth`` above the caller runs a file whose path
    holds one of ``parts`` (``"/lightning/pytorch/"``, ``"/torch/distributions/"``)."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        name = frame.f_code.co_filename.replace("\\", "/")
        if any(part in name for part in parts):
            return True
        frame = frame.f_back
    return False


# Where the training code's own frames are not: trainwatch, torch and the
# training libraries that call into it.
_LIBRARY_PARTS = ("/trainwatch/", "/torch/", "/lightning/", "/pytorch_lightning/", "/transformers/")


def _caller_frames(depth: int) -> list:
    """The training code's frames, innermost first: those outside trainwatch, torch
    and the training libraries, among the ``depth`` above the caller's caller."""
    frames = []
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            break
        name = frame.f_code.co_filename.replace("\\", "/")
        if not any(part in name for part in _LIBRARY_PARTS):
            frames.append(frame)
        frame = frame.f_back
    return frames


def values_in_caller(kind: type, depth: int = 64) -> list[tuple[str, Any]]:
    """The values of type ``kind`` the training code's frames hold, each once, with
    the first name found for it (innermost frames first). Asked only as an alert
    is built."""
    found: dict[int, tuple[str, Any]] = {}
    for frame in _caller_frames(depth):
        for key, value in list(frame.f_locals.items()):
            if isinstance(value, kind) and id(value) not in found and key.isidentifier():
                found[id(value)] = (key, value)
    return list(found.values())


def names_in_caller(
    objects: list[object], unwrap: Callable[[Any], Any] | None = None, depth: int = 64
) -> dict[int, str]:
    """The names the training code's frames give ``objects`` (by id), looked up in the
    innermost frames outside trainwatch, torch and the training libraries, the
    first name found kept: ``decoder``, ``decoder_optimizer``; a value ``unwrap``
    turns into one of them names it too (Lightning's ``opt_g`` for the optimizer it
    wraps). Asked only as an alert is built."""
    wanted = {id(obj): obj for obj in objects}
    found: dict[int, str] = {}
    for frame in _caller_frames(depth):
        if len(found) == len(wanted):
            break
        for key, value in list(frame.f_locals.items()):
            if unwrap is not None and id(value) not in wanted:
                value = unwrap(value)
            if wanted.get(id(value)) is value and id(value) not in found and key.isidentifier():
                found[id(value)] = key
    return found
