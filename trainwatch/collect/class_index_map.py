"""A class-index label map broadcast over the model's C channels in the loss.

A hand-written multi-class Dice loss pairs softmax probabilities ``(N, C, H, W)``
with the mask as it comes: ``mask.unsqueeze(1).float()``, ``(N, 1, H, W)``,
holding class indices 0..C-1, not one 0/1 map per class. The product
broadcasts the map across the C channels: no error, and the loss still falls
(each channel is pushed toward the class index rather than toward whether the
pixel is of that class), while the model learns no segmentation. The same
holds for ``(probs - target) ** 2``, for 3D volumes ``(N, C, D, H, W)`` against
``(N, 1, D, H, W)``, and beside a cross-entropy given the right ``(N, H, W)``
target.

The shapes alone cannot tell it: a 0/1 validity mask ``(N, 1, H, W)`` that
blanks an ignored region, or a per-pixel weight map, broadcasts the same way on
purpose. The values can: a class-index map holds whole numbers, at least 0 and
at most C-1, and more than two of them (a map of 0s and 1s is a mask, and with
C = 2 a class map cannot be told from one, so two channels are never judged).
Segmentation labels often mark the pixels to ignore with one value outside the
classes: 255 (VOC's border, Cityscapes' void) or a negative one (-1, -100, the
``ignore_index`` of ``cross_entropy``). One such value beside the indices still
makes a class map; it adds no class, so a 0/255 binary mask stays a mask.
The evidence is measured on the device at the op, on the broadcast audit's
steps only (``collect/broadcast.py``), and read once at the step's end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainwatch.collect.tensors import spread_rows

# Fewer channels leave no room for a third class index beside a 0/1 mask's values.
MIN_CLASSES = 3
# Samples of the target measured: enough to meet a third class, few enough to
# cost little on a 3D volume.
_SAMPLES = 16
# Ops whose operands are not the pair compared: ``where``'s first is a condition.
_NOT_PAIRS = frozenset({"where"})
# The ignore value above the classes that segmentation datasets use (VOC, Cityscapes).
IGNORED_ABOVE = 255


def broadcast_channel(name: str, output: tuple[int, ...], target: tuple[int, ...]) -> int | None:
    """The axis where ``target``'s size 1 meets ``output``'s C >= 3 channels, every
    other axis equal (``(N, 1, H, W)`` against ``(N, C, H, W)``: 1); None otherwise.

    A map needs axes beside the batch and the channels: an ``(N, 1)`` value per
    sample against ``(N, C)`` scores is a per-sample weight as often as a label.
    """
    if name in _NOT_PAIRS or len(output) != len(target) or len(output) < 3:
        return None
    differing = [i for i, (o, t) in enumerate(zip(output, target)) if o != t]
    if len(differing) != 1:
        return None
    axis = differing[0]
    if axis == 0 or target[axis] != 1 or output[axis] < MIN_CLASSES:
        return None
    return axis


def is_ignore_value(value: float) -> bool:
    """A label value that marks pixels to ignore rather than a class: 255, or below 0."""
    return value == IGNORED_ABOVE or value < 0


def class_index_evidence(target: torch.Tensor, classes: int) -> torch.Tensor | None:
    """On the device, without a sync: of a few samples of ``target``, ``[whole
    numbers, smallest and largest value in 0..classes-1, a value of that range
    strictly between them, smallest and largest value outside it]`` (whole numbers
    between their smallest and largest value take more than two values exactly
    when one lies strictly between; the values outside are one ignore value when
    their smallest is their largest). A bound of no value is infinite. None for
    what cannot hold class indices."""
    if target.dtype == torch.bool or target.is_complex() or target.numel() == 0:
        return None
    with torch.no_grad():
        values = spread_rows(target.detach(), _SAMPLES).float()
        whole = (values == values.round()).all()
        inside = (values >= 0) & (values <= classes - 1)
        infinite = torch.tensor(float("inf"), device=values.device)
        low = torch.where(inside, values, infinite).amin()
        high = torch.where(inside, values, -infinite).amax()
        between = (inside & (values > low) & (values < high)).any()
        outside_low = torch.where(inside, infinite, values).amin()
        outside_high = torch.where(inside, -infinite, values).amax()
        return torch.stack([whole.float(), low, high, between.float(), outside_low, outside_high])


@dataclass(frozen=True)
class ClassMapValues:
    """What a class-index map was measured to hold."""

    low: int  # its smallest class index
    high: int  # its largest
    ignored: int | None  # the value marking pixels to ignore, where it holds one


@dataclass
class PendingClassMap:
    """One op measured, until the step's end reads its evidence."""

    evidence: torch.Tensor
    name: str  # the op, as torch names it
    shapes: tuple[tuple[int, ...], tuple[int, ...]]  # its operands', in order
    output: tuple[int, ...]  # the model's side
    axis: int  # the channel axis the map is broadcast over
    source: str | None
    module: str | None

    def values(self) -> ClassMapValues | None:
        """The map's class indices and its ignore value, where the evidence says it is
        a class map (one read to the host: audited steps only); None where it is not."""
        whole, low, high, between, outside_low, outside_high = self.evidence.tolist()
        if not (whole and between):
            return None
        ignored = None
        if outside_low <= outside_high:  # values outside the classes
            if outside_low != outside_high or not is_ignore_value(outside_low):
                return None  # more than one, or one that is no ignore value
            ignored = int(outside_low)
        return ClassMapValues(int(low), int(high), ignored)
