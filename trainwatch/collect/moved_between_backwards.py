"""Sees gradients that moved the weights before the next backward pass added onto them.

SAM (sharpness-aware minimization, and ASAM, GSAM) takes two backward passes
per step: the first one's gradient ``g(w)`` moves every weight in place to
``w + e`` (``e`` made from it), and the second one, at ``w + e``, must find the
gradients reset: its ``g(w + e)`` is what the update applies. Without that
reset (``first_step()`` without ``zero_grad``) the update applies ``g(w) +
g(w + e)``. No optimizer step came between the two passes, so the usual look
(gradients a step used) cannot see that ``g(w)`` was used; what shows it is
that every weight whose gradient the first pass wrote moved since, that
gradient left as the pass left it.

Every weight, not some: adversarial training on the embedding alone (FGM, PGD
on ``word_embeddings``) moves one weight between two backward passes that add
up by design, and gradient accumulation moves none. A gradient reset in
between (SAM as written) is no such gradient, and a backward that writes none
of them (an inner ``torch.autograd.grad`` of first-order MAML adapting the
weights in place) adds nothing: both stay silent (the tracker checks the write).
Looked at on the first step after watching began, where SAM's first pass comes.

The same move tells when a missing ``zero_grad()`` after the step matters
although the gradients are reset before the next step: the step's first
backward added onto the gradients the previous step used, and that sum moved
the weights (SAM's perturbation made from it) before the reset. Looked at from
the end of such a backward to the next one's start.

A weight moved in place shows in its version counter. A write through
``.data`` (``p.data.add_(e)``, as many SAM implementations perturb) shows in
its values only: on the first step, each backward's end also takes the
weights' norms, accumulated in float64 (on the device; read back only where a
gradient was kept while some counter did not move).

Only backward passes the tracker already looks at one parameter at a time come
here: a few C loops over the parameters at such a backward's start and end.
The usual step, its gradients found reset as its backward begins, pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat
from operator import attrgetter, eq, is_not, ne
from typing import NamedTuple

import torch

from trainwatch.collect.tensors import local_part
from trainwatch.process_steps import ANY_OPTIMIZER_STEPS, PROCESS_STEPS

_GRAD = attrgetter("grad")
_VERSION = attrgetter("_version")
# The part of the gradients' squared norm that a weight left in place may hold (see
# _left_in_place): a perturbation made from so little rounds away in float32.
NEGLIGIBLE = 1e-6


def _marks(params: Sequence[torch.Tensor]) -> dict[int, tuple[int, int]]:
    """Each gradient held, by its parameter's id: the tensor's id and version."""
    grads = list(map(_GRAD, params))
    held = list(map(is_not, grads, repeat(None)))
    kept = list(compress(grads, held))
    return dict(zip(compress(map(id, params), held), zip(map(id, kept), map(_VERSION, kept))))


def _key() -> tuple[int, int]:
    """Moves at every optimizer step of the process (every watched one; any while
    some look holds the count)."""
    return ANY_OPTIMIZER_STEPS.count, PROCESS_STEPS.taken


def weight_norms(params: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Each weight's L2 norm accumulated in float64, on its device, not read (None
    where one cannot be taken: a weight not materialized yet).

    A norm, not a sum: SAM's move of a softmax output layer sums to zero (its
    gradient does, over the classes), and a sum would not see it.
    """
    try:
        with torch.no_grad():
            weights = [local_part(p.detach()) for p in params]
            try:
                return list(torch._foreach_norm(weights, 2, dtype=torch.float64))
            except (TypeError, RuntimeError):  # older torch, a layout foreach refuses
                return [torch.linalg.vector_norm(w, dtype=torch.float64) for w in weights]
    except (RuntimeError, TypeError, ValueError):
        return None


def read_flags(flags: list[torch.Tensor]) -> list[bool]:
    """Device booleans, read back at once."""
    return torch.stack([f.to(flags[0].device) for f in flags]).tolist()


