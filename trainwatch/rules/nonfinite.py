"""NaN/Inf: the origin, not the cascade, with the op and the line when known."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from trainwatch.alert import Alert
from trainwatch.collect.nonfinite_locate import NORM_OVERFLOW
from trainwatch.layers import ParamInfo
from trainwatch.process_steps import OriginTold
from trainwatch.record import NonfiniteReport, StepRecord
from trainwatch.rules.base import Rule, by_owner, short_names, unless_clipping
from trainwatch.rules.nonfinite_origin import EVERY_MODULE_FINITE, GRADIENT_OVERFLOW
from trainwatch.strict_json import nonfinite_name

_OP_HINTS = {
    "aten::log": "log of a value at or below 0: a softmax or a probability that reached "
    "0 (use log_softmax, cross_entropy or BCEWithLogitsLoss instead of log(softmax(x)) / "
    "log(sigmoid(x))), or a quantity meant to stay positive that went negative (a "
    "variance, a scale: predict its log, or pass it through softplus or exp); or clamp "
    "the argument",
    "aten::_softmax": "a softmax over a row that is entirely -inf (a fully masked row): "
    "keep at least one position unmasked or use a large negative number instead of -inf",
    "aten::exp": "exp overflowed: scale or clamp the logits, or use logsumexp / softmax, "
    "which subtract the maximum first",
    "aten::div": "division by zero: add an epsilon to the denominator (a zero std on a "
    "constant batch, a zero norm, a zero count)",
    "aten::sqrt": "sqrt of a negative number, or its gradient at 0: clamp the argument "
    "(x.clamp_min(eps).sqrt()) or add an epsilon",
    "aten::rsqrt": "rsqrt at 0 or below: add an epsilon (as LayerNorm/BatchNorm do)",
    "aten::pow": "a fractional power at 0 or below (or its gradient): clamp the base",
    "aten::linalg_vector_norm": "the gradient of a norm at a zero vector is undefined: "
    "add an epsilon, e.g. (x.pow(2).sum() + eps).sqrt()",
    "aten::norm": "the gradient of a norm at a zero vector is undefined: add an epsilon",
    "aten::mul": "a product overflowed (Inf * 0 = NaN, or a value past the dtype's range)",
    # Every FFT op (_fft_r2c, _fft_c2c, _fft_c2r): torch.fft.*, torch.stft.
    "aten::_fft_": "an FFT sums every value along the transformed dimensions, so inputs "
    "about the dtype's range divided by their count overflow it (3.4e38 in fp32, 65504 "
    "in fp16): normalise or rescale the input before the transform (the norm= argument "
    "scales only its result), and run fp16 FFTs in fp32",
}

# Matmuls overflow past their dtype's range: what to do depends on which.
_MATMULS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm")
_FP16_OVERFLOW = (
    "a matmul overflowed: in fp16 keep activations below 65504 "
    "(bf16, a lower learning rate, or normalisation)"
)
_RANGE_OVERFLOW = (
    "a matmul overflowed {dtype}'s range (about {top}): values that large come from "
    "an outlier in the data (a corrupt input or target) or from weights the updates "
    "blew up: check this batch, normalise the inputs, or lower the learning rate"
)
_RANGES = {
    "torch.float32": "3.4e38",
    "torch.bfloat16": "3.4e38",
    "torch.float64": "1.8e308",
    # Each part of a complex value has its real dtype's range.
    "torch.complex64": "3.4e38",
    "torch.complex128": "1.8e308",
}
_UNKNOWN_OVERFLOW = (
    "a matmul overflowed its dtype's range (65504 in fp16, about 3.4e38 in fp32 and "
    "bf16): keep fp16 activations small (bf16, normalisation), and look for an "
    "outlier in the data or weights blown up by the updates"
)


def _matmul_hint(dtype: str | None) -> str:
    """fp16's small range has its own remedies; past fp32's, the values themselves are wrong."""
    if dtype == "torch.float16":
        return _FP16_OVERFLOW
    if dtype in _RANGES:
        return _RANGE_OVERFLOW.format(dtype=dtype.removeprefix("torch."), top=_RANGES[dtype])
    return _UNKNOWN_OVERFLOW


_UNLOCATED_HINT = (
    "for a model compiled in place, compile with `model = torch.compile(model)` rather "
    "than `model.compile()`: trainwatch then sees the model's inputs and outputs around "
    "the graph and replays a bad pass eagerly to name the module and the op; or run the "
    "steps in question eagerly (`torch.compiler.set_stance('force_eager')`). For "
    "gradients made under torch.func (vmap/grad per-sample gradients) or written by the "
    "loop, look at its own arithmetic on them: a per-sample norm of 0 divided into a "
    "clipping factor, a log or sqrt of 0"
)


def _hint(report: NonfiniteReport, default: str) -> str:
    if report.op in _MATMULS:
        return _matmul_hint(report.dtype)
    if report.op and report.op in _OP_HINTS:
        return _OP_HINTS[report.op]
    if report.op:
        for op, hint in _OP_HINTS.items():
            if report.op.startswith(op):
                return hint
    return default


def _data(report: NonfiniteReport) -> dict[str, Any]:
    data: dict[str, Any] = {
        key: value
        for key, value in {
            "cause": report.cause,
            "kind": report.kind,
            "count": report.count,
            "shape": list(report.shape) if report.shape is not None else None,
            "dtype": report.dtype,
            "device": report.device,
            "input_min": report.input_min,
            "input_max": report.input_max,
            "op": report.op,
            "source": report.source,
            "op_basis": report.op_basis,
            "loss": report.loss,
        }.items()
        if value is not None
    }
    if report.under_where:
        data["under_where"] = True
    if report.op_inputs_masked:
        data["op_inputs_masked"] = True
    if report.largest is not None:
        data["parameter"] = report.parameter
        data["largest"] = report.largest
    if report.gradients_finite:
        data["gradients_finite"] = True
    if report.spread:
        data["spread"] = report.spread[:20]
        data["spread_count"] = len(report.spread)
    return data


def _what(report: NonfiniteReport) -> str:
    kind = {"nan": "NaN", "inf": "Inf", "-inf": "-Inf"}.get(report.kind or "", "NaN/Inf")
    count = f"{report.count} {kind}" if report.count is not None else kind
    shape = f" in a {report.dtype} tensor of shape {list(report.shape)}" if report.shape else ""
    op = f", made by {report.op}" if report.op else ""
    line = f" at {report.source}" if report.source else ""
    return f"{count}{shape}{op}{line}"


class _ReportRule(Rule):
    """One alert per report: each rule only chooses its words for the report's cause."""

    def report(self, record: StepRecord) -> NonfiniteReport | None:
        raise NotImplementedError

    def words(self, record: StepRecord, report: NonfiniteReport) -> tuple[str, str]:
        """The message and the hint."""
        raise NotImplementedError

    def data(self, record: StepRecord, report: NonfiniteReport) -> dict[str, Any]:
        """The alert's ``data``: the report's facts."""
        return _data(report)

    def evaluate(self, record: StepRecord) -> list[Alert]:
        report = self.report(record)
        if report is None:
            return []
        message, hint = self.words(record, report)
        data = self.data(record, report)
        if report.after_exploding:
            message += " (after exploding_gradient was reported)"
            hint = _AFTER_EXPLODING + (" or add a warm-up" if self.loop_clips else _OR_CLIP)
            data["after_exploding"] = True
        return [self.alert(record.step, report.module, message, hint, data)]


