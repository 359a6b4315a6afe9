"""A loss term that broadcast a batch axis against another: ``(N, 1)`` with ``(N,)``."""

from __future__ import annotations

from typing import Any

from trainwatch.alert import Alert
from trainwatch.config import BroadcastConfig
from trainwatch.record import BroadcastReport, StepRecord
from trainwatch.rules.base import Rule


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _size_one_axes(high: tuple[int, ...], low: tuple[int, ...]) -> list[int]:
    """The size-1 axes of ``high`` to squeeze, for the hint: those without which it is
    ``low`` (of a one-channel map ``(N, 1, H, W)`` against ``(N, H, W)``, axis 1), or
    else the one that meets the other's samples (``(N, 1, 1)`` against ``(N, K)``)."""
    rank, found, i = len(high), [], 0
    for position, size in enumerate(high):
        if i < len(low) and low[i] == size:
            i += 1
        elif size == 1:
            found.append(position)
        else:
            break
    if i == len(low) and found:
        return found
    padded = (1,) * (rank - len(low)) + tuple(low)
    for j in range(1, rank):
        if high[j] == 1 and padded[j] > 1 and any(high[k] == padded[j] for k in range(j)):
            return [j]
    return [rank - 1]


def _squeezes(high: tuple[int, ...], low: tuple[int, ...]) -> tuple[str, str]:
    """How the hint makes the two sides equal: squeezing ``high``, reshaping ``low``.
    The last axis is named ``-1``, as an ``(N, 1)`` output is usually squeezed."""
    axes = _size_one_axes(high, low)
    if len(axes) > 1:
        return f".squeeze({tuple(axes)})", ".view_as(other)"
    axis = -1 if axes[0] == len(high) - 1 else axes[0]
    return f".squeeze({axis})", f".view_as(other) / .unsqueeze({axis})"


class BroadcastRule(Rule):
    """One finding for training and one for evaluation: an evaluation seen first (a
    Lightning sanity check, a baseline validation before training) must not absorb
    the training finding a shared loss helper raises next, whose hint is not the
    evaluation's "training itself may be sound". A line told in training is not
    told again for an evaluation: the same fix mends both."""

    id = "broadcast"
    needs = frozenset({"broadcast_audit"})
    reads = "broadcasts"
    config: BroadcastConfig

    def __init__(self, config: BroadcastConfig) -> None:
        super().__init__(config)
        self.training_sources: set[str] = set()  # the lines told in training

    def evaluate(self, record: StepRecord) -> list[Alert]:
        alerts = []
        for found in record.broadcasts:
            first, second = found.shapes
            high, low = (first, second) if len(first) > len(second) else (second, first)
            where = f" at {found.source}" if found.source else ""
            evaluation = found.phase == "evaluation"
            if evaluation and found.source and found.source in self.training_sources:
                continue
            if not evaluation and found.source:
                self.training_sources.add(found.source)
            data = {
                "op": found.op,
                "shapes": [list(s) for s in found.shapes],
                "result": list(found.result),
                "source": found.source,
                "phase": found.phase,
            }
            if evaluation:
                data["finding"] = "evaluation"  # counted apart from training's
            if found.kind == "class_index_map":
                alerts.append(self._class_map_alert(record.step, found, data))
                continue
            alerts.append(
                self.alert(
                    record.step,
                    found.module,
                    f"{found.op} of {_shape(first)} and {_shape(second)} broadcast to "
                    f"{_shape(found.result)}{where}"
                    f"{' in an evaluation pass' if evaluation else ''}: every sample is "
                    "paired with every other sample's value",
                    _hint(high, low, evaluation),
                    data,
                )
            )
        return alerts

    def _class_map_alert(self, step: int, found: BroadcastReport, data: dict[str, Any]) -> Alert:
        """A class-index map ``(N, 1, H, W)`` broadcast over the output's C channels."""
        output = found.result
        axis = found.axis if found.axis is not None else 1
        low, high = found.values or (0, output[axis] - 1)
        first, second = found.shapes
        target = second if tuple(first) == tuple(output) else first
        data.update(kind="class_index_map", classes=output[axis], channel_axis=axis)
        data["values"] = [low, high]
        data["ignored"] = found.ignored
        ignored = "" if found.ignored is None else f", and {found.ignored} for pixels to ignore"
        where = f" at {found.source}" if found.source else ""
        evaluation = found.phase == "evaluation"
        return self.alert(
            step,
            found.module,
            f"{found.op} of {_shape(first)} and {_shape(second)}{where}"
            f"{' in an evaluation pass' if evaluation else ''}: the {_shape(target)} side "
            f"holds class indices ({low} to {high}{ignored}), broadcast over the output's "
            f"{output[axis]} channels: every channel is paired with the class index, "
            "not with its own 0/1 target",
            _class_map_hint(output, axis, evaluation, found.ignored),
            data,
        )


