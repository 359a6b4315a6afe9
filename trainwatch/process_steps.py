"""The optimizer steps every watched model of this process has taken, on one clock.

A model never trained by backward here (an EMA copy, a momentum target) has
no steps of its own. Whether its no-grad passes come at every step of the
model that is trained (a target network: part of training) or only now and
then (an EMA copy evaluated every few hundred steps) is told on this clock,
and what such a model finds is dated by the step the training is in.
"""

from __future__ import annotations

from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook


class ProcessSteps:
    """Attributes written at every step (no call: it runs at every step)."""

    __slots__ = ("taken", "now", "backwards")

    def __init__(self) -> None:
        self.taken = 0  # steps taken by every monitor together
        self.now = 0  # the step count of the monitor that stepped last: the step in progress
        # Backward passes that reached some watched model (a critic accumulating
        # micro-batches between two samples of its generator, before its step).
        self.backwards = 0


PROCESS_STEPS = ProcessSteps()


class AnyOptimizerSteps:
    """Steps of every optimizer in the process, watched or not, counted while held.

    A generator sampled under ``no_grad`` once per critic step (WGAN-GP's five
    critic steps per generator step) runs no-grad passes with no training
    pass of its own between them, as a validation loop does; what tells them
    apart is that an optimizer stepped between two of them, even when only
    the generator is watched. One global step post-hook, installed while some
    monitor holds it: one call per optimizer step, none per module.
    """

    __slots__ = ("count", "_holders", "_handle")

    def __init__(self) -> None:
        self.count = 0
        self._holders = 0
        self._handle: Any = None

    def hold(self) -> None:
        self._holders += 1
        if self._handle is None:
            self._handle = register_optimizer_step_post_hook(_count_step)

    def release(self) -> None:
        self._holders = max(0, self._holders - 1)
        if not self._holders and self._handle is not None:
            self._handle.remove()
            self._handle = None


def _count_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    ANY_OPTIMIZER_STEPS.count += 1


ANY_OPTIMIZER_STEPS = AnyOptimizerSteps()