_AFTER_EXPLODING = (
    "the gradients were exploding before this (exploding_gradient): the updates "
    "likely grew the weights and activations until they overflowed. Lower the "
    "learning rate"
)
_OR_CLIP = ", add a warm-up, or clip gradients (torch.nn.utils.clip_grad_norm_)"


class NonfiniteForwardRule(_ReportRule):
    id = "nonfinite_forward"
    needs = frozenset({"nonfinite_probe"})
    reads = "nonfinite_forward"

    def report(self, record: StepRecord) -> NonfiniteReport | None:
        return record.nonfinite_forward

    def words(self, record: StepRecord, report: NonfiniteReport) -> tuple[str, str]:
        spread = f"; it spread to {len(report.spread)} modules" if len(report.spread) > 1 else ""
        if report.cause == "input":
            return (
                f"the input to `{report.module or '<model>'}` is already non-finite "
                f"before any module computed on it{spread}",
                "the data is bad: check the batch for NaN/Inf (a corrupt sample, a "
                "division in preprocessing, an uninitialised buffer), or a functional "
                "op in the training loop between the data and the model",
            )
        if report.cause == "unreplayed":
            inputs = ""
            if report.input_min is not None:
                inputs = f" in [{report.input_min:.4g}, {report.input_max:.4g}]"
            return (
                f"the model's output is non-finite ({_what(report)}) although its inputs "
                f"are finite{inputs} and so are this rank's weights: born inside the "
                "model on this rank, in a module not located (its FSDP-sharded or "
                "SyncBatchNorm modules talk to the other ranks inside forward, so it is "
                "not replayed on one rank)",
                "to name the module and the op, set nonfinite_forward.check: deferred "
                "(every module's output summed as it runs, no replay needed; costly), or "
                "run the same batch in one process without sharding; then look for a "
                "log/sqrt/division at the edge of its domain or an overflow",
            )
        if report.cause == "given_weights":
            return (
                f"first non-finite value of the forward pass: {_what(report)} from "
                f"`{report.module}`, which ran on non-finite weights handed in for the call "
                "(torch.func.functional_call: weights computed outside the model, such as "
                f"an inner-loop update){spread}",
                "the values those weights were computed from went bad first: look at the "
                "inner-loop loss and its gradients (a log/sqrt/division at the edge of its "
                "domain), or clip the inner-loop update",
            )
        if report.cause == "parameter":
            return (
                f"first non-finite value of the forward pass, from `{report.module}` whose "
                f"own weights are non-finite{spread}",
                "an optimizer update blew these weights up: lower the learning rate"
                + unless_clipping(self, " or clip gradients")
                + "; set nonfinite_parameter.check_every: 1 to be told at the update itself",
            )
        if report.cause == "module_or_parameter":
            return (
                f"first non-finite value of the forward pass: {_what(report)} from "
                f"`{report.module}`, whose weights are non-finite after this step's "
                f"update{spread}",
                "either an op in this module made it (a log/sqrt/division at the edge "
                "of its domain, an exp past the dtype's range) or the previous update "
                "blew its weights up (learning rate too high); "
                "nonfinite_parameter.check_every: 1 tells the two apart",
            )
        inputs = ""
        low, high = report.input_min, report.input_max
        if report.op_inputs_masked and low != -math.inf:
            # The op read a -inf the module made itself (attention's padding mask):
            # the module's own inputs were finite, the op's were not.
            given = (
                f", whose own inputs are finite in [{low:.4g}, {high:.4g}]"
                if low is not None
                else ""
            )
            inputs = f" from inputs holding -inf (a mask made inside the module{given})"
        elif low is not None:
            # An input may hold -inf only as a deliberate mask (an attention mask):
            # the values it was made from are finite otherwise.
            finite = "inputs finite but for a -inf mask" if low == -math.inf else "finite inputs"
            inputs = f" from {finite} in [{low:.4g}, {high:.4g}]"
        return (
            f"first non-finite value of the forward pass: {_what(report)}{inputs}{spread}",
            _hint(
                report,
                "look for a log/sqrt/division of values at the edge of their domain, "
                "an exp that overflowed, or a value past its dtype's range (65504 in fp16)",
            ),
        )