def _left_in_place(
    params: dict[int, torch.Tensor],
    stayed: list[int],
    kept: list[int],
    norms: dict[int, torch.Tensor],
) -> bool:
    """Whether the weights that stayed while the others moved are ones a perturbation
    made from the gradients leaves in place: all zeros (ASAM scales it by the weight:
    a zero bias, the usual start, does not move), or holding under ``NEGLIGIBLE`` of
    the gradients' squared norm (a convolution's bias before batch norm, whose
    gradient is rounding noise: its move rounds away)."""
    zero = read_flags([norms[pid] == 0 for pid in stayed])
    rest = [pid for pid, all_zero in zip(stayed, zero) if not all_zero]
    if not rest:
        return True
    with torch.no_grad():
        grads = [local_part(params[pid].grad.detach()) for pid in kept]
        try:
            norms_now = torch._foreach_norm(grads, 2, dtype=torch.float64)
        except (TypeError, RuntimeError):  # older torch, sparse gradients
            return False
    squares = dict(zip(kept, (float(n) ** 2 for n in norms_now)))
    return sum(map(squares.__getitem__, rest)) <= NEGLIGIBLE * sum(squares.values())


class _Ended(NamedTuple):
    """What a backward left as it ended."""

    key: tuple[int, int]
    left: dict[int, tuple[int, int]]  # every gradient held: its tensor's id and version
    wrote: list[int]  # the parameters whose gradient it wrote (first step only)
    weights: list[int]  # every parameter's version
    norms: list[torch.Tensor] | None  # every weight's float64 norm (first step only)


class MovedSince(NamedTuple):
    """The weights moved since the previous backward ended, and its gradients left as
    it left them while every weight they belong to moved."""

    kept: list[int]  # empty: not so, or not the first step
    moved: frozenset[int]


NOTHING_MOVED = MovedSince([], frozenset())


class MovedBetweenBackwards:
    """The latest backward's gradients, and the weights, compared at the next start.

    The tracker hands it the backward passes of the first step after watching
    began (``first``: where SAM's first pass comes), and a backward that added
    onto used gradients with the next one's start (the weights' moves only).
    """

    __slots__ = ("_start", "noted", "first_taken")

    def __init__(self) -> None:
        self._start: dict[int, tuple[int, int]] | None = None  # gradients as a backward began
        self.noted: _Ended | None = None  # the latest backward handed here, until the next
        # PROCESS_STEPS.taken while no step boundary came since watching began.
        self.first_taken = PROCESS_STEPS.taken

    def starts(self, params: Sequence[torch.Tensor], first: bool) -> MovedSince:
        """A backward begins, no gradient of it accumulated yet: what moved since the
        previous one ended, with no optimizer step between."""
        marks = _marks(params) if first else None
        self._start = marks
        ended, self.noted = self.noted, None
        if ended is None or ended.key != _key():
            return NOTHING_MOVED
        ids = list(map(id, params))
        versions = list(map(_VERSION, params))
        if len(versions) != len(ended.weights):
            return NOTHING_MOVED  # parameters added since: not compared
        moved = set(compress(ids, map(ne, versions, ended.weights)))
        wrote = ended.wrote
        kept = []
        if marks is not None and wrote:
            kept = list(compress(wrote, map(eq, map(marks.get, wrote), map(ended.left.get, wrote))))
        now = None
        if kept and not moved.issuperset(kept) and ended.norms:
            # Written through .data, perhaps: the values tell (read once, first step).
            now = weight_norms(params)
            if now is not None and len(now) == len(ended.norms):
                moved.update(compress(ids, read_flags(list(map(torch.ne, now, ended.norms)))))
            else:
                now = None
        if not moved:
            return NOTHING_MOVED  # micro-batches of one step, losses of one graph
        stayed = [pid for pid in kept if pid not in moved]
        if stayed and (
            now is None
            or len(stayed) == len(kept)
            or not _left_in_place(dict(zip(ids, params)), stayed, kept, dict(zip(ids, now)))
        ):
            kept = []  # some weight stayed: not the whole model moved by its gradients
        return MovedSince(kept, frozenset(moved))

    def ended(
        self, params: Sequence[torch.Tensor], left: dict[int, tuple[int, int]], first: bool
    ) -> None:
        """A backward ended leaving ``left`` (the tracker's note of every gradient)."""
        start = self._start
        wrote = []
        if first and start is not None:
            wrote = list(compress(left, map(ne, left.values(), map(start.get, left))))
        norms = weight_norms(params) if wrote else None
        self.noted = _Ended(_key(), left, wrote, list(map(_VERSION, params)), norms)
