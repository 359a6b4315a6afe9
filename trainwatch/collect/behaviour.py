"""Behaviour checks around the model's forward pass: modes, loss shapes, activations.

One object, created only when one of its rules is enabled, listens to the
model's passes (``collect/passes.py``: the start and end of each forward pass
of the whole model) and installs no hook of its own on a healthy step; the
activation rules hook every module for the duration of a sampled pass only.
At the step boundary it hands what it saw to the step record; device numbers
join the step's single readback.

- Modes (pure Python on ``.training`` flags, the modules kept in the order
  the model calls them, learned from one pass): a forward pass without
  gradients with dropout/batch norm in training mode is published at once,
  from the end of that pass (an evaluation needs no optimizer step after it);
  a pass with gradients in eval mode is remembered, and counted as a training
  step only when backward runs through its output; with the model itself in
  eval mode, only when the step's update uses what that backward wrote, not
  where the gradients were wiped before the next backward in training mode
  or never written to ``.grad`` (an EWC Fisher estimate, a saliency map:
  ``collect/eval_gradients.py``).
  Dropout and batch norm called as functions (``F.dropout(x, p,
  training=self.training)``) are found by a sampled look at the calls of a
  no-grad pass made in training mode, or by looks at the first training
  passes and then at a no-grad pass in eval mode, where the calls seen acting
  in training must stop (``collect/functional_modes.py``); the modules seen
  calling them are then checked like dropout modules. So are modules seen
  drawing random numbers in training mode there that draw none when run
  once more in eval mode (stochastic depth's ``DropPath``).
- Broadcast: a short audit of the first steps (``collect/broadcast.py``); it
  also measures the loss target's spread, constant_output's reference for the
  model's own output. The first evaluation passes are audited the same way
  (``collect/broadcast_eval.py``), handed over from the end of a pass only
  when gradients are off or the model is in eval mode. Both are re-armed
  (``rearm_audit``) when the pipeline sees a new phase of training begin,
  and the training audit for one step at sparse sampled steps, and step by
  step while a layer that joined the loss unaudited waits for its next
  gradient (``collect/joined_layers.py``) or a loss of a new kind waits for
  its audit (``collect/loss_kind.py``); the evaluation
  audit also when ``trainwatch run`` sees a dataset first evaluated
  (``rearm_evaluations``); between them no pass calls the audit.
- Activations: sampled statistics (``collect/activations.py``), and what the
  loss compares the sampled model output with on its pass
  (``collect/output_target.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable

from trainwatch.collect.activations import FIELDS, TARGET, ActivationSampler, RowKey
from trainwatch.collect.broadcast import BroadcastAudit
from trainwatch.collect.broadcast_eval import EvaluationAudit
from trainwatch.collect.calls import CallTracker
from trainwatch.collect.eval_gradients import EvalModeGradients, hook_backward, joined
from trainwatch.collect.eval_passes import EvalPassJudge, PartStreak, batch_rows, pass_shapes
from trainwatch.collect.functional_modes import FunctionalLook
from trainwatch.collect.lone_parts import LoneParts
from trainwatch.collect.loss_kind import KindReader
from trainwatch.collect.modes import ModeWatch
from trainwatch.collect.output_target import OutputTargetLook
from trainwatch.collect.pass_chain import PassChain
from trainwatch.collect.passes import ModelPasses
from trainwatch.collect.structure import StructureWatch
from trainwatch.collect.weights_moved import weights_fingerprint
from trainwatch.compiled import is_wrapper, unwrap, user_name
from trainwatch.config import Config
from trainwatch.frame import Slot, StepFrame
from trainwatch.guard import Guard
from trainwatch.hooks import WeakHook
from trainwatch.process_steps import ANY_OPTIMIZER_STEPS, PROCESS_STEPS
from trainwatch.record import ModeReport, StepRecord
from trainwatch.rules import rules_needing


@dataclass
class BehaviourToken:
    """What a step's record still needs from its readback."""

    names: list[RowKey]
    stats: Slot


