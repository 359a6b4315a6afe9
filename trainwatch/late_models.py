"""Models first called late, in a ``no_grad`` or ``inference_mode`` block, for ``trainwatch run``.

The global forward hooks that find new models cost every module call in the
process, so they come off once every model found has settled. A model first
called after that is most often one that is only ever evaluated: an EMA copy
or a teacher validated every few hundred steps, under ``torch.no_grad()`` or
``torch.inference_mode()``. Left unfound, an EMA copy validated in training
mode (dropout on, batch norm updating its statistics on validation data)
goes unreported.

While a lookout is installed, entering either block turns the forward hooks
on for that block, at the 1st, 2nd, 4th, 8th... entry from the same place in
the script reached from the same call. A block entered at every step (an EMA
update, a DQN target) turns them on a logarithmic number of times over a run;
one entered for the first time at step 500 turns them on at once; one torch
enters itself (``clip_grad_norm_``'s own ``no_grad``) never. Between those
entries a block costs one wrapped ``__enter__`` and ``__exit__`` and a
dictionary lookup.

The call counts because an evaluation helper is shared: ``evaluate(m)`` with
its ``no_grad`` on one line, called for the model every epoch and for an SWA
or EMA copy from epoch 6 on. Counted by the block's line alone, the copy's
first evaluation was the 7th entry and went unseen; counted with the call
that led there, it is the first entry from ``evaluate(swa_model)``. (Models
passed through one call, ``for m in models: evaluate(m)``, share its 1st,
2nd, 4th... entries still.)

The same lookout, with a monitor as its watcher, finds the parts of a model
called on their own in such a block (``model.encode(x)`` in an evaluation):
:mod:`trainwatch.collect.lone_parts`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from typing import Any, Protocol

import torch
from torch.autograd import grad_mode

import trainwatch
from trainwatch.compiled import compiling

# Blocks entered by code of these are not the script's: torch's own (clip_grad_norm_'s,
# an optimizer's) and trainwatch's run no module of the script's.
_TORCH = os.path.dirname(torch.__file__) + os.sep
_OWN = os.path.dirname(trainwatch.__file__) + os.sep
# Frames that enter a block on behalf of their caller: the ``@torch.no_grad()``
# decorator, and ``contextlib``'s ``ExitStack.enter_context``.
_ON_BEHALF = frozenset({os.path.join(_TORCH, "utils", "_contextlib.py"), contextlib.__file__})
# The attribute a block that turned the hooks on carries until it ends.
_LOOKING = "_trainwatch_looking"
_BLOCKS = (grad_mode.no_grad, grad_mode.inference_mode)


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
    """Told of each ``no_grad`` and ``inference_mode`` block entered while installed.

    One pair of wrappers on the blocks' ``__enter__``/``__exit__`` serves every
    installed lookout (``trainwatch run``'s, and each monitor's look for parts
    of its model called on their own, see :mod:`trainwatch.collect.lone_parts`),
    so lookouts installed and removed in any order leave the blocks as they
    were once the last one is removed. A failure of its own goes to the
    watcher and takes the lookout off: the script's block runs on as if it had
    never been there. The watcher is held weakly, so a watcher dropped without
    closing is not kept alive by it.
    """

    def __init__(self, watcher: Watcher) -> None:
        self._watcher = weakref.ref(watcher)
        # Entries by site: the block's instruction and the call that led to it.
        self._entries: dict[tuple[int, int, int, int], int] = {}
        self._codes: list[tuple[Any, Any]] = []  # the code objects the ids stand for
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        self._installed = True
        _LOOKOUTS.append(weakref.ref(self, _forget))
        _wrap_blocks()

    def remove(self) -> None:
        if not self._installed:
            return
        self._installed = False
        _LOOKOUTS[:] = [ref for ref in _LOOKOUTS if ref() not in (self, None)]
        if not _LOOKOUTS:
            _unwrap_blocks()

    def entered(self, block: Any, script: Any) -> None:
        """``block`` was entered by the script, in the frame ``script``."""
        watcher = self._watcher()
        if watcher is None or not watcher.look_wanted():
            return
        # Counted per site: the block's place in the script and the call that led
        # there. A helper shared by every evaluation (``evaluate(model)``, then
        # ``evaluate(ema)`` from epoch 6 on) enters its block from one site per
        # model, so a model first met there late is met at its site's first entry.
        # Places are told by code objects' ids and instruction offsets: no hash of
        # a code object (a long script's is long) nor walk of its line table.
        code, caller = script.f_code, (script.f_back or script)
        site = id(code), script.f_lasti, id(caller.f_code), caller.f_lasti
        count = self._entries.get(site, 0) + 1
        self._entries[site] = count
        if count == 1:
            self._codes.append((code, caller.f_code))  # their ids stay theirs
        if count & (count - 1) == 0:  # the 1st, 2nd, 4th, 8th... entry from this site
            vars(block).setdefault(_LOOKING, []).append((self, watcher.look()))

    def left(self, token: Any) -> None:
        watcher = self._watcher()
        if watcher is not None:
            watcher.looked(token)

    def fail(self, exc: BaseException) -> None:
        self.remove()
        watcher = self._watcher()
        if watcher is not None:
            watcher.lookout_failed(exc)


# The lookouts installed, in the order installed (held weakly: one dropped
# without being removed is skipped).
_LOOKOUTS: list[weakref.ref[NoGradLookout]] = []
# Per block class: its own __enter__ and __exit__, and the wrappers put in their place.
_ORIGINALS: list[tuple[type, Any, Any, Any, Any]] = []


def _forget(ref: weakref.ref[NoGradLookout]) -> None:
    """A lookout collected without being removed: the blocks go back once none is left."""
    if ref in _LOOKOUTS:
        _LOOKOUTS.remove(ref)
        if not _LOOKOUTS:
            _unwrap_blocks()


def _wrap_blocks() -> None:
    if _ORIGINALS:
        return
    for block in _BLOCKS:
        enter, leave = block.__enter__, block.__exit__
        ours_enter, ours_exit = _wrapped(enter, leave)
        _ORIGINALS.append((block, enter, leave, ours_enter, ours_exit))
        block.__enter__ = ours_enter  # type: ignore[method-assign]
        block.__exit__ = ours_exit  # type: ignore[method-assign]


def _unwrap_blocks() -> None:
    for block, enter, leave, ours_enter, ours_exit in _ORIGINALS:
        # Put back only what is still ours (another wrapper may sit on top).
        if block.__dict__.get("__enter__") is ours_enter:
            block.__enter__ = enter  # type: ignore[method-assign]
        if block.__dict__.get("__exit__") is ours_exit:
            block.__exit__ = leave  # type: ignore[method-assign]
    _ORIGINALS.clear()


def _wrapped(enter: Any, leave: Any) -> tuple[Any, Any]:
    def __enter__(block: Any) -> Any:
        result = enter(block)
        if _LOOKOUTS and not compiling():
            # The script's frame that entered it (written out: torch's own blocks,
            # several a step, cost no call of ours).
            script = sys._getframe(1)
            name = script.f_code.co_filename
            while name in _ON_BEHALF and script.f_back is not None:
                script = script.f_back  # who called the decorated function, or the ExitStack
                name = script.f_code.co_filename
            if name.startswith(_TORCH) or name.startswith(_OWN):
                return result  # torch's own block (clip_grad_norm_'s), or trainwatch's
            for ref in tuple(_LOOKOUTS):
                lookout = ref()
                if lookout is None:
                    continue
                try:
                    lookout.entered(block, script)
                except Exception as exc:  # never break the script's block
                    lookout.fail(exc)
        return result

    def __exit__(block: Any, *exc_info: Any) -> Any:
        looking = None if compiling() else vars(block).pop(_LOOKING, None)
        if looking is not None:
            for lookout, token in looking:
                try:
                    lookout.left(token)
                except Exception as exc:
                    lookout.fail(exc)
        return leave(block, *exc_info)

    return __enter__, __exit__
