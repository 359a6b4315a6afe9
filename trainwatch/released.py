"""An optimizer the training script let go, at the place it had in a monitor.

A loop that builds a new optimizer every epoch or every round (active
learning, a learning rate set by hand per epoch) drops the old one; a
monitor that kept it would keep its whole state (Adam's two moments per
weight) for the rest of the run. Its place is kept instead, by this
stand-in holding nothing: the other optimizers' hooks and records know
them by their place.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from trainwatch.held import held_only_by


class ReleasedOptimizer:
    """Holds no parameter: no check finds anything of the model in it."""

    def __init__(self, name: str) -> None:
        self.name = name  # the class of the optimizer it stands for
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[Any, Any] = {}
        self.defaults: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"ReleasedOptimizer({self.name})"


def live(optimizers: list[Any]) -> list[Any]:
    """The optimizers still watched, in order."""
    return [opt for opt in optimizers if type(opt) is not ReleasedOptimizer]


def release_dropped(
    holder: object, optimizers: list[Any], stop: tuple[type, ...] = ()
) -> Iterator[int]:
    """Puts a :class:`ReleasedOptimizer` in the place of each of ``optimizers`` that only
    ``holder``'s own objects still hold (``stop``: as for ``held_only_by``), and yields
    that place as it goes, for the holder to forget what it kept of that optimizer
    before the next one is weighed."""
    for index in range(len(optimizers)):
        if type(optimizers[index]) is ReleasedOptimizer:
            continue
        # (No name of our own for it: every reference but the holder's is the script's.)
        if held_only_by(holder, [optimizers[index]], stop=stop):
            optimizers[index] = ReleasedOptimizer(type(optimizers[index]).__name__)
            yield index
