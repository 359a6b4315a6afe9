"""The one thing every rule produces and every sink consumes.

An alert is a frozen value so that sinks can share it without copying and a
rule can never change what another sink already rendered.
"""

from __future__ import annotations

import time
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
