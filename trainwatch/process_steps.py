"""The optimizer steps every watched model of this process has taken, on one clock.

A model never trained by backward here (an EMA copy, a momentum target) has
no steps of its own. Whether its no-grad passes come at every step of the
model that is trained (a target network: part of training) or only now and
then (an EMA copy evaluated every few hundred steps) is told on this clock,
and what such a model finds is dated by the step the training is in.

The NaN/Inf origins any monitor of the process has reported are kept here
too: a model whose weights the training code copies from another (an EMA
copy, a target network) takes that model's NaN/Inf through the copy, which
its own monitor alone would take for a second origin.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class OriginTold:
    """A NaN/Inf origin one monitor reported: what another model's knock-on names."""

    rule: str
    model: str | None  # the reporting monitor's model (its `trainwatch run` name)
    module: str | None
    step: int  # that monitor's step
    # Whoever told it (its dispatcher): a monitor dropped unclosed takes its origins along.
    teller: weakref.ref[Any] = field(compare=False, repr=False)


class OriginsTold:
    """The NaN/Inf origins reported in this process while some monitor is open.

    Written only when an origin is first reported and read only when a
    NaN/Inf is found: nothing at a healthy step. Cleared when the last open
    monitor closes, so a new run in the same process starts with none.
    """

    __slots__ = ("told", "settle")

    def __init__(self) -> None:
        self.told: list[OriginTold] = []
        # Reads back every open monitor's step still in flight (set by the monitor
        # module): under lagged readback an origin found at the latest step is
        # told only at the next one, after the copy made from it was judged.
        self.settle: Callable[[], None] | None = None

    def tell(self, origin: OriginTold) -> None:
        self.told.append(origin)

    def first(self) -> OriginTold | None:
        """The earliest origin whose teller is still alive (the one the rest follow),
        once the steps in flight are read back."""
        if self.settle is not None:
            self.settle()
        return next((origin for origin in self.told if origin.teller() is not None), None)

    def clear(self) -> None:
        self.told.clear()


ORIGINS_TOLD = OriginsTold()


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
