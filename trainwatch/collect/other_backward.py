"""Sees whether a backward pass cancels the gradients an earlier backward left on
parameters while another optimizer stepped: the generator's gradients in a GAN
whose discriminator loss uses the generator's output without ``.detach()``.

The loop resets both optimizers at the top of the iteration; the
discriminator's backward also writes gradients into the generator (torch would
refuse the generator's backward through the freed graph, so
``retain_graph=True`` went in, and the loop ran); the discriminator steps; the
generator's backward adds onto what was left; the generator steps with the sum.
The two losses pull the generator's output in opposite directions (a logistic
loss's gradient in the logit is sigmoid(x) for the label 0 and sigmoid(x) - 1
for 1, a Wasserstein critic's is the same term of opposite signs), so the sum
is a small fraction of either: the generator barely learns while every loss
still moves.

The same order of events is healthy elsewhere: a multi-task loop whose heads
each step after their own backward while the shared encoder steps last, an
actor-critic with a shared trunk and two optimizers, domain adaptation through a
gradient-reversal layer. Their later backward adds to the earlier one's
gradients; it does not cancel them. So the evidence is the figure: the norm of
the gradients the earlier backward left, taken as the later backward begins
(before it adds anything: one batched norm), against their norm at their own
optimizer's step. At most ``RATIO`` of it left, at ``CANCELLED`` of the last
``LOOKED`` steps looked at, is told.

Nothing of it runs on the usual step: the look starts where that order of
events may be under way (a later backward pass of a step, or gradients an
optimizer leaves alone as it steps while others hold gradients a backward left),
and stops for good once told, or once ``SETTLED_STEPS`` of the model's
optimizer steps in a row showed no cancellation.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

import torch

from trainwatch.collect.between_backwards import gradient_marks
from trainwatch.frame import Slot
from trainwatch.record import CancelledReport

_PARAM = attrgetter("param")
_PARAMS = itemgetter("params")

# At most this fraction of the earlier backward's gradient norm left at the step.
RATIO = 0.5
# Told when this many of the last LOOKED steps looked at were cancelled.
CANCELLED = 5
LOOKED = 6
# The model's optimizer steps in a row with no cancellation seen that settle the
# look: the loop is not cancelling, and the look stops for good.
SETTLED_STEPS = 20
# Figures kept waiting for their frame to land, at most (a frame never read,
# as a step dropped by a halt, is let go).
_WAITING = 8


class _Candidate(NamedTuple):
    """Gradients a backward left, still there when another optimizer stepped, which
    a later backward began to add onto."""

    # By parameter id: its gradient's (id, version) as that backward began, and its
    # place in ``norms``; a parameter leaves as its optimizer steps.
    marks: dict[int, tuple[int, int]]
    place: dict[int, int]
    norms: torch.Tensor  # each one's norm then, on the device
    others: tuple[str, ...]  # the optimizers that stepped in between


class _Figure(NamedTuple):
    """One step's figure, waiting for its frame: [norm before, norm at the step]."""

    index: int  # the model's optimizer that stepped
    step: int
    slot: Slot
    ids: list[int]
    others: tuple[str, ...]


def _ids_of(optimizer: Any) -> frozenset[int]:
    return frozenset(map(id, chain.from_iterable(map(_PARAMS, optimizer.param_groups))))