class NonfiniteBackwardRule(_ReportRule):
    id = "nonfinite_backward"
    needs = frozenset({"nonfinite_probe"})
    reads = "nonfinite_backward"

    def report(self, record: StepRecord) -> NonfiniteReport | None:
        report = record.nonfinite_backward
        if report is not None and report.cause == NORM_OVERFLOW:
            return None  # no NaN/Inf: exploding_gradient tells it
        return report

    def evaluate(self, record: StepRecord) -> list[Alert]:
        report = record.nonfinite_backward
        if report is None or report.cause != "other_rank":
            return super().evaluate(record)
        hint = "the rank where the NaN/Inf was born reports its origin; look there"
        if report.op_basis == EVERY_MODULE_FINITE:
            message = (
                f"the gradient of {report.parameter} arrived non-finite from another rank "
                "(through the gradient reduce-scatter or all-reduce): every module's "
                "gradient in this rank's own backward is finite"
            )
        elif report.op_basis is not None:  # not replayed: judged from what this rank saw
            message = (
                f"the gradient of {report.parameter} arrived non-finite from another rank "
                "(through the gradient reduce-scatter or all-reduce): this rank's forward "
                "output, its loss and the gradient entering its model are finite. Not "
                "replayed (the model's sharded modules talk to the other ranks), so a "
                "NaN/Inf born in this rank's own backward would look the same"
            )
            hint += (
                "; if no rank reports one, it was born in a backward: set "
                "nonfinite_forward.check: deferred (every module's gradient summed) to "
                "have that rank name the module"
            )
        else:
            message = (
                f"the gradient of {report.parameter} arrived non-finite from another rank "
                "(through the gradient all-reduce): this rank's own forward and backward, "
                "replayed here, are finite"
            )
        return [self.alert(record.step, None, message, hint, _data(report), severity="info")]

    def words(self, record: StepRecord, report: NonfiniteReport) -> tuple[str, str]:
        if report.cause == "unlocated":
            return (
                f"non-finite gradient in parameter {report.parameter}, applied by the "
                "optimizer step; no hook saw the model run this step (inside a graph "
                "compiled in place, or only inside a torch.func transform such as vmap "
                "or grad, or the loop computed or wrote the gradients itself), so where "
                "the NaN/Inf was born is not located",
                _UNLOCATED_HINT,
            )
        if report.cause == GRADIENT_OVERFLOW:
            return _gradient_overflow(record, report, self.loss_out_of_reach)
        if report.cause == "loss":
            return _loss_backward(record, report)
        where = (
            f"in the gradient of parameter {report.parameter}"
            if report.parameter
            else "while its output gradient was finite"
        )
        return (
            f"first non-finite gradient of the backward pass: {_what(report)}, {where}; "
            f"{_applied(record)}",
            _hint(
                report,
                "a derivative that is infinite at the edge of its domain (sqrt or a norm "
                "at 0, log at 0, division by 0): add an epsilon",
            ),
        )


