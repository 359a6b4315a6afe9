"""Whether a library's code is further up the stack: what runs a call decides
how it is read (a trainer's loop, ``torch.distributions``). Asked only on rare
paths (a model's first call, an audited step), never per step."""

from __future__ import annotations

import sys


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
