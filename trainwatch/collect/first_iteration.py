"""Whether the steps of optimizers a loop never gave ``tw.watch`` show a second iteration.

``tw.watch(model)`` without an optimizer expects ``monitor.step()`` after each
update; an optimizer stepping the model in a loop that calls none is watched
as if passed (trainwatch/optimizer_not_given.py). Its second step is not
always the loop's second iteration: a WGAN's critic steps five times before
the generator's first step, and a loop calling ``monitor.step()`` once per
iteration calls it after that. Taken at the critic's second step for a loop
that marks no steps, such a loop would lose its own marks (each optimizer's
step a step) to a console line saying ``monitor.step()`` is not called.

So a repeated step of an optimizer over the model, no ``monitor.step()``
having come, is the second iteration only where the steps show one:

- another optimizer followed stepped since this one's latest step (over
  the model, or over the model of another monitor looking for its
  optimizers: ``tw.watch(G)`` beside ``tw.watch(D)``): the loop went round
  (the critic after the generator's step, a DCGAN's ``opt_d`` after
  ``opt_g``'s);
- gradients this optimizer does not apply (the other parameters of those
  models) were reset and written anew since its latest step, no optimizer
  holding them having stepped: the next iteration's backward came (a
  discriminator whose ``opt_d.step()`` is forgotten has its gradients
  thrown away at each ``zero_grad()``, frozen for the generator's step or
  not); these parameters are :attr:`FirstIteration.lost`;
- it is the only optimizer seen, and no other live optimizer holds a
  trainable parameter of those models: no other optimizer's first step is
  to come (the usual loop: at its second step);
- :data:`STEPS_WITHOUT_MARK` steps of the model's optimizers went by.

A ``monitor.step()`` coming first says the loop marks its own steps. Each
step seen notes the gradients the optimizer holds and those beside it (weak
references, a Python loop over those models' parameters): paid only while
the look lasts, until the loop is known to mark its steps or not.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

from trainwatch.live_optimizers import optimizers_holding

# Steps of the model's optimizers with no monitor.step() after which the loop is
# taken to mark none, where nothing above told: more than the longest critic
# warm-up in use (the original WGAN's 100 critic steps per generator step over
# its first generator iterations).
STEPS_WITHOUT_MARK = 128

# A gradient as a step found it (weakly, with its write counter; None: none).
Grad = tuple["weakref.ref[torch.Tensor]", int] | None


def gradients_now(params: Sequence[torch.Tensor]) -> list[Grad]:
    """Each parameter's gradient as it is now (weakly) with its write counter."""
    return [None if p.grad is None else (weakref.ref(p.grad), p.grad._version) for p in params]


@dataclass(frozen=True)
class SeenStep:
    """An optimizer's latest step seen, unwatched."""

    place: int  # among the model's steps seen (0: the first)
    tick: int  # among the steps followed (the model's, and other waiting models')
    params: list[torch.Tensor]  # the model's parameters it holds
    grads: list[Grad]  # each one's gradient then
    beside: list[torch.Tensor]  # the parameters it does not hold, of the models followed
    beside_grads: list[Grad]


class FirstIteration:
    """The steps seen while it is not known whether the loop marks its own."""

    def __init__(self) -> None:
        self.steps: weakref.WeakKeyDictionary[Optimizer, SeenStep] = weakref.WeakKeyDictionary()
        # The latest tick of each optimizer followed (a counter over the steps seen).
        self._ticks: weakref.WeakKeyDictionary[Optimizer, int] = weakref.WeakKeyDictionary()
        self._tick = 0
        # Parameters found reset and written anew at the step that told a second
        # iteration (their optimizer, if any, never stepped).
        self.lost: list[torch.Tensor] = []
        # Whether some live optimizer besides the one seen holds a trainable parameter
        # beside it (None: not asked yet; asked once, one scan of live objects).
        self._others_wait: bool | None = None

    def other_stepped(self, optimizer: Optimizer) -> None:
        """An optimizer over another model followed took a step."""
        self._tick += 1
        self._ticks[optimizer] = self._tick

    def seen(
        self,
        optimizer: Optimizer,
        place: int,
        params: list[torch.Tensor],
        beside: list[torch.Tensor],
    ) -> None:
        """``optimizer`` takes its step ``place``, unwatched."""
        self._tick += 1
        self._ticks[optimizer] = self._tick
        self.steps[optimizer] = SeenStep(
            place, self._tick, params, gradients_now(params), beside, gradients_now(beside)
        )

    def second(self, optimizer: Optimizer, steps_seen: int) -> bool:
        """``optimizer``, seen before, steps again with no ``monitor.step()`` since the
        look began: whether the steps show a second iteration (``steps_seen``: the
        model's steps seen so far)."""
        latest = self.steps[optimizer]
        if any(tick > latest.tick for opt, tick in self._ticks.items() if opt is not optimizer):
            return True  # another one stepped since: the loop went round
        self.lost = _lost(latest.beside, latest.beside_grads)
        if self.lost:
            return True
        if len(self.steps) == 1 and not self._others_waiting(optimizer, latest.beside):
            return True
        return steps_seen >= STEPS_WITHOUT_MARK

    def _others_waiting(self, optimizer: Optimizer, beside: list[torch.Tensor]) -> bool:
        if self._others_wait is None:
            trainable = [p for p in beside if p.requires_grad]
            held = holders(trainable, (optimizer,)) if trainable else {}
            self._others_wait = bool(held)
        return self._others_wait


def _lost(params: list[torch.Tensor], then: list[Grad]) -> list[torch.Tensor]:
    """Those of ``params`` whose gradient then is gone and a new one written since (a
    ``zero_grad()`` to None, then a backward)."""
    lost = []
    for param, grad in zip(params, then):
        now = param.grad
        if grad is not None and now is not None and grad[0]() is not now:
            lost.append(param)
    return lost


def holders(
    params: Iterable[torch.Tensor], excluded: Sequence[Optimizer] = ()
) -> dict[int, list[Optimizer]]:
    """Per id of ``params``, the live optimizers (but ``excluded``) holding it, a
    wrapper left out: one heap scan, made once per look, where a finding or a
    decision is due."""
    return optimizers_holding(params, excluded, wrappers=False)
