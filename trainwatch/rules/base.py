"""What every rule shares: a record in, zero or more alerts out."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any, ClassVar

from trainwatch.alert import Alert
from trainwatch.collect.weights_at_alert import HeldParameters
from trainwatch.config import RuleConfig
from trainwatch.layers import ParamInfo
from trainwatch.record import StepRecord
from trainwatch.rules.state import plain, rebuilt


class Rule:
    """A pure decision over step records; owns whatever state it needs."""

    id: ClassVar[str]
    # The collectors it needs; the Monitor attaches the union of the enabled
    # rules' needs, so a rule switched off costs nothing.
    needs: ClassVar[frozenset[str]] = frozenset()
    # The record field without which this rule has nothing to say (an empty
    # one is skipped without a call); None: it sees every record (streaks).
    reads: ClassVar[str | None] = None
    # The loop clips its gradients (trainwatch saw clip_grad_norm_ run): a hint
    # then does not tell it to. Set by the monitor, not a learnt state.
    loop_clips: bool = False
    # The training code cannot hand the loss over (``trainwatch run`` watches a
    # script that knows nothing of trainwatch): messages do not ask it to. Set by
    # the monitor, not a learnt state.
    loss_out_of_reach: bool = False
    # The model's weights and their optimizers, looked at only as an alert is
    # built (a weight found all zero); set by the step pipeline.
    held: HeldParameters | None = None

    def __init__(self, config: RuleConfig) -> None:
        self.config = config
        self.component = f"rule {self.id}"  # its name when it fails (internal_error)

    def evaluate(self, record: StepRecord) -> list[Alert]:
        raise NotImplementedError

    def closing(self) -> list[Alert]:
        """What the rule held back for a later step that will not come (at close)."""
        return []

    # -- checkpoints ------------------------------------------------------------
    _NOT_STATE: ClassVar[frozenset[str]] = frozenset(
        {"config", "component", "loop_clips", "loss_out_of_reach", "held"}
    )

    def state_dict(self) -> dict[str, Any]:
        """Whatever the rule learnt so far (streaks, averages), as plain data."""
        return {
            key: plain(value) for key, value in vars(self).items() if key not in self._NOT_STATE
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        module = type(self).__module__
        for key, value in state.items():
            if key in vars(self) and key not in self._NOT_STATE:
                setattr(self, key, rebuilt(value, module))

    def alert(
        self,
        step: int,
        module: str | None,
        message: str,
        hint: str,
        data: dict[str, Any] | None = None,
        *,
        severity: str | None = None,
    ) -> Alert:
        return Alert(
            rule=self.id,
            severity=severity or self.config.severity,  # type: ignore[arg-type]
            step=step,
            module=module,
            message=message,
            hint=hint,
            data=data or {},
        )


def unless_clipping(rule: Rule, advice: str) -> str:
    """``advice`` to clip gradients, or nothing where the loop clips them already."""
    return "" if rule.loop_clips else advice


def by_owner(params: Iterable[ParamInfo]) -> dict[str, list[ParamInfo]]:
    """Group parameters by owning module, keeping first-seen order."""
    groups: dict[str, list[ParamInfo]] = defaultdict(list)
    for info in params:
        groups[info.owner].append(info)
    return dict(groups)


def short_names(params: Iterable[ParamInfo], limit: int = 4) -> str:
    names = [p.name for p in params]
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
