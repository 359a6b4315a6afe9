"""What every re-run of a model's forward stands under, so that training never sees it.

trainwatch runs a module's forward again on its own (``stalled_training``'s
first batch, a module's random draws looked at in eval mode). Such a re-run
changes nothing of training: the modules' state it writes is put back
(``UndoneEffects``: the generators the model holds or its call is given
among it), the user's forward and backward hooks are held off for it (its
forward pre-hooks, which feed the call, run: ``rerun_hooks``), buffers are
swapped for copies, torch's, Python's and numpy's global generators are
forked (the CUDA ones of ``devices`` too), gradients are off, trainwatch's
collectors see no pass of it (``quiet.replay``) and compiled code runs
eagerly. A NaN replay and an op trace stand under the same pieces.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from trainwatch.collect import quiet
from trainwatch.collect.op_trace import swapped_buffers
from trainwatch.collect.rerun_effects import UndoneEffects
from trainwatch.compiled import eager
from trainwatch.rng import forked_rngs


@contextmanager
def rerun_guarded(
    module: nn.Module, subs: Sequence[nn.Module], devices: Sequence[int], effects: UndoneEffects
) -> Iterator[None]:
    """``module`` (whose modules are ``subs``) re-run inside: ``effects`` (made by the
    caller with the call's arguments, read after: ``lasting``) puts back what the
    forward writes and holds off the user's watching hooks."""
    with ExitStack() as stack:
        stack.enter_context(effects)
        stack.enter_context(swapped_buffers(module, subs))
        stack.enter_context(forked_rngs(devices=devices))
        stack.enter_context(torch.no_grad())
        stack.enter_context(quiet.replay())
        stack.enter_context(eager())
        yield
