"""The class targets a classification loss receives, counted on sampled steps.

Data sorted by label and read in order gives every batch one or two classes.
Nothing in the model shows it; the targets handed to ``cross_entropy`` or
``nll_loss`` do. On a sampled training step a ``TorchFunctionMode`` is active
from the end of the model's forward pass (with gradients on) to the step
boundary, the span in which the loss is computed (on a step the broadcast
audit follows too, the look rides the audit's mode instead: one mode sees
the loss, not two); the first such loss call
with integer targets (or the ``labels`` a model that computes its own loss is
called with) has its targets counted per class on the device
(a ``bincount``, no host sync), and the counts join the step's one readback;
a CPU batch of up to 4096 targets is counted on the host instead, with no
op (each small op costs a launch). The monitor subscribes the look to the model's passes on sampled
steps only (step 0 and every ``every``-th after it: a bug in the data or the
loss is there from the first batch, and is told there), so other steps pay
nothing for it. A class loss over tokens or pixels (a
language model's next-token loss) marks the run as one whose targets vary
within each sample: nothing more to count. The same look measures the
labels such a loss gives padding (:mod:`trainwatch.collect.padded_labels`)
until a finding: a healthy verdict is no reason to stop, as a collate may
break mid-run. A run whose sampled steps show no class loss at all (a
regression), or a token loss (its batches with padding or without), is
looked at half as often after every few such steps, down to a sixteenth of
the cadence, until a class loss shows up again (a classifier trained after a
pretext phase). Where the batches may be of another make from a step on (a
new pass over the training data, a new phase of training), a token loss's
look comes at that step too (:meth:`ClassTargetLook.look_soon`).

The same span also reads the kind of the step's loss at its first ``backward``
(:mod:`trainwatch.collect.loss_kind`), for the broadcast audit to follow a loss
changed mid-run: while it does, the look comes at least every
``broadcast.loss_kind_every`` steps (the slowest pace above is capped there), and
goes on after its class targets and padding are done.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from trainwatch.collect.broadcast import BroadcastAudit, _call, _stack_is_ours_to_use
from trainwatch.collect.loss_kind import KindReader, backward_roots, node_number
from trainwatch.collect.mode_stack import enter_loss_mode
from trainwatch.collect.mode_stack import leave as leave_mode
from trainwatch.collect.padded_labels import PaddingLook
from trainwatch.collect.tensors import tensor_leaves
from trainwatch.record import PaddedLabels

_CLASS_LOSSES = frozenset({"cross_entropy", "nll_loss"})
# The ops of the span the look acts on: a class loss, and the loss's backward.
_LOOKED_FOR = _CLASS_LOSSES | {"backward"}
# Targets of a CPU batch up to this many are counted on the host, with no op.
_COUNTED_ON_HOST = 4096
# A run whose loss is no class loss (a regression, a reconstruction) pays for
# the look's span on every sampled step for nothing: after this many sampled
# steps in a row without one, the look comes half as often, down to once per
# _SLOWEST times the configured cadence; a class loss seen brings it back.
_MISSES = 4
_SLOWEST = 16


def per_position(logits: Any, target: Any, batch: int | None) -> bool:
    """Integer targets per token or pixel: more than one per sample of the model's batch."""
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        return False
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        return False
    if target.dim() >= 2:
        return True
    return target.dim() == 1 and batch is not None and target.shape[0] > batch


