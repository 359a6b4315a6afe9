"""The optimizer steps every watched model of this process has taken, on one clock.

A model never trained by backward here (an EMA copy, a momentum target) has
no steps of its own. Whether its no-grad passes come at every step of the
model that is trained (a target network: part of training) or only now and
then (an EMA copy evaluated every few hundred steps) is told on this clock,
and what such a model finds is dated by the step the training is in.
"""

from __future__ import annotations


class ProcessSteps:
    """Attributes written at every step (no call: it runs at every step)."""

    __slots__ = ("taken", "now")

    def __init__(self) -> None:
        self.taken = 0  # steps taken by every monitor together
        self.now = 0  # the step count of the monitor that stepped last: the step in progress


PROCESS_STEPS = ProcessSteps()
