"""Keeps alerts in memory: the list behind ``Monitor.alerts``."""

from __future__ import annotations

from trainwatch.alert import Alert
from trainwatch.sinks.base import Sink


class MemorySink(Sink):
    name = "memory"

    def __init__(self) -> None:
        # First alerts of each (rule, module) only: repeats are counted by the
        # monitor, so memory stays flat however long training runs.
        self.alerts: list[Alert] = []

    def emit(self, alert: Alert) -> None:
        self.alerts.append(alert)