def class_counts(
    logits: Any, target: Any, max_classes: int, batch: int | None = None
) -> torch.Tensor | list[float] | None:
    """Per-class counts of ``target``, or None: a float vector on its device, or, for
    a small batch of targets on the CPU, a list of floats counted on the host.

    Classes only: one integer target per sample (``(N,)``, ``N`` the model's
    batch when known) against logits (or log-probabilities) whose axis 1
    holds at most ``max_classes`` classes. Per-token or per-pixel targets are
    left alone: tokens of one text and pixels of one image repeat their
    classes by nature. Targets outside the classes (``ignore_index``) are
    left out.
    """
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        return None
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        return None  # probabilities or soft labels: not classes
    if logits.dim() != 2 or target.dim() != 1 or target.numel() < 2:
        return None
    if batch is not None and target.shape[0] != batch:
        return None
    classes = logits.shape[1]
    if classes < 2 or classes > max_classes:
        return None
    flat = target.detach().reshape(-1)
    if flat.device.type == "cpu" and flat.numel() <= _COUNTED_ON_HOST:
        # Read as ints and counted in one C loop: no op at all (each small op
        # on a sampled step costs a launch, about as much as this whole count).
        counts = [0.0] * classes
        for value, times in Counter(flat.tolist()).items():
            if 0 <= value < classes:
                counts[value] += times
        return counts
    # Every target outside the classes lands in one of two end bins, cut off
    # after: a handful of small ops on a sampled step (one per op's launch).
    bins = flat.long().clamp(-1, classes).add_(1)
    return torch.bincount(bins, minlength=classes + 2)[1 : classes + 1].float()


def _logits_of(output: Any) -> torch.Tensor | None:
    """The class scores of a model output: its ``logits`` field, or its first tensor of rank 2+."""
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if isinstance(logits, torch.Tensor):
        return logits
    return next((t for _, t in tensor_leaves(output) if t.dim() >= 2), None)


class _TargetMode(TorchFunctionMode):
    def __init__(self, look: ClassTargetLook) -> None:
        super().__init__()
        self.look = look

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = _call(func, args, kwargs)  # a loss's own warnings still name the user's line
        self.look.op_seen(func, args, kwargs)
        return out