_WHERE_TRAP = (
    "the torch.where gradient trap: backward runs through the branch torch.where did "
    "not pick too, and the NaN/Inf it makes there ({made}) poisons the gradient "
    "although the loss picked a finite value. Mask the inputs, not the output: "
    "s / n.clamp_min(1) rather than torch.where(n > 0, s / n, 0); for a log or sqrt, "
    "clamp its argument (x.clamp_min(eps))"
)
_LOSS_BACKWARD_HINT = (
    "the loss is finite but its backward is not: most often a torch.where guard whose "
    "branch not taken is NaN/Inf (torch.where(n > 0, s / n, 0) still backpropagates "
    "through s / n: mask the inputs instead, s / n.clamp_min(1)), or a derivative "
    "infinite at the edge of its domain in the loss (sqrt or a norm at 0, log at 0): "
    "add an epsilon"
)


def _loss_backward(record: StepRecord, report: NonfiniteReport) -> tuple[str, str]:
    """A finite loss whose backward sent a NaN/Inf into the model: with the op of
    the loss's backward and the line, where its graph names them."""
    loss = record.loss if record.loss is not None else report.loss
    finite = f", while the loss ({loss:.4g}) is finite" if loss is not None else ""
    op = ""
    if report.op:
        line = f" at {report.source}" if report.source else ""
        under = " under a torch.where" if report.under_where else ""
        op = f"; made by the derivative of {report.op}{under}{line}"
    what = _what(dataclasses.replace(report, op=None, source=None))
    if report.under_where:
        made = (
            "a division by a zero count: 0 * inf"
            if report.op == "aten::div"
            else f"the derivative of {report.op} at the edge of its domain"
        )
        hint = _WHERE_TRAP.format(made=made)
    else:
        hint = _hint(report, _LOSS_BACKWARD_HINT)
    return (
        f"first non-finite gradient of the backward pass: {what}, in the loss's "
        f"backward, before the gradient reached the model{finite}{op}; {_applied(record)}",
        hint,
    )


_GRADIENT_OVERFLOW_HINT = (
    "scale the loss with torch.amp.GradScaler (weights kept in fp32 under autocast): "
    "it lowers the scale and skips a step that overflows; or make the loss smaller "
    "(a mean rather than a sum, a smaller static loss scale), or train in bf16, "
    "whose range is fp32's"
)


def _applied(record: StepRecord) -> str:
    """A step no boundary judged was skipped (a GradScaler, the loop's own guard)."""
    if record.source == "passes":
        return "no optimizer step followed it"
    return "the optimizer step applied it"


def _gradient_overflow(
    record: StepRecord, report: NonfiniteReport, loss_out_of_reach: bool = False
) -> tuple[str, str]:
    """fp16's range, not the loss: the loss is finite, or not known to be otherwise.

    ``loss_out_of_reach``: under ``trainwatch run``, which cannot read the loss
    and has no ``monitor.step`` to hand it to."""
    if record.loss is not None:
        cause = (
            f"while the loss ({record.loss:.4g}) is finite: a loss this large, or one "
            "scaled up without a GradScaler, sends back a gradient past fp16's range"
        )
    else:
        handed = "not seen" if loss_out_of_reach else "not handed over (monitor.step(loss=loss))"
        cause = (
            "from a large loss or a loss scale too high (no GradScaler); the loss was "
            f"{handed}, so a loss itself non-finite is not ruled out"
        )
    return (
        "the gradient entering the model's output overflowed float16's range (65504): "
        f"{_what(report)}, {cause}; {_applied(record)}",
        _GRADIENT_OVERFLOW_HINT,
    )