class OtherBackwardLook:
    """The backward passes reaching one model, and the optimizer steps between them,
    while a cancellation is looked for."""

    def __init__(self, states: dict[int, Any], optimizers: Sequence[Any]) -> None:
        self._states = states  # the tracker's, by parameter id (each with .param)
        self._optimizers = optimizers  # the model's own (the Monitor's live list)
        # What the latest backward left: each gradient's (id, version) by parameter id.
        self._end: dict[int, tuple[int, int]] | None = None
        # The optimizers that stepped since (a label, their parameters' ids).
        self._stepped: list[tuple[str, frozenset[int]]] = []
        self._candidate: _Candidate | None = None
        self._figures: list[_Figure] = []
        # Per optimizer of the model: its latest verdicts (step, cancelled), the latest last.
        self._verdicts: dict[int, list[tuple[int, bool]]] = {}
        self._known: dict[int, tuple[Any, int, frozenset[int]]] = {}
        self.quiet = 0  # the model's optimizer steps in a row with no cancellation seen
        self.told = False

    @property
    def settled(self) -> bool:
        """Told, or ``SETTLED_STEPS`` of the model's steps in a row showed no
        cancellation (the figure still on its way, the latest step's, goes unread)."""
        return self.told or self.quiet >= SETTLED_STEPS

    def _params(self) -> list[torch.Tensor]:
        return list(map(_PARAM, self._states.values()))

    # -- backward passes -----------------------------------------------------
    def ended(self) -> None:
        """A backward reaching the model ended: what it left."""
        self._end = gradient_marks(self._params())
        self._stepped = []

    def starts(self) -> None:
        """A backward reaching the model begins, before it adds anything: where some
        optimizer stepped since the previous one ended, the gradients that one left
        on parameters that optimizer does not hold, still untouched, are about to be
        added onto; their norms are taken now."""
        end, stepped = self._end, self._stepped
        self._end, self._stepped = None, []
        if not end or not stepped or self._candidate is not None:
            return
        used = frozenset().union(*(ids for _, ids in stepped))
        params = self._params()
        now = gradient_marks(params)
        waiting = [pid for pid, mark in end.items() if pid not in used and now.get(pid) == mark]
        if not waiting:
            return
        by_id = {id(p): p for p in params}
        grads = [by_id[pid].grad for pid in waiting]
        if any(type(g) is not torch.Tensor or g.layout != torch.strided for g in grads):
            return  # a shard or a sparse gradient: not looked at
        norms = _norms(grads)
        if norms is None:
            return
        held = set(waiting)
        others = tuple(dict.fromkeys(label for label, ids in stepped if ids.isdisjoint(held)))
        self._candidate = _Candidate(
            {pid: now[pid] for pid in waiting},
            {pid: i for i, pid in enumerate(waiting)},
            norms,
            others,
        )

    # -- optimizer steps -----------------------------------------------------
    def stepped(self, optimizer: Any) -> None:
        """Any optimizer of the process stepped: its parameters' gradients are used
        (a candidate's among them is judged already, at that step's gathering)."""
        ids = self._held_by(optimizer)
        self._stepped.append((self._label(optimizer), ids))
        candidate = self._candidate
        if candidate is not None:
            self._candidate = _drop(candidate, ids)

    def _held_by(self, optimizer: Any) -> frozenset[int]:
        known = self._known.get(id(optimizer))
        count = sum(map(len, map(_PARAMS, optimizer.param_groups)))
        if known is not None and known[0]() is optimizer and known[1] == count:
            return known[2]
        ids = _ids_of(optimizer)
        self._known[id(optimizer)] = (weakref.ref(optimizer), count, ids)
        return ids

    def _label(self, optimizer: Any) -> str:
        for index, own in enumerate(self._optimizers):
            if own is optimizer:
                return f"optimizer {index} ({type(optimizer).__name__})"
        return type(optimizer).__name__

    # -- the model's optimizer steps ------------------------------------------
    def take(
        self, index: int, params: Sequence[torch.Tensor], step: int, add: Callable[..., Slot]
    ) -> None:
        """Optimizer ``index`` of the model is about to step ``params``: the
        candidate's gradients among them that the later backward added onto get
        their figure, read back with the step (``add``: the step frame's)."""
        candidate = self._candidate
        picked: list[int] = []
        grads: list[torch.Tensor] = []
        ids: list[int] = []
        if candidate is not None:
            marks, place = candidate.marks, candidate.place
            for param in params:
                mark = marks.get(id(param))
                grad = param.grad
                if mark is None or grad is None or id(grad) != mark[0]:
                    continue  # not the candidate's, or reset since
                if grad._version != mark[1]:  # added onto since the later backward began
                    ids.append(id(param))
                    picked.append(place[id(param)])
                    grads.append(grad)
            self._candidate = _drop(candidate, frozenset(map(id, params)))
        now = _norms(grads) if grads else None
        if candidate is None or now is None:
            self.quiet += 1
            return
        norms = candidate.norms
        before = norms[torch.tensor(picked, device=norms.device)]
        figure = torch.stack(
            [torch.linalg.vector_norm(before), torch.linalg.vector_norm(now).to(norms.device)]
        )
        self._figures.append(_Figure(index, step, add(figure), ids, candidate.others))
        del self._figures[:-_WAITING]

    def judge(self) -> CancelledReport | None:
        """The figures whose frames have landed, judged; a report once ``CANCELLED``
        of an optimizer's last ``LOOKED`` were cancelled."""
        waiting: list[_Figure] = []
        found = None
        for figure in self._figures:
            if not figure.slot.frame.landed():
                waiting.append(figure)
                continue
            values = figure.slot.values()
            if len(values) != 2:
                continue
            before, at_step = values
            cancelled = before > 0.0 and at_step <= RATIO * before
            self.quiet = 0 if cancelled else self.quiet + 1
            latest = self._verdicts.setdefault(figure.index, [])
            latest.append((figure.step, cancelled))
            del latest[:-LOOKED]
            count = sum(c for _, c in latest)
            if found is None and not self.told and count >= CANCELLED:
                since = next(step for step, c in latest if c)
                found = CancelledReport(
                    figure.index,
                    since,
                    len(latest),
                    count,
                    before,
                    at_step,
                    figure.ids,
                    figure.others,
                )
                self.told = True
        self._figures = waiting
        return found


def _drop(candidate: _Candidate, ids: frozenset[int]) -> _Candidate | None:
    """The candidate without the parameters ``ids`` (None: nothing of it left)."""
    marks = candidate.marks
    if ids.isdisjoint(marks):
        return candidate
    for pid in ids.intersection(marks):
        del marks[pid]
    return candidate if marks else None


def _norms(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """Each gradient's L2 norm, fp32, as one device tensor (one batched kernel per
    device); None where they cannot be taken."""
    try:
        norms = torch._foreach_norm([g.detach() for g in grads], 2.0, dtype=torch.float32)
        device = norms[0].device
        return torch.stack([n.to(device) for n in norms])
    except (TypeError, RuntimeError):
        return None
