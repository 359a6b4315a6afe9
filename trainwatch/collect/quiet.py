"""Marks trainwatch's own re-runs of a model, so no collector takes them for training.

A NaN replay or an op trace runs the user's modules again (without gradients,
in whatever mode they are in): the mode, activation and broadcast checks, and
``trainwatch run``'s model discovery, must not see those passes, and the user
sees no warning from them (``user_warnings.muted``): a re-run under ``no_grad``
of a reentrant checkpoint would warn that no input requires grad, the very
sign of a real pitfall.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from trainwatch.user_warnings import muted

state = threading.local()
# Re-runs in progress in any thread: read directly on hot paths (``quiet.anywhere``,
# one attribute load), and only when it is not zero is this thread's own depth asked.
anywhere = 0


def replaying() -> bool:
    return anywhere > 0 and getattr(state, "depth", 0) > 0


@contextmanager
def replay() -> Iterator[None]:
    global anywhere
    anywhere += 1
    state.depth = getattr(state, "depth", 0) + 1
    try:
        with muted():
            yield
    finally:
        state.depth -= 1
        anywhere -= 1
