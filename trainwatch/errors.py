"""Exceptions trainwatch raises on purpose (never from a failure of its own)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainwatch.alert import Alert


class TrainingHealthError(RuntimeError):
    """Raised from the training loop when a rule listed in ``halt_on`` fires.

    Every sink already holds the alert when this is raised, so stopping here
    loses nothing.
    """

    def __init__(self, alert: Alert) -> None:
        self.alert = alert
        where = f" in `{alert.module}`" if alert.module else ""
        rank = alert.data.get("rank")
        on = f" on rank {rank}" if rank is not None else ""
        super().__init__(f"{alert.rule} at step {alert.step}{where}{on}: {alert.message}")


class ConfigError(ValueError):
    """A config key or value that trainwatch cannot accept; names the key."""


class WatchError(RuntimeError):
    """``tw.watch`` was asked for something it cannot do (e.g. watch twice)."""