def _hint(high: tuple[int, ...], low: tuple[int, ...], evaluation: bool) -> str:
    """How to mend it, and what it does. A ``high`` side ending in ``low``'s whole
    shape met it axis for axis: it held the batch twice before the op."""
    if tuple(high[len(high) - len(low) :]) == tuple(low):
        return (
            f"the {_shape(high)} side pairs the samples before this op: an axis of the "
            f"batch's size stands before the {_shape(low)} it shares with the other side, "
            "left by an earlier broadcast (a mixup coefficient shaped (N, 1, 1, 1) for the "
            "images reused on (N, C) targets); shape what made it like the "
            f"{_shape(low)} side (lam.view(-1, 1)). "
            + (_EVALUATION.capitalize() if evaluation else _PAIRED_TARGETS)
        )
    squeeze, reshape = _squeezes(high, low)
    return (
        f"make the shapes equal before the op: squeeze the {_shape(high)} "
        f"side ({squeeze}) or reshape the {_shape(low)} side to match "
        f"({reshape}); " + (_EVALUATION if evaluation else _training(high))
    )


_PAIRED_TARGETS = (
    "Each output is trained against every sample's target, not its own: the loss "
    "still falls, toward the batch's average."
)
_TRAINING = (
    "A regression trained like this collapses to predicting the target mean; a policy "
    "gradient loses every per-action signal."
)
_STACKED = (
    "if that side was stacked from per-step (1,) tensors (a policy's log-probabilities), "
    "torch.cat them instead of torch.stack. "
)


def _training(high: tuple[int, ...]) -> str:
    """The consequence in training; the stacking story only where the shape allows it:
    per-step ``(1,)`` tensors stacked make ``(T, 1)``."""
    return (_STACKED if len(high) == 2 and high[-1] == 1 else "") + _TRAINING


_EVALUATION = (
    "the number computed (a validation loss, a metric) is not the one meant: model "
    "selection, early stopping or a scheduler on a plateau act on a wrong value, though "
    "training itself may be sound."
)


def _one_hot(output: tuple[int, ...], axis: int) -> str:
    """The one-hot that shapes an index map like ``output``: ``F.one_hot`` puts the
    classes last, ``permute`` moves them to the channel ``axis``."""
    rank, classes = len(output), output[axis]
    made = f"F.one_hot(mask, {classes})"
    if axis != rank - 1:
        order = [*range(axis), rank - 1, *range(axis, rank - 1)]
        made += f".permute{tuple(order)}"
    return made + ".float()"


def _class_map_hint(
    output: tuple[int, ...], axis: int, evaluation: bool, ignored: int | None = None
) -> str:
    classes = output[axis]
    mask = _shape(output[:axis] + output[axis + 1 :])
    return (
        f"the target is a class-index map broadcast over the {classes} channels; one-hot it "
        f"so each channel gets its own 0/1 map, shaped {_shape(output)} like the output: "
        f"{_one_hot(output, axis)} from the {mask} long mask (mask.squeeze({axis}).long() "
        f"where it comes with a size-1 channel axis). "
        + ("" if ignored is None else _ignoring(ignored, axis))
        + (
            _EVALUATION.capitalize()
            if evaluation
            else "A Dice or squared-error loss trained like this still falls, but each "
            "channel is pushed toward the class index rather than toward whether the pixel "
            "is of its class: the model learns no segmentation."
        )
    )


def _ignoring(ignored: int, axis: int) -> str:
    """How the one-hot leaves out the pixels marked ``ignored``: F.one_hot refuses the
    value, and an ignored pixel belongs in neither side of the loss."""
    return (
        f"The map marks pixels to ignore with {ignored}, which F.one_hot refuses: take "
        f"valid = (mask != {ignored}), one-hot mask.masked_fill(~valid, 0), and multiply "
        f"both the one-hot and the probabilities by valid.unsqueeze({axis}).float() so "
        "ignored pixels count in neither. "
    )
