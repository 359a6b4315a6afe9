"""Which no-grad passes in training mode are evaluations, and which are part of training.

A validation loop that forgot ``model.eval()`` runs no-grad passes in a row, or
one now and then. A GAN's discriminator step samples its generator under
``no_grad`` between the generator's own training passes, every step, and wants
batch norm in training mode there. So:

- two no-grad passes in a row (no training pass between): an evaluation loop,
  reported at once;
- a single one between training passes: held until the next step boundary
  has shown whether it recurs. Recurring every step, it is part of training
  and stays silent; not recurring, it is a periodic evaluation and is
  reported then, with the step it ran in.

Whatever is still held when the monitor closes is reported then.
"""

from __future__ import annotations

from trainwatch.record import StepRecord


class EvalPassJudge:
    def __init__(self) -> None:
        self._held: list[StepRecord] = []
        self.in_a_row = 0  # no-grad training-mode passes since the last training pass
        self._isolated_now = False  # this interval had one, followed by a training pass
        self._isolated_before = False  # and so had the interval before
        self._recurring = False  # it happens every step: part of training

    def nograd_pass(self, record: StepRecord) -> list[StepRecord]:
        """A no-grad pass with mode-dependent modules in training mode."""
        self.in_a_row += 1
        if self.in_a_row >= 2:
            due, self._held = [*self._held, record], []
            return due
        if self._recurring:
            return []
        self._held.append(record)
        return []

    def training_pass(self) -> None:
        if self.in_a_row == 1:
            self._isolated_now = True
        self.in_a_row = 0

    def step_boundary(self) -> list[StepRecord]:
        isolated, self._isolated_now = self._isolated_now, False
        if isolated and self._isolated_before:
            self._recurring = True
            self._held = []
        elif not isolated:
            self._recurring = False
        self._isolated_before = isolated
        if self._held and not isolated:
            # The held pass did not come back this step: an evaluation.
            due, self._held = self._held, []
            return due
        return []

    def flush(self) -> list[StepRecord]:
        due, self._held = self._held, []
        return due
