"""A run that changes nothing: the output on the first batch does not move, the loss stays flat.

Training that runs without error but leaves the model as it was (a learning
rate of effectively zero, adapters on modules whose output barely counts,
an optimizer holding another copy of the weights) shows in neither the loss
curve's shape nor the gradients: the gradients are fine, the updates are
not. The move of the model's own output on a fixed batch, relative to that
output's spread, is scale-free, so one threshold fits every model.

That move is counted from the phase's first batch, so a learning rate that
collapses after a few real steps (a per-epoch schedule stepped every batch)
leaves it large for ever. The updates themselves tell that case: every
layer's update-to-weight ratio, measured on the same sampled steps, falls
orders of magnitude below any real training's and stays there.

Sooner still, the learning rates tell it: read one step in ten, an
optimizer whose every param group sits at a millionth of its own peak while
it keeps stepping has collapsed, which no schedule meant to train does for
long (cosine to 0 spends 6.4e-4 of its decay there, OneCycleLR ends at 4e-6
of its peak).

A model whose own param groups all sit at exactly 0 while another group of
its optimizers trains (a backbone frozen by its learning rate beside the head
it feeds, watched as a model of its own) is frozen on purpose, as with
``requires_grad=False``: no stall. Every learning rate exactly 0 is told, as
what it is (the steps train nothing), and a stall told stands only while it
lasts: once the model moves again (a hold at lr 0 over, a schedule restarted)
a note withdraws it, as frozen_in_optimizer's ``unfrozen`` does a freeze's.
"""

from __future__ import annotations

import math
import statistics

from trainwatch.alert import Alert
from trainwatch.config import StalledTrainingConfig
from trainwatch.record import LearningRates, StallReport, StepRecord
from trainwatch.rules.base import Rule

