"""The interface every sink implements: alerts and numbers in, never a model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from trainwatch.alert import Alert
from trainwatch.setup_audit import SetupAudit


@dataclass
class StepNumbers:
    """The per-step figures sinks may render (TensorBoard scalars, summaries)."""

    step: int
    layer_norms: dict[str, float] = field(default_factory=dict)
    total_norm: float | None = None
    loss: float | None = None
    # Per-layer ||dW|| / ||W|| of the update, on stalled_training's sampled steps only.
    update_ratios: dict[str, float] = field(default_factory=dict)
    # How far the output on the first batch moved, over its spread (same steps).
    output_change: float | None = None


@dataclass
class AlertTally:
    """A (rule, module) pair's first alert and how often it recurred."""

    first: Alert
    count: int = 1
    last_step: int = 0


@dataclass
class Summary:
    """What a monitor saw over its life, handed to sinks when it closes."""

    steps: int
    tallies: list[AlertTally]
    latest_norms: dict[str, float]
    # Why no step was watched, when none was: a run that printed nothing at all
    # would leave the user guessing whether trainwatch ran.
    idle: str | None = None


class Sink:
    """Base class with no-op defaults, so a sink implements only what it renders."""

    name = "sink"

    def emit(self, alert: Alert) -> None:
        """A new (rule, module) alert: render it now."""

    def emit_many(self, alerts: Sequence[Alert]) -> None:
        """The new alerts of one publish, in order (often one step's findings).

        A sink that keeps one record per alert takes them one by one; the
        console overrides this to fold a same-step flood into one group.
        """
        for alert in alerts:
            self.emit(alert)

    def repeat(self, alert: Alert, count: int) -> None:
        """The same (rule, module) fired again; ``count`` is its total so far."""

    def on_step(self, numbers: StepNumbers) -> None:
        """A step finished; its figures are ready."""

    def setup(self, audit: SetupAudit) -> None:
        """The training setup was audited (at attach, after a change): not an alert."""

    def note(self, text: str) -> None:
        """One line of trainwatch's own about what it watches (not an alert): shown
        by the console alone."""

    def close(self, summary: Summary) -> None:
        """The monitor is closing; flush and release files."""