_LOSS_OVERFLOW = (
    "the loss overflowed, not the model: an error so large that its square passes "
    "float32's range (about 3.4e38), from a target or input far outside the data's "
    "range (a corrupt label): check this batch for outliers, drop or clamp them, or "
    "use a robust loss (huber_loss, smooth_l1_loss)"
)


_UNKNOWN_LOSS_HINT = (
    "a non-finite loss: a log of a probability that reached 0 (use cross_entropy / "
    "BCEWithLogitsLoss), NaN or Inf in the targets, a division by a zero count (an "
    "empty mask); or a finite loss whose backward is not: a torch.where guard whose "
    "branch not taken is NaN/Inf (torch.where(n > 0, s / n, 0) still backpropagates "
    "through s / n: mask the inputs instead, s / n.clamp_min(1))"
)


_ENTERING_ALONE_HINT = (
    "the loss function made it, at outputs the model holds at exactly 0: a log (or a "
    "division) of a rate or probability that a ReLU or clamp(min=0) makes 0 "
    "(a Poisson NLL's log(rate)); end the model in softplus or exp, use "
    "poisson_nll_loss(log_input=True), or take log(rate + eps)"
)


def _entering_alone(
    record: StepRecord, report: NonfiniteReport, loss_out_of_reach: bool
) -> tuple[str, str]:
    """Non-finite where it entered the model, kept from every parameter by the model's
    own ReLU or clamp: the loss printed is NaN/Inf, the training goes on as if not."""
    held = record.loss if record.loss is not None else report.loss
    if held is not None:
        loss = f"the loss is non-finite ({held})"
    else:
        handed = "not seen" if loss_out_of_reach else "not handed over (monitor.step(loss=loss))"
        loss = f"the loss ({handed}) is most likely non-finite"
    return (
        f"{loss}: the gradient it sent into the model's output is non-finite "
        f"({_what(report)}) while the model's output was finite; every parameter's "
        "gradient stayed finite, since the model zeroes the gradient at those outputs "
        "(a ReLU or clamp at its end), so the optimizer steps on as if nothing were wrong",
        _ENTERING_ALONE_HINT,
    )


# What a report found where the gradient entered the model says of that gradient.
_ENTERING_FACTS = ("kind", "count", "shape", "dtype", "device")


class NonfiniteLossRule(_ReportRule):
    id = "nonfinite_loss"
    needs = frozenset({"nonfinite_probe"})
    reads = "nonfinite_loss"

    def report(self, record: StepRecord) -> NonfiniteReport | None:
        report = record.nonfinite_loss
        if report is not None and report.module is not None:
            # The loss is never a module's: the alert's module is None.
            report = dataclasses.replace(report, module=None)
        return report

    def data(self, record: StepRecord, report: NonfiniteReport) -> dict[str, Any]:
        """The loss's own facts: ``kind`` and ``loss`` are the loss's, as the message
        tells them. A report found where the gradient entered the model (cause
        ``loss``) describes that gradient (the NaN an inf loss sends back): its
        facts keep their ``entering_`` names, never passed off as the loss's."""
        data = _data(report)
        if report.cause == "loss":
            for key in _ENTERING_FACTS:
                if key in data:
                    data["entering_" + key] = data.pop(key)
        loss = record.loss if record.loss is not None else report.loss
        if loss is not None:
            data["loss"] = loss
            if not math.isfinite(loss):
                data["kind"] = nonfinite_name(loss)
        return data

    def words(self, record: StepRecord, report: NonfiniteReport) -> tuple[str, str]:
        loss = record.loss if record.loss is not None else report.loss
        value = f" ({loss})" if loss is not None else ""
        if report.cause == "unlocated":
            return (
                f"the loss is non-finite{value}; the model ran inside a graph compiled "
                "in place, which no hook sees, so whether its output was already "
                "non-finite is not known",
                _UNLOCATED_HINT,
            )
        if report.largest is not None:
            clipped = ""
            if report.clip_norm is not None and not math.isfinite(report.clip_norm):
                clipped = "; clip_grad_norm_ scales them by max_norm / inf = 0"
            return (
                f"the loss is non-finite{value} while the model's output was finite; "
                "every gradient is finite, but so large that their norm overflows "
                f"(the largest element {report.largest:.3g}, in {report.parameter}){clipped}",
                _LOSS_OVERFLOW,
            )
        if report.gradients_finite:
            return _entering_alone(record, report, self.loss_out_of_reach)
        if report.cause == "loss" and record.loss is None and report.loss is None:
            # Neither handed over nor found where the training code holds it.
            handed = (
                "not seen"
                if self.loss_out_of_reach
                else "not handed over (monitor.step(loss=loss))"
            )
            return (
                "the loss is non-finite, or its backward is: the gradient entering the "
                f"model is non-finite ({_what(report)}) while the model's output was "
                f"finite; the loss was {handed}, so which of the two is not known",
                _UNKNOWN_LOSS_HINT,
            )
        return (
            f"the loss is non-finite{value} while the model's output was finite",
            _hint(
                report,
                "the loss function made it: a log of a probability that reached 0 "
                "(use cross_entropy / BCEWithLogitsLoss), NaN or Inf in the targets, "
                "a division by a zero count (an empty mask), a CTC target its input "
                "cannot align to (ctc_loss gives inf: a target longer than its input "
                "after downsampling; pass zero_infinity=True), or an error so large that "
                "its square overflows (a target far outside the data's range)",
            ),
        )