class ClassTargetLook:
    """Listens to the model's passes; counts a sampled step's class targets, and
    measures the labels it gives padding (:mod:`trainwatch.collect.padded_labels`)."""

    def __init__(
        self,
        every: int,
        max_classes: int,
        step_of: Callable[[], int],
        on_error: Callable[[str, BaseException], None],
        *,
        counts: bool = True,
        padding: PaddingLook | None = None,
        audit: Callable[[], BroadcastAudit | None] | None = None,
        kinds_every: int = 0,
    ) -> None:
        self.every = every
        self._configured_every = every
        # The slowest pace: a sixteenth of the cadence, or while the loss's kind is
        # read here (``on_loss_kind``, a loss computed after the pass), the slowest
        # that still comes every ``kinds_every`` steps (at the configured cadence
        # where that is slower).
        self._slowest_every = every * _SLOWEST
        self._kinds_every = kinds_every
        # Handed the span's loss at its first ``backward`` on a step the broadcast
        # audit does not follow (it hands its own), for its kind to be read: set by
        # the pipeline, with ``read_loss_kinds``.
        self.on_loss_kind: KindReader | None = None
        self._kind_read = False  # this step's
        # The model computes its loss itself (given ``labels``): no kind to read here.
        self._loss_inside = False
        self._last_node = -1  # the latest autograd node of this step's passes
        self._misses = 0
        self._span_seen = False  # this sampled step's training pass opened the span
        # A look asked for at the next token loss (``look_soon``), and the cadence
        # to go on at after it.
        self._asked = False
        self._every_after_ask = every
        self.max_classes = max_classes
        self._step_of = step_of
        self._on_error = on_error
        self._mode = _TargetMode(self)
        self._depth: int | None = None  # the mode stack's depth with ours on top
        # The model's broadcast audit (a getter: the look does not keep it alive), and the
        # one whose mode this span rides: on a step the audit follows, its mode is
        # on the stack over the same span, and a second mode would see every op of
        # the loss again.
        self._audit = audit
        self._riding: BroadcastAudit | None = None
        self.counts: torch.Tensor | list[float] | None = None
        self.batch: int | None = None  # the first dimension of the model's output
        # A class loss over tokens or pixels was seen: targets vary within each sample.
        self.per_position = False
        # Whether the class targets are counted (unshuffled_data), and the padding job
        # (loss_on_padding), open until its verdict.
        self._counting = counts
        self.padding = padding
        # This sampled step's loss was found (counted, per position, or measured).
        self.looked = False
        # This sampled step's labels at padding were measured (the padding job's take).
        self.measured = False
        # No class targets or padding left to look for.
        self.targets_done = not counts and padding is None
        # Nothing left to look for (nor the loss's kind): the monitor stops
        # subscribing the look.
        self.finished = self.targets_done
        # Subscribed to the model's passes (the monitor does it for sampled steps only).
        self.listening = False
        self.broken = False

    # -- the span: from a training pass's output to the step boundary --------
    def pass_starts(self, module: Any) -> None:
        if self._depth is not None or self._riding is not None:
            self._stop()  # the model's own ops are not the loss

    def pass_ends(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        if self.broken or self.finished:
            return
        if self._depth is not None or self._riding is not None:
            return
        if self._step_of() % self.every or not torch.is_grad_enabled():
            return
        counting = not self.looked and not self.targets_done
        reads_kind = self.on_loss_kind is not None and not self._kind_read
        if not counting and not reads_kind:
            return
        tensors = [t for _, t in tensor_leaves(output)]
        self.batch = next((t.shape[0] for t in tensors if t.dim() > 0), None)
        if reads_kind:
            self._last_node = max(self._last_node, *map(node_number, tensors), -1)
        labels = kwargs.get("labels") if isinstance(kwargs, dict) else None
        if isinstance(labels, torch.Tensor):
            # A loss computed inside the model: its kind is the model's own, not read,
            # and its look keeps no pace for the kind.
            self._kind_read = True
            if not self._loss_inside:
                self._loss_inside = True
                self._pace_limit()
            if not counting:
                self._update_finished()
                return
            # The loss is computed inside the model (``model(ids, labels=y)``,
            # Hugging Face style): its targets are the labels handed in.
            self._labels_seen(module, kwargs, labels, output)
            self._span_seen = True
            return
        # The audit's pass_ends ran before this one (it listened first): its mode
        # is on the stack now if it follows this step's loss.
        audit = self._audit() if self._audit is not None else None
        if audit is not None and audit.carries and audit.rider is None:
            audit.rider = self.op_seen
            self._riding = audit
            self._span_seen = True
        elif _stack_is_ours_to_use():
            enter_loss_mode(self._mode)
            self._depth = torch._C._len_torch_function_stack()
            self._span_seen = True

    def op_seen(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """An op of the span (seen by the look's own mode, or the audit's it rides)."""
        # The op's name first: most ops of the span are no class loss, no backward.
        name = getattr(func, "__name__", "")
        if name not in _LOOKED_FOR:
            return
        if name != "backward":
            if not self.looked and not self.targets_done:
                try:
                    self.loss_seen(args, kwargs)
                except Exception as exc:  # never break the user's loss
                    self.fail(exc)
        elif not self._kind_read:
            self._kind_read = True
            told = self.on_loss_kind
            # Riding the audit's mode, the audit hands the loss over itself (audited).
            if told is not None and self._riding is None:
                told(backward_roots(args, kwargs), self._last_node, False)

    def _labels_seen(self, module: Any, kwargs: dict[str, Any], labels: Any, output: Any) -> None:
        logits = _logits_of(output)
        if self._counting and not self.per_position:
            self.counts = class_counts(logits, labels, self.max_classes, self.batch)
            self.per_position = self.counts is None and per_position(logits, labels, self.batch)
        padding = self.padding
        measured = (
            padding is not None
            and padding.open
            and padding.from_labels(module, kwargs, labels, output)
        )
        if self._asked:
            self._answered()
        self.measured = measured
        self.looked = self.counts is not None or self.per_position or measured
        self._update_finished()

    def loss_seen(self, args: Any, kwargs: dict[str, Any]) -> None:
        """A class loss computed after the pass: its targets counted, its padding measured."""
        logits = args[0] if args else kwargs.get("input")
        target = args[1] if len(args) > 1 else kwargs.get("target")
        if self._counting and not self.per_position:
            self.counts = class_counts(logits, target, self.max_classes, self.batch)
        if self.counts is None and per_position(logits, target, self.batch):
            self.per_position = True
            padding = self.padding
            if padding is not None and padding.open:
                self.measured = padding.from_loss(logits, target, kwargs, self.batch)
            if self._asked:
                self._answered()
        self.looked = self.counts is not None or self.per_position
        self._update_finished()

    def _update_finished(self) -> None:
        padding = self.padding
        self.targets_done = (not self._counting or self.per_position) and (
            padding is None or not padding.open
        )
        self.finished = self.targets_done and (self.on_loss_kind is None or self._loss_inside)

    def read_loss_kinds(self, told: KindReader | None) -> None:
        """Hand ``told`` each sampled step's loss for its kind (``collect/loss_kind.py``),
        at least every ``kinds_every`` steps; None: no more (the run's waits are spent)."""
        self.on_loss_kind = told
        self._pace_limit()
        self._update_finished()

    def _pace_limit(self) -> None:
        """The slowest pace (``_slowest_every``) for the loss's kind as it is read now."""
        slowest = self._configured_every * _SLOWEST
        if self.on_loss_kind is not None and not self._loss_inside:
            paced = self._configured_every
            while paced * 2 <= min(self._kinds_every, slowest):
                paced *= 2
            slowest = paced
        self._slowest_every = slowest
        self.every = min(self.every, slowest)

    def end_span(self) -> None:
        """The step boundary is reached: no loss is computed any more."""
        self._stop()

    def take(self) -> torch.Tensor | list[float] | None:
        """At the step boundary: the step's counts (None when not sampled or not seen)."""
        self._stop()
        found, self.counts, self.looked = self.counts, None, False
        self._kind_read, self._last_node = False, -1
        if self._span_seen:
            self._span_seen = False
            if self.targets_done:  # the loss's kind alone: at its own cadence
                self.every = self._slowest_every
            else:
                # A class loss per sample keeps the cadence; one over tokens whose
                # padding is still to be judged (no padded batch yet: packed
                # sequences) does not.
                self._pace(found is not None)
        return found

    def look_soon(self) -> bool:
        """The batches may be of another make from the next training pass on (a new
        pass over the training data, a new phase): where a token loss's padding is
        still looked at, that pass is sampled (then the cadence goes on as it was).
        True: asked (the caller subscribes the look for it, between steps)."""
        padding = self.padding
        if self.broken or padding is None or not padding.open or not padding.reached:
            return False
        if not self._asked:
            self._every_after_ask = self.every
        self._asked, self.every = True, 1
        return True

    def _answered(self) -> None:
        """The look asked for has seen a token loss: the cadence goes on as it was."""
        self._asked = False
        self.every = min(self._every_after_ask, self._slowest_every)

    def take_padding(self) -> tuple[PaddedLabels | None, torch.Tensor | None]:
        """This sampled step's padding finding (read on the host), or its figures to read back."""
        self.measured = False
        found = self.padding.take()  # type: ignore[union-attr]
        self._update_finished()
        return found

    def land_padding(self, values: list[float]) -> PaddedLabels | None:
        """The padding figures read back with the step: the finding, or None."""
        found = self.padding.land(values)  # type: ignore[union-attr]
        self._update_finished()
        return found

    def _pace(self, class_loss_seen: bool) -> None:
        if class_loss_seen:
            self._misses, self.every = 0, self._configured_every
            return
        self._misses += 1
        if self._misses >= _MISSES:
            self._misses = 0
            self.every = min(self.every * 2, self._slowest_every)

    def _stop(self) -> None:
        riding = self._riding
        if riding is not None:
            self._riding = None
            if riding.rider == self.op_seen:
                riding.rider = None
        if self._depth is None:
            return
        if leave_mode(self._mode):
            self._depth = None
        # Otherwise a mode entered after ours is still active: ours stays,
        # inert once counts are taken, and is popped at a later boundary.

    def fail(self, exc: BaseException) -> None:
        self.broken = True
        self._on_error("class target look", exc)

    def detach(self) -> None:
        self.broken = True
        self._stop()
        self.counts = None
