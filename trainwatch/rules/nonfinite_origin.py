"""Origin or knock-on effect: what the non-finite probe gathered, turned into origins.

Runs when a step lands (after its readback): it decides which of forward,
backward, loss or a parameter update is the origin, so the rules report the
cause once and never the cascade that follows from it. Given what was
already reported (rule ids), not the dispatcher's bookkeeping.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

import torch
from torch import nn

from trainwatch.collect.nonfinite_locate import (
    FINITE,
    NEG_INF,
    NORM_OVERFLOW,
    NonfiniteFinding,
    StepWindow,
    locate_backward,
    locate_forward,
    owners,
)
from trainwatch.collect.nonfinite_replay import NOT_REPLAYED
from trainwatch.collect.tensors import local_part
from trainwatch.halt_sync import running_distributed
from trainwatch.layers import ParamInfo, own_parameters
from trainwatch.process_steps import ORIGINS_TOLD, OriginTold
from trainwatch.record import AmpReport, NonfiniteReport, StepRecord

# The cause of a gradient that overflowed fp16 where it entered the model's output.
GRADIENT_OVERFLOW = "gradient_overflow"

# Why a rank that did not replay its backward knows the NaN/Inf came from another.
EVERY_MODULE_FINITE = "every module's gradient in this rank's own backward was summed: finite"


def knock_on(reported: Collection[str]) -> bool:
    """Whether a NaN/Inf now is the knock-on effect of one already reported.

    The one place this is decided: once a non-finite origin was reported,
    what follows (weights poisoned by its update, every later loss) is its
    cascade, never a second origin. ``reported`` holds the rule ids that
    have fired so far in this monitor; another model's origin reaches it
    only through weights the training code copies (``_written_after``).
    """
    return any(rule.startswith("nonfinite") for rule in reported)


def _written_after() -> OriginTold | None:
    """The NaN/Inf another monitor of the process reported before weights of this
    model were written non-finite: the copy it came through (an EMA, a target
    network's update) makes them its knock-on. This monitor's own origins are
    ``knock_on``'s, decided before; so any told here is another model's."""
    return ORIGINS_TOLD.first()


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _mark_after_exploding(record: StepRecord, reported: Collection[str]) -> None:
    """Reports made after exploding_gradient fired: where that led, most likely.

    Not a NaN/Inf already in the model's input (cause "input"): no update grew
    the batch, so the data hint stands however the gradients went before.
    """
    if "exploding_gradient" not in reported:
        return
    for report in (record.nonfinite_forward, record.nonfinite_backward, record.nonfinite_loss):
        if report is not None and report.cause != "input":
            report.after_exploding = True


class NonfiniteJudge:
    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.owners = owners(names)
        # Backward passes per optimizer step when healthy (gradient accumulation):
        # scales how many passes without a step count as GradScaler skipping.
        self.passes_per_step = 1
        self._recent_passes: list[int] = []  # backward passes of the last few steps
        self._judged_step = 0  # the last step that came past the usual-step shortcut
        # The step this process began at (a resumed run's is past 0): a GradScaler
        # warms up again before its first update here, unless its state was restored.
        self.first_step = 0

    def _report(self, finding: NonfiniteFinding, cause: str | None = None) -> NonfiniteReport:
        return NonfiniteReport(
            module=self.names[finding.module] if 0 <= finding.module < len(self.names) else None,
            cause=cause or finding.cause,
            kind=finding.kind,
            count=finding.count,
            shape=finding.shape,
            dtype=finding.dtype,
            device=finding.device,
            input_min=finding.input_min,
            input_max=finding.input_max,
            op=finding.op,
            source=finding.source,
            op_basis=finding.op_basis,
            op_inputs_masked=finding.op_inputs_masked,
            spread=[self.names[i] for i in finding.spread if 0 <= i < len(self.names)],
            loss=finding.loss,
            under_where=finding.under_where,
        )

    @staticmethod
    def trailing_skips(flags: Sequence[torch.Tensor | float]) -> int:
        values = [float(f) for f in flags]
        count = 0
        for value in reversed(values):
            if value <= 0.0:
                break
            count += 1
        return count

    def judge(
        self,
        record: StepRecord,
        window: StepWindow | None,
        values: dict[str, list[float]],
        checked_params: list[ParamInfo],
        param_norms: list[float],
        modules: Callable[[], list[nn.Module | None]],
        reported: Collection[str],
        info: Callable[[torch.Tensor], ParamInfo] | None = None,
    ) -> None:
        isfinite = math.isfinite
        if (
            window is not None
            and window.forward_origin is None
            and window.backward_origin is None
            and not window.output_bad
            and not window.entering_origin
            and not values
            and not window.skipped_host
            and window.forward_seen
            and (record.loss is None or isfinite(record.loss))
            and isfinite(sum(record.param_norms))
            and isfinite(sum(param_norms))
        ):
            return  # the usual step: nothing anywhere is non-finite
        bad_grads = [
            param for param, norm in zip(record.present, record.param_norms) if not isfinite(norm)
        ]
        overflow = _norm_overflow(window, bad_grads)
        if overflow is not None:
            bad_grads = []  # every gradient finite: only their norm overflowed
        forward_bad = False
        if window is not None:
            forward_bad = self._forward(
                record, window, values.get("sums"), modules, reported, info, not bad_grads
            )
            skipped = values.get("skipped") or window.skipped_host
            # A pass is skipped when no step applies its gradient: a GradScaler or
            # the loop's own guard drops it and steps (if at all) on finite ones.
            # A step applying non-finite gradients applied the non-finite passes
            # before it too, summed into them (gradient accumulation while a NaN
            # persists in the weights): every pass is its own, none skipped.
            applied = bool(bad_grads)
            if record.step > self.first_step and (applied or not any(skipped)):
                # The fewest passes of the recent steps that skipped none: a step
                # the scaler skipped only adds passes. The first step's may all be
                # the scaler's warm-up (an overflow inside the model leaves its
                # flag clear). Steps not judged since the last one had a single pass.
                single = [1] if record.step - 1 > self._judged_step else []
                recent = [*self._recent_passes, *single, len(skipped) + 1]
                self._recent_passes = recent[-8:]
                self.passes_per_step = min(self._recent_passes)
            self._judged_step = record.step
            record.skipped_backward_passes = 0 if applied else self.trailing_skips(skipped)
            if record.skipped_backward_passes and record.step > self.first_step:
                # Skips before the first update are the scaler's warm-up: not handed over.
                record.amp = AmpReport(record.skipped_backward_passes, self.passes_per_step)
        forward_clean = not forward_bad
        loss_bad = record.loss is not None and not _finite(record.loss)
        if (
            window is not None
            and not window.forward_seen
            and not forward_bad  # the forward's origin was found: it was seen
            and (bad_grads or loss_bad)
        ):
            if not knock_on(reported):
                self._unlocated(record, bad_grads, loss_bad)  # else: the cascade
            _mark_after_exploding(record, reported)
            return
        entering = None
        if (
            forward_clean
            and window is not None
            and record.param_norms  # a step that came: its backward was applied
            and not bad_grads
            and window.backward_origin is None
        ):
            # Deferred checks: every parameter's gradient finite, and what entered the
            # model in the step's backward perhaps not (the model zeroed it there).
            entering = self._entering_summed(window, values.get("grad_sums"))
        if (
            forward_clean
            and window is not None
            # A step that never came (skipped) has no norms: its origin stands alone.
            and (bad_grads or window.backward_origin is not None or entering is not None)
        ):
            self._backward(
                record, window, values.get("grad_sums"), bad_grads, loss_bad, reported, entering
            )
        if overflow is not None and forward_clean:
            self._overflow(record, overflow)
        if loss_bad and forward_clean and record.nonfinite_loss is None:
            record.nonfinite_loss = NonfiniteReport(module=None, cause="value")
        bad_grad_names = {p.name for p in bad_grads}
        checked = [
            param
            for param, norm in zip(checked_params, param_norms)
            if not _finite(norm) and param.name not in bad_grad_names and param.in_model
        ]
        if checked and not record.nonfinite_params:
            record.nonfinite_params = checked
        _mark_after_exploding(record, reported)

    def _forward(
        self,
        record: StepRecord,
        window: StepWindow,
        sums: list[float] | None,
        modules: Callable[[], list[nn.Module | None]],
        reported: Collection[str],
        info: Callable[[torch.Tensor], ParamInfo] | None,
        grads_finite: bool,
    ) -> bool:
        """Report the forward origin, if any; True when the forward had any NaN/Inf."""
        # Verdicts taken on the spot (CPU) where known, else the read-back sums.
        finite = [
            known
            if known is not None
            else (sums is None or sums[i] == FINITE or sums[i] == NEG_INF)  # -inf: a mask
            for i, known in enumerate(window.finite)
        ]
        located = locate_forward(window.calls, finite, sums)
        finding = window.forward_origin or located
        if finding is None:
            if not window.output_bad:
                return False
            if knock_on(reported):
                return True  # still broken since an earlier report: the cascade
            # The output was bad but replaying the pass did not reproduce it
            # (randomness): name the model, unlocated.
            finding = NonfiniteFinding(0, "forward", "module")
            finding.op_basis = "not reproduced by a replay"
        if window.forward_origin is not None and located is not None:
            finding.spread = located.spread
        report = self._report(finding)
        found = modules()  # the probe's modules, looked up only when there is an origin
        module = found[finding.module] if 0 <= finding.module < len(found) else None
        bad_params: list[torch.Tensor] = []
        if finding.cause in ("module", "unreplayed") and module is not None:
            # The model itself is named when its modules ran unseen inside a
            # compiled graph: then any of its weights may be the cause.
            whole = finding.module == 0
            # Seen when the module ran (on the spot), or now: unless this step's
            # own non-finite gradients have just been applied to them, which
            # leaves it open whether they were bad before (then say so only).
            if finding.nonfinite_weights:
                bad_params = finding.nonfinite_weights  # as the module ran, before the update
            elif finding.weights_nonfinite or (finding.weights_nonfinite is None and grads_finite):
                bad_params = _nonfinite_params(module, whole)
            elif finding.weights_nonfinite is None and _nonfinite_params(module, whole):
                # This step's own NaN gradients were just applied, so whether
                # the weights were bad during the forward is open (an op that
                # overflowed, or the previous update): after an earlier report
                # it is the cascade; else both stories are told.
                if knock_on(reported):
                    return True
                report.cause = "module_or_parameter"
        if bad_params:
            if knock_on(reported):
                return True  # weights poisoned by an update already reported: the cascade
            if info is not None and finding.weights_written:
                # Written in place since the last update (a clamp, a checkpoint
                # loaded, a copy): the training code made them, before this forward.
                record.nonfinite_params = [info(p) for p in bad_params]
                record.nonfinite_params_written = _written_after() or True
                return True
            if info is not None and record.step > 0:
                # Finite gradients, non-finite weights: the last update made them.
                record.nonfinite_params = [info(p) for p in bad_params]
                record.nonfinite_params_step = record.step - 1
                return True
            report.cause = "parameter"
        record.nonfinite_forward = report
        return True

    @staticmethod
    def _overflow(record: StepRecord, finding: NonfiniteFinding) -> None:
        """Finite gradients whose norm overflowed: an explosion, not a NaN/Inf; or,
        where the loss the loop handed over overflowed to +inf too, that loss (a
        NaN loss is told as it is, beside the explosion)."""
        report = NonfiniteReport(
            module=finding.owner,
            cause=NORM_OVERFLOW,
            dtype=finding.dtype,
            parameter=finding.parameter,
            largest=finding.largest,
            clip_norm=finding.clip_norm,
        )
        if record.loss == math.inf:
            report.module, report.cause = None, "value"
            record.nonfinite_loss = report
        else:
            record.nonfinite_backward = report

    def _entering_summed(
        self, window: StepWindow, grad_sums: list[float] | None
    ) -> NonfiniteFinding | None:
        """Deferred checks: the gradient already non-finite where it entered the model
        in the step's last backward. Backward passes no step used before it (a
        GradScaler's skips) are not looked at: from the model's own output
        gradient of the last pass on (the first gradient a backward hands it)."""
        if not grad_sums or grad_sums.count(FINITE) == len(grad_sums):
            return None
        events = window.grad_events
        starts = [
            i for i, (call, side, _) in enumerate(events) if call.module == 0 and side == "out"
        ]
        if not starts:
            return None
        finding = locate_backward(
            events[starts[-1] :], [v == FINITE for v in grad_sums], grad_sums, self.owners
        )
        return finding if finding is not None and finding.cause == "loss" else None

    @staticmethod
    def _unlocated(record: StepRecord, bad_grads: list[ParamInfo], loss_bad: bool) -> None:
        """No hook saw this step's forward (compiled in place): say what is bad, not where.

        Blaming the backward or the loss would be a guess: a NaN born in the
        forward looks exactly the same from the gradients.
        """
        if loss_bad:
            record.nonfinite_loss = NonfiniteReport(module=None, cause="unlocated")
            return
        first = bad_grads[0]
        record.nonfinite_backward = NonfiniteReport(
            module=first.owner, cause="unlocated", parameter=first.name
        )

    def _backward(
        self,
        record: StepRecord,
        window: StepWindow,
        grad_sums: list[float] | None,
        bad_grads: list[ParamInfo],
        loss_bad: bool,
        reported: Collection[str],
        entering: NonfiniteFinding | None = None,
    ) -> None:
        """``entering``: what entered the model non-finite (deferred checks), where no
        parameter's gradient is."""
        finding = window.backward_origin
        if finding is None:
            finding = window.entering_origin or entering
        if finding is None and grad_sums is not None:
            finding = locate_backward(
                window.grad_events, [v == FINITE for v in grad_sums], grad_sums, self.owners
            )
        if finding is None:
            if knock_on(reported):
                # Not located (replays stopped after a few bad steps in a row),
                # after an origin was reported: the weights its update poisoned.
                return
            first = bad_grads[0]
            if window.backward_replayed and running_distributed():
                # Replayed here, this rank's backward is finite: the gradient
                # turned non-finite in the all-reduce; the rank it was born on
                # reports the origin.
                record.nonfinite_backward = NonfiniteReport(
                    module=None, cause="other_rank", parameter=first.name
                )
                return
            basis = None
            if window.backward_unreplayable:
                # Not replayed (FSDP-sharded), but this rank's forward output,
                # loss and the gradient entering its model were finite.
                basis = NOT_REPLAYED
            elif grad_sums is not None and all(v == FINITE for v in grad_sums):
                # Deferred checks: every module's gradient here was finite.
                basis = EVERY_MODULE_FINITE
            if basis is not None and not loss_bad and running_distributed():
                # The gradient turned non-finite in the reduce-scatter (or the
                # all-reduce), from another rank, which reports its origin.
                record.nonfinite_backward = NonfiniteReport(
                    module=None, cause="other_rank", parameter=first.name, op_basis=basis
                )
                return
            record.nonfinite_backward = NonfiniteReport(
                module=first.owner, cause="parameter", parameter=first.name
            )
            return
        if finding.cause == "loss":
            report = self._report(finding)
            report.module = None
            # The loss handed over, else the one the training code held.
            loss = record.loss if record.loss is not None else finding.loss
            if not bad_grads:
                # Every parameter's gradient is finite: the model's own forward (a
                # ReLU or clamp at its output) zeroed the gradient where it was not.
                # An fp16 overflow there, or a NaN/Inf from a finite loss, handed
                # over or held (a where-masked log's 0 * inf), reached no update:
                # nothing to tell. Nor where the gradients were wiped after backward
                # (zero_grad() before the step, told on its own): they say nothing of it.
                if (
                    _fp16_overflow(finding, record.loss)
                    or (loss is not None and _finite(loss))
                    or record.gradients_reset_after_backward()
                ):
                    return
                report.gradients_finite = True
                record.nonfinite_loss = report
                return
            if _fp16_overflow(finding, record.loss):
                report.cause = GRADIENT_OVERFLOW
                record.nonfinite_backward = report
            elif loss is not None and _finite(loss):
                # A finite loss whose backward made the NaN/Inf (a torch.where
                # whose branch not taken divides by zero).
                record.nonfinite_backward = report
            else:  # the loss is non-finite, or not known to be finite
                record.nonfinite_loss = report
            return
        record.nonfinite_backward = self._report(finding)


def _fp16_overflow(finding: NonfiniteFinding, loss: float | None) -> bool:
    """Whether a gradient non-finite where it enters the model overflowed fp16's range
    (65504) there, rather than coming from a non-finite loss.

    The loss's gradient is cast to the fp16 output's dtype on its way in: a
    large loss, or a loss scaled up without a GradScaler, sends back values
    past 65504, which turn to Inf while the loss stays finite. A NaN there,
    with the loss not handed over, is more likely the loss itself (NaN
    targets) and is told as before.
    """
    if finding.dtype != "torch.float16":
        return False
    if loss is not None:
        return math.isfinite(loss)
    return finding.kind != "nan"


def _norm_overflow(
    window: StepWindow | None, bad_grads: list[ParamInfo]
) -> NonfiniteFinding | None:
    """The probe's finding that every gradient of the model is finite, only their norm
    overflowed; taken out of the window, where it stands in for a backward origin.

    None when a parameter outside the model (not looked at) has a non-finite
    norm: that one is judged as before.
    """
    if window is None or window.backward_origin is None:
        return None
    finding = window.backward_origin
    if finding.cause != NORM_OVERFLOW:
        return None
    window.backward_origin = None
    return finding if all(param.in_model for param in bad_grads) else None


def _nonfinite_params(module: nn.Module, recurse: bool = False) -> list[torch.Tensor]:
    """Judged on what this rank holds: a check of a whole DTensor would be a collective.

    A meta parameter (a template run only through ``functional_call``) has no
    values, so none to find non-finite. A module's own weights include those of
    the ParameterLists it holds: its forward uses them."""
    params = module.parameters() if recurse else own_parameters(module)
    return [
        p
        for p in params
        if not p.is_meta and not bool(torch.isfinite(local_part(p.detach())).all())
    ]
