"""Gradients backward made that the loop took away before the step.

Self-supervised recipes keep a layer out of the first updates by dropping its
gradient between ``backward()`` and ``optimizer.step()``: SwAV sets the
prototypes' ``p.grad = None`` for its first iterations, DINO its last layer's
for the first epoch (``cancel_gradients_last_layer``). Backward reached that
layer at every step; the loop dropped what it made. That is no cut (a
``.detach()``), no branch run on some steps and no dead layer, and the layer
trains once the drop ends.

What the step's latest backward left (``GradResetTracker.left``: per parameter,
its gradient tensor's id and version as that backward ended) tells it: a
parameter it left a gradient on whose gradient is ``None`` now, or was written
in place or replaced since and is exactly zero, was dropped by the loop, while
the optimizer's other parameters kept theirs (every one dropped so is
``zero_grad()`` between backward and the step, a reset told apart first).
The tracker notes that on certain steps only: the first, a step after one that
left a gradient ``None`` (every step of a drop to ``None`` in a plain loop, but
the first of one begun mid-run), and, through ``LeavingsNotes``, the first few
steps and a few steps after each time ``zero_gradient`` finds a parameter
without a gradient or with an exactly zero one not yet told, or one dropped
(a drop by zeroing; a drop inside Lightning's closure, whose arm at each
backward's end leaves no gradient ``None`` to arm). A healthy step pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat
from operator import and_, attrgetter, is_, is_not, ne

import torch

from trainwatch.collect.accumulation import GradResetTracker
from trainwatch.collect.backward_end_listener import BackwardEndListener

_GRAD = attrgetter("grad")


def dropped_to_none(
    params: Sequence[torch.Tensor], left: dict[int, tuple[int, int]]
) -> list[torch.Tensor]:
    """Of an optimizer's ``params``, the trainable ones the latest backward left a
    gradient on (``left``) whose gradient is ``None`` now; C loops, then a look
    at those without one."""
    nones = compress(params, map(is_, map(_GRAD, params), repeat(None)))
    return [p for p in nones if p.requires_grad and id(p) in left]


def rewritten_since(
    params: Sequence[torch.Tensor], left: dict[int, tuple[int, int]]
) -> list[torch.Tensor]:
    """Of ``params``, those the latest backward left a gradient on whose gradient
    was set to None, replaced or written in place since; C loops."""
    grads = list(map(_GRAD, params))
    before = list(map(left.get, map(id, params)))
    now = zip(map(id, grads), map(getattr, grads, repeat("_version"), repeat(-1)))
    noted = map(is_not, before, repeat(None))
    return list(compress(params, map(and_, noted, map(ne, before, now))))


class LeavingsNotes(BackwardEndListener):
    """Has the tracker note what each backward leaves, where it would not (the usual
    step), over the first steps and while ``zero_gradient`` asks: a parameter
    without a gradient (``None``) or with an exactly zero one, not yet told, or
    one found dropped. Each request covers the next optimizer steps of the
    process; with none since, the listener goes at the last one's boundary, and
    the usual step pays nothing again."""

    def __init__(self, tracker: GradResetTracker) -> None:
        super().__init__(tracker)
        self.request()  # the first steps are noted unasked

    def step_gathered(self) -> None:
        """A step boundary read what this noted: after the last step a request covers,
        the listener goes now, so that the next backward queues no call at its end."""
        if self.past_request():
            self.stop()
