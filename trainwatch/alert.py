"""The one thing every rule produces and every sink consumes.

An alert is a frozen value so that sinks can share it without copying and a
rule can never change what another sink already rendered.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

Severity = Literal["info", "warning", "error"]
SEVERITIES: tuple[str, ...] = ("info", "warning", "error")
_RANK = {name: i for i, name in enumerate(SEVERITIES)}


def severity_rank(severity: str) -> int:
    """Order severities so thresholds (``--fail-on warning``) compare as numbers."""
    return _RANK[severity]


@dataclass(frozen=True)
class Alert:
    """One finding: what happened, where, when, and what usually fixes it."""

    rule: str
    severity: Severity
    step: int
    module: str | None
    message: str
    hint: str
    data: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time, compare=False)

    @property
    def key(self) -> tuple[str, str | None] | tuple[str, str | None, Any]:
        """Repeats of the same (rule, module) are counted, not re-reported.

        A rule that tells findings of one (rule, module) apart (a later change
        of the training setup) names them in ``data["finding"]``.
        """
        finding = self.data.get("finding")
        return (self.rule, self.module) if finding is None else (self.rule, self.module, finding)

    def to_dict(self) -> dict[str, Any]:
        """The ``alerts.jsonl`` record: one JSON object a line, fields a stable contract."""
        return {
            "rule": self.rule,
            "severity": self.severity,
            "step": self.step,
            "module": self.module,
            "message": self.message,
            "hint": self.hint,
            "data": self.data,
            "time": self.time,
        }

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> Alert:
        return cls(
            rule=record["rule"],
            severity=record["severity"],
            step=int(record["step"]),
            module=record.get("module"),
            message=record.get("message", ""),
            hint=record.get("hint", ""),
            data=dict(record.get("data") or {}),
            time=float(record.get("time", 0.0)),
        )


# An alert with the step it last fired at (a tally's first alert and last step).
Told = tuple[Alert, int]


def _told_of(alert: Alert) -> tuple[Any, str, str | None]:
    return (alert.data.get("model"), alert.rule, alert.module)


def withdrawals(told: Iterable[Told]) -> dict[tuple[Any, str, str | None], int]:
    """Per (model, rule, module), the last step its rule took back what it had told.

    A rule that learns later that its finding no longer holds (a freeze told of,
    then undone) says so in an alert of its own carrying ``data["withdraws"]``.
    """
    found: dict[tuple[Any, str, str | None], int] = {}
    for alert, last_step in told:
        if alert.data.get("withdraws"):
            # The latest time it was taken back: a finding told again after one
            # withdrawal (a second stall) may be withdrawn again.
            key = _told_of(alert)
            found[key] = max(found.get(key, last_step), last_step)
    return found


def undone_at(alert: Alert, last_step: int, withdrawn: dict[Any, int]) -> int | None:
    """The step this alert was withdrawn at; None while it stands (never taken
    back, or told again after that)."""
    if alert.data.get("withdraws"):
        return None
    step = withdrawn.get(_told_of(alert))
    return step if step is not None and last_step <= step else None


def standing_worst(told: Iterable[Told]) -> str | None:
    """The highest severity still standing when the run ends (``--fail-on``):
    internal errors aside, and so is an alert its own rule withdrew later."""
    told = list(told)
    withdrawn = withdrawals(told)
    standing = [
        alert.severity
        for alert, last_step in told
        if alert.rule != "internal_error" and undone_at(alert, last_step, withdrawn) is None
    ]
    return max(standing, key=severity_rank, default=None)
