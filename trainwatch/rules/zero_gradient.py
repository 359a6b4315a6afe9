"""A trainable parameter the optimizer holds, getting no learning signal."""

from __future__ import annotations

from trainwatch.alert import Alert
from trainwatch.config import ZeroGradientConfig
from trainwatch.layers import ParamInfo
from trainwatch.record import StepRecord
from trainwatch.rules.base import Rule, by_owner, short_names

_HINTS = {
    "none": (
        "backward never reached these parameters: look for a .detach(), a "
        ".item()/.numpy() round trip, torch.no_grad() around the layer, or a branch "
        "whose output does not reach the loss."
    ),
    "never_called": (
        "the layer is defined but its forward never ran, so its parameters sit in "
        "the optimizer untrained. Fine if deliberate (an unused head or pooler); "
        "otherwise call it in forward(). Under DDP it needs find_unused_parameters=True, "
        "or leave its parameters out of the optimizer."
    ),
    "zero": (
        "backward reached these parameters but every gradient entry is exactly "
        "zero: usually all units upstream are dead (ReLU stuck at 0), the output "
        "is multiplied by zero, or a mask removes everything."
    ),
}


class _Streak:
    __slots__ = ("start", "count", "kind", "reported")

    def __init__(self, start: int, kind: str) -> None:
        self.start = start
        self.count = 0
        self.kind = kind
        self.reported = False


class ZeroGradientRule(Rule):
    id = "zero_gradient"
    needs = frozenset({"call_tracker"})
    config: ZeroGradientConfig

    def __init__(self, config: ZeroGradientConfig) -> None:
        super().__init__(config)
        self._streaks: dict[str, _Streak] = {}

    def evaluate(self, record: StepRecord) -> list[Alert]:
        if record.source not in ("optimizer", "manual"):
            return []
        # Parameters that left the model (a replaced head) are not_optimized's story.
        silent: list[tuple[ParamInfo, str]] = [
            (info, "none") for info in record.missing if info.in_model
        ]
        silent += [
            (info, "zero")
            for info, norm in zip(record.present, record.param_norms)
            if norm == 0.0 and info.in_model
        ]
        silent_names = {info.name for info, _ in silent}
        for info in record.present:
            if info.name not in silent_names:
                self._streaks.pop(info.name, None)

        due: list[ParamInfo] = []
        for info, kind in silent:
            streak = self._streaks.get(info.name)
            if streak is None:
                streak = self._streaks[info.name] = _Streak(record.step, kind)
            streak.count += 1
            if streak.count >= self.config.patience and not streak.reported:
                streak.reported = True
                due.append(info)

        alerts = []
        for owner, params in by_owner(due).items():
            streaks = [self._streaks[p.name] for p in params]
            kind = "none" if any(s.kind == "none" for s in streaks) else "zero"
            since = min(s.start for s in streaks)
            steps = record.step - since + 1
            what = "no gradient (None)" if kind == "none" else "an exactly zero gradient"
            message = (
                f"{short_names(params)} got {what} in {steps} consecutive "
                f"step{'s' if steps != 1 else ''} since step {since}"
            )
            severity = None
            if kind == "none" and owner in record.never_called:
                # Usually deliberate: a note, not a warning (a cut-off layer is).
                kind, severity = "never_called", "info"
                message = f"{owner} is never called in forward: {message}"
            alerts.append(
                self.alert(
                    since,
                    owner,
                    message,
                    _HINTS[kind],
                    {
                        "kind": kind,
                        "parameters": [p.name for p in params],
                        "since_step": since,
                        "steps": steps,
                    },
                    severity=severity,
                )
            )
        return alerts
