"""Mixed precision: a GradScaler that keeps skipping once training has begun.

GradScaler skips a step whose gradients hold an Inf/NaN and halves its scale.
Before the first update that is its warm-up (a scale set high on purpose comes
down until it fits), however long it takes; the judge never hands those skips
over. Once updates apply, a long run of skips, or skipping most recent steps,
means the forward or backward overflows at any scale. A scale below 1 means
even unscaled gradients overflow: the scaler has nothing left to give.
Where no scaler's loss scale is in view, the steps are skipped all the same
(a loop's own guard on a non-finite norm skips them as a scaler does) and
the alert says so without speaking of a scale.
"""

from __future__ import annotations

from trainwatch.alert import Alert
from trainwatch.record import AmpReport, StepRecord
from trainwatch.rules.base import Rule

_HINT = (
    "the forward pass overflows even at a tiny scale: find where with nonfinite_forward, "
    "use bf16, or keep the overflowing op in fp32 (torch.autocast(enabled=False) around it)"
)


_NO_SCALER_HINT = (
    "skipping a bad batch now and then is harmless; skipping every one means the "
    "NaN/Inf comes back each step: nonfinite_forward / nonfinite_backward name the "
    "module and op where it was born, so fix it there (an epsilon, a clamp, bad "
    "data). If a GradScaler does the skipping, pass it as tw.watch(..., scaler=scaler)"
)


class SkippedStepsRule(Rule):
    """Skips after updates began: many in a row, or most of the recent steps."""

    id = "amp_skipped_steps"
    needs = frozenset({"nonfinite_probe"})
    reads = "amp"

    def __init__(self, config: object) -> None:
        super().__init__(config)  # type: ignore[arg-type]
        # One entry per skipped backward pass: how many updates had applied
        # before it. Only the latest ``window * passes_per_step`` are kept.
        self.skips: list[int] = []
        # The step and run length last noted: the same run is handed over
        # again as it grows (each new pass, then the step that ends it).
        self.noted: tuple[int, int] = (-1, 0)

    def evaluate(self, record: StepRecord) -> list[Alert]:
        amp = record.amp
        if amp is None:
            return []
        alerts: list[Alert] = []
        if amp.scale is not None and amp.scale < 1.0:
            alerts.append(self._scale_alert(record.step, amp))
        if amp.skipped:
            recent = self._note(record.step, amp)
            alert = self._skip_alert(record.step, amp, recent)
            if alert is not None:
                alerts.append(alert)
        return alerts

    def _note(self, step: int, amp: AmpReport) -> float:
        """Record the new skips; return how many of the last ``window`` steps were skipped."""
        last_step, last_run = self.noted
        new = amp.skipped - last_run if step == last_step else amp.skipped
        self.noted = (step, amp.skipped)
        per = max(1, amp.passes_per_step)
        window = self.config.window  # type: ignore[attr-defined]
        self.skips.extend([step] * max(0, new))
        del self.skips[: max(0, len(self.skips) - window * per)]
        # The i-th latest skipped pass lies within the last ``window`` steps when
        # the updates after it and the skipped steps since (its own included)
        # number no more than ``window``.
        count = 0
        for i, applied_before in enumerate(reversed(self.skips), start=1):
            if (step - applied_before) + i / per > window:
                break
            count += 1
        return count / per

    def _skip_alert(self, step: int, amp: AmpReport, recent: float) -> Alert | None:
        config = self.config
        window = config.window  # type: ignore[attr-defined]
        data: dict[str, object] = {"skipped": amp.skipped, "recent_skipped_steps": recent}
        if amp.scale is not None:
            data["scale"] = amp.scale
        if amp.skipped >= config.patience:  # type: ignore[attr-defined]
            what = (
                f"{amp.skipped} backward passes in a row produced non-finite gradients "
                "and no optimizer step ran, after updates had begun"
            )
        elif recent > config.max_fraction * window:  # type: ignore[attr-defined]
            what = (
                f"{recent:g} of the last {window} steps were skipped for non-finite "
                "gradients, after updates had begun"
            )
        else:
            return None
        if amp.scale is None:
            # No GradScaler's scale in view (none watched, or none at all): the
            # skipping is the loop's own guard, or a scaler trainwatch was not given.
            return self.alert(
                step,
                None,
                f"{what}: something keeps skipping the updates (a guard in the loop on "
                "a non-finite loss or gradient norm: no GradScaler with a loss scale is "
                "watched), so the model has stopped training while the NaN/Inf persists",
                _NO_SCALER_HINT,
                data,
            )
        return self.alert(
            step,
            None,
            f"{what}: the GradScaler keeps skipping and the loss scale is collapsing",
            _HINT,
            data,
        )

    def _scale_alert(self, step: int, amp: AmpReport) -> Alert:
        return self.alert(
            step,
            None,
            f"the GradScaler's loss scale fell to {amp.scale:g}, below 1: even unscaled "
            "gradients overflow, so scaling cannot help any more",
            _HINT,
            {"scale": amp.scale, "skipped": amp.skipped},
        )
