"""A loss term that broadcast a batch axis against another: ``(N, 1)`` with ``(N,)``."""

from __future__ import annotations

from trainwatch.alert import Alert
from trainwatch.config import BroadcastConfig
from trainwatch.record import StepRecord
from trainwatch.rules.base import Rule


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


class BroadcastRule(Rule):
    id = "broadcast"
    needs = frozenset({"broadcast_audit"})
    reads = "broadcasts"
    config: BroadcastConfig

    def evaluate(self, record: StepRecord) -> list[Alert]:
        alerts = []
        for found in record.broadcasts:
            first, second = found.shapes
            high, low = (first, second) if len(first) > len(second) else (second, first)
            where = f" at {found.source}" if found.source else ""
            evaluation = found.phase == "evaluation"
            alerts.append(
                self.alert(
                    record.step,
                    None,
                    f"{found.op} of {_shape(first)} and {_shape(second)} broadcast to "
                    f"{_shape(found.result)}{where}"
                    f"{' in an evaluation pass' if evaluation else ''}: every sample is "
                    "paired with every other sample's value",
                    f"make the shapes equal before the op: squeeze the {_shape(high)} "
                    f"side (.squeeze(-1)) or reshape the {_shape(low)} side to match "
                    "(.view_as(other) / .unsqueeze(-1)); "
                    + (_EVALUATION if evaluation else _TRAINING),
                    {
                        "op": found.op,
                        "shapes": [list(s) for s in found.shapes],
                        "result": list(found.result),
                        "source": found.source,
                        "phase": found.phase,
                    },
                )
            )
        return alerts


_TRAINING = (
    "a loss stacked from per-step (1,) tensors: torch.cat them instead of torch.stack. "
    "A regression trained like this collapses to predicting the target mean; a policy "
    "gradient loses every per-action signal."
)
_EVALUATION = (
    "the number computed (a validation loss, a metric) is not the one meant: model "
    "selection, early stopping or a scheduler on a plateau act on a wrong value, though "
    "training itself may be sound."
)
