"""The optimizer steps every watched model of this process has taken, on one clock.

A model never trained by backward here (an EMA copy, a momentum target) has
no steps of its own. Whether its no-grad passes come at every step of the
model that is trained (a target network: part of training) or only now and
then (an EMA copy evaluated every few hundred steps) is told on this clock.
"""

from __future__ import annotations


class ProcessSteps:
    """A counter bumped as an attribute (no call: it runs at every step)."""

    __slots__ = ("taken",)

    def __init__(self) -> None:
        self.taken = 0


PROCESS_STEPS = ProcessSteps()