class BehaviourWatch:
    def __init__(
        self,
        model: nn.Module,
        config: Config,
        rule_ids: set[str],
        step_of: Callable[[], int],
        publish: Callable[[StepRecord], None],
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self._model = weakref.ref(model)
        self._config = config
        self._step_of = step_of
        self._publish = publish
        self._on_error = on_error
        self._guard = Guard(on_error)
        self._structure = StructureWatch()
        self.check_eval_pass = "eval_in_train_mode" in rule_ids
        self.check_train_step = "train_in_eval_mode" in rule_ids
        checks_modes = self.check_eval_pass or self.check_train_step
        self.modes = ModeWatch(model, on_error) if checks_modes else None
        self._told_frozen = False  # a frozen part in training mode: one finding a run
        # That finding, held until a training pass of a later step finds the part
        # still frozen: (the finding, the process's optimizer steps and steps then).
        self._frozen_seen: tuple[StepRecord, tuple[int, int]] | None = None
        # That finding once told, until its part trains (a staged fine-tune
        # unfreezing its backbone): then withdrawn, once.
        self._frozen_told: ModeReport | None = None
        self.train_in_eval: ModeReport | None = None
        # Eval-mode backward passes whose gradients no update was seen to use yet
        # (see attach_passes); their report is in train_in_eval until taken back.
        self.eval_gradients = EvalModeGradients(self) if self.check_train_step else None
        self._eval_backward_ends = WeakHook(self, "eval_backward_ends")
        evals = config.eval_in_train_mode
        self.functional = (
            FunctionalLook(
                evals.functional_passes,
                evals.functional_every,
                on_error,
                config.train_in_eval_mode.functional_passes if self.check_train_step else 0,
            )
            if checks_modes
            else None
        )
        self._model_passes = 0  # since the last step boundary
        # The model's parts by id, with their names: parts called on their own.
        self._parts: dict[int, str] = {}
        # Whether the step in progress is one the sampler measures (and which step).
        self._due_step = -1
        self._due_now = False
        self.eval_passes = EvalPassJudge(PROCESS_STEPS.taken)
        self._part_streak = PartStreak()  # parts called one after the other: one pass
        self._pass_chain = PassChain()  # passes that feed on the one before: one solve
        # Whether the model has an optimizer of its own (set by the pipeline): a
        # generator not yet trained, sampled once per critic step, is one.
        self.optimized: Callable[[], bool] = _never
        # Whether the model, with no optimizer of its own, copies one an optimizer
        # trains (set by the pipeline; asked only when a step ran in eval mode): a
        # target or reference network, kept in eval on purpose.
        self.a_target: Callable[[], bool] = _never
        # Every optimizer step of the process, and the backward passes of watched
        # models, at the model's last no-grad pass.
        self._steps_at_nograd: tuple[int, int] | None = None
        self._holds_steps = self.check_eval_pass
        if self._holds_steps:
            ANY_OPTIMIZER_STEPS.hold()
        # Which of the model's modules ran (set by the pipeline where it tracks
        # calls): a frozen part never called is not said to run in training mode.
        self.calls: CallTracker | None = None
        # The model's passes (see attach_passes): the broadcast audit reads a pass's arguments.
        self.passes: ModelPasses | None = None
        # Parts of the model called on their own in a no-grad block (an evaluation
        # through model.encode): looked for while the model holds dropout or batch norm.
        self.lone_parts: LoneParts | None = None
        audits = bool(rule_ids & rules_needing("broadcast_audit"))
        audit_steps = config.broadcast.audit_steps
        # The training audit; ``broadcast`` holds it only while it runs (a healthy
        # step past it asks one attribute), and ``rearm_audit`` puts it back.
        self._audit = (
            BroadcastAudit(audit_steps, on_error, "loss_input" in rule_ids) if audits else None
        )
        if self._audit is not None:
            self._audit.name_called = self._name_called
        self.broadcast = self._audit
        # The first evaluation passes' audit: a whole first validation.
        self.evaluations = (
            EvaluationAudit(config.broadcast.evaluation_passes, step_of, publish, on_error)
            if audits
            else None
        )
        # The model's passes counter at its last pass without gradients, and how many
        # such passes came in a row up to it: a pass with gradients since the step
        # boundary, between them, makes a pass without gradients a target side.
        self._last_nograd = -2
        self._nograd_run = 0
        spread, zeros = "constant_output" in rule_ids, "dead_units" in rule_ids
        # The sampled steps of the enabled ones: every step before the later of
        # their first_steps, then every step a multiple of one's ``every``.
        sampling = [
            section for section in (config.constant_output, config.dead_units) if section.enabled
        ]
        self._sampled_until = max((s.first_steps for s in sampling), default=0)
        self._sampled_every = tuple(sorted({s.every for s in sampling}))
        self.sampler = (
            ActivationSampler(
                model,
                max(config.constant_output.rows, config.dead_units.rows),
                spread,
                zeros,
                on_error,
            )
            if spread or zeros
            else None
        )
        # What the loss asks of the sampled model output on its pass (constant_output's),
        # from the step the rule judges a relative collapse of that output on.
        self.output_target = (
            OutputTargetLook(config.constant_output.rows, on_error) if spread else None
        )
        self._targets_from = config.constant_output.warmup
        if self.sampler is not None:
            self.sampler.target_look = self.output_target

    def attach_passes(self, passes: ModelPasses) -> None:
        """The model's passes, which this subscribes to (the evaluation check
        also looks for parts of the model called on their own)."""
        self.passes = passes
        if self.eval_gradients is not None:
            self.eval_gradients.passes = passes
        model = self._model()
        if self.check_eval_pass and self.modes is not None and model is not None:
            mc_dropout = self._config.eval_in_train_mode.mc_dropout
            self.lone_parts = LoneParts(
                model,
                passes,
                self.modes,
                self.eval_passes,
                self._module_names,
                mc_dropout,
                self._on_error,
            )
            if self.modes.listed:
                self.lone_parts.follow()

    def backward_seen(self, report: ModeReport, grad: torch.Tensor) -> None:
        """Backward ran through a pass with mode-dependent modules in eval mode.

        With the pass's root in training mode (norms or a part put in eval) it is
        a training step. With the root in eval mode too, it is one only if an
        update uses its gradients: held (``EvalModeGradients``), its report
        standing from the backward's end until a backward in training mode
        finds those gradients gone.
        """
        gradients = self.eval_gradients
        model = self._model() if report.whole_model else None
        if gradients is not None and model is not None:
            first = gradients.backward_starts(report, self._step_of(), self.train_in_eval, model)
            if first:
                Variable._execution_engine.queue_callback(self._eval_backward_ends)
            if first is not None:
                return
        self.training_backward_starts()
        self.train_in_eval = joined(self.train_in_eval, report)

    def eval_backward_ends(self) -> None:
        """An eval-mode backward ended: its report stands where it wrote ``.grad``."""
        gradients = self.eval_gradients
        if gradients is not None and gradients.in_backward:
            report = gradients.backward_ends()
            if report is not None:
                self.train_in_eval = joined(self.train_in_eval, report)

    def step_ends_in_backward(self) -> None:
        """A step boundary reached inside a backward's end (``trainwatch run`` ends a
        hand-trained model's steps as its backward ends): an eval-mode backward of
        it ends now, so that its report is this step's. Its own end, queued after
        the boundary's, then finds it ended; left to it, the report would go to
        the next step.
        """
        gradients = self.eval_gradients
        if gradients is not None and gradients.in_this_backward():
            self.eval_backward_ends()

    def training_backward_starts(self, grad: torch.Tensor | None = None) -> None:
        """A backward in training mode begins: eval-mode gradients held are added
        onto (they go into its update), or were wiped or never written (their
        report is taken back). A step boundary since they ran took their report."""
        gradients = self.eval_gradients
        if gradients is None or not gradients.held or gradients.in_this_backward():
            return  # (in the eval-mode backward itself: its gradients go in too)
        current = gradients.step == self._step_of()
        prior = gradients.prior
        applied = current and gradients.applied()
        gradients.release()
        if current and not applied:
            self.train_in_eval = prior

    def fail(self, exc: BaseException) -> None:
        self._on_error("behaviour checks", exc)

    # -- failure containment -----------------------------------------------------
    def guard(self, component: str, fn: Any, *args: Any) -> Any:
        return self._guard.run(component, fn, *args)

    # -- a forward pass of the whole model ----------------------------------------
    def _due(self, step: int) -> bool:
        """A sampled step of constant_output's or dead_units' (read at every pass)."""
        if step < self._sampled_until:
            return True
        for every in self._sampled_every:
            if step % every == 0:
                return True
        return False

    def _first_steps(self, step: int) -> bool:
        """Within the first sampled steps, when every module is measured."""
        return step < self._sampled_until

    def pass_starts(self, module: nn.Module) -> None:
        """A forward pass of the whole model begins (called by ``ModelPasses``)."""
        model = self._model()
        if self.broadcast is not None:
            # The model's own ops are not the loss; a part called on its own
            # (``self.policy(obs)`` in a LightningModule) makes outputs the loss
            # is built from just the same.
            inputs = self.passes.inputs if self.passes is not None else None
            self.broadcast.pass_starts(None if is_wrapper(module) else module, inputs)
        whole = module is model or unwrap(module) is model
        if not whole and self._part_name(module) is None:
            return
        self._model_passes += 1
        if self._structure.changed():
            self._rebuild()
        if whole:
            # A part called on its own (``self.net(x)`` in a LightningModule) is
            # checked like the model, but teaches nothing of the whole's call order.
            modes = self.modes
            if modes is not None and not modes.ordered:
                if is_wrapper(module):
                    modes.ordered = True  # hooks added after compiling never fire
                else:
                    modes.start_learning()
            look = self.functional
            if look is not None and torch.is_grad_enabled() not in look.skipped_grad_modes:
                self._look_for_functional_modes(module, look)
        sampler = self.sampler
        if sampler is not None and sampler.enabled:
            step = self._step_of()
            if step != self._due_step:  # decided once a step, not at every pass
                self._due_step, self._due_now = step, self._due(step)
            if not self._due_now:
                sampler.active = False
                return
            if self.output_target is not None:
                self.output_target.pause()  # the model's own ops are not the loss
            if torch.is_grad_enabled():
                sampler.start_pass(
                    True, not is_wrapper(module), every_module=self._first_steps(step)
                )
            else:
                sampler.active = False

    def _look_for_functional_modes(self, module: nn.Module, look: FunctionalLook) -> None:
        """A pass no module type flags: maybe watch its calls. A no-grad pass in training
        mode, for calls acting (an evaluation in training mode); one of the first
        training passes, for the modules calling them; a no-grad pass in eval mode
        while such modules are held, for whether their calls stop acting in it."""
        model = self._model()
        modes = self.modes
        if model is None or modes is None or is_wrapper(module):
            return  # compiled code would not make the calls a look could see
        if torch.is_grad_enabled():
            if modes.listed:
                look.no_more_training_passes()  # its modules say it holds dropout or norms
            elif look.training_due() and model.training:  # counted in either mode
                look.start(model, False, training=True)
        elif not model.training:
            if look.judge_due():
                look.start(model, False, judging=True)
        elif self.check_eval_pass:
            skip = self._config.eval_in_train_mode.mc_dropout
            if modes.in_mode(True, skip_dropout=skip) is None and look.due():
                look.start(model, skip)

    def pass_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        model = self._model()
        grad = torch.is_grad_enabled()
        part: tuple[str, nn.Module] | None = None
        if module is not model and unwrap(module) is not model:
            name = self._part_name(module)
            if name is None:
                if self.broadcast is not None:
                    self.broadcast.pass_ends(output, grad)
                return
            part = (name, unwrap(module))
        sampler = self.sampler
        if sampler is not None and (sampler.active or sampler.handles or sampler.outputs):
            sampler.end_pass(module, args, output)
            measured, sampler.model_output = sampler.model_output, None
            if grad and self.output_target is not None and self._due_step >= self._targets_from:
                self.output_target.pass_ends(measured)
        modes = self.modes
        if modes is not None:
            if part is None:
                if modes.learning:
                    modes.stop_learning()
                if self.functional is not None and self.functional.active:
                    found = self.functional.finish()
                    if found:
                        self.modes.learn_functional(found)
                        if self.lone_parts is not None:
                            self.lone_parts.follow()
            # Gradients asked once: a training pass's checks, or an evaluation's.
            if grad:
                passes = self.eval_passes
                if passes.attentive:  # else it has nothing to do (no no-grad pass near)
                    self._training_pass(passes, args, kwargs)
                if modes.in_frozen and not self._told_frozen and self.check_eval_pass:
                    self._frozen_in_training(modes, "" if part is None else part[0])
                # Looked at again after a report of modules in frozen parts: a later
                # pass of the step may train them, still in eval (a model frozen for
                # another's backward, then updated without .train()).
                if (
                    self.check_train_step
                    and (
                        self.train_in_eval is None
                        or self.eval_gradients.held
                        or self.train_in_eval.in_frozen_parts
                    )
                    and modes.listed
                ):
                    report = modes.in_mode(False, part=part)
                    if report is not None:
                        hook_backward(output, WeakHook(self, "backward_seen", report))
            elif self.check_eval_pass:
                if part is not None and modes.in_frozen and part[1].training:
                    # A part's own pass without gradients, in training mode (a
                    # teacher training_step calls): frozen parts in it run beside
                    # the training. One in eval mode (an EMA copy evaluated) does not.
                    modes.part_called(part[0])
                self._nograd_modes(model, modes, part, args, kwargs, output)
        if self.broadcast is not None:
            self.broadcast.pass_ends(output, grad, None if part is None else part[0])
        if not grad or not module.training:
            self._evaluation_ends(module, output, grad)

    def _nograd_modes(
        self,
        model: nn.Module | None,
        modes: ModeWatch,
        part: tuple[str, nn.Module] | None,
        args: Any,
        kwargs: Any,
        output: Any,
    ) -> None:
        """A pass without gradients: modules in training mode, told or held."""
        report = modes.in_mode(
            True,
            skip_dropout=self._config.eval_in_train_mode.mc_dropout,
            part=part,
            pass_over=True,
        )
        if report is None:
            return
        report.input_shape, report.output_shape = pass_shapes(args, output)
        # A pass after a training pass (or a step's end) starts a streak; one that
        # feeds on the pass before it is that computation's next step (a solver's).
        fresh = not self.eval_passes.in_a_row
        iterates = self._pass_chain.feeds_on_last(args, kwargs, output) and not fresh
        if part is not None:
            report = self._part_streak.joined(part[0], report, fresh, iterates)
        else:
            self._part_streak.reset()
            if iterates:
                report = None  # one solve of the model, already judged at its first pass
        if report is not None:
            self._judge_nograd_pass(model, report, batch_rows(args, kwargs))

    def _training_pass(self, passes: EvalPassJudge, args: Any, kwargs: Any) -> None:
        """A pass with gradients near no-grad passes: the judge learns where it sits,
        its batch size, and whether it takes what the last no-grad pass made or took
        (that pass fed it: part of the step)."""
        fed = bool(passes.in_a_row) and self._pass_chain.taken_by(args, kwargs)
        steps = (ANY_OPTIMIZER_STEPS.count, self._step_of())
        passes.training_pass(steps, fed, batch_rows(args, kwargs))

    def _evaluation_ends(self, module: nn.Module, output: Any, grad: bool) -> None:
        """A pass without gradients or in eval mode ended: an evaluation's, perhaps."""
        audit = self.evaluations
        if audit is None or not audit.live:
            return
        if grad:
            training = self.broadcast
            if not audit.grad_passes or (training is not None and training.live):
                return  # the training audit follows every pass with gradients of its steps
        else:
            trained = self._trained_this_step()
            if trained and module.training:
                return  # a target side (a DQN's), the training audit's
        audit.evaluation_ends(output, grad, self.passes)

    def _trained_this_step(self) -> bool:
        """A pass with gradients since the step boundary: this pass without gradients
        comes after one, not only after others without gradients."""
        passes = self.passes
        now = passes.passes if passes is not None else 0
        run = self._nograd_run + 1 if now == self._last_nograd + 1 else 1
        self._last_nograd, self._nograd_run = now, run
        return self._model_passes > run

    def _judge_nograd_pass(
        self, model: nn.Module | None, report: ModeReport, rows: int | None = None
    ) -> None:
        """A pass without gradients ran modules in training mode: an evaluation, or
        part of training? The judge tells, now or at a step boundary. ``rows``: the
        pass's batch size."""
        step = self._step_of()
        if not self.eval_passes.trained:
            # No steps of its own (an EMA copy): the step the training is in.
            step = max(step, PROCESS_STEPS.now)
        record = StepRecord(step=step, source="forward")
        record.eval_in_train = report
        weights = weights_fingerprint(model)
        clock = PROCESS_STEPS.taken
        # An optimizer step, or a backward of a watched model, since the
        # last such pass: a critic's step (or its micro-batch) between two
        # samples of its generator.
        marks = (ANY_OPTIMIZER_STEPS.count, PROCESS_STEPS.backwards)
        before, self._steps_at_nograd = self._steps_at_nograd, marks
        between = before is not None and before != marks
        told = self.eval_passes.nograd_pass(
            record,
            weights,
            clock,
            stepped_between=between and self.optimized(),
            steps=(marks[0], PROCESS_STEPS.now),
            rows=rows,
            frozen=self._all_frozen,
        )
        for due in told:
            self._publish(due)

    def _all_frozen(self) -> bool:
        """No parameter of the model requires grad now (a teacher frozen after its
        training): asked only where a model that trained briefly stops stepping."""
        model = self._model()
        params = list(model.parameters()) if model is not None else []
        return bool(params) and not any(p.requires_grad for p in params)

    def _frozen_in_training(self, modes: ModeWatch, within: str) -> None:
        """A training pass ran a large frozen part in training mode: told once a run,
        dated at the pass that found it, once a training pass of a later step finds
        it frozen still. A part frozen only around another optimizer's step
        (Lightning's ``toggle_optimizer`` freezes a GAN's generator for the
        discriminator's) trains on its own step's pass: no frozen part.
        ``within``: the part the pass was of ("" for the whole model)."""
        seen = self._frozen_seen
        if seen is not None:
            record, steps = seen
            if not modes.still_frozen(record.eval_in_train.modules):
                # Trained in turns: no frozen part, and nothing more to look at.
                self._frozen_seen = None
                self._told_frozen = True
            elif (ANY_OPTIMIZER_STEPS.count, PROCESS_STEPS.taken) != steps:
                self._told_frozen = True
                self._frozen_seen = None
                self._frozen_told = record.eval_in_train
                self._publish(record)
            return
        report = modes.frozen_in_training(self.calls, within)
        if report is None:
            return
        report.during_training = True
        record = StepRecord(step=self._step_of(), source="forward")
        record.eval_in_train = report
        self._frozen_seen = (record, (ANY_OPTIMIZER_STEPS.count, PROCESS_STEPS.taken))

    def frozen_part_flush(self) -> list[StepRecord]:
        """At close: a frozen part found in training mode and frozen still is told."""
        seen, self._frozen_seen = self._frozen_seen, None
        if seen is None or self.modes is None:
            return []
        if not self.modes.still_frozen(seen[0].eval_in_train.modules):
            return []
        return [seen[0]]

    def evaluation_flush(self) -> list[StepRecord]:
        """At close: what the last evaluation's span found (a validation after the
        last step has no pass after it to end its span)."""
        return self.evaluations.flush() if self.evaluations is not None else []

    def parameters_changed(self) -> None:
        """Parameters were frozen or unfrozen: which parts are frozen, asked again."""
        if self.modes is not None:
            self.modes.find_frozen_parts()
            if self._frozen_told is not None:
                self._told_part_trains(self.modes)

    def _told_part_trains(self, modes: ModeWatch) -> None:
        """The frozen part told of as running in training mode trains now, all of
        it (a staged fine-tune: the backbone unfrozen, or handed to an optimizer,
        after the head's warm-up): its training mode is right from now on, and the
        finding is withdrawn, once. Asked only where the freeze may have changed
        (flags flipped, the optimizers' membership, gradients where none were
        held): a part frozen for the whole run keeps its finding."""
        told = self._frozen_told
        if told is None or not modes.all_train(told.modules):
            return
        self._frozen_told = None
        record = StepRecord(step=self._step_of(), source="forward")
        record.eval_in_train = replace(told, trains_now=True)
        self._publish(record)

    def part_called_alone(self, name: str) -> None:
        """The model's part ``name`` was called on its own, outside the model's passes,
        where the call tracker could not see it (see ``ModeWatch.part_called``)."""
        if self.modes is not None:
            self.modes.part_called(name, now=False)

    def held_by_none(self, params: list[nn.Parameter]) -> None:
        """The model's parameters no watched optimizer holds (the membership changed):
        those requiring grad and never given a gradient make frozen parts too."""
        if self.modes is not None:
            self.modes.held_by_none(params)
            if self._frozen_told is not None:
                self._told_part_trains(self.modes)

    def got_gradients(self, params: list[nn.Parameter]) -> None:
        """Parameters no optimizer holds had gradients at a step: none of them is idle.

        A part taken for frozen on the first pass, before any gradient (a backbone
        left out of the optimizer, ``not_optimized``'s), is no frozen part: its
        finding is dropped, and one frozen later is found and dated anew.
        """
        modes = self.modes
        if modes is None:
            return
        modes.got_gradients(params)
        seen = self._frozen_seen
        if seen is not None and not modes.still_frozen(seen[0].eval_in_train.modules):
            self._frozen_seen = None
        if self._frozen_told is not None:
            self._told_part_trains(modes)

    def _name_called(self, module: nn.Module | None) -> str | None:
        """A called module's name as findings give it: "" for the model, its name for a
        part called on its own; None for a module of neither (or a compiled wrapper)."""
        if module is None:
            return None
        model = self._model()
        if module is model or unwrap(module) is model:
            return ""
        return self._part_name(module)

    def _part_name(self, module: nn.Module) -> str | None:
        """The name in the model of a part called on its own (None: not one of its parts).

        Only modules the model's pass hooks watch come here: the model's
        children, once a step's gradients came without a pass of the whole.
        """
        inner = unwrap(module)
        name = self._parts.get(id(inner))
        if name is None:
            # One walk, when a part is first met (and after the tree changed).
            name = self._name_modules().get(id(inner))
        return name

    def _module_names(self) -> dict[int, str]:
        """Every module of the model by id, with its name (the tree as it is now)."""
        if self._structure.changed():
            self._rebuild()
        return self._parts or self._name_modules()

    def _name_modules(self) -> dict[int, str]:
        """One walk of the model: each module's name, by id."""
        model = self._model()
        if model is not None:
            self._parts = {id(sub): user_name(raw) for raw, sub in model.named_modules()}
        return self._parts

    def _rebuild(self) -> None:
        self._parts = {}
        model = self._model()
        if model is None:
            return
        if self.modes is not None:
            self.modes.refresh()
            if self.modes.listed and self.lone_parts is not None:
                self.lone_parts.follow()  # dropout or batch norm added
        if self.sampler is not None:
            self.sampler.attach(model)

    # -- step boundary --------------------------------------------------------------
    def gather(self, record: StepRecord, frame: StepFrame) -> BehaviourToken | None:
        if self.functional is not None and self.functional.pending:
            self.functional.release()
        for due in self.eval_passes.step_boundary():
            self._publish(due)  # a single no-grad pass that did not recur: an evaluation
        try:
            return self._gather(record, frame)
        except Exception:
            self.detach()  # the monitor reports it once; nothing of ours stays behind
            raise

    def _gather(self, record: StepRecord, frame: StepFrame) -> BehaviourToken | None:
        found, self.train_in_eval = self.train_in_eval, None
        if (
            found is None
            and self.check_train_step
            and self.modes is not None
            and not self._model_passes
            and any(info.in_model for info in record.present)
        ):
            # Gradients, but no pass of the model seen (compiled after watching,
            # before its wrapper was found): the modes now are the pass's. Only the
            # model's own count: an optimizer holding it beside another model (an
            # EMA copy handed to the model's optimizer) steps it on that model's
            # gradients, which are no training pass of this one.
            found = self.modes.in_mode(False)
        if found is not None:
            # A target or reference copy (a DPO reference, a DQN target) in eval mode
            # is set up as meant: the gradients backward sends it are no training
            # step of its own, and no update uses them (not_optimized's finding, or
            # accumulated_gradient's once the loop moves it), so model.train() is
            # no advice for it.
            record.train_in_eval = None if found.whole_model and self.a_target() else found
        self._model_passes = 0
        audit = self.broadcast
        if audit is not None:
            record.broadcasts = audit.step_boundary()
            record.loss_inputs = audit.take_loss_inputs()
            if audit.finished:
                # Over, its findings handed over and its mode off the stack (a mode
                # entered after it may still hold it there: then it stays, and is
                # popped at a later boundary).
                self.broadcast = None
        token = None
        if self.sampler is not None:
            self.sampler.active = False
            names, stats = self.sampler.take()
            if audit is not None:
                stats = self._with_target(audit, names, stats)
            if stats is not None:
                token = BehaviourToken(names, frame.add(stats))
        return token

    def _with_target(
        self, audit: BroadcastAudit, names: list[RowKey], stats: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The sampled rows, and the loss target's spread the audit measured as one more."""
        target = audit.take_target()
        if target is None:
            return stats
        names.append(RowKey(TARGET, "", True))
        row = torch.full((len(FIELDS),), float("nan"), device=target.device)
        row[0] = target
        return row[None] if stats is None else torch.cat([stats, row[None].to(stats)])

    def rearm_audit(self, steps: int, phase: bool) -> None:
        """Audit the loss of the next ``steps`` steps: a new phase of training (a new
        head, optimizer or loss, perhaps a new target's shape) or a sampled step.
        A new phase re-arms the evaluation audit too."""
        audit = self._audit
        if audit is None or audit.ended:
            return
        audit.rearm(steps)
        self.broadcast = audit
        if phase:
            self.rearm_evaluations()

    def read_loss_kinds(self, told: KindReader | None) -> None:
        """Hand ``told`` each loss the training audit follows to its ``backward``, for
        its kind (``collect/loss_kind.py``); None: no more."""
        if self._audit is not None:
            self._audit.on_loss_kind = told

    def rearm_evaluations(self) -> None:
        """Follow the next evaluation passes: those of a new phase of training, or
        of a dataset first evaluated now (a test set, with its own metric code)."""
        if self.evaluations is not None:
            self.evaluations.rearm(self._config.broadcast.evaluation_passes)

    def land(self, record: StepRecord, token: BehaviourToken) -> None:
        record.activations = ActivationSampler.unpack(token.names, token.stats.values())

    def detach(self) -> None:
        if self.eval_gradients is not None:
            self.eval_gradients.release()
        if self._holds_steps:
            self._holds_steps = False
            ANY_OPTIMIZER_STEPS.release()
        if self.modes is not None:
            self.modes.stop_learning(apply=False)
        if self.functional is not None:
            self.functional.detach()
        if self.lone_parts is not None:
            self.lone_parts.detach()
        if self._audit is not None:
            self._audit.detach()
        if self.evaluations is not None:
            self.evaluations.detach()
        if self.sampler is not None:
            self.sampler.detach()
        if self.output_target is not None:
            self.output_target.detach()
        self._structure.detach()


def _never() -> bool:
    return False
