"""From rules to sinks: de-duplicate, fan out, and halt if asked to.

A sink that fails is switched off and the failure is reported through the
sinks that still work; the user's training is never interrupted by it.
"""

from __future__ import annotations

import dataclasses
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from trainwatch.alert import Alert
from trainwatch.errors import TrainingHealthError
from trainwatch.process_steps import ORIGINS_TOLD, OriginTold
from trainwatch.setup_audit import SetupAudit
from trainwatch.sinks.base import AlertTally, Sink, StepNumbers, Summary


class Observer(Protocol):
    """Hears what every dispatcher of the process tells: ``trainwatch run`` hears the
    alerts (and, at close, the steps) of a script's own ``tw.watch`` or Lightning
    callback this way."""

    def heard(self, dispatcher: Dispatcher, alert: Alert, repeat: bool) -> None: ...

    def closed(self, dispatcher: Dispatcher, summary: Summary) -> None: ...


# Empty but under ``trainwatch run``; nothing is looked at on a step without alerts.
OBSERVERS: list[Observer] = []


class Dispatcher:
    def __init__(self, sinks: Sequence[Sink], halt_on: Sequence[str]) -> None:
        self.sinks: list[Sink] = list(sinks)
        self.halt_on = frozenset(halt_on)
        self.tallies: dict[tuple[str, str | None], AlertTally] = {}
        self._internal_reported: set[str] = set()
        self.held: Alert | None = None  # a halt waiting for a step boundary
        self.reported: set[str] = set()  # rule ids that have fired so far
        # Under torch.distributed without a relay: this rank, stamped on each alert.
        self.rank: int | None = None
        # The watched model's name, as other monitors' knock-on alerts name it.
        self.model: str | None = None
        # While a tuner's trial steps run (see set_aside): what they set aside.
        self._aside: _SetAside | None = None

    def set_aside(self) -> None:
        """Until :meth:`take_back`, what is published goes nowhere: no sink, no
        observer, no halt, no NaN/Inf origin told to the other monitors, and the
        tallies (which rules read as "already reported") are the while's own.

        For a tuner's trial steps (trainwatch/tuner_trials.py), whose updates are
        undone after. Swapped, not asked per step: the usual step pays nothing.
        """
        if self._aside is None:
            self._aside = _SetAside(
                self.sinks, self.tallies, self.reported, self.held, self.halt_on
            )
            self.sinks, self.tallies, self.reported = [], {}, set()
            self.held, self.halt_on = None, frozenset()

    def take_back(self) -> None:
        """The sinks, tallies and halts as they were at :meth:`set_aside`; an internal
        error met meanwhile is reported now (its component stays off)."""
        aside, self._aside = self._aside, None
        if aside is None:
            return
        self.sinks, self.tallies, self.reported = aside.sinks, aside.tallies, aside.reported
        self.held, self.halt_on = aside.held, aside.halt_on
        for component, exc, step in aside.failures:
            self._internal_reported.discard(component)
            self.internal_error(component, exc, step)

    def publish(self, alerts: Sequence[Alert], *, may_halt: bool = True) -> None:
        """Hand a step's alerts to every sink; then halt if a new one is in halt_on.

        Only a (rule, module)'s first warning or error halts: a loop that caught
        the error and carried on is not stopped again by the same finding.
        """
        halt: Alert | None = None
        if self.rank is not None:
            alerts = [_with_rank(alert, self.rank) for alert in alerts]
        heard: list[tuple[Alert, int]] = []  # each alert with its count; 1: a new one
        for alert in alerts:
            tally = self.tallies.get(alert.key)
            if tally is None:
                self.tallies[alert.key] = AlertTally(alert, 1, alert.step)
                self.reported.add(alert.rule)
                heard.append((alert, 1))
                if (
                    alert.rule.startswith("nonfinite")
                    and alert.severity != "info"
                    and self._aside is None
                ):
                    self._origin_told(alert)
                if halt is None and alert.rule in self.halt_on and alert.severity != "info":
                    # An info line is no fault (a knock-on of an origin told
                    # elsewhere, a layer defined but never called): no halt.
                    halt = alert
            else:
                tally.count += 1
                tally.last_step = alert.step
                heard.append((alert, tally.count))
        self._tell(heard)
        if halt is not None:
            if not may_halt:
                # Found while a property was read: raised at the next step
                # boundary or flush(), never from a read.
                self.held = self.held or halt
                return
            self.held = None
            raise TrainingHealthError(halt)

    def _origin_told(self, alert: Alert) -> None:
        """A NaN/Inf origin, for the process's other monitors: what follows it in their
        models (weights copied from this one) is its knock-on, not a second origin."""
        ORIGINS_TOLD.tell(
            OriginTold(alert.rule, self.model, alert.module, alert.step, weakref.ref(self))
        )

    def _tell(self, heard: list[tuple[Alert, int]]) -> None:
        """The new alerts to each sink in one call (the console folds a same-step
        flood into one group), then the repeats, then the observers, all in order.

        A repeat of an alert new in this same publish reaches the sinks after it.
        """
        new = [alert for alert, count in heard if count == 1]
        if new:
            self._each_sink("emit", lambda sink: sink.emit_many(new))
        for alert, count in heard:
            if count > 1:
                self._each_sink("repeat", lambda sink, a=alert, c=count: sink.repeat(a, c))
        if self._aside is not None:
            return  # a tuner's trial: no part of the run the observers count
        for alert, count in heard:
            for observer in OBSERVERS:
                observer.heard(self, alert, count > 1)

    def raise_held(self) -> None:
        """Apply a halt that was found where raising was not allowed."""
        halt, self.held = self.held, None
        if halt is not None:
            raise TrainingHealthError(halt)

    def numbers(self, numbers: StepNumbers) -> None:
        """Every step: only the sinks that take numbers (not the memory or the console)."""
        for sink in list(self.sinks):
            if type(sink).on_step is not Sink.on_step:
                self._each_sink("on_step", lambda sink: sink.on_step(numbers), only=sink)

    def setup(self, audit: SetupAudit) -> None:
        """The setup table: only the sinks that render it."""
        for sink in list(self.sinks):
            if type(sink).setup is not Sink.setup:
                self._each_sink("setup", lambda sink: sink.setup(audit), only=sink)

    def note(self, text: str) -> None:
        """One line of trainwatch's own about what it watches, not an alert: only the
        sinks that show such lines (the console)."""
        for sink in list(self.sinks):
            if type(sink).note is not Sink.note:
                self._each_sink("note", lambda sink: sink.note(text), only=sink)

    def close(self, summary: Summary) -> None:
        self._each_sink("close", lambda sink: sink.close(summary))
        for observer in OBSERVERS:
            observer.closed(self, summary)

    def summary(self, steps: int, latest_norms: dict[str, float]) -> Summary:
        return Summary(steps, list(self.tallies.values()), dict(latest_norms))

    def state_dict(self) -> list[dict[str, Any]]:
        """The tallies as JSON types (for checkpoints)."""
        return [
            {"alert": t.first.to_dict(), "count": t.count, "last_step": t.last_step}
            for t in self.tallies.values()
        ]

    def load_state_dict(self, state: Sequence[dict[str, Any]]) -> list[Alert]:
        """Restore tallies saved by ``state_dict``; returns the first alerts it did not hold."""
        restored = []
        for entry in state:
            alert = Alert.from_dict(entry["alert"])
            if alert.key in self.tallies:
                continue
            self.tallies[alert.key] = AlertTally(
                alert, int(entry.get("count", 1)), int(entry.get("last_step", alert.step))
            )
            self.reported.add(alert.rule)
            restored.append(alert)
        return restored

    def internal_error(self, component: str, exc: BaseException, step: int) -> None:
        """Report a failure inside trainwatch once per component."""
        if component in self._internal_reported:
            return
        self._internal_reported.add(component)
        if self._aside is not None:
            self._aside.failures.append((component, exc, step))  # told once taken back
            return
        alert = Alert(
            rule="internal_error",
            severity="warning",
            step=step,
            module=None,
            message=(
                f"trainwatch's {component} failed and switched itself off "
                f"({type(exc).__name__}: {exc}); training continues unchanged"
            ),
            hint="a bug in trainwatch, not in your training: please report it with data.traceback",
            data={
                "component": component,
                # A different failure is its own finding, told; the same one
                # met again by another part (an odd user object both trip
                # on) is counted as a repeat.
                "finding": f"{type(exc).__name__}: {exc}"[:200],
                "exception": type(exc).__name__,
                "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[
                    -4000:
                ],
            },
        )
        self.publish([alert])

    def _each_sink(self, what: str, call: Callable[[Sink], None], only: Sink | None = None) -> None:
        for sink in list(self.sinks) if only is None else [only]:
            try:
                call(sink)
            except Exception as exc:
                self.sinks.remove(sink)
                self.internal_error(f"{sink.name} sink ({what})", exc, step=-1)


class _SetAside:
    """What a dispatcher holds while a tuner's trial runs (see ``Dispatcher.set_aside``)."""

    __slots__ = ("sinks", "tallies", "reported", "held", "halt_on", "failures")

    def __init__(
        self,
        sinks: list[Sink],
        tallies: dict[tuple[str, str | None], AlertTally],
        reported: set[str],
        held: Alert | None,
        halt_on: frozenset[str],
    ) -> None:
        self.sinks, self.tallies, self.reported = sinks, tallies, reported
        self.held, self.halt_on = held, halt_on
        self.failures: list[tuple[str, BaseException, int]] = []


def _with_rank(alert: Alert, rank: int) -> Alert:
    if "rank" in alert.data:
        return alert
    return dataclasses.replace(alert, data={**alert.data, "rank": rank})
