"""An optimizer that holds the model but never steps, while training goes on elsewhere.

A domain-adversarial or GAN loop with two models and two optimizers that
forgets one ``opt.step()`` trains one model and not the other: the forgotten
one's gradients pile up at every backward and its weights never move. Its
monitor counts its steps from that optimizer's step hooks, which never run,
so no rule ever judged it. Seen from the model's own passes instead: a model
whose optimizer has not stepped once while the process took
:data:`PATIENCE` optimizer steps of other models, and whose parameters hold
gradients, is reported once (``not_optimized``).

It listens to the passes only until the model's first step: a model that
trains pays nothing for it from then on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from trainwatch.process_steps import PROCESS_STEPS

# Optimizer steps of other models in this process before a model whose own
# optimizer never stepped is told (a GAN's critic steps 5 times per generator
# step: its generator still steps within a few).
PATIENCE = 20
# Steps since one of a model's optimizers last stepped, while another steps, from
# which parameters only it holds that still get gradients are never updated (long
# enough for phases that alternate every few tens of steps).
STOPPED_STEPPING = 100


class IdleOptimizer:
    """Watches one model's passes for an optimizer that never steps."""

    def __init__(
        self,
        model: nn.Module,
        optimizers: list[Any],
        steps_taken: Callable[[], int],
        found: Callable[[int, list[nn.Parameter]], None],
        backward_reached: Callable[[], bool] = lambda: False,
    ) -> None:
        self._model = model
        # Whether some backward has reached the model since watching began (its
        # optimizer never stepped, so nothing cleared it since).
        self._backward_reached = backward_reached
        self._optimizers = optimizers  # the monitor's own list
        self._steps_taken = steps_taken
        self._found = found
        self._since = PROCESS_STEPS.taken
        self.done = False

    def pass_starts(self, module: nn.Module) -> None:
        if (
            self.done
            or not self._optimizers
            or PROCESS_STEPS.taken - self._since < PATIENCE
            or self._steps_taken()
        ):
            return
        trainable = [p for p in self._model.parameters() if p.requires_grad]
        held = [p for p in trainable if p.grad is not None]
        if not held:
            if not self._backward_reached():
                self._since = PROCESS_STEPS.taken  # no backward reaches it (yet): wait again
                return
            # Reset before this pass (zero_grad() first, as the tutorials order
            # it): backward reached it all the same, its gradients are only gone.
            held = trainable
        self.done = True
        self._found(PROCESS_STEPS.taken - self._since, held)

    def pass_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        return None

    def detach(self) -> None:
        self.done = True
