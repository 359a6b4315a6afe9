"""Parameters two of the model's optimizers hold, both stepping them on one gradient.

A seq2seq loop that builds ``decoder_optimizer = Adam(encoder.parameters())``
(a copy-paste of the line above it) leaves the decoder in no optimizer and
the encoder in two: each backward's gradient then updates the encoder twice,
with two learning rates and two sets of moments, and nothing fails. The
setup table shows it (the optimizer column says ``0, 1``), no step does.

Two optimizers holding the same parameters is not wrong in itself: a
learning-rate finder's throwaway optimizer, an optimizer rebuilt each epoch
beside the old one still alive, Adam then L-BFGS over the same weights, a
module shared by a GAN's two halves whose losses alternate, each with its own
backward. What is wrong is the second update of one gradient. So the
parameters held by more than one optimizer are found when the membership is
read (at attach, when a param group changes: never on a healthy step), and
only then are the steps of those optimizers looked at, for a few steps: a
parameter one optimizer stepped, stepped by another while its gradient is
still the one the first used (the same tensor, written by no backward since),
is stepped twice. An optimizer stepped inside another one's ``step()`` (a
wrapper that trainwatch does not know, stepping the optimizer it wraps) is
one update, not two.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

from trainwatch.optimizer_wrappers import inner_optimizer
from trainwatch.process_steps import PROCESS_STEPS
from trainwatch.record import SteppedTwice

# Steps of the optimizers holding shared parameters looked at before a setup
# found no double update is let be: a loop that steps one gradient twice does
# so from its first iteration (a later change of the membership looks again).
LOOKED_STEPS = 20

# The frames torch runs an optimizer's step() in (its hooks' wrapper, the
# no-grad decorator), named by their code.
_STEP_FRAMES = frozenset({"wrapper", "_use_grad", "step"})


@dataclass(frozen=True)
class _Stepped:
    """What an optimizer's step left on one parameter: who stepped it, on which
    gradient (held weakly), that gradient's write counter then, and the backward
    passes the process had seen then."""

    optimizer: int
    grad: weakref.ref[torch.Tensor]
    version: int
    backwards: int


def shared_parameters(optimizers: list[Optimizer], ours: set[int]) -> dict[int, list[torch.Tensor]]:
    """Per optimizer index, the parameters of the model (``ours``: their ids) that it
    holds and some other optimizer holds too; empty where none is held twice."""
    holders: dict[int, list[int]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for index, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for param in group["params"]:
                key = id(param)
                if key not in ours:
                    continue
                held = holders.setdefault(key, [])
                if index not in held:
                    held.append(index)
                    tensors[key] = param
    shared: dict[int, list[torch.Tensor]] = {}
    for key, indices in holders.items():
        if len(indices) > 1:
            for index in indices:
                shared.setdefault(index, []).append(tensors[key])
    return shared


class DoubleSteps:
    """The steps of optimizers that share parameters, looked at for a gradient
    stepped twice; made only where some parameter is held twice."""

    def __init__(
        self,
        optimizers: list[Optimizer],
        shared: dict[int, list[torch.Tensor]],
        counts_backwards: bool,
    ) -> None:
        self._optimizers = optimizers
        self._shared = shared
        # Whether backward passes through the model are counted (the stale-gradient
        # tracker is on): a gradient scaled in place since (a GradScaler unscaling
        # it for each optimizer) is still the one no backward wrote.
        self._counts_backwards = counts_backwards
        self._stepped: dict[int, _Stepped] = {}
        self._looked = 0
        self.done = False

    def stepped(self, index: int | None) -> tuple[SteppedTwice, list[torch.Tensor]] | None:
        """Optimizer ``index`` just stepped: the two optimizers and the parameters
        they both stepped on one gradient, once, when found; ``done`` once found or
        looked at long enough."""
        own = self._shared.get(index) if index is not None else None
        if not own or self.done:
            return None
        self._looked += 1
        if self._looked >= LOOKED_STEPS:
            self.done = True
        optimizer = self._optimizers[index]
        if _inside_another_step(optimizer):
            return None  # a wrapper's inner optimizer: the wrapper's step is the update
        backwards = PROCESS_STEPS.backwards
        seen = self._stepped
        twice: dict[int, list[torch.Tensor]] = {}
        for param in own:
            grad = param.grad
            if grad is None:
                continue
            before = seen.get(id(param))
            if (
                before is not None
                and before.optimizer != index
                and before.grad() is grad
                and (
                    before.version == grad._version
                    or (self._counts_backwards and before.backwards == backwards)
                )
            ):
                twice.setdefault(before.optimizer, []).append(param)
            seen[id(param)] = _Stepped(index, weakref.ref(grad), grad._version, backwards)
        if not twice:
            return None
        self.done = True
        first, params = next(iter(twice.items()))
        found = SteppedTwice(
            first,
            type(self._optimizers[first]).__name__,
            index,
            type(optimizer).__name__,
            _holds(self._optimizers[first]),
            _holds(optimizer),
        )
        return found, params


def _holds(optimizer: Optimizer) -> int:
    return sum(len(group["params"]) for group in optimizer.param_groups)


def _inside_another_step(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` stepped inside another optimizer's ``step()``: one
    that is not a wrapper trainwatch knows around it (Lightning's own steps it
    from inside its ``step``)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in _STEP_FRAMES:
            owner = frame.f_locals.get("self")
            if (
                isinstance(owner, Optimizer)
                and owner is not optimizer
                and inner_optimizer(owner) is not optimizer
            ):
                return True
        frame = frame.f_back  # type: ignore[assignment]
    return False
