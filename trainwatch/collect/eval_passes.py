"""Which no-grad passes in training mode are evaluations, and which are part of training.

A validation loop that forgot ``model.eval()`` runs no-grad passes in a row, or
one now and then. A GAN's discriminator step samples its generator under
``no_grad`` between the generator's own training passes, every step, and wants
batch norm in training mode there. So:

- three no-grad passes in a row (no training pass between, and, for a model
  with an optimizer of its own, no optimizer step nor backward of a watched
  model between either: a critic stepping, or accumulating a micro-batch,
  between two samples of its generator is training): an evaluation loop,
  reported at once (a halt stops it there), unless the run may be one that
  every step runs (:meth:`EvalPassJudge._may_recur`): before or in the
  model's first training step, about as long as the step before had or
  every step has, or a target's. Such a run is held up to :data:`SHORT_RUN`
  passes, more being an evaluation loop, told at once;
- a short run between training passes, or after the step's training passes
  (pseudo-labels computed last, just before backward; labels guessed over K
  augmentations, as MixMatch does; a double-DQN target's two passes of the
  online network; a mean teacher on K noisy views, DINO's teacher once per
  global crop): held until the next step boundary has shown whether it
  recurs. Recurring every step, about as long (:data:`RUN_SLACK`), it is part
  of training and stays silent; not recurring, it is a periodic evaluation
  and is reported then, with the step it ran in. Once such runs recur, a
  longer one (a validation pass next to the step's own) is reported for its
  passes beyond them.

Calls that feed on the pass before them (a fixed-point solver's twenty
``z = cell(z, u)``, ``collect/pass_chain.py``) come to the judge as one pass.

A no-grad pass whose tensors the next training pass takes (its input, or its
output: diffusion self-conditioning's first estimate, drawn on a random half
of the steps; a solve's fixed point) fed that pass: part of the step, let go
whether or not it recurs (:meth:`EvalPassJudge.training_pass`). A run that
recurs is still an evaluation where it sits after the optimizer step: it
comes before each step's training passes only once the model has stepped, on
a batch of a size none of the step's training passes takes (full-batch
training validated every epoch without ``model.eval()``;
:meth:`EvalPassJudge._after_the_step`). Where the runs sit is followed only
around them: a loop that makes no no-grad pass asks one attribute a step.

Whatever is still held when the monitor closes is reported then. One or two
passes before the model's first training pass are a check of the model just
built (``assert model(torch.zeros(2, 10)).shape == ...`` under ``no_grad``),
not an evaluation: they are let go at that first training pass. A longer run
there (a baseline evaluation) is a short run like any other: told at the next
step boundary unless it recurs.

The step of another model between two passes counts for a model with an
optimizer of its own only once that model has trained: before its first
training pass, a generator sampled once per critic step and a teacher whose
optimizer was built but never steps (loaded from a checkpoint, it forgot
``teacher.eval()``) look the same. Such passes are held, their weights
unchanged: the generator's first training pass lets them go (a critic takes a
hundred steps at most before it, the original WGAN's warm-up);
:data:`IDLE_PASSES` of them with none, or any still held when the monitor
closes, are an evaluation, told with the step of the first.

A model whose weights changed between two such passes with no training pass
of its own between them is trained another way: an EMA or momentum target
(BYOL, MoCo, a mean teacher), copied from the online network every step,
runs in training mode under ``no_grad`` on purpose. The weights are told by
their first parameter (``weights_moved``): its version counter, its storage
and a few of its values, so an EMA in place under ``no_grad``, one assigned
to ``param.data`` and one written into ``param.data`` in place all show.

A target runs at every step of the network it follows (once per step, or
once per view or crop). An EMA copy kept for evaluation moves just the same, but is
run only now and then: passes :data:`SPARSE_GAP` or more steps of the
process apart (every model's steps, on one clock) with its weights moved in
between are an evaluation of that copy, one that forgot ``ema.eval()``.

A target's last short run, still held when the monitor closes, has no next
pass to show its weights moving: once seen moving as a target, it is let go.
A model with no step boundary of its own has its short runs judged at its
next pass (its weights moved: a target; or not, the run going on across a
step: told). A model never trained here and never seen moving so, whose
short run of no-grad passes is all it ran (an SWA or EMA copy evaluated once at the
end, a model loaded and tested), ran an evaluation in training mode: told at
close.

A model that trained alone (every optimizer step of the process, from its
first training pass on, its own: :data:`TRAINED_ALONE` or more, or fewer with
its parameters all frozen since or dropout on in the pass) and then,
with no step of its own and its weights unchanged, runs no-grad passes while
other optimizers take :data:`FROZEN_AFTER` steps was trained first and is now
used frozen: a teacher distilled from, a reward or target model. A GAN's
generator is never trained alone (its critic steps between its own steps);
one sampled during its critic's warm-up before its first step is no model
trained alone either, and one pretrained alone takes its own step before its
critic's sixth. Told then, not after :data:`IDLE_PASSES` (as one trained
beside another optimizer still is), each pass dated at the step the other
model's training was in at it: the model's own step count stopped. Its
weights moving between such passes close together, with no step of its own,
make it a target instead (a mean teacher started from it, following its
student by EMA): silent. Those, the passes of a model whose optimizer stays
idle, and passes in a row of a model with no optimizer each after another
optimizer's step (a teacher loaded and distilled from) are told as a frozen
model used in training mode, not an evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainwatch.collect.tensors import floating_list, tensor_leaves
from trainwatch.record import ModeReport, StepRecord

# Process steps between two no-grad passes of a model trained elsewhere from
# which they are an evaluation, not a target's: a target runs at every step
# (a GAN-like loop of two or three optimizers steps that many times per
# iteration).
SPARSE_GAP = 4

# The longest run of no-grad passes in a row within one step that may be part
# of every step, held until the steps after it show whether it recurs: label
# guesses over K augmentations (MixMatch: 2 to 4), a double-DQN target's two
# passes, a mean teacher on K noisy views, a teacher run once per global crop
# (DINO, iBOT), a few Monte-Carlo dropout samples. A longer run (a validation
# loop's batches) is an evaluation loop, told at once.
SHORT_RUN = 8
# The most no-grad passes in a row held whatever came before them (a pseudo-label
# pass, two augmentations' label guesses, a double-DQN target's two passes): a
# third is an evaluation loop, told at once, unless the run may be one that every
# step runs (see EvalPassJudge._may_recur). A teacher loaded and distilled from,
# one pass after each student step, is told so at its third pass.
HELD_ALWAYS = 2
# Passes in a row before a model's first training pass that are let go at it: a
# check of the model just built. A longer run there (a baseline evaluation) is
# judged as a short run is, by whether it recurs.
SHAPE_CHECK = 2
# How many passes two steps' short runs may differ by and still be the same run
# recurring (one or two passes a step, as a loop varies).
RUN_SLACK = 1

# No-grad passes of a model with an optimizer of its own that never trained,
# each after another model's step, its weights unchanged, from which its
# optimizer is idle and they are an evaluation (twice the original WGAN's
# hundred critic steps before its generator's first). Also the most passes held
# for a model that trained and then stopped having step boundaries of its own.
IDLE_PASSES = 200
# Held passes of such a model (an optimizer of its own, never trained) from which
# they are an evaluation at close: as many as the steps of other models after
# which an optimizer that never stepped is idle (not_optimized's patience). Fewer
# may be a generator's samples in a run stopped before its first step.
IDLE_AT_CLOSE = 20
# Own optimizer steps, with no other optimizer of the process stepping between,
# from which a model was trained alone (a teacher's training): a generator's first
# step after its critic's warm-up is one.
TRAINED_ALONE = 20
# Other optimizers' steps, the model's weights unchanged and its own optimizer
# idle, from which a model trained alone is used frozen (a teacher): more than
# WGAN-GP's five critic steps a generator step (with a generator trained alone
# first, a pretrained super-resolution network).
FROZEN_AFTER = 5


# How many times more values a sample has than the latent vector it was drawn
# from, from which a no-grad pass made samples (a DCGAN's 100 noise values make
# 3x64x64 pixels, 122 times more), not predictions (a class, a value, a
# reconstruction of the same size).
SAMPLE_GROWTH = 8


def pass_shapes(args: Any, output: Any) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """The shapes of a no-grad pass's first input tensor (None unless floating: token
    ids are data) and of its first floating output, for :func:`generator_sample`."""
    first = next(tensor_leaves(args), None)
    shown = None if first is None or not first[1].is_floating_point() else tuple(first[1].shape)
    outputs = floating_list(output)
    return shown, tuple(outputs[0].shape) if outputs else None


def batch_rows(args: Any, kwargs: Any) -> int | None:
    """The batch size of a pass: its first input tensor's first dimension (None: no
    tensor, or a 0-d one). What tells a validation set's batch from the step's."""
    first = next(tensor_leaves(args), None) or next(tensor_leaves(kwargs), None)
    if first is None or not first[1].dim():
        return None
    return int(first[1].shape[0])


def generator_sample(report: ModeReport) -> bool:
    """Samples drawn from a generator, as a GAN's progress samples are: batch norm
    alone in training mode (DCGAN samples with batch statistics; dropout left on
    is a forgotten ``eval()`` anywhere), a floating latent vector per sample (no
    spatial extent: an image or a sequence in is data, as a segmentation or
    super-resolution network's input is) and :data:`SAMPLE_GROWTH` times more
    values out per sample. Decided when the finding is told, never on a step."""
    shape_in, shape_out = report.input_shape, report.output_shape
    if shape_in is None or shape_out is None or len(shape_in) < 2 or len(shape_out) < 2:
        return False
    if shape_in[0] != shape_out[0] or sum(size > 1 for size in shape_in[1:]) > 1:
        return False
    if any("norm" not in kind.lower() for kind in report.kinds):
        return False
    return math.prod(shape_out[1:]) >= SAMPLE_GROWTH * max(1, math.prod(shape_in[1:]))


@dataclass
class _FrozenUse:
    """No-grad passes of a trained model since its last step of its own (a teacher
    distilled from, if it trained alone and stays unchanged)."""

    own_step: int  # the model's step count at them (a new step: a new use)
    optimizer_steps: int  # every optimizer step of the process at the first
    alone: bool  # trained alone up to the first
    unchanged: bool = True  # its weights the same at every pass since
    moving: bool = False  # they moved between two passes close together: a target
    # Each pass, with the monitors' steps of the process at it: its date once told.
    passes: list[tuple[StepRecord, int]] = field(default_factory=list)
    told: bool = False  # told: each later pass is told at once


def _no() -> bool:
    return False


def _mark_frozen_use(records: list[StepRecord], trained: bool) -> None:
    """Passes of a model used frozen while another trains, a teacher or target:
    no evaluation, so told with its own advice (``teacher.eval()`` for good)."""
    for record in records:
        report = record.eval_in_train
        if report is not None:
            report.frozen_use = True
            report.trained_first = trained


class EvalPassJudge:
    def __init__(self, clock: int | None = None) -> None:
        """``clock``: the optimizer steps the process had taken when the model was
        watched (None: unknown): a run before any step since is its first."""
        self._born = clock
        self._held: list[StepRecord] = []
        self.in_a_row = 0  # no-grad training-mode passes since the last training pass
        self._run_now = 0  # the longest short run of this interval (0: none)
        self._run_before = 0  # and of the interval before
        self._recurring = 0  # the short run that happens every step: part of training
        self._follows_training = False  # the run under way came right after a training pass
        self._weights: object = None  # what the weights were at the last such pass
        self._clock: int | None = None  # the process's steps at the last such pass
        self.trained = False  # a training pass of this model was seen
        # Its weights were seen moving between two passes close together, with no
        # training pass of its own between them: a target network (see flush).
        self._target = False
        # Its optimizer never stepped while others took IDLE_PASSES steps, one
        # between each two of its passes: every such pass is an evaluation.
        self._idle = False
        # Every optimizer step of the process, and its own step count, at its first
        # training pass: whether it trained alone (see _frozen_use).
        self._trained_from: tuple[int, int] | None = None
        self._use: _FrozenUse | None = None  # its passes since its last step
        # Passes of the run under way that came after another optimizer's step (all
        # but the first: used while another trains), and every optimizer step of
        # the process at the last pass.
        self._run_stepped = 0
        self._optimizer_steps: int | None = None
        # The run under way went on across a step of the process: no short run
        # within one step, one every step may run (see _may_recur).
        self._run_spans = False
        # Where this step's runs sit (see _after_the_step). The behaviour checks
        # hand every training pass over while ``attentive``: before the model's
        # first one, during a run, and through each step that made a run or
        # followed one; a loop that makes no no-grad pass hands over none.
        self.attentive = True
        self._watched_step = True  # attentive since this step began: its order is known
        self._step_had_run = False  # a no-grad pass came in this step
        self._step_trained = False  # a training pass of this step came
        self._step_rows: set[int] = set()  # the batch sizes of this step's training passes
        self._leading = False  # the run under way came before this step's training passes
        self._lead_rows: int | None = None  # and the batch size of its first pass
        self._after_step = False  # such a run ended at this step's first training pass
        self._run_after = 0  # the longest run of this step after its training passes
        # Batch sizes of the no-grad passes in the model's first step (up to its
        # first step boundary after a training pass): what the loop does in its
        # own iteration, before any optimizer step of the model.
        self._first_rows: set[int] = set()
        self._in_first_step = True
        self._last_record: StepRecord | None = None  # the last no-grad pass's

    def nograd_pass(
        self,
        record: StepRecord,
        weights: object = None,
        clock: int | None = None,
        stepped_between: bool = False,
        steps: tuple[int, int] | None = None,
        rows: int | None = None,
        frozen: Callable[[], bool] = _no,
    ) -> list[StepRecord]:
        """A no-grad pass with mode-dependent modules in training mode.

        ``weights``: a fingerprint of the model's weights now (None: unknown).
        ``clock``: the optimizer steps this process has taken (None: unknown).
        ``stepped_between``: some optimizer of the process, watched or not, stepped
        (or a watched model ran a backward) since the model's last no-grad pass,
        and the model has an optimizer of its own (a frozen teacher has none: its
        passes stay judged as they are). Before the model's first training pass
        such passes are held apart (:meth:`_before_training`): its optimizer may
        never step. ``steps``: every optimizer step of the process, watched or
        not, and the step the process's training is in (what a model trained
        alone and then used frozen is told by, :meth:`_frozen_use`). ``rows``: the
        batch size of the pass's first input tensor (None: unknown), what tells
        other data from the step's own (:meth:`_after_the_step`). ``frozen``: whether
        none of the model's parameters requires grad now (asked only where a model
        that trained briefly stops stepping, see :meth:`_alone`).
        """
        self.attentive = self._step_had_run = True
        self._last_record = record
        if self._in_first_step and rows is not None:
            self._first_rows.add(rows)
        if stepped_between and self.in_a_row and not self.trained:
            return self._before_training(record, weights, clock)
        if stepped_between and self.in_a_row:
            # Not in a row: an evaluation loop steps no optimizer and runs no
            # backward between its batches. A generator sampled once per critic step (WGAN-GP's five
            # critic steps per generator step) runs one such pass per step of
            # another model: one pass of each interval, as a GAN's one critic
            # step a generator step is.
            self._run_ends()
            self.in_a_row = 0
        optimizer_steps = steps[0] if steps is not None else None
        gap = clock - self._clock if clock is not None and self._clock is not None else 0
        if self.in_a_row == 0:
            self._follows_training = self.trained
            self._run_stepped = 0
            self._run_spans = False
            self._leading = self._watched_step and not self._step_trained
            self._lead_rows = rows
        elif optimizer_steps is not None and optimizer_steps != self._optimizer_steps:
            self._run_stepped += 1
            self._run_spans = True
        elif gap:
            self._run_spans = True
        self._optimizer_steps = optimizer_steps
        self.in_a_row += 1
        moved = weights is not None and self._weights is not None and weights != self._weights
        self._weights = weights
        self._clock = clock
        if self.trained and steps is not None and clock is not None:
            due = self._frozen_use(record, moved, gap, clock, steps, frozen)
            if due is not None:
                return due
        if moved and self.in_a_row >= 2 and not self.trained and gap >= SPARSE_GAP:
            # Moved by training elsewhere, yet run only now and then: an EMA
            # copy's evaluation, not a target's pass.
            self._new_run()
            due, self._held = [*self._held, record], []
            return due
        if moved and self.in_a_row >= 2:
            # Updated since the last one, by no training pass of its own: a target
            # network. Its passes are part of training, this one and those held.
            self._new_run()
            self._held = []
            self._target = True
            return []
        # A short run within one step may be part of every step (K views, K
        # augmentations), trained here or not (a target called on each view,
        # BYOL, a mean teacher): held, and reported at the step boundary that
        # shows it did not recur, or at close (a model with no step boundary of
        # its own: at its next pass, which shows whether its weights moved). A
        # longer run, or one that cannot be a run of every step, is an
        # evaluation loop or a frozen model's use, told now.
        if self.in_a_row > SHORT_RUN or (
            self.in_a_row > HELD_ALWAYS and not self._may_recur(record.step, clock)
        ):
            return self._in_a_row(record)
        if self.in_a_row <= self._recurring:
            return []
        self._held.append(record)
        if self.trained and len(self._held) >= IDLE_PASSES:
            # Held since the model's last step boundary of its own, IDLE_PASSES of
            # them: it stopped training (a teacher trained first, then distilled
            # from, not alone) and no boundary will judge them. Used frozen; told
            # now, so nothing held grows with the run.
            due, self._held = self._held, []
            use = self._use
            if use is not None and use.unchanged and steps is not None and clock is not None:
                return self._used_frozen(use, due, clock, steps[1])
            return due
        return []

    def _may_recur(self, step: int, clock: int | None) -> bool:
        """Whether a run longer than a shape check, still under way, may be the one
        every step runs, and so waits for the steps after it; if not, it is an
        evaluation loop told at its third pass, as a halt wants (the evaluation
        stopped there, not a step later).

        It may recur where nothing before it could show it: before the model's
        first training step, or in it (a MixMatch model's first label guesses, a
        FixMatch model's first weak views after its forward, a mean teacher's
        first targets); or where it comes back about as long as the step before
        had it, or as every step has it; or, for a model trained by no backward,
        once seen moving as a target. A run across steps of the process with no
        step of the model's own, and an EMA copy first sampled after steps were
        taken since it was watched, are no such run.
        """
        if self._run_spans:
            return False
        if not self.trained:
            return self._target or clock is None or self._born is None or clock == self._born
        start = self._trained_from
        if start is not None and step == start[1]:
            return True
        return self.in_a_row <= max(self._run_before, self._recurring) + RUN_SLACK

    def _new_run(self) -> None:
        """Weights moved since the last pass: this pass starts a new run. What the
        run before counted (passes after other models' steps, the weights
        unchanged between them) is no part of it: an EMA copy sampled in a loop at
        every evaluation, updated at every step between evaluations, would
        otherwise carry one more such pass into each evaluation's run until its
        loop looked like a frozen teacher's passes, one after each other step."""
        self.in_a_row = 1
        self._run_stepped = 0
        self._run_spans = False

    def _in_a_row(self, record: StepRecord) -> list[StepRecord]:
        """A run of no-grad passes too long for a step, with those held: an
        evaluation loop, told.

        A model with no optimizer of its own (a teacher loaded and distilled from)
        has its passes in a row across other models' steps: one after each such
        step, its weights unchanged, it is used frozen while another trains.
        """
        if self._use is not None:
            self._use.passes = []  # told here
        due, self._held = [*self._held, record], []
        if self._run_stepped >= self.in_a_row - 1:
            _mark_frozen_use(due, self.trained)
        return due

    def _before_training(
        self, record: StepRecord, weights: object, clock: int | None
    ) -> list[StepRecord]:
        """A pass after another model's step, by a model with an optimizer of its
        own that has not trained yet: a generator sampled per critic step before its
        first step, or a teacher whose optimizer stays idle. Held until its first
        training pass lets it go, or told once :data:`IDLE_PASSES` have come: used
        frozen, its optimizer idle."""
        moved = weights is not None and self._weights is not None and weights != self._weights
        self._weights, self._clock = weights, clock
        self.in_a_row = 1
        if moved:
            # Changed with no training pass of its own: trained another way, so
            # the passes before were part of training, and its optimizer not idle.
            self._held, self._idle, self._target = [], False, True
        if self._idle:
            _mark_frozen_use([record], False)
            return [record]
        self._held.append(record)
        if len(self._held) < IDLE_PASSES:
            return []
        self._idle = True
        due, self._held = self._held, []
        _mark_frozen_use(due, False)
        return due

    def _frozen_use(
        self,
        record: StepRecord,
        moved: bool,
        gap: int,
        clock: int,
        steps: tuple[int, int],
        frozen: Callable[[], bool] = _no,
    ) -> list[StepRecord] | None:
        """A pass of a model that trained, since its last step of its own: once it
        is seen trained alone and then used frozen, told (None: judged as before).

        Its weights moving between two such passes close together, with no step
        of its own, make it a target (a mean teacher following its student by
        EMA, started from the model trained first): those passes are training.
        """
        optimizer_steps, now = steps
        use = self._use
        if use is None or use.own_step != record.step:
            alone = self._alone(record.step, optimizer_steps, record.eval_in_train, frozen)
            use = self._use = _FrozenUse(record.step, optimizer_steps, alone)
        elif moved:
            use.unchanged, use.told = False, False
            use.moving = gap < SPARSE_GAP  # else an EMA copy evaluated now and then
            if use.moving:
                self._let_go(use)
        elif use.moving and len(use.passes) >= SHORT_RUN:
            # Unchanged since: no longer followed as a target, its passes held as before.
            use.moving, use.passes = False, []
        if use.moving:
            use.passes.append((record, clock))  # let go at its next move, or at close
            self._held.append(record)
            return []
        if not use.unchanged:
            return None
        if use.told:
            record.step = now
            _mark_frozen_use([record], True)
            return [record]
        if len(use.passes) < IDLE_PASSES:  # passes with no other step between: bounded
            use.passes.append((record, clock))
        if not use.alone or optimizer_steps - use.optimizer_steps < FROZEN_AFTER:
            return None
        due = [r for r, _ in use.passes]
        told = {id(r) for r in due}
        self._held = [r for r in self._held if id(r) not in told]
        return self._used_frozen(use, due, clock, now)

    def _let_go(self, use: _FrozenUse) -> None:
        """The passes of ``use`` held so far were a target's: training, not told."""
        passes = {id(r) for r, _ in use.passes}
        self._held = [r for r in self._held if id(r) not in passes]
        use.passes = []

    def _used_frozen(
        self, use: _FrozenUse, due: list[StepRecord], clock: int, now: int
    ) -> list[StepRecord]:
        """Passes of a model trained first, then used frozen: told, each dated at the
        step the other model's training was in then (the monitors' steps since it,
        counted back from now; its own step count stopped), and later ones at once."""
        taken = {id(r): t for r, t in use.passes}
        for record in due:
            at = taken.get(id(record))
            if at is not None:
                record.step = max(0, now - (clock - at))
        use.told, use.passes = True, []
        _mark_frozen_use(due, True)
        return due

    def _alone(
        self,
        own_step: int,
        optimizer_steps: int,
        report: ModeReport | None = None,
        frozen: Callable[[], bool] = _no,
    ) -> bool:
        """No other optimizer of the process stepped since its first training pass,
        and it took :data:`TRAINED_ALONE` steps or more. (Fewer steps of the process
        than its own: a mixed-precision step skipped, never another's.)

        Fewer steps alone (a teacher pre-trained briefly, fine-tuned a few steps,
        or its training cut short) do too where the model now shows it stopped
        training for good: its parameters all frozen since (``frozen``), or
        dropout in training mode in the pass (``report``), which a generator sampled
        between its critic's steps does not run (DCGAN samples with batch norm
        alone). A generator after its critic's warm-up took its one step alone
        with neither, and keeps the longer count."""
        start = self._trained_from
        if start is None:
            return False
        taken = own_step - start[1]
        if taken < 1 or optimizer_steps - start[0] > taken:
            return False
        if taken >= TRAINED_ALONE:
            return True
        dropout = report is not None and any("dropout" in kind.lower() for kind in report.kinds)
        return dropout or frozen()

    def _run_ends(self) -> None:
        """A run of no-grad passes ended: a short one may be part of every step."""
        if self.in_a_row <= SHORT_RUN:
            self._run_now = max(self._run_now, self.in_a_row)
            if not self._leading:
                self._run_after = max(self._run_after, self.in_a_row)

    def training_pass(
        self, steps: tuple[int, int] | None = None, fed: bool = False, rows: int | None = None
    ) -> None:
        """``steps``: every optimizer step of the process and the model's own step
        count now (kept from the first: whether it trains alone). ``fed``: the pass
        takes a tensor of the last no-grad pass (``PassChain.taken_by``): that pass
        made its input (self-conditioning's first estimate, a solve's fixed point)
        and was part of this step, whether or not it recurs: let go, and no part
        of the run for the judge. ``rows``: the batch size of its first input."""
        if fed and self.in_a_row:
            self._let_go_feeding()
        self._run_ends()
        if self._leading:
            # The first training pass of a step whose start was watched, after a
            # run that came before it: told apart at the step boundary.
            self._leading = False
            self._after_step = self.in_a_row > 0
        self._step_trained = True
        if rows is not None:
            self._step_rows.add(rows)
        if not self.trained:
            self._trained_from = steps
            if self.in_a_row <= SHAPE_CHECK:
                # Passes before the model's first training pass, too few to be an
                # evaluation loop: a shape check or a dry run of the model just
                # built; or a generator's samples, one per step of its critic
                # before its own first. A longer run waits, as any short run does,
                # for the steps after it (a baseline evaluation, once, is told).
                self._held = []
        self.in_a_row = 0
        self.trained = True
        self.attentive = self._watched_step or self._step_had_run

    def _let_go_feeding(self) -> None:
        """The last no-grad pass fed the training pass now: no evaluation, and no
        part of the run before it (a validation pass before it is still one)."""
        record = self._last_record
        if self._held and self._held[-1] is record:
            self._held.pop()
        use = self._use
        if use is not None and use.passes and use.passes[-1][0] is record:
            use.passes.pop()
        self.in_a_row -= 1

    def found_part_of_a_model(self) -> None:
        """The model is a part of a bigger one, first called now, before any step
        (``trainwatch run`` watched the part first: a teacher the loop calls before
        the model, an encoder's shape check): the bigger model's monitor watches it
        from now on. Its passes so far were that model's before its first training
        pass: one or two are let go, as :meth:`training_pass` lets them go; a longer
        run (a baseline evaluation through the part) is still told at close."""
        if self.in_a_row <= SHAPE_CHECK:
            self._held = []

    def step_boundary(self) -> list[StepRecord]:
        if not self.attentive:
            # No no-grad pass in this step nor in the one before, none under way
            # and none held: nothing to judge (a healthy step asks this alone).
            return []
        if 0 < self.in_a_row <= SHORT_RUN and self._follows_training:
            # A short run after this step's training passes: one of this step,
            # as one before them is (the next step's first training pass must
            # not count it again).
            self._run_ends()
            self.in_a_row = 0
        told = self._after_the_step()
        run, before = self._run_now, self._run_before
        if not run:
            self._run_before = self._recurring = 0
            # The held pass did not come back this step: an evaluation.
            return told + self._due() if self._held else told
        self._run_now, self._run_before = 0, run
        if self._recurring and run > self._recurring:
            # Longer than the run every step has: those beyond it (a
            # validation pass next to the step's own) are an evaluation.
            return told + self._due()
        if before and abs(run - before) <= RUN_SLACK:
            # Short runs of about the same length at two steps in a row: part of
            # training, up to the longer of them.
            self._recurring = self._recurring or max(run, before)
            self._held = []
        elif before and not self._recurring:
            # A run of another length than the step's before (a baseline
            # evaluation of three batches, then one pseudo-label pass a step):
            # the one before did not recur.
            return told + self._due()
        return told

    def _after_the_step(self) -> list[StepRecord]:
        """The step's no-grad run, if it sat after the optimizer step: told.

        A loop's order shows in the model's first step: what it runs there, before
        any optimizer step of its own, is its iteration's work (pseudo-labels,
        label guesses, rollouts, a solve before the training pass). A run of
        another batch size, coming only once the model has stepped, before each
        step's training passes, came after the step before: full-batch training
        validated every epoch, ``model.eval()`` forgotten. It recurs, but it is
        an evaluation, told with the step of its first pass still held (the
        step it followed). Other data tells it: its batch size is that of none of
        the step's training passes nor of the model's first step's no-grad
        passes (a shape check's batch is no such pass), and the training pass
        after it took none of its tensors (it fed nothing, see ``fed``). Pseudo-
        labels switched on after a warm-up share the batch size of a training
        pass of theirs (the strong view's).

        Ends the step's bookkeeping of where its runs sat.
        """
        rows = self._lead_rows
        after = (
            self._after_step
            and rows is not None
            and rows not in self._step_rows
            and rows not in self._first_rows
        )
        if self.trained:
            self._in_first_step = False
        self._watched_step = not self.trained or self.in_a_row > 0 or self._step_had_run
        self.attentive = self._watched_step
        self._step_had_run = self._step_trained = self._after_step = self._leading = False
        self._step_rows = set()
        run_after, self._run_after = self._run_after, 0
        if not after:
            return []
        # Told, and no run of every step: its length leaves the runs judged.
        self._run_now = run_after
        return self._due()

    def _due(self) -> list[StepRecord]:
        if not self.trained:
            # A model never trained by backward here keeps them: its next pass
            # tells whether its weights moved meanwhile, a target, or not.
            return []
        due, self._held = self._held, []
        return due

    def flush(self, optimized: bool = False) -> list[StepRecord]:
        """What is still held at close: an evaluation, unless a target's last passes.

        A target network (seen moving between its passes, trained by no backward
        here) ends the run with a short run of passes whose next pass never comes
        to show its weights moving again: those are part of its training. So
        does a model with an optimizer of its own (``optimized``) that has not
        trained yet, up to :data:`IDLE_AT_CLOSE` passes: a generator sampled at
        each of its critic's steps, in a run stopped before the generator's own
        first step (a smoke run, ``--max-steps 5`` on a WGAN-GP); from there on its
        optimizer is idle (a teacher's, built and never stepped). A model
        never seen moving so, never trained and with no optimizer, whose short run
        of passes is all there is (an SWA or EMA copy evaluated once at the
        end, a model loaded and tested), ran an evaluation in training mode: told.
        """
        use = self._use
        if use is not None and use.moving:
            self._let_go(use)  # a target's last passes, no next one to show it moving
        due, self._held = self._held, []
        if not self.trained and optimized and len(due) < IDLE_AT_CLOSE:
            return []  # it may still train: a smoke run stopped in its critic's steps
        if not self.trained and optimized:
            _mark_frozen_use(due, False)  # its optimizer idle while others stepped
        if not self.trained and self._target and len(due) <= SHORT_RUN:
            return []
        return due


