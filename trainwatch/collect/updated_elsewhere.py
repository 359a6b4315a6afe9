"""Parameters of the model that an optimizer the monitor was not given trains.

A GAN often lives in one container (``nn.ModuleDict({"G": G, "D": D})``, a
LightningModule-like module holding ``self.G`` and ``self.D``) with one
optimizer per half, and the loop builds and steps both. Watched as
``tw.watch(model, opt_g)``, the discriminator's parameters get gradients
(the generator's loss runs through it) while no watched optimizer holds
them: taken for parameters left out of every optimizer, they would be told
as never updated, though ``opt_d`` updates them every iteration.

So where such parameters are first met (the boundary ``not_optimized``
would judge them at, never on the healthy step), the live optimizers are
scanned once for one the monitor does not watch that holds them. Those no
such optimizer holds are told at once, as before. Those one holds wait for
their verdict, looked at at each later boundary where the branch that meets
them runs (they hold gradients), with two kinds of evidence between one
boundary and the next:

- their weights moved (each one's float64 sum, as
  :mod:`trainwatch.collect.frozen_moves` compares them): an update came;
- their weights did not move, yet a backward wrote their gradients: a
  gradient went by that no update used.

A boundary with neither says nothing: the watched optimizer steps more often
than theirs (a WGAN's critic watched, five of its steps to one of the
generator's), and the generator's gradients wait for its step. At
:data:`MOVES` updates they are trained by that optimizer: one console note
says so, and they are never told. At :data:`UNUSED` unused gradients and no
update (``opt_d.step()`` forgotten, an optimizer built and dropped), they are
told as never updated, dated at the step they were first met. Two updates,
not one: a WGAN's clamp after a forgotten step moves a critic's weights once
(its first clamp), and so does a checkpoint loaded mid-run; after one update
the unused gradients told by are :data:`UNUSED_AFTER_MOVE` (an optimizer
stepped every second iteration leaves one unused gradient between its steps).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim import Optimizer

from trainwatch.collect.frozen_moves import weight_sums
from trainwatch.live_optimizers import optimizers_holding

# Boundaries whose weights moved since the previous one before the parameters are
# taken for trained by an optimizer the monitor was not given.
MOVES = 2
# Boundaries with gradients written since the previous one and weights unmoved
# before they are told as never updated, where no update was seen ...
UNUSED = 2
# ... and where one was.
UNUSED_AFTER_MOVE = 6

# A gradient as a look found it: the tensor (held weakly) and its write counter.
_Grad = tuple["weakref.ref[torch.Tensor] | None", int]


def _grads(params: Sequence[torch.Tensor]) -> list[_Grad]:
    return [(None, 0) if p.grad is None else (weakref.ref(p.grad), p.grad._version) for p in params]


def _written(then: list[_Grad], params: Sequence[torch.Tensor]) -> bool:
    """Whether a backward wrote some gradient of ``params`` since ``then`` (a new
    tensor, after a reset to None, or the same one written in place)."""
    for (ref, version), param in zip(then, params):
        grad = param.grad
        if grad is not None and (ref is None or ref() is not grad or grad._version != version):
            return True
    return False


def _same(before: float, now: float) -> bool:
    """Equal sums, a NaN equal to a NaN (a weight left alone reads so)."""
    return before == now or (before != before and now != now)


@dataclass
class _Pending:
    """Parameters an unwatched optimizer holds, their verdict waiting."""

    since: int  # the step they were first met at
    params: list[nn.Parameter]
    optimizers: list[str]  # the classes of the unwatched optimizers holding them
    sums: list[float]
    grads: list[_Grad]
    moves: int = 0
    unused: int = 0

    def look(self) -> None:
        """Compares with the previous look, and becomes the reference."""
        sums = weight_sums(self.params)
        if any(not _same(a, b) for a, b in zip(self.sums, sums)):
            self.moves += 1
        elif _written(self.grads, self.params):
            self.unused += 1
        self.sums, self.grads = sums, _grads(self.params)

    def told(self) -> bool:
        return self.unused >= (UNUSED_AFTER_MOVE if self.moves else UNUSED)


@dataclass(frozen=True)
class Verdict:
    """Parameters decided at one boundary: told as never updated (``due``, first
    met at ``since``), or trained by an optimizer not given (``trained``, with the
    classes of the optimizers holding them)."""

    due: list[nn.Parameter]
    since: int
    trained: list[nn.Parameter]
    optimizers: list[str]


class UpdatedElsewhere:
    """Holds back the parameters an optimizer the monitor was not given may train."""

    def __init__(self) -> None:
        self._known: set[int] = set()  # ids met: decided or waiting
        self._elsewhere: set[int] = set()  # ids trained by an optimizer not given
        self._pending: list[_Pending] = []
        self.verdicts: list[Verdict] = []  # decided at the latest boundary

    def held_back(
        self,
        step: int,
        params: Sequence[nn.Parameter],
        watched: Sequence[Optimizer],
        resting: Sequence[nn.Parameter] = (),
    ) -> list[nn.Parameter]:
        """Of ``params`` (no watched optimizer holds them, they got gradients at
        ``step``), those to tell now; the verdicts that fell at this boundary are
        left in :attr:`verdicts`. ``resting``: parameters no watched optimizer holds
        that are frozen at this boundary and hold a gradient (a discriminator frozen
        for the generator's step): those an unwatched optimizer holds wait for their
        verdict too; none is told here."""
        self.verdicts = []
        if self._pending:
            self._look()
        known = self._known
        fresh = [p for p in params if id(p) not in known]
        if fresh:
            self._meet(step, fresh, watched)
        fresh = [p for p in resting if id(p) not in known]
        if fresh:
            self._meet(step, fresh, watched)
        if not self._elsewhere and not self._pending:
            return list(params)
        waiting = {id(p) for pending in self._pending for p in pending.params}
        return [p for p in params if id(p) not in self._elsewhere and id(p) not in waiting]

    def _meet(self, step: int, fresh: list[nn.Parameter], watched: Sequence[Optimizer]) -> None:
        """First met: held back where some unwatched optimizer holds them."""
        self._known.update(map(id, fresh))
        holders = _unwatched_holders(fresh, watched)
        held = [p for p in fresh if id(p) in holders]
        if held:
            classes = list(dict.fromkeys(name for p in held for name in holders[id(p)]))
            self._pending.append(_Pending(step, held, classes, weight_sums(held), _grads(held)))

    def _look(self) -> None:
        """Each waiting set compared with the previous boundary; those decided leave."""
        still: list[_Pending] = []
        for pending in self._pending:
            pending.look()
            if pending.moves >= MOVES:
                self._elsewhere.update(map(id, pending.params))
                self.verdicts.append(Verdict([], pending.since, pending.params, pending.optimizers))
            elif pending.told():
                self.verdicts.append(Verdict(pending.params, pending.since, [], []))
            else:
                still.append(pending)
        self._pending = still


def _unwatched_holders(
    params: Sequence[torch.Tensor], watched: Sequence[Optimizer]
) -> dict[int, list[str]]:
    """Per id of ``params``, the classes of the live optimizers not in ``watched``
    that hold it (one scan of live objects: made where a finding is due only)."""
    found = optimizers_holding(params, watched)
    return {key: [type(opt).__name__ for opt in opts] for key, opts in found.items()}
