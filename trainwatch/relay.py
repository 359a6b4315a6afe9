"""Alerts from every rank, reported once: stamp the rank, carry them to rank zero.

Each rank runs its own Monitor whose only sink is a :class:`RelaySink`. The
relay stamps ``data["rank"]`` and hands the alert to this rank's
:class:`Reporter`. On rank zero the reporter owns the real sinks (console,
alerts.jsonl, TensorBoard); on the others it keeps an :class:`Outbox` that
:func:`gather_to_zero` empties into rank zero's reporter at points every rank
reaches together (never per step, so healthy training pays no collective).
No Lightning here: any launcher that runs ``torch.distributed`` can use it.
``tw.watch``, ``trainwatch run`` and the Hugging Face callback, which have no
such common points, deliver through the process group's store instead
(:mod:`trainwatch.store_relay`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from trainwatch.alert import Alert
from trainwatch.dispatch import Dispatcher
from trainwatch.followed_collectives import Followed
from trainwatch.setup_audit import SetupAudit
from trainwatch.sinks.base import Sink, StepNumbers, Summary
from trainwatch.sinks.memory import MemorySink


def stamp(alert: Alert, rank: int) -> Alert:
    if alert.data.get("rank") == rank:
        return alert
    return dataclasses.replace(alert, data={**alert.data, "rank": rank})


class Outbox(Sink):
    """Alerts a non-zero rank has not delivered yet, in the order they were raised."""

    name = "outbox"

    def __init__(self) -> None:
        self.pending: list[dict[str, Any]] = []

    def emit(self, alert: Alert) -> None:
        self.pending.append(alert.to_dict())

    def repeat(self, alert: Alert, count: int) -> None:
        self.pending.append(alert.to_dict())

    def take(self) -> list[dict[str, Any]]:
        taken, self.pending = self.pending, []
        return taken


class Reporter:
    """Where one rank's stamped alerts go; rank zero's also receives the others'."""

    def __init__(self, rank: int, sinks: Sequence[Sink] = ()) -> None:
        self.rank = rank
        self.memory = MemorySink()
        self.outbox = Outbox() if rank != 0 else None
        own = [self.memory, *sinks, *([self.outbox] if self.outbox is not None else [])]
        # Halting is the Monitor's job (it raises after the relay delivered).
        self.dispatcher = Dispatcher(own, halt_on=())
        self.closed = False
        self._steps = 0
        self._norms: dict[str, float] = {}
        # The monitor's closing note where it ran the model but watched no step
        # (``Summary.idle``), told with the summary; an adapter clears it where
        # no training was due (an evaluation run).
        self.idle: str | None = None

    def relay(self) -> RelaySink:
        return RelaySink(self)

    def publish(self, alerts: Sequence[Alert]) -> None:
        """One publish of the Monitor's, kept together (the console groups a flood)."""
        if not self.closed:
            self.dispatcher.publish([stamp(alert, self.rank) for alert in alerts], may_halt=False)

    def receive(self, records: Sequence[dict[str, Any]]) -> None:
        """Rank zero: alerts gathered from the other ranks (already stamped)."""
        if self.closed:
            return
        alerts = sorted((Alert.from_dict(r) for r in records), key=lambda a: a.step)
        if alerts:
            self.dispatcher.publish(alerts, may_halt=False)

    def monitor_closed(self, summary: Summary) -> None:
        self._steps, self._norms = summary.steps, dict(summary.latest_norms)
        self.idle = summary.idle

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        summary = self.dispatcher.summary(self._steps, self._norms)
        summary.idle = self.idle
        self.dispatcher.close(summary)


class RelaySink(Sink):
    """The Monitor's sink on every rank: forwards into the rank's Reporter."""

    name = "relay"

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter

    def emit(self, alert: Alert) -> None:
        self.reporter.publish([alert])

    def emit_many(self, alerts: Sequence[Alert]) -> None:
        self.reporter.publish(alerts)

    def repeat(self, alert: Alert, count: int) -> None:
        self.reporter.publish([alert])

    def on_step(self, numbers: StepNumbers) -> None:
        if not self.reporter.closed:
            self.reporter.dispatcher.numbers(numbers)

    def setup(self, audit: SetupAudit) -> None:
        if not self.reporter.closed and self.reporter.rank == 0:
            self.reporter.dispatcher.setup(audit)

    def close(self, summary: Summary) -> None:
        # The reporter outlives the monitor: a last gather may still bring
        # other ranks' alerts to rank zero before its sinks close.
        self.reporter.monitor_closed(summary)


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_to_zero(reporter: Reporter | None) -> None:
    """Collective: every rank must call it at the same point, whatever its state.

    One gather of the alerts raised since the last call; a rank
    whose trainwatch failed still takes part with an empty list, so a
    failure inside trainwatch can never leave the other ranks waiting.
    """
    rank, size = world()
    if size == 1:
        return
    outgoing: list[dict[str, Any]] = []
    try:
        if reporter is not None and reporter.outbox is not None:
            outgoing = reporter.outbox.take()
    except Exception:  # an empty contribution keeps the collective matched
        outgoing = []
    # An all-gather with tensors of our own, followed until gloo lets go of
    # them: the last gather comes at the end of a run, right before exit.
    followed = Followed()
    received = followed.all_gather_object(outgoing)
    followed.let_go()
    if rank == 0 and reporter is not None:
        for records in received[1:]:
            reporter.receive(records or [])