_HINT = (
    "the updates do not change what the model computes. Usual causes: a learning "
    "rate of effectively zero (a scheduler that decayed it to 0, a wrong unit), "
    "adapters (LoRA target_modules) on modules whose output barely matters, or an "
    "optimizer built over another copy of the model's parameters (made before a "
    "deepcopy, a reload or a wrapper). Check the optimizer's learning rate and which "
    "parameters are trainable; healthy updates move weights by about 1e-3 of their norm."
)
_STOPPED_HINT = (
    "the updates stopped after the first steps, usually because the learning rate "
    "collapsed: a scheduler meant per epoch stepped every batch (StepLR's step_size, "
    "ExponentialLR's gamma, MultiStepLR's milestones counted in epochs), a decay in the "
    "wrong unit, or a schedule that reaches 0 long before the run ends. Check where "
    "sched.step() is called and the learning rate the optimizer holds now; with that "
    "as intended, the gradients themselves vanished. Healthy updates move weights by "
    "about 1e-3 of their norm."
)
_ZERO_HINT = (
    "every learning rate is exactly 0, so every update is zero and these steps train "
    "nothing. Usual causes: a warm-up that starts at 0 (LambdaLR(lambda e: e / warmup), "
    "whose first epoch or step runs at lr 0), a schedule returning 0 for a stretch, or "
    "lr=0 set in the optimizer. Start the warm-up above 0 ((e + 1) / warmup); a hold at "
    "0 that is meant (Adam's second moments gathered first) costs its steps only, and "
    "this warning is withdrawn once a learning rate rises and the model moves."
)
_RESUMED_HINT = (
    "nothing to do: the stall told earlier was a stretch (a learning rate held at 0, a "
    "schedule that restarted) and training moves the model again; the steps before "
    "trained nothing."
)
# The stop's hint where no watched optimizer holds a learning rate (updates written by hand).
_STOPPED_BY_HAND_HINT = (
    "the updates stopped after the first steps while the gradients still push, and no "
    "optimizer is watched: the hand-written update's learning rate fell to 0 (a "
    "schedule of its own decayed in the wrong unit or reaching 0 long before the run "
    "ends), or the update no longer applies the gradients (zeroed before it, or a "
    "condition that skips it). Check the rate the loop applies now and where it zeroes "
    "the gradients (after the update); healthy updates move weights by about 1e-3 of "
    "their norm."
)
_COLLAPSED_HINT = (
    "the learning rate fell to nothing while the optimizer keeps stepping: usually a "
    "scheduler meant per epoch stepped every batch (StepLR's step_size, ExponentialLR's "
    "gamma, MultiStepLR's milestones counted in epochs; in Lightning, a per-epoch "
    "scheduler returned with interval 'step'), a decay in the wrong unit, or "
    "ReduceLROnPlateau reducing without a min_lr. Step the scheduler where its unit "
    "says (once an epoch), or give it steps, and set a floor (min_lr, eta_min)."
)
# Healthy runs' typical update-to-weight ratio, quoted in the message.
_HEALTHY_RATIO = 1e-3
# Sampled steps in a row, past the warm-up, whose updates stopped: one alone
# may be the last step of a schedule that ends at 0.
_STOPPED_SAMPLES = 2
# How many standard errors of the two loss windows' difference still count as flat.
_NOISE = 3.0
# Updates that stopped are the learning rate's doing once every group's rate is
# 0 or this far below the largest the phase had (a schedule's initial_lr included).
# At its own learning rate a run whose updates stop has converged (gradients of
# zero: an exact fit, LBFGS at its tolerance), which is no stall.
_RATE_FELL = 1e-3
# Gradients still alive: the step's total norm at least this share of the largest
# the phase's sampled steps had. A converged fit's fall by many orders of magnitude.
_GRADIENTS_ALIVE = 1e-3
# A learning rate collapsed: below this share of its param group's own peak.
# OneCycleLR ends at 4e-6 of its peak, linear decay to 0 at 1/steps of it.
_COLLAPSED = 1e-6
# And there, while stepping, for this share of the steps it took to fall from
# its peak (at least ``lr_collapse_steps``): cosine annealing to 0 spends
# 2 * sqrt(1e-6) / pi = 6.4e-4 of its decay below the bound, at any length
# (its last 64 steps of 100,000), a per-epoch schedule stepped every batch the
# rest of the run.
_COLLAPSED_SHARE = 1e-2
# A stall told is withdrawn once the model moves again by this many times the
# bounds it was told under: its output on the first batch by 100 * min_change
# (1e-3; a fine-tune at lr 1e-6 moves 3e-3), its weights by 100 *
# min_update_ratio a step (1e-6; that fine-tune's 5.7e-6). Far enough above
# the bounds that a run hovering there is not told and withdrawn in turn.
_RESUMED = 100.0


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
        self._stopped = _Stopped()
        self._peak_rate = 0.0  # the largest learning rate the phase had, as sampled
        self._peak_norm = 0.0  # and the largest total gradient norm
        # Each optimizer's learning rates as the looks saw them (by index): kept
        # across phases, as an optimizer's schedule goes on through them.
        self._rates: dict[int, _Rates] = {}
        # The looks finding every learning rate exactly 0: since which step (-1:
        # not now), and the latest such stretch over ([from, to]; empty: none).
        self._zero_since = -1
        self._zero_was: list[int] = []
        # The findings told that stand (each criterion; a collapse by optimizer,
        # "collapsed <index>"), across phases: withdrawn together once the model
        # moves again, then the rule is armed again.
        self._standing: set[str] = set()
        self._told_at = 0  # the step the first of them was told
        self._stopped_told = False  # the model's re-runs stopped: told once a run

    def evaluate(self, record: StepRecord) -> list[Alert]:
        if record.optimizer_rates is None:
            return self._stalled(record)
        return self._with_rates(record)  # one sampled step in ten

    def _with_rates(self, record: StepRecord) -> list[Alert]:
        looked = record.optimizer_rates or []
        self._note_zero(record.step, looked)
        alerts = self._stalled(record)  # (a new phase starts there)
        collapsed = self._collapsed(record.step, looked)
        if collapsed:
            self._fired = True  # what the re-runs would tell later, told now
            self._tell([f"collapsed {alert.data['optimizer']}" for alert in collapsed], record)
        return alerts + collapsed

    def _note_zero(self, step: int, looked: list[LearningRates]) -> None:
        """Since when every learning rate the looks read is exactly 0."""
        rates = [rate for look in looked for rate in look.rates]
        if rates and not any(rates):
            if self._zero_since < 0:
                self._zero_since = step
        elif self._zero_since >= 0:
            self._zero_was = [self._zero_since, step]
            self._zero_since = -1

    def _collapsed(self, step: int, looked: list[LearningRates]) -> list[Alert]:
        """The optimizers whose learning rates collapsed, each told once a collapse."""
        alerts = []
        for look in looked:
            rates = self._rates.get(look.optimizer)
            if rates is None or not rates.fits(look):
                rates = self._rates[look.optimizer] = _Rates(look)
            if rates.note(step, look, self.config.lr_collapse_steps):
                alerts.append(self._collapsed_alert(step, look, rates))
        return alerts

    def _stalled(self, record: StepRecord) -> list[Alert]:
        report = record.stall
        if report is None or not report.rerun_stopped or self._stopped_told:
            return self._judged(record)
        self._stopped_told = True
        return [self._rerun_stopped_alert(record.step, report.rerun_stopped), *self._judged(record)]

    def _judged(self, record: StepRecord) -> list[Alert]:
        if record.stall_phase != self._phase:
            self._restart(record.stall_phase)  # a new phase: its own first losses
        loss = record.loss if record.loss is not None else record.late_loss
        if loss is not None and math.isfinite(loss):
            if len(self._first_losses) < self.config.loss_window:
                self._first_losses.append(loss)
            else:
                self._latest_losses.append(loss)
                del self._latest_losses[: -self.config.loss_window]
        norm = record.total_norm
        if norm is not None and math.isfinite(norm) and norm > self._peak_norm:
            self._peak_norm = norm
        report = record.stall
        if report is None:
            return []
        # A stall told that the model moved out of since: withdrawn.
        alerts = self._moves_again(record, report) if self._standing else []
        if self._fired:
            return alerts
        config = self.config
        stopped = self._stopped
        stopped.note(record, report, config, self._latest_losses)
        self._peak_rate = max(
            [self._peak_rate, *report.learning_rates, *report.initial_learning_rates]
        )
        if report.steps < config.warmup or report.left_out_told:
            return alerts  # (left out of every optimizer: not_optimized's finding, told)
        still = report.change is not None and report.change < config.min_change
        if still and not _frozen_by_rate(report) and self._loss_flat(self._first_losses):
            self._fired = True
            self._tell(["output_change"], record)
            return [*alerts, self._alert(record.step, report)]
        # The loss from when the updates stopped: the steps before may have trained.
        if (
            stopped.long_enough(report.steps)
            and self._rate_fell(report)
            and self._gradients_alive(record)
            and self._loss_flat(stopped.losses)
        ):
            self._fired = True
            self._tell(["updates_stopped"], record)
            return [*alerts, self._stopped_alert(record.step, report)]
        return alerts

    def _tell(self, findings: list[str], record: StepRecord) -> None:
        """``findings`` told at ``record``'s step: they stand until the model moves."""
        if not self._standing:
            self._told_at = record.step
        self._standing.update(findings)

    def _moves_again(self, record: StepRecord, report: StallReport) -> list[Alert]:
        """The findings standing that the model's moves now undo, dropped; once none
        stands, the note withdrawing them (and the rule armed again). The output on
        the first batch moved :data:`_RESUMED` times ``min_change``, or the weights
        :data:`_RESUMED` times ``min_update_ratio`` in a step (for a collapse, its
        optimizer's rates back above the bound too)."""
        config = self.config
        change = report.change
        ratios = report.update_ratios
        norm = record.total_norm
        updates = max(ratios.values()) if ratios and (norm is None or math.isfinite(norm)) else 0.0
        moved = change is not None and change >= _RESUMED * config.min_change
        updated = updates >= _RESUMED * config.min_update_ratio
        for finding in list(self._standing):
            if finding == "output_change":
                undone = moved
            elif finding == "updates_stopped":
                undone = updated
            else:  # "collapsed <index>"
                rates = self._rates.get(int(finding.rpartition(" ")[2]))
                undone = updated and (rates is None or rates.since < 0)
            if undone:
                self._standing.discard(finding)
        if self._standing:
            return []
        self._fired = False
        self._stopped = _Stopped()
        return [self._resumed_alert(record.step, report, updates)]

    def _rate_fell(self, report: StallReport) -> bool:
        """Whether the learning rate can have stopped the updates: every group's now
        0, or :data:`_RATE_FELL` of the phase's largest or less (a step the updates
        stopped at a learning rate as high as ever is a converged run's). Unknown
        (no watched optimizer, hand-written updates): the gradients decide."""
        rates = report.learning_rates
        if not rates:
            return True
        now = max(rates)
        return now == 0.0 or now <= _RATE_FELL * self._peak_rate

    def _gradients_alive(self, record: StepRecord) -> bool:
        """Whether the gradients still push: a run whose gradients fell to nothing
        (an exact fit, LBFGS returning at its tolerance) stops its own updates."""
        norm = record.total_norm
        if norm is None or not self._peak_norm:
            return True  # not known
        return norm >= _GRADIENTS_ALIVE * self._peak_norm

    def _restart(self, phase: int) -> None:
        self._phase = phase
        self._first_losses = []
        self._latest_losses = []
        self._fired = False
        self._stopped = _Stopped()
        self._peak_rate = 0.0
        self._peak_norm = 0.0

    def _loss_flat(self, first: list[float]) -> bool:
        """The latest losses as ``first`` (the phase's first, or those when the updates
        stopped), or not known (no loss handed over): the figures decide alone."""
        latest = self._latest_losses
        if len(first) < 2 or len(latest) < 2:
            return True
        before, after = statistics.fmean(first), statistics.fmean(latest)
        noise = math.sqrt(
            statistics.variance(first) / len(first) + statistics.variance(latest) / len(latest)
        )
        return abs(after - before) <= max(self.config.loss_change * abs(before), _NOISE * noise)

    def _loss_text(self, first: list[float]) -> str:
        if len(first) < 2 or len(self._latest_losses) < 2:
            if self.loss_out_of_reach:
                return "the loss not seen (trainwatch run cannot read it)"
            return "the loss unknown (pass it with monitor.step(loss=loss))"
        before = statistics.fmean(first)
        after = statistics.fmean(self._latest_losses)
        return f"the loss flat ({before:.4g} -> {after:.4g})"

    def _alert(self, step: int, report: StallReport) -> Alert:
        ratios = report.update_ratios
        audit = _audit(report)
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
        zero = bool(lrs) and not any(lrs)
        if zero:
            cause, rates = f"{self._zero_text(report)}, so ", ""
        else:
            cause = ""
            rates = f"; lr {', '.join(f'{lr:.1e}' for lr in lrs)}" if lrs else ""
        message = (
            f"training changes nothing: {cause}after {report.steps} steps the output on the "
            f"first batch moved {report.change:.1e} of its spread (below "
            f"{self.config.min_change:g}), {self._loss_text(self._first_losses)}; "
            f"{audit}{update}{rates}"
        )
        data = {
            "criterion": "output_change",
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
        if zero:
            data["cause"] = "learning_rate_zero"
            data["zero_since"] = self._zero_since if self._zero_since >= 0 else None
        return self.alert(step, "", message, _ZERO_HINT if zero else _HINT, data)

    def _zero_text(self, report: StallReport) -> str:
        """Every learning rate exactly 0: since when, and who holds it there."""
        since = f" since step {self._zero_since}" if self._zero_since >= 0 else ""
        initial = sorted({lr for lr in report.initial_learning_rates if lr > 0.0})
        if initial:
            source = f"held there by its scheduler (initial lr {_rates(initial)})"
        else:
            source = "as set in the optimizer's param groups"
        return f"every learning rate has been exactly 0{since}, {source}"

    def _resumed_alert(self, step: int, report: StallReport, updates: float) -> Alert:
        """The model moves again: the stall told earlier withdrawn."""
        moved = []
        if report.change is not None:
            moved.append(f"its output on the first batch moved {report.change:.1e} of its spread")
        if updates > 0.0:
            moved.append(f"its weights {updates:.1e} of their norm in a step")
        lrs = sorted(set(report.learning_rates))
        rates = f" (lr {_rates(lrs)} now" if lrs else ""
        # Every rate held at 0 over the step the stall was told: the stretch it was.
        was = self._zero_was if self._zero_was and self._zero_was[1] > self._told_at else []
        if rates and was:
            rates += f"; every learning rate was exactly 0 from step {was[0]} to step {was[1]}"
        rates += ")" if rates else ""
        message = (
            f"training moves the model again by step {step}: "
            f"{' and '.join(moved) or 'it moved'}{rates}, so the stall told at step "
            f"{self._told_at} no longer stands"
        )
        data = {
            "kind": "resumed",
            "finding": "resumed",
            "withdraws": True,  # the warning no longer stands (--fail-on)
            "told_at": self._told_at,
            "change": report.change,
            "update_ratio_max": updates,
            "learning_rates": lrs,
        }
        if was:
            data["zero_from"], data["zero_to"] = was
        return self.alert(step, "", message, _RESUMED_HINT, data, severity="info")

    def _rerun_stopped_alert(self, step: int, what: str) -> Alert:
        message = (
            f"the model is no longer re-run on its first batch: its forward {what}, "
            "which a re-run could not put back (the re-run was stopped before it); "
            "its stalls are judged from the updates alone"
        )
        hint = (
            "nothing to fix in training: trainwatch re-runs the model's forward on a few "
            "rows now and then, and undoes what the forward changes in the model's state; "
            "a change it cannot undo is not made, and that model is not re-run again"
        )
        return self.alert(
            step, "", message, hint, {"kind": "rerun_stopped", "what": what}, severity="info"
        )

    def _collapsed_alert(self, step: int, look: LearningRates, rates: _Rates) -> Alert:
        name = f"optimizer {look.optimizer} ({look.optimizer_class})"
        judged = [i for i, peak in enumerate(rates.peaks) if peak > 0.0]
        peaks = [rates.peaks[i] for i in judged]
        now = [look.rates[i] for i in judged]
        groups = "its learning rate" if len(judged) == 1 else "every param group's learning rate"
        stepped = (step if look.last_step is None else look.last_step) - rates.since
        message = (
            f"learning rate collapsed: {name} keeps stepping with {groups} below "
            f"{_COLLAPSED:g} of its peak, fallen there by step {rates.since} and stepped "
            f"{stepped} steps since (lr {_rates(now)} now, peak {_rates(peaks)}): its "
            f"updates change nothing any more"
        )
        data = {
            "kind": "learning_rate_collapsed",
            "criterion": "learning_rate_collapsed",
            "optimizer": look.optimizer,
            "optimizer_class": look.optimizer_class,
            "collapsed_since": rates.since,
            "steps_collapsed": stepped,
            "peak_step": rates.peak_step,
            "learning_rates": now,
            "peak_learning_rates": peaks,
            "bound": _COLLAPSED,
        }
        return self.alert(step, "", message, _COLLAPSED_HINT, data)

    def _stopped_alert(self, step: int, report: StallReport) -> Alert:
        ratios = report.update_ratios
        stopped = self._stopped
        typical = statistics.median(ratios.values())
        top = max(ratios, key=ratios.__getitem__)
        lrs = sorted(set(report.learning_rates))
        if lrs and not any(lrs):
            since = f" since step {self._zero_since}" if self._zero_since >= 0 else ""
            rates = f"; every learning rate is 0{since}"
        elif lrs:
            rates = f"; lr {_rates(stopped.first_rates)} at step {stopped.since_step}"
            rates += f", {_rates(lrs)} now"
        else:
            rates = ""
        healthy = f"healthy ~{_HEALTHY_RATIO:.0e}"
        if ratios[top] > 0.0:
            what = (
                f"the updates barely change the weights: update/weight ||dW||/||W|| at most "
                f"{ratios[top]:.1e} (in {top!r}, median {typical:.1e}; {healthy}), below "
                f"{self.config.min_update_ratio:g},"
            )
        else:
            what = (
                "the updates leave every weight exactly as it was (||dW|| = 0 in every "
                f"layer; ||dW||/||W|| {healthy})"
            )
        before = (
            f"before, the output on the first batch moved {report.change:.1e} of its spread"
            if report.change is not None
            else "the output on the first batch not measured"
        )
        message = (
            f"training stopped: from step {stopped.since_step} on, {what} at "
            f"{stopped.samples} sampled steps in a row{rates}; "
            f"{self._loss_text(stopped.losses)}; {before}; {_audit(report)}"
        )
        data = {
            "criterion": "updates_stopped",
            "change": report.change,
            "steps": report.steps,
            "stopped_since": stopped.since_step,
            "min_update_ratio": self.config.min_update_ratio,
            "trainable": report.trainable,
            "total": report.total,
            "trainable_in": list(report.trainable_in),
            "update_ratio_median": typical,
            "update_ratio_max": ratios[top],
            "update_ratios": dict(ratios),
            "learning_rates": lrs,
            "learning_rates_then": sorted(set(stopped.first_rates)),
        }
        hint = _STOPPED_HINT if lrs else _STOPPED_BY_HAND_HINT
        return self.alert(step, "", message, hint, data)


class _Stopped:
    """The sampled steps in a row whose updates left every layer as it was.

    Stopped: every layer's ``||dW|| / ||W||`` below ``min_update_ratio``,
    orders of magnitude under any real training (a learning rate of 1e-6
    still moves Adam's weights by about 1e-5 of their norm). A step whose
    gradients held NaN/Inf (GradScaler skipped it, the weights stayed put
    with a healthy learning rate) says nothing and starts the count over:
    skips that go on are amp_skipped_steps' finding. The first stopped step
    of the row is kept to tell when the updates stopped, at what learning
    rate, and the loss then: the loss is compared with that one, as the
    steps before it may have trained. Slotted: a checkpoint keeps it (rules/state.py).
    """

    __slots__ = ("samples", "past_warmup", "since", "since_step", "first_rates", "losses")

    def __init__(self) -> None:
        self.samples = 0  # stopped sampled steps in a row
        self.past_warmup = 0  # of them, those at or past the warm-up
        self.since = 0  # the phase's steps at the row's first
        self.since_step = 0  # its step number
        self.first_rates: list[float] = []
        self.losses: list[float] = []  # the latest losses then

    def note(
        self,
        record: StepRecord,
        report: StallReport,
        config: StalledTrainingConfig,
        losses: list[float],
    ) -> None:
        ratios = report.update_ratios
        norm = record.total_norm
        skipped = norm is not None and not math.isfinite(norm)
        if skipped or not ratios or not max(ratios.values()) < config.min_update_ratio:
            self.samples = self.past_warmup = 0
            return
        if not self.samples:
            self.since, self.since_step = report.steps, record.step
            self.first_rates = list(report.learning_rates)
            self.losses = list(losses)
        self.samples += 1
        self.past_warmup += report.steps >= config.warmup

    def long_enough(self, steps: int) -> bool:
        """Stopped at enough sampled steps past the warm-up, and for at least as many
        steps as the phase ran before: a schedule that decays to 0 at the end of a
        long run has its last sampled steps stopped, never half its steps."""
        return self.past_warmup >= _STOPPED_SAMPLES and 2 * self.since <= steps


class _Rates:
    """One optimizer's learning rates, as the looks saw them: each param group's
    peak so far, and whether every group is collapsed now.

    A group's peak counts once its rate was above 0 (a warm-up from 0 and a
    range test, which only rises, never collapse); a group held at 0 from the
    start (frozen on purpose) is left out. Collapsed: every group with a peak
    below :data:`_COLLAPSED` of it. Told once the optimizer stepped there for
    ``lr_collapse_steps`` steps and :data:`_COLLAPSED_SHARE` of those the rate
    took to fall from its peak, then not again until a rate rises above the
    bound (a restart). Slotted: a checkpoint keeps it (rules/state.py).
    """

    __slots__ = ("optimizer_class", "peaks", "peak_step", "since", "told")

    def __init__(self, look: LearningRates) -> None:
        self.optimizer_class = look.optimizer_class
        self.peaks = [0.0] * len(look.rates)
        self.peak_step = 0  # the latest look with a group at its peak
        self.since = -1  # the first look of this collapse; -1: not collapsed
        self.told = False

    def fits(self, look: LearningRates) -> bool:
        """The same optimizer with the same groups (a group added starts over)."""
        return look.optimizer_class == self.optimizer_class and len(look.rates) == len(self.peaks)

    def note(self, step: int, look: LearningRates, steps: int) -> bool:
        """Take the look at ``step`` in; whether the collapse is to be told now."""
        peaks = self.peaks
        for group, rate in enumerate(look.rates):
            if rate > 0.0 and rate >= peaks[group]:
                peaks[group] = rate
                self.peak_step = step
        # The groups with a peak: one held at 0 throughout says nothing.
        judged = [(rate, peak) for rate, peak in zip(look.rates, peaks) if peak > 0.0]
        if not judged or not all(rate < _COLLAPSED * peak for rate, peak in judged):
            self.since, self.told = -1, False  # (a NaN rate: not collapsed)
            return False
        if self.since < 0:
            self.since = step
        last = look.last_step
        needed = max(steps, _COLLAPSED_SHARE * (self.since - self.peak_step))
        if self.told or last is None or last - self.since < needed:
            return False
        self.told = True
        return True


def _frozen_by_rate(report: StallReport) -> bool:
    """Whether every param group holding the model's own weights sits at exactly 0
    while another group trains: a part frozen by its learning rate on purpose (the
    backbone of a fine-tune beside its head), as with ``requires_grad=False``."""
    own = report.model_learning_rates
    return bool(own) and not any(own) and any(report.learning_rates)


def _audit(report: StallReport) -> str:
    share = report.trainable / report.total if report.total else 0.0
    audit = f"trainable {report.trainable:,} of {report.total:,} parameters ({share:.2%})"
    if report.trainable_in:
        audit += ", most in " + ", ".join(repr(name) for name in report.trainable_in)
    return audit


def _rates(lrs: list[float]) -> str:
    return ", ".join(f"{lr:.1e}" for lr in sorted(set(lrs))) or "unknown"
