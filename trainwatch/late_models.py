"""Models first called late, in a ``no_grad`` or ``inference_mode`` block, for ``trainwatch run``.

The global forward hooks that find new models cost every module call in the
process, so they come off once every model found has settled. A model first
called after that is most often one that is only ever evaluated: an EMA copy
or a teacher validated every few hundred steps, under ``torch.no_grad()`` or
``torch.inference_mode()``. Left unfound, an EMA copy validated in training
mode (dropout on, batch norm updating its statistics on validation data)
goes unreported.

While a lookout is installed, entering either block turns the forward hooks
on for that block, at the 1st, 2nd, 4th, 8th... entry from the same line of
the script. A block entered at every step (an EMA update, a DQN target,
``clip_grad_norm_``'s own ``no_grad``) turns them on a logarithmic number of
times over a run; one entered for the first time at step 500 turns them on
at once. Between those entries a block costs one wrapped ``__enter__`` and
``__exit__`` and a dictionary lookup.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any, Protocol

import torch
from torch.autograd import grad_mode

import trainwatch
from trainwatch.compiled import compiling

# Frames of these are not the script's: the line that counts is the first one outside.
_TORCH = os.path.dirname(torch.__file__) + os.sep
_OWN = os.path.dirname(trainwatch.__file__) + os.sep
# The attribute a block that turned the hooks on carries until it ends.
_LOOKING = "_trainwatch_looking"
_BLOCKS = (grad_mode.no_grad, grad_mode.inference_mode)


def _script_line(frame: Any) -> tuple[Any, int] | None:
    """Where the block was entered: the first frame outside torch (None: trainwatch's own)."""
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
        frame = frame.f_back
    if frame is None or frame.f_code.co_filename.startswith(_OWN):
        return None
    return frame.f_code, frame.f_lineno


class Watcher(Protocol):
    """What the lookout asks of the one who watches the script (held weakly)."""

    def look_wanted(self) -> bool:
        """Whether a look is worth it now: the forward hooks are off, a model is watched."""

    def look(self) -> Any:
        """Turn the forward hooks on; what is returned comes back to :meth:`looked`."""

    def looked(self, token: Any) -> None:
        """The looking block ended."""

    def lookout_failed(self, exc: BaseException) -> None:
        """The lookout failed (it has come off): report it."""


class NoGradLookout:
    """Wraps ``no_grad`` and ``inference_mode``'s ``__enter__``/``__exit__`` while installed.

    A failure of its own goes to the watcher and takes the lookout off: the
    script's block runs on as if it had never been there. The watcher is held
    weakly, so a watcher dropped without closing is not kept alive by it.
    """

    def __init__(self, watcher: Watcher) -> None:
        self._watcher = weakref.ref(watcher)
        self._entries: dict[tuple[Any, int], int] = {}
        self._originals: list[tuple[type, Any, Any, Any, Any]] = []

    def install(self) -> None:
        if self._originals:
            return
        me = weakref.ref(self)
        for block in _BLOCKS:
            enter, leave = block.__enter__, block.__exit__
            ours_enter, ours_exit = _wrapped(enter, leave, me)
            self._originals.append((block, enter, leave, ours_enter, ours_exit))
            block.__enter__ = ours_enter  # type: ignore[method-assign]
            block.__exit__ = ours_exit  # type: ignore[method-assign]

    def remove(self) -> None:
        for block, enter, leave, ours_enter, ours_exit in self._originals:
            # Put back only what is still ours (another wrapper may sit on top).
            if block.__dict__.get("__enter__") is ours_enter:
                block.__enter__ = enter  # type: ignore[method-assign]
            if block.__dict__.get("__exit__") is ours_exit:
                block.__exit__ = leave  # type: ignore[method-assign]
        self._originals.clear()

    def entered(self, block: Any) -> None:
        watcher = self._watcher()
        if watcher is None or not watcher.look_wanted():
            return
        line = _script_line(sys._getframe(2))
        if line is None:
            return
        count = self._entries.get(line, 0) + 1
        self._entries[line] = count
        if count & (count - 1) == 0:  # the 1st, 2nd, 4th, 8th... entry from this line
            vars(block)[_LOOKING] = watcher.look()

    def left(self, block: Any) -> None:
        looking = vars(block)
        if _LOOKING in looking:
            token = looking.pop(_LOOKING)
            watcher = self._watcher()
            if watcher is not None:
                watcher.looked(token)

    def fail(self, exc: BaseException) -> None:
        self.remove()
        watcher = self._watcher()
        if watcher is not None:
            watcher.lookout_failed(exc)


def _wrapped(enter: Any, leave: Any, lookout: weakref.ref[NoGradLookout]) -> tuple[Any, Any]:
    def __enter__(block: Any) -> Any:
        result = enter(block)
        watcher = lookout()
        if watcher is not None and not compiling():
            try:
                watcher.entered(block)
            except Exception as exc:  # never break the script's block
                watcher.fail(exc)
        return result

    def __exit__(block: Any, *exc_info: Any) -> Any:
        watcher = lookout()
        if watcher is not None and not compiling():
            try:
                watcher.left(block)
            except Exception as exc:
                watcher.fail(exc)
        return leave(block, *exc_info)

    return __enter__, __exit__
