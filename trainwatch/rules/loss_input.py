"""A loss given the wrong kind of scores: ``softmax`` before ``CrossEntropyLoss``, raw
logits into ``nll_loss``."""

from __future__ import annotations

from trainwatch.alert import Alert
from trainwatch.config import LossInputConfig
from trainwatch.record import LossInputReport, StepRecord
from trainwatch.rules.base import Rule

# By kind: what the loss is given, what it expects, what that does, and the fix.
_TOLD = {
    "softmax_into_cross_entropy": (
        "the output of a softmax",
        "logits: it applies log_softmax itself, so the softmax is applied twice, every "
        "input lies in (0, 1), the gradient all but vanishes and a classifier trains "
        "to a fraction of the accuracy it should reach",
        "give cross_entropy the raw logits: remove the softmax {place} (apply it only at "
        "inference, where probabilities are wanted), or take log_softmax and use nll_loss",
    ),
    "softmax_into_nll": (
        "the output of a softmax",
        "log-probabilities: it takes -p[target], not -log p[target], a loss that "
        "barely rewards the right class",
        "use log_softmax instead of softmax before nll_loss, or give the logits to cross_entropy",
    ),
    "logits_into_nll": (
        "raw logits, not log-probabilities ({measured})",
        "log-probabilities (all at most 0, each row's logsumexp 0): it takes -x[target], "
        "which falls without bound as the target's score grows, so the loss heads for -inf "
        "(an exploding gradient on the way) and the model learns nothing useful",
        "apply F.log_softmax(x, dim=1) to nll_loss's input (or end forward with it), or "
        "give the logits to F.cross_entropy (nn.CrossEntropyLoss), which applies "
        "log_softmax itself; lowering the learning rate only slows the fall",
    ),
    "sigmoid_into_bce_with_logits": (
        "the output of a sigmoid",
        "logits: it applies sigmoid itself, so the sigmoid is applied twice and every "
        "prediction is squeezed into (0.5, 0.73): the loss cannot fall and the gradient "
        "all but vanishes",
        "give binary_cross_entropy_with_logits the raw logits: remove the sigmoid {place} "
        "(apply it only at inference), or keep it and use binary_cross_entropy (nn.BCELoss)",
    ),
    "sigmoid_into_cross_entropy": (
        "the output of a sigmoid",
        "logits: it applies log_softmax itself, so every input lies in (0, 1), the "
        "classes' scores differ by less than 1, the gradient all but vanishes and a "
        "classifier trains to a fraction of the accuracy it should reach",
        "give cross_entropy the raw logits: remove the sigmoid {place}; for a yes/no "
        "target with one output use binary_cross_entropy_with_logits",
    ),
    "softmax_into_bce_with_logits": (
        "the output of a softmax",
        "logits: it applies sigmoid itself, so every prediction is squeezed into "
        "(0.5, 0.73): the loss cannot fall and the gradient all but vanishes",
        "give binary_cross_entropy_with_logits the raw logits: remove the softmax "
        "{place} (for one class per sample, use cross_entropy on the logits)",
    ),
    "softmax_into_kl_div": (
        "the output of a softmax",
        "log-probabilities as its input (the first argument): it computes "
        "target * (log target - input), so probabilities taken for log-probabilities "
        "make a loss that is no divergence (it goes negative) and pull the model the "
        "wrong way",
        "use log_softmax instead of softmax for kl_div's input {place}; the target "
        "stays probabilities (or log-probabilities with log_target=True)",
    ),
}
_CLASSES = {
    "cross_entropy": "nn.CrossEntropyLoss",
    "nll_loss": "nn.NLLLoss",
    "binary_cross_entropy_with_logits": "nn.BCEWithLogitsLoss",
    "kl_div": "nn.KLDivLoss",
}


class LossInputRule(Rule):
    """Told once per kind and source line: the audit looks at the first steps of each
    phase and at sparse sampled steps, and the same loss line is the same fix."""

    id = "loss_input"
    needs = frozenset({"broadcast_audit"})
    reads = "loss_inputs"
    config: LossInputConfig

    def __init__(self, config: LossInputConfig) -> None:
        super().__init__(config)
        self.told: set[tuple[str, str | None]] = set()

    def evaluate(self, record: StepRecord) -> list[Alert]:
        alerts = []
        for found in record.loss_inputs:
            key = (found.kind, found.source)
            if key in self.told:
                continue
            self.told.add(key)
            alerts.append(self._alert(record.step, found))
        return alerts

    def _alert(self, step: int, found: LossInputReport) -> Alert:
        given, expects, hint = _TOLD[found.kind]
        if found.kind == "logits_into_nll":
            given = given.format(measured=_measured(found))
        where = " in the model's forward" if found.in_forward else ""
        at = f" at {found.source}" if found.source else ""
        loss = f"{found.loss} ({_CLASSES[found.loss]})"
        data = {
            "kind": found.kind,
            "loss": found.loss,
            "source": found.source,
            "in_forward": found.in_forward,
        }
        if found.largest is not None:
            data["largest"] = found.largest
            data["logsumexp"] = found.logsumexp
        return self.alert(
            step,
            found.module,
            f"{loss}{at} is given {given}{where}, where it expects {expects}",
            hint.format(place="from forward" if found.in_forward else "before the loss"),
            data,
        )


def _measured(found: LossInputReport) -> str:
    """What the values showed: a value above 0, a row's logsumexp far from 0."""
    told = []
    if found.largest is not None and found.largest > 0:
        told.append(f"values up to {found.largest:.3g}")
    if found.logsumexp is not None:
        told.append(f"a row whose logsumexp is {found.logsumexp:.3g} away from 0")
    return " and ".join(told)
