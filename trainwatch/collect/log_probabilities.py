"""Raw logits fed to ``nll_loss``, which expects log-probabilities.

``F.nll_loss(x, y)`` is ``-x[y]`` averaged: given a model's raw scores (the
``log_softmax`` dropped from ``forward``, or ``nn.NLLLoss`` where
``nn.CrossEntropyLoss`` was meant) it is unbounded below. The loss falls to
-1e24 as the target's score grows without limit, and the model learns nothing
useful; the gradient norm that explodes along the way points at the learning
rate, the wrong cause. The graph cannot tell it (a ``Linear`` feeding the loss
is also what a gather of scores looks like); the values can: a log-probability
is never above 0, and each row's ``logsumexp`` over the class dimension (dim 1;
``(N, C, d1, ...)`` for segmentation and sequences) is 0, up to rounding (also
in bf16), with masked classes at ``-inf``. A few rows are measured on the
device at the call and read at the step's end, on the broadcast audit's steps
only (``collect/broadcast.py``).

``nll_loss`` is also a gather: ``-F.nll_loss(scores, idx, reduction="none")``
reads ``scores[idx]`` (a conditional GAN's discriminator output, a point
process's log-intensities, a margin loss's target logit). Its result negated,
directly or through a sum, mean or reshape, is such a gather and is not told.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

# A log-probability above this is no rounding of one at or below 0.
POSITIVE_TOLERANCE = 1e-2
# A row whose probabilities sum outside [e^-0.5, e^0.5] (0.61 to 1.65) is no
# distribution: rounding in bf16 moves a 128k-class row's logsumexp by about 0.03.
LOGSUMEXP_TOLERANCE = 0.5
# Rows measured: samples, and positions of each along its extra dimensions.
_SAMPLES = 16
_POSITIONS = 16
# Ops that negate their first operand (``-nll``, ``0 - nll``) or their second
# (``ll - nll``, ``ll -= nll``).
_NEGATE_FIRST = frozenset({"neg", "negative", "__neg__", "neg_", "rsub", "__rsub__"})
_NEGATE_SECOND = frozenset({"sub", "subtract", "__sub__", "sub_", "__isub__"})
_SCALES = frozenset({"mul", "multiply", "__mul__", "__rmul__", "mul_", "__imul__"})
# Ops through which the gather's result is still itself, negated later.
_CARRIES = frozenset(
    {
        "sum",
        "mean",
        "view",
        "reshape",
        "squeeze",
        "unsqueeze",
        "flatten",
        "__getitem__",
        "float",
        "to",
        "masked_fill",
        "where",
    }
)


def _input_and_target(args: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    given = args[0] if args else kwargs.get("input")
    target = args[1] if len(args) > 1 else kwargs.get("target")
    return given, target


def _ignore_index(args: Any, kwargs: dict[str, Any]) -> Any:
    # nll_loss(input, target, weight, size_average, ignore_index, reduce, reduction)
    return args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)


def log_probability_gap(args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """On the device: ``[largest value, largest |logsumexp| of a row]`` of a few rows
    of ``nll_loss``'s input whose target is not ``ignore_index`` (``-inf`` and 0 when
    none is). None where there is nothing to measure."""
    given, target = _input_and_target(args, kwargs)
    if not isinstance(given, torch.Tensor) or not isinstance(target, torch.Tensor):
        return None
    if not given.is_floating_point() or given.dim() == 0 or given.numel() == 0:
        return None
    with torch.no_grad():
        rows, labels = _rows(given.detach(), target.detach())
        rows = rows.float()
        top = rows.amax(dim=1)
        lse = torch.logsumexp(rows, dim=1)
        # A row all -inf (every class masked), not finite, or all zero (a padded
        # position's row multiplied out by its mask) is not judged.
        kept = (labels != _ignore_index(args, kwargs)) & lse.isfinite() & top.isfinite()
        kept &= rows.ne(0).any(dim=1)
        return torch.stack(
            [
                top.masked_fill(~kept, float("-inf")).amax(),
                lse.abs().masked_fill(~kept, 0.0).amax(),
            ]
        )


def _rows(given: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A few rows over the class dimension (dim 1; dim 0 unbatched) and their targets."""
    if given.dim() == 1:
        return given[None], target.reshape(1)
    n = min(given.shape[0], _SAMPLES)
    given, target = given[:n], target[:n]
    if given.dim() == 2:
        return given, target.reshape(-1)
    flat = given.flatten(2)  # (n, C, positions)
    labels = target.reshape(n, -1)
    positions = flat.shape[2]
    if positions > _POSITIONS:
        picked = torch.linspace(0, positions - 1, _POSITIONS, device=flat.device).long()
        flat, labels = flat.index_select(2, picked), labels.index_select(1, picked)
    return flat.transpose(1, 2).reshape(-1, flat.shape[1]), labels.reshape(-1)


@dataclass
class RawLogitsJudgement:
    """One ``nll_loss`` call measured, until the step's end reads it."""

    gap: torch.Tensor
    result: weakref.ref[torch.Tensor] | None
    source: str | None
    module: str | None
    negated: bool = False


class PendingNll:
    """The step's ``nll_loss`` calls measured; a result negated later is a gather."""

    def __init__(self) -> None:
        self.judgements: list[RawLogitsJudgement] = []
        # By id: the loss's result, and what only carries it (its sum, a view).
        self._results: dict[int, tuple[weakref.ref[torch.Tensor], RawLogitsJudgement]] = {}

    def add(self, gap: torch.Tensor, result: Any, source: str | None, module: str | None) -> None:
        ref = weakref.ref(result) if isinstance(result, torch.Tensor) else None
        judgement = RawLogitsJudgement(gap, ref, source, module)
        self.judgements.append(judgement)
        if ref is not None:
            self._results[id(result)] = (ref, judgement)

    def _judgement_of(self, value: Any) -> RawLogitsJudgement | None:
        if not isinstance(value, torch.Tensor):
            return None
        entry = self._results.get(id(value))
        return entry[1] if entry is not None and entry[0]() is value else None

    def after_op(self, name: str, args: Any, out: Any) -> None:
        """An op of the step's loss: does it negate (or carry) a measured result?"""
        first = self._judgement_of(args[0]) if args else None
        second = self._judgement_of(args[1]) if len(args) > 1 else None
        if first is None and second is None:
            return
        if name in _NEGATE_FIRST and first is not None:
            first.negated = True
        elif name in _NEGATE_SECOND and second is not None:
            second.negated = True
        elif name in _SCALES:
            other = args[1] if first is not None else args[0]
            if isinstance(other, (int, float)) and other < 0:
                (first or second).negated = True  # type: ignore[union-attr]
        elif name in _CARRIES and first is not None and isinstance(out, torch.Tensor):
            self._results[id(out)] = (weakref.ref(out), first)

    def take(self) -> list[tuple[RawLogitsJudgement, float, float]]:
        """The judgements not negated, with their largest value and |logsumexp|
        read to the host (one read per call measured: audited steps only)."""
        found = []
        for judgement in self.judgements:
            if judgement.negated:
                continue
            top, lse = judgement.gap.tolist()
            if top > POSITIVE_TOLERANCE or lse > LOGSUMEXP_TOLERANCE:
                found.append((judgement, top, lse))
        self.clear()
        return found

    def clear(self) -> None:
        self.judgements.clear()
        self._results.clear()
