"""Leaving a torch function mode that trainwatch entered, without popping anyone else's.

``TorchFunctionMode.__exit__`` pops whatever mode is on top of the stack. A
mode entered after ours (the user's, another collector's, another monitor's:
a GAN's generator and discriminator each audit their loss) may still be there
when ours should end. Ours then waits, marked as wanting out, and leaves as
soon as every mode above it has: whichever of trainwatch's modes leaves next
takes those marked below it along. Without that, a mode under another one of
trainwatch's stayed on the stack for good once its monitor had closed, and
every later op in the process passed through it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from trainwatch.fast_paths import mode_entered, mode_left

# Modes of trainwatch's asked to leave while another mode sat above them, and
# those of them taken along since (their owners learn it at their next ask).
_WANTS_OUT: list[Any] = []
_TAKEN: weakref.WeakSet[Any] = weakref.WeakSet()  # a closed owner never asks again
# Those of ours that follow a loss to the step boundary (the broadcast audit's, the
# class-target look's), while they are on the stack: a step boundary finds them
# here without a call, and takes them off before its own reads, which a mode
# would otherwise see (every gradient read is a tensor attribute's).
LOSS_MODES: list[Any] = []


def _top() -> Any:
    depth = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(depth - 1) if depth else None


def _take(modes: list[Any], mode: Any) -> bool:
    """Remove ``mode`` from ``modes`` (by identity); whether it was there."""
    for i, held in enumerate(modes):
        if held is mode:
            del modes[i]
            return True
    return False


def enter_loss_mode(mode: Any) -> None:
    """Push ``mode``, one that follows a loss until the step boundary takes it off."""
    enter(mode)
    LOSS_MODES.append(mode)


def enter(mode: Any) -> None:
    """Push ``mode``, one of trainwatch's (its layers keep their fast paths: see fast_paths)."""
    mode.__enter__()
    mode_entered(mode)


def leave(mode: Any) -> bool:
    """Pop ``mode`` if it is on top; else mark it to leave once it is. Whether it is off.

    A mode is never taken for off because it is missing from the stack: inside
    a mode's own handler torch pops it for the while, and puts it back after.
    """
    if mode in _TAKEN:
        _TAKEN.discard(mode)
        return True  # taken along by a mode of ours above it
    if _top() is not mode:
        if not any(waiting is mode for waiting in _WANTS_OUT):
            _WANTS_OUT.append(mode)
        return False
    mode.__exit__(None, None, None)
    mode_left(mode)
    _take(_WANTS_OUT, mode)
    _take(LOSS_MODES, mode)
    # Those of ours that wanted out and are on top now leave too.
    while _WANTS_OUT:
        top = _top()
        if top is None or not _take(_WANTS_OUT, top):
            break
        top.__exit__(None, None, None)
        mode_left(top)
        _take(LOSS_MODES, top)
        _TAKEN.add(top)
    return True