class NonfiniteParameterRule(Rule):
    id = "nonfinite_parameter"
    needs = frozenset({"nonfinite_probe"})
    reads = "nonfinite_params"

    def evaluate(self, record: StepRecord) -> list[Alert]:
        step = record.nonfinite_params_step
        step = record.step if step is None else step
        written = record.nonfinite_params_written
        if isinstance(written, OriginTold):
            return [
                _knock_on(self, step, owner, params, record.optimizer, written)
                for owner, params in by_owner(record.nonfinite_params).items()
            ]
        if written:
            return [
                self.alert(
                    step,
                    owner,
                    f"{short_names(params)} became non-finite before step {step}'s "
                    "forward, written in place by the training code, not by an "
                    "optimizer's update",
                    "look at what writes into the weights outside optimizer.step(): an EMA "
                    "or momentum update, a clamp or weight constraint, a checkpoint or "
                    "state_dict loaded, a copy from another model",
                    {
                        "parameters": [p.name for p in params],
                        "optimizer": record.optimizer,
                        "cause": "written",
                    },
                )
                for owner, params in by_owner(record.nonfinite_params).items()
            ]
        return [
            self.alert(
                step,
                owner,
                f"{short_names(params)} became non-finite in the optimizer step "
                f"{step} although its gradients were finite (or were written through "
                ".data after it, which no counter sees)",
                "the update blew the weights up: lower the learning rate, "
                + unless_clipping(self, "clip gradients (torch.nn.utils.clip_grad_norm_), ")
                + "or check the optimizer's eps/state; "
                "unless code after optimizer.step() writes into param.data (a clamp)",
                {"parameters": [p.name for p in params], "optimizer": record.optimizer},
            )
            for owner, params in by_owner(record.nonfinite_params).items()
        ]


def _knock_on(
    rule: Rule,
    step: int,
    owner: str,
    params: list[ParamInfo],
    optimizer: int | None,
    origin: OriginTold,
) -> Alert:
    """Weights the training code wrote non-finite after another model's NaN/Inf was
    reported: copied from that model (an EMA update, a target network's sync),
    its cascade; told once, as info, naming the origin it follows."""
    model = f"{origin.model}'s" if origin.model else "another watched model's"
    where = f" in `{origin.module}`" if origin.module else ""
    return rule.alert(
        step,
        owner,
        f"{short_names(params)} became non-finite before step {step}'s forward, written "
        f"by the training code after {model} NaN/Inf reported at step {origin.step}"
        f"{where} ({origin.rule}): most likely copied from that model (an EMA or "
        "target-network update), its knock-on, not a second origin",
        f"fix the origin reported in {origin.model or 'that model'} first; if these weights "
        "take nothing from that model, look at the code that writes them",
        {
            "parameters": [p.name for p in params],
            "optimizer": optimizer,
            "cause": "written",
            "follows": {
                "rule": origin.rule,
                "model": origin.model,
                "module": origin.module,
                "step": origin.step,
            },
        },
        severity="info",
    )
