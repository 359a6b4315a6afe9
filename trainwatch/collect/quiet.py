"""Marks trainwatch's own re-runs of a model, so no collector takes them for training.

A NaN replay or an op trace runs the user's modules again (without gradients,
in whatever mode they are in): the mode, activation and broadcast checks, and
``trainwatch run``'s model discovery, must not see those passes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

# Read directly on hot paths (``getattr(state, "depth", 0)``), to spare a call.
state = threading.local()


def replaying() -> bool:
    return getattr(state, "depth", 0) > 0


@contextmanager
def replay() -> Iterator[None]:
    state.depth = getattr(state, "depth", 0) + 1
    try:
        yield
    finally:
        state.depth -= 1
