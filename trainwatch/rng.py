"""Every random generator training draws from, forked around trainwatch's re-runs.

A replay, an op trace or a stalled-training re-run calls the model's forward
once more. torch's generators are forked for it (``torch.random.fork_rng``),
but a forward may also draw from Python's ``random`` (teacher forcing written
as ``random.random() < ratio``, a stochastic depth coin) or from numpy's
global generator: a re-run would move those too, and the training that
follows would no longer be the one the script runs without trainwatch.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


@contextmanager
def forked_rngs(devices: Sequence[int] = ()) -> Iterator[None]:
    """torch's CPU generator and those of ``devices`` (CUDA), Python's ``random``
    and numpy's global generator (when numpy is loaded) are put back on exit."""
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=list(devices)):
            yield
    finally:
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)
