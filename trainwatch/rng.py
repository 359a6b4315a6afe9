"""Every random generator training draws from, forked around trainwatch's re-runs.

A replay, an op trace or a stalled-training re-run calls the model's forward
once more. torch's generators are forked for it (``torch.random.fork_rng``),
but a forward may also draw from Python's ``random`` (teacher forcing written
as ``random.random() < ratio``, a stochastic depth coin) or from numpy's
global generator: a re-run would move those too, and the training that
follows would no longer be the one the script runs without trainwatch.

A model may also hold generators of its own: a VAE drawing its noise with
``torch.randn(..., generator=self.gen)`` for reproducible sampling, a
``np.random.default_rng`` masking features, a ``random.Random`` coin, a
``torch.Generator`` handed to ``forward(x, generator=g)``. Those are the
model's state: the re-run puts them back with the rest of it
(:class:`~trainwatch.collect.rerun_effects.UndoneEffects` finds them and
saves their states here, :func:`generator_states`), only when a re-run
happens.

A NaN replay must draw what the pass it replays drew: a NaN that hangs on a
draw (every token of a text dropped by the model's own token dropout) is
found again only then. The CPU generator's state is read as each pass
begins (a tensor); for a model holding generators of its own, their states
are read with it (:class:`DrawsAtStart`), and :func:`drawing_as_at` sets
both back for the replay and puts the model's generators back after it.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from copy import deepcopy
from typing import Any

import torch


@contextmanager
def forked_rngs(devices: Sequence[int] = ()) -> Iterator[None]:
    """torch's CPU generator and those of ``devices`` (CUDA), Python's ``random``
    and numpy's global generator (when numpy is loaded) are put back on exit."""
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=list(devices)):
            yield
    finally:
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


def generator_kinds() -> tuple[type, ...]:
    """The kinds of random generator a model may hold: torch's, Python's
    ``random.Random`` and, when numpy is loaded, numpy's ``Generator``,
    ``RandomState`` and bit generators."""
    kinds: list[type] = [torch.Generator, random.Random]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kinds += [numpy.random.Generator, numpy.random.RandomState, numpy.random.BitGenerator]
    return tuple(kinds)


def generators_in(values: Iterable[Any], kinds: tuple[type, ...]) -> list[Any]:
    """The generators of ``kinds`` among ``values`` and in the lists, tuples, sets
    and dicts among them (one level: a call's arguments)."""
    found = []
    for value in values:
        if isinstance(value, kinds):
            found.append(value)
        elif type(value) in (list, tuple, set, frozenset, dict):
            items = value.values() if type(value) is dict else value
            found += (item for item in items if isinstance(item, kinds))
    return found


def generator_states(generators: list[Any]) -> list[Any]:
    """Each generator's state now (None where it has none to read:
    ``random.SystemRandom``)."""
    return [_state(generator) for generator in generators]


def put_generator_states(generators: list[Any], states: list[Any]) -> None:
    """Each generator back in the state :func:`generator_states` read."""
    for generator, state in zip(generators, states):
        if state is None:
            continue
        try:
            if isinstance(generator, torch.Generator):
                generator.set_state(state)
            elif isinstance(generator, random.Random):
                generator.setstate(state)
            elif hasattr(generator, "bit_generator"):  # numpy's Generator
                generator.bit_generator.state = state
            elif hasattr(generator, "set_state"):  # numpy's RandomState
                generator.set_state(state)
            else:  # a numpy bit generator
                generator.state = state
        except Exception:
            continue


class DrawsAtStart:
    """The CPU generator's state as a pass began (``cpu``), and the states then of
    the generators the model holds (``generators``, ``states``)."""

    __slots__ = ("cpu", "generators", "states")

    def __init__(self, cpu: torch.Tensor, generators: list[Any]) -> None:
        self.cpu = cpu
        self.generators = generators
        self.states = generator_states(generators)


# What a replay is handed as a pass's draws: the CPU generator's state alone (a
# model holding no generator), or with those of the model's own (None: unknown).
PassDraws = torch.Tensor | DrawsAtStart | None


def draws_now(generators: list[Any]) -> torch.Tensor | DrawsAtStart:
    """The CPU generator's state now, with those of ``generators`` where there are any."""
    cpu = torch.default_generator.get_state()
    return DrawsAtStart(cpu, generators) if generators else cpu


@contextmanager
def drawing_as_at(draws: PassDraws) -> Iterator[None]:
    """Inside, torch's CPU generator and the model's own draw from where ``draws``
    read them: a re-run draws what its pass drew. The CPU generator is the
    caller's to fork (``forked_rngs``); the model's are put back on exit as they
    were on entry, so training goes on from where the pass left them."""
    if draws is None:
        yield
        return
    if isinstance(draws, torch.Tensor):
        torch.default_generator.set_state(draws)
        yield
        return
    now = generator_states(draws.generators)
    try:
        torch.default_generator.set_state(draws.cpu)
        put_generator_states(draws.generators, draws.states)
        yield
    finally:
        put_generator_states(draws.generators, now)


def generator_as_now(generator: Any) -> Any:
    """A new generator in ``generator``'s state now (``generator`` itself where it
    cannot be copied): what a call handed it draws from, kept for a re-run."""
    try:
        if isinstance(generator, torch.Generator):
            copy = torch.Generator(device=generator.device)
            copy.set_state(generator.get_state())
            return copy
        return deepcopy(generator)
    except Exception:
        return generator


def _state(generator: Any) -> Any:
    try:
        if isinstance(generator, torch.Generator):
            return generator.get_state()
        if isinstance(generator, random.Random):
            return generator.getstate()
        if hasattr(generator, "bit_generator"):
            return generator.bit_generator.state
        if hasattr(generator, "get_state"):
            return generator.get_state()
        return generator.state
    except Exception:
        return None
