"""A run that changes nothing: the output on the first batch does not move, the loss stays flat.

Training that runs without error but leaves the model as it was (a learning
rate of effectively zero, adapters on modules whose output barely counts,
an optimizer holding another copy of the weights) shows in neither the loss
curve's shape nor the gradients: the gradients are fine, the updates are
not. The move of the model's own output on a fixed batch, relative to that
output's spread, is scale-free, so one threshold fits every model.
"""

from __future__ import annotations

import math
import statistics

from trainwatch.alert import Alert
from trainwatch.config import StalledTrainingConfig
from trainwatch.record import StallReport, StepRecord
from trainwatch.rules.base import Rule

_HINT = (
    "the updates do not change what the model computes. Usual causes: a learning "
    "rate of effectively zero (a scheduler that decayed it to 0, a wrong unit), "
    "adapters (LoRA target_modules) on modules whose output barely matters, or an "
    "optimizer built over another copy of the model's parameters (made before a "
    "deepcopy, a reload or a wrapper). Check the optimizer's learning rate and which "
    "parameters are trainable; healthy updates move weights by about 1e-3 of their norm."
)
# Healthy runs' typical update-to-weight ratio, quoted in the message.
_HEALTHY_RATIO = 1e-3
# How many standard errors of the two loss windows' difference still count as flat.
_NOISE = 3.0


class StalledTrainingRule(Rule):
    id = "stalled_training"
    needs = frozenset({"first_batch"})
    # Only the sampled steps (a phase's first losses, those before each re-run).
    reads = "stall_phase"
    config: StalledTrainingConfig

    def __init__(self, config: StalledTrainingConfig) -> None:
        super().__init__(config)
        self._first_losses: list[float] = []
        self._latest_losses: list[float] = []  # the latest ``loss_window`` (plain data)
        self._fired = False  # once per phase
        self._phase = 0

    def evaluate(self, record: StepRecord) -> list[Alert]:
        if record.stall_phase != self._phase:
            self._restart(record.stall_phase)  # a new phase: its own first losses
        loss = record.loss if record.loss is not None else record.late_loss
        if loss is not None and math.isfinite(loss):
            if len(self._first_losses) < self.config.loss_window:
                self._first_losses.append(loss)
            else:
                self._latest_losses.append(loss)
                del self._latest_losses[: -self.config.loss_window]
        report = record.stall
        if report is None or self._fired or report.change is None:
            return []
        config = self.config
        if report.steps < config.warmup or report.change >= config.min_change:
            return []
        if not self._loss_flat():
            return []
        self._fired = True
        return [self._alert(record.step, report)]

    def _restart(self, phase: int) -> None:
        self._phase = phase
        self._first_losses = []
        self._latest_losses = []
        self._fired = False

    def _loss_flat(self) -> bool:
        """Flat, or not known (no loss handed over): the output's move decides alone."""
        first, latest = self._first_losses, self._latest_losses
        if len(first) < 2 or len(latest) < 2:
            return True
        before, after = statistics.fmean(first), statistics.fmean(latest)
        noise = math.sqrt(
            statistics.variance(first) / len(first) + statistics.variance(latest) / len(latest)
        )
        return abs(after - before) <= max(self.config.loss_change * abs(before), _NOISE * noise)

    def _loss_text(self) -> str:
        if len(self._first_losses) < 2 or len(self._latest_losses) < 2:
            return "the loss unknown (pass it with monitor.step(loss=loss))"
        before = statistics.fmean(self._first_losses)
        after = statistics.fmean(self._latest_losses)
        return f"the loss flat ({before:.4g} -> {after:.4g})"

    def _alert(self, step: int, report: StallReport) -> Alert:
        ratios = report.update_ratios
        share = report.trainable / report.total if report.total else 0.0
        audit = f"trainable {report.trainable:,} of {report.total:,} parameters ({share:.2%})"
        if report.trainable_in:
            audit += ", most in " + ", ".join(repr(name) for name in report.trainable_in)
        if ratios:
            typical = statistics.median(ratios.values())
            top = max(ratios, key=ratios.__getitem__)
            update = (
                f"; update/weight ||dW||/||W|| median {typical:.1e} "
                f"(healthy ~{_HEALTHY_RATIO:.0e}), largest {ratios[top]:.1e} in {top!r}"
            )
        else:
            typical = None
            update = "; no trainable weight moved"
        lrs = sorted(set(report.learning_rates))
        rates = f"; lr {', '.join(f'{lr:.1e}' for lr in lrs)}" if lrs else ""
        message = (
            f"training changes nothing: after {report.steps} steps the output on the first "
            f"batch moved {report.change:.1e} of its spread (below {self.config.min_change:g}), "
            f"{self._loss_text()}; {audit}{update}{rates}"
        )
        data = {
            "change": report.change,
            "steps": report.steps,
            "min_change": self.config.min_change,
            "trainable": report.trainable,
            "total": report.total,
            "trainable_in": list(report.trainable_in),
            "update_ratio_median": typical,
            "update_ratios": dict(ratios),
            "learning_rates": lrs,
        }
        return self.alert(step, "", message, _HINT, data)