class PartStreak:
    """No-grad passes of the model's parts in a row, as the judge counts them.

    Parts called one after the other (``decode(encode(x))``, ``head(net(x))``,
    a pseudo-label made with ``classifier(encoder(x))`` at every step) make one
    pass of the model between them: only a part called again starts a new pass
    for the judge, unless that call iterates the pass before it (a fixed-point
    solver's ``z = cell(z, u)``: one solve). Every record of the streak carries the same report, the
    modules of all its parts in the order called (filled in as they come, so a
    held record tells them all), so one evaluation is told once, at its first
    module.
    """

    def __init__(self) -> None:
        self._report: ModeReport | None = None
        self._in_pass: set[str] = set()  # the parts of the pass under way
        self._parts: set[str] = set()  # every part of the streak

    def joined(
        self, part: str, report: ModeReport, fresh: bool, iterates: bool = False
    ) -> ModeReport | None:
        """The report of a new pass for the judge; None: ``part`` goes on with the pass
        under way. ``fresh``: no such pass since the last training pass, a new streak.
        ``iterates``: the call feeds on the pass before it (``collect/pass_chain.py``,
        a solver's next step), so even a part called again goes on with the pass."""
        streak = self._report
        if streak is None or fresh:
            self._report, self._in_pass, self._parts = report, {part}, {part}
            return report
        new = [(m, k) for m, k in zip(report.modules, report.kinds) if m not in streak.modules]
        streak.modules.extend(m for m, _ in new)
        streak.kinds.extend(k for _, k in new)
        streak.in_frozen_parts.extend(m for m in report.in_frozen_parts if m in dict(new))
        if part not in self._parts:
            self._parts.add(part)
            streak.total += report.total
        if part in self._in_pass and not iterates:
            self._in_pass = {part}
            return streak
        self._in_pass.add(part)
        return None

    def reset(self) -> None:
        """A pass of the whole model ended the streak."""
        self._report = None
