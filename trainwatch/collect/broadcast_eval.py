"""The broadcast audit of an evaluation: what the loop computes from the model's outputs.

A validation loss written ``((pred - y) ** 2).mean()`` with ``pred (N, 1)``
and ``y (N,)`` averages every prediction against every target: the number
model selection, early stopping or a plateau scheduler acts on is wrong,
while training is fine. The training audit (``collect/broadcast.py``)
follows passes with gradients only, and only over the first steps.

An evaluation pass is a pass of the model without gradients that is not the
target side of a training step (no pass with gradients of the model since
the last step boundary: a DQN's target computed after the online pass is the
training audit's), or any pass without gradients of the model in eval mode;
once the training audit is over, a pass with gradients of the model in eval
mode too (a validation loop without ``no_grad``). The first ``passes`` of
them, and again of each new phase of training (``rearm``), are followed, by
the training audit's own judge, into what the loop computes from them until
the next pass with gradients of the model in training mode starts: the
outputs of one evaluation stay followed across its passes, so a metric over
their ``torch.cat`` is judged too. In an evaluation
everything is computed without gradients, so everything derived from the
outputs is followed, predictions thresholded to booleans and classes from
``argmax`` included, and comparisons are judged besides the training audit's
ops: ``((logits > 0).float() == y).float().mean()`` with ``logits (N, 1)`` and
``y (N,)`` is an accuracy near one half whatever the model. A pairing is
judged only when exactly one operand comes
from the model: distances between two evaluation outputs are on purpose;
and only when the other carries no gradient: a loss pairing a target
network's output (a model of its own, never trained, its every pass without
gradients) with the trained model's prediction is a training loss.

Nothing of this runs on a training step: the monitor hands it a pass only
when gradients are off or the model is in eval mode, and it subscribes to the
model's passes only from an evaluation pass to the next training pass. What
it finds is published as soon as the span of the pass ends (the next pass of
the model starts, or the monitor closes), dated at the step the evaluation
ran: Lightning's sanity check before the first step, or a validation after
the last one, is told like any other. A pass with gradients in eval mode
followed by a backward or a step before the next pass was training after
all (a model trained in eval mode): what it found is dropped (the training
audit judged that loss), it is not counted, and such passes are not taken
for evaluations again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainwatch.collect.broadcast import _COMPARISONS, _ELEMENTWISE, _IN_PASS, BroadcastAudit
from trainwatch.collect.passes import ModelPasses
from trainwatch.process_steps import PROCESS_STEPS
from trainwatch.record import StepRecord


class _EvaluationJudge(BroadcastAudit):
    """The training audit's judge, following an evaluation's outputs."""

    phase = "evaluation"
    # An accuracy compares predictions with targets: ``(pred > 0).float() == y``.
    judged_ops = _ELEMENTWISE | _COMPARISONS

    def _follows(self, tensor: torch.Tensor, name: str) -> bool:
        """No gradient to go by: everything made from the outputs, thresholded
        predictions and ``argmax(1, keepdim=True)``'s classes too."""
        return True

    def _measure_target(self, operands: list[torch.Tensor]) -> None:
        """An evaluation's targets are no reference for a training output's spread."""

    def _judge(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Only a prediction against its target. The other side carrying a gradient is
        no evaluation's: a training loss that takes a target network's output (a DQN's,
        watched as a model of its own), which the trained model's audit judges."""
        derived = self._derived(a)
        if derived != self._derived(b) and not (b if derived else a).requires_grad:
            super()._judge(name, a, b)

    def forget(self) -> None:
        """A training pass starts: the evaluation's outputs are no longer followed."""
        self.stop()
        self._tracked.clear()
        self._given.clear()
        self._class_maps.clear()
        self._batch = None


def _training_marks() -> tuple[int, int]:
    """Backward passes and steps of the process: moved when a pass was trained on."""
    return PROCESS_STEPS.backwards, PROCESS_STEPS.taken


class EvaluationAudit:
    """Follows the first evaluation passes of a run; a listener of the model's
    passes only between an evaluation pass and the next training pass."""

    def __init__(
        self,
        passes: int,
        step_of: Callable[[], int],
        publish: Callable[[StepRecord], None],
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self.passes_left = passes
        self._step_of = step_of
        self._publish = publish
        self.follower = _EvaluationJudge(1, on_error)  # one "step": ours are counted in passes
        self._passes: ModelPasses | None = None  # subscribed to, while following
        self._step = 0  # the step the followed pass ran at
        # For a pass with gradients: the process's training marks at its end.
        self._marks: tuple[int, int] | None = None
        self.grad_passes = True  # passes with gradients in eval mode may be evaluations

    @property
    def live(self) -> bool:
        return self.passes_left > 0 and self.follower.live

    def evaluation_ends(self, output: Any, grad: bool, passes: ModelPasses | None) -> None:
        """An evaluation pass ended: follow its output into what the loop makes of it."""
        judge = self.follower
        if not self.live or passes is None:
            return
        self.passes_left -= 1
        self._step = self._step_of()
        self._marks = _training_marks() if grad else None
        judge.start(output)
        if self._passes is None:
            self._passes = passes
            passes.subscribe("broadcast audit of evaluations", self)

    # -- a listener of the model's passes while following ------------------------
    def pass_starts(self, module: nn.Module) -> None:
        """The span of the last evaluation pass ends; a training pass ends the following."""
        judge = self.follower
        judge.pass_starts()  # the model's own ops are not what the loop computes
        trained, record = self._settle()
        if not self.live:
            self._rest()
        elif trained or (torch.is_grad_enabled() and module.training):
            judge.forget()
            _IN_PASS.discard(judge)  # no pass_ends comes once unsubscribed
            self._leave_passes()
        if record is not None:
            self._publish(record)

    def pass_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        _IN_PASS.discard(self.follower)

    def _settle(self) -> tuple[bool, StepRecord | None]:
        """What the last pass's span found, as a record to publish. Whether that
        pass, one with gradients, was trained on since: no evaluation, nothing told."""
        judge = self.follower
        found = judge.take_findings()
        marks, self._marks = self._marks, None
        if marks is not None and marks != _training_marks():
            self.passes_left += 1
            self.grad_passes = False
            return True, None
        if not found:
            return False, None
        record = StepRecord(step=self._step, source="forward")
        record.broadcasts = found
        return False, record

    def flush(self) -> list[StepRecord]:
        """At close: the last evaluation's findings, and nothing of this stays."""
        record = None
        if self._passes is not None:
            self.follower.stop()
            record = self._settle()[1]
        self.detach()
        return [] if record is None else [record]

    def _rest(self) -> None:
        """Its passes used up: nothing followed, no listening, until a new phase
        of training re-arms it (``rearm``)."""
        judge = self.follower
        judge.forget()
        _IN_PASS.discard(judge)
        self._leave_passes()

    def rearm(self, passes: int) -> None:
        """A new phase of training, or a dataset first evaluated: its first evaluation
        passes are followed too (a new task comes with its own validation loss, a test
        set with its own metrics). Never after a failure or close."""
        if not self.follower.ended:
            self.passes_left = max(self.passes_left, passes)

    def _leave_passes(self) -> None:
        passes, self._passes = self._passes, None
        if passes is not None:
            passes.unsubscribe(self)

    def detach(self) -> None:
        self.passes_left = 0
        self.follower.detach()
        self._leave_passes()
