"""The Monitor: trainwatch's public object, the optimizer hooks and the step lifecycle.

One step, as data: the optimizer's pre-step hook has the step pipeline
(trainwatch/step_pipeline.py, which holds the collectors) gather what the
step is about to apply; the post-step hook counts the step, has the frame
read back in one transfer (now, or at the next step with a lagged readback),
judged by the rules, and hands their alerts to the sinks, halting where
``halt_on`` says. Plain loops (through ``tw.watch``, in trainwatch/watching.py),
the Lightning callback and ``trainwatch run`` drive this same object.

Other jobs a monitor has are done by objects it owns: the gathering around
``clip_grad_norm_`` (trainwatch/clip_gathering.py), the catch of an optimizer
training the model unwatched (trainwatch/unwatched_catch.py) or stepped by a
loop that passed ``tw.watch`` none (trainwatch/optimizer_not_given.py), the step-end
collective across ranks (``halt_sync_for_run`` in trainwatch/halt_sync.py) and
the findings only closing settles (trainwatch/closing_findings.py).
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.optim import Optimizer

from trainwatch import clip_hook, loader_hook, registry, termination
from trainwatch.alert import Alert
from trainwatch.clip_gathering import ClipGathering
from trainwatch.closing_findings import findings_at_close
from trainwatch.collect.copies_in_optimizer import COPIES_TOLD
from trainwatch.collect.data_order import own_batching, sequential_order
from trainwatch.compiled import unwrap
from trainwatch.config import Config
from trainwatch.dispatch import Dispatcher
from trainwatch.errors import TrainingHealthError, WatchError
from trainwatch.guard import Guard
from trainwatch.halt_sync import HaltSync, halt_sync_for_run, running_distributed
from trainwatch.hooks import HookGroup, WeakHook
from trainwatch.optimizer_not_given import OptimizerNotGiven
from trainwatch.optimizer_wrappers import inner_optimizer
from trainwatch.preflight import check_optimizer, check_optimizer_matches, preflight
from trainwatch.process_steps import ORIGINS_TOLD, PROCESS_STEPS
from trainwatch.raised import note_raise
from trainwatch.record import LooseTraining, ReplacedModel
from trainwatch.released import live, release_dropped
from trainwatch.rules import build_rules
from trainwatch.rules.rule_set import RuleSet
from trainwatch.setup_audit import SetupAudit, build_audit
from trainwatch.sinks import ConsoleSink, MemorySink, Sink
from trainwatch.step_pipeline import PendingStep, StepPipeline
from trainwatch.tuner_trials import tuner_trial_running
from trainwatch.unwatched_catch import UnwatchedOptimizerCatch
from trainwatch.weak import weak_callback, weak_getter, weak_method

_OPEN: weakref.WeakSet[Monitor] = weakref.WeakSet()


def _land_every_in_flight() -> None:
    """Every open monitor's step still in flight (lagged readback), read back now: a
    NaN/Inf origin found there is told before another model's copy of it is judged."""
    for monitor in list(_OPEN):
        if not monitor.closed:
            monitor._land_in_flight(may_halt=False)


ORIGINS_TOLD.settle = _land_every_in_flight


class Monitor:
    """Watches one model (and its optimizers) for silent training bugs.

    Create it with :func:`trainwatch.watch`. Close it (or use it as a context
    manager) to take every hook off again.
    """

    # True for the monitors `trainwatch run` creates on its own: a script that
    # calls tw.watch on the same model later takes over instead of failing.
    yields_to_explicit_watch: bool = False
    # True where `trainwatch run` ends a hand-trained model's steps at each
    # backward's end: such a step is not proof of an update.
    steps_end_at_backward: bool = False

    def __init__(
        self,
        model: nn.Module,
        optimizers: Sequence[Optimizer] = (),
        *,
        config: Config | None = None,
        sinks: Sequence[Sink] = (),
        scaler: Any = None,
        data: Any = None,
    ) -> None:
        layers = preflight(model, optimizers)
        # torch.compile(model) returns a wrapper: names, hooks and checks are
        # the wrapped model's, and the wrapper's own (eager) call stands for it.
        root = unwrap(model)
        for param in layers.parameters():
            owner = registry.owner_of(param)
            if owner is not None and owner.yields_to_explicit_watch:
                owner.close()  # `trainwatch run`'s automatic monitor steps aside
        self.config = config if config is not None else Config()
        self.model = model
        self._root = root
        self.closed = False
        self._memory = MemorySink()
        self._dispatcher = Dispatcher([self._memory, *sinks], self.config.halt_on)
        self._dispatcher.model = type(root).__name__
        for sink in sinks:
            if isinstance(sink, ConsoleSink) and sink.model_label is None:
                sink.model_label = _NameWhileSeveral(weakref.ref(self))
        if running_distributed():
            # Each rank's alerts say which rank they are from (a relay, if any,
            # stamps the same number); set again at the first step boundary for
            # a process group set up after watching.
            self._dispatcher.rank = torch.distributed.get_rank()
        rules = build_rules(self.config)
        self._handles = HookGroup()
        self._optimizers: list[Optimizer] = []
        # The steps' gradients are all any step uses: one optimizer watched, and no
        # other seen stepping the model (see _step_not_watched).
        self._one_optimizer = False
        self._others_step = False
        self._step = 0
        self._steps_here = 0  # steps taken in this process (a resumed run restores _step)
        # Under torch.distributed with halt_on: the check that stops every rank
        # together (False: not decided yet; None: not needed).
        self.halt_sync: HaltSync | bool | None = False
        # Run by every rank together before a distributed halt is raised; an
        # adapter whose relay carries alerts to rank zero sets `relayed`.
        self.before_halt: list[Any] = []
        self.relayed = False
        # Under torch.distributed: run at each step's end (rank zero reads the
        # other ranks' alerts there), and at close before the sinks close.
        self.at_boundary: list[Any] = []
        self.before_close: list[Any] = []
        self._pending: dict[int, PendingStep] = {}
        # Optimizers whose pending step was gathered before clipping (collect_before_step).
        self._held_early: set[int] = set()
        # Per optimizer, the forward passes seen when it was last gathered early:
        # a clip after that gathering (Lightning clips after its hook) keeps it.
        self._gathered_at_pass: dict[int, int] = {}
        self._in_flight: PendingStep | None = None  # lagged readback: read at the next step
        # While a tuner's trial steps run: the state they began from (see begin_trial).
        self._trial: tuple[dict[str, Any], int] | None = None
        self._guard = Guard(weak_callback(self._internal_error))
        self._disabled = self._guard.disabled
        self._rules = RuleSet(rules, self._guard)
        self._attaching = True
        # The collectors the enabled rules need: nothing else is attached.
        self._pipeline = StepPipeline(
            model,
            root,
            layers,
            self.config,
            self._rules,
            frozenset().union(*(rule.needs for rule in rules)),
            self._optimizers,
            self._dispatcher,
            self._guard,
            scaler=scaler,
            step_count=weak_getter(self, "step_count", 0),
            steps_taken=weak_getter(self, "_steps_here", 0),
            on_error=weak_callback(self._internal_error),
            on_raise=weak_callback(self._name_the_module),
            claim=weak_callback(self._claim),
        )
        # The step gathered before clip_grad_norm_ rescales its gradients.
        self._clipping = ClipGathering(
            self._pipeline,
            self._rules,
            self._optimizers,
            self._pending,
            self._gathered_at_pass,
            self.collect_before_step,
        )
        # Weights updated while no watched optimizer steps: the optimizer doing it
        # is looked for, and watched once found.
        self._unwatched = UnwatchedOptimizerCatch(
            self._pipeline,
            self._optimizers,
            self._dispatcher,
            self._guard,
            self._handles,
            closed=weak_getter(self, "closed", True),
            watch=weak_callback(self.add_optimizer),
            on_hook_error=weak_callback(self.fail),
        )
        self._pipeline.on_unwatched = weak_callback(self._unwatched.weights_moved)
        # Under tw.watch(model) without an optimizer: one the loop steps over the
        # model without calling monitor.step() (see watch_optimizer_not_given).
        self._not_given: OptimizerNotGiven | None = None
        # What close() (or the finalizer, for a monitor dropped unclosed) detaches.
        # Run by close() too, so the finalizer's table no longer holds the parts
        # (and through them the model) of a closed monitor still referenced.
        self._detach = weakref.finalize(self, _collected, self._handles, *self._pipeline.parts)
        try:
            if data is not None:
                self.watch_data(data)
            registry.claim(layers.parameters(), self)
            _OPEN.add(self)
            clip_hook.install(self)
            if self._pipeline.looks_at_padding:
                loader_hook.install(self)
            for opt in optimizers:
                self.add_optimizer(opt)
        except BaseException:
            # Nothing of a monitor that failed to attach stays on the model, its
            # optimizers or the process (a monitor built in its place attaches anew).
            _OPEN.discard(self)
            clip_hook.release(self)
            loader_hook.release(self)
            self._detach()
            registry.release(self)
            raise
        self._attaching = False
        if not self._optimizers:
            # Hand-written updates: where the weights stand before the first one.
            self._guarded("hand-written updates", self._pipeline.start_zeroed_updates)
        if self._pipeline.setup.due and self._optimizers and not _any_lazy(model):
            # (A lazy module's parameters have no size before its first call:
            # the audit waits for the first step.)
            self._guarded("setup audit", self._pipeline.audit_setup, self._step)

    # -- public surface ----------------------------------------------------
    @property
    def alerts(self) -> list[Alert]:
        """Every alert so far, oldest first (repeats of a (rule, module) are counted)."""
        self._land_in_flight(may_halt=False)
        return list(self._memory.alerts)

    @property
    def alert_counts(self) -> dict[tuple[str, str | None], int]:
        """How often each (rule, module) fired, repeats included."""
        self._land_in_flight(may_halt=False)
        return {key: tally.count for key, tally in self._dispatcher.tallies.items()}

    @property
    def passes_seen(self) -> int:
        """Outermost forward passes of the model seen so far."""
        return self._pipeline.passes.passes

    @property
    def backward_seen(self) -> bool:
        """Whether a backward pass reached the model since its last step (before its
        first: ever). Read at close, never at a step: a model that ran and was
        backpropagated through, though no optimizer stepped, is told apart from one
        that only ran forward."""
        return self._pipeline.tracker.backward_seen

    @property
    def step_count(self) -> int:
        """Optimizer steps seen (or ``monitor.step()`` calls without an optimizer)."""
        return self._step

    @property
    def steps_here(self) -> int:
        """Steps this monitor watched itself: ``step_count`` less those it was told
        came before (a resumed run's, or steps ``trainwatch run`` counted for it)."""
        return self._steps_here

    @property
    def model_name(self) -> str | None:
        """The model's name where other monitors' alerts name it (a NaN/Inf's knock-on
        in an EMA copy names the model it came from): its class, or the name
        `trainwatch run` gave it."""
        return self._dispatcher.model

    @model_name.setter
    def model_name(self, name: str) -> None:
        self._dispatcher.model = name

    def model_holds(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the watched model's own parameters (not one its
        optimizers hold outside it)."""
        return param in self._pipeline.layers

    @property
    def scaler(self) -> Any:
        """The torch.amp.GradScaler whose loss scale the AMP check reads (None: not visible)."""
        return self._pipeline.scaler

    @property
    def optimizers(self) -> list[Optimizer]:
        """The optimizers watched, but those the script let go (see add_optimizer)."""
        return live(self._optimizers)

    @property
    def setup_audit(self) -> SetupAudit | None:
        """The latest setup table: trainable and frozen parameters by location,
        adapters, and which optimizer holds what (made now if no step made one)."""
        if self._pipeline.setup.latest is not None:
            return self._pipeline.setup.latest
        return self._guarded("setup audit", build_audit, self._root, self._optimizers)

    def grad_norms(self) -> dict[str, float]:
        """Per-layer gradient L2 norms of the latest step, by qualified module name.

        Under FSDP2, the whole layers' norms of the latest step they were summed
        across ranks at (every ``distributed.gather_every`` steps; empty before).
        """
        self._land_in_flight(may_halt=False)
        return self._latest_norms

    @property
    def _latest_norms(self) -> dict[str, float]:
        """Each optimizer's latest step merged (a GAN's two halves, say)."""
        merged: dict[str, float] = {}
        for norms in self._pipeline.latest_by_source.values():
            merged.update(norms)
        return merged

    @property
    def total_grad_norm(self) -> float | None:
        """L2 norm over every gradient of the latest step (under FSDP2, as ``grad_norms``)."""
        self._land_in_flight(may_halt=False)
        return self._pipeline.total_norm

    def add_optimizer(self, optimizer: Optimizer) -> None:
        """Watch one more optimizer (one created after ``tw.watch``, a GAN's second)."""
        self._ensure_open()
        optimizer = inner_optimizer(optimizer)
        check_optimizer(optimizer)
        if any(opt is optimizer for opt in self._optimizers):
            return
        if self._pipeline.layers.outdated() or self._pipeline.structure.changed():
            # An optimizer built after module.to() replaced the parameters, or over
            # a module put into the model since the last step (a new head).
            self._pipeline.rebuild_layers()
        check_optimizer_matches(optimizer, self._pipeline.layers, len(self._optimizers))
        if self._steps_here:
            # A new optimizer after steps taken in this process: a new phase
            # (fine-tuning after pre-training) for the layers it trains. One
            # added before any step (a resumed run) continues the old history.
            info = self._pipeline.layers.info
            self._pipeline.restarted.update(
                info(p).owner for group in optimizer.param_groups for p in group["params"]
            )
            # Its batches may be of another make (a fine-tuning collate): looked at
            # from its first step, not only from the phase's detection after it.
            self._pipeline.batches_may_change()
        if self._optimizers and not self._attaching:
            self._guarded("dropped optimizers", self._release_dropped_optimizers)
        index = len(self._optimizers)
        # The hooks first: an optimizer that takes none is not left half attached.
        before = optimizer.register_step_pre_hook(WeakHook(self, "_before_optimizer_step", index))
        self._handles.add(before)
        self._handles.add(
            optimizer.register_step_post_hook(WeakHook(self, "_after_optimizer_step", index))
        )
        self._guarded("optimizer restarts", self._watch_loads, optimizer, index)
        self._optimizers.append(optimizer)
        self._one_optimizer = len(self._optimizers) == 1 and not self._others_step
        registry.changed()  # which monitor tells a parameter held outside its model
        self._pipeline.tracker.track_reached = False  # its steps say what the gradients were
        self._guarded("optimizer audit", self._pipeline.audit_optimizer, index)
        if self._trial is None and tuner_trial_running():
            # First watched at a tuner's trial step (`trainwatch run` finds the model
            # at its first call, inside a learning-rate range test run before fit).
            self.begin_trial()

    def watch_optimizer_not_given(self) -> None:
        """Watch, as if passed, the torch optimizers found stepping the model's
        parameters while no optimizer is watched and ``monitor.step()`` is not
        called (a loop that forgot to pass its optimizer to ``tw.watch``), from
        their second step on; one console line says so. ``tw.watch`` asks for this
        when given no optimizer (see trainwatch/optimizer_not_given.py)."""
        self._ensure_open()
        if self._not_given is None and not self._optimizers:
            self._not_given = OptimizerNotGiven(
                self._pipeline,
                self._optimizers,
                self._guard,
                self._handles,
                closed=weak_getter(self, "closed", True),
                steps_taken=weak_getter(self, "_steps_here", 0),
                adopt=weak_callback(self._adopt_not_given),
                watch=weak_callback(self.add_optimizer),
                step_not_watched=weak_method(self._step_not_watched, 0),
                step_count=weak_getter(self, "_step", 0),
                stepped_before=weak_callback(self._stepped_before),
                note=self._dispatcher.note,
                model_name=weak_getter(self, "model_name", None),
            )

    def _adopt_not_given(self, optimizers: list[Optimizer], unwatched: int) -> None:
        """The optimizers the loop steps without having passed them, watched from the
        step under way; the ``unwatched`` steps they took before are counted first,
        so alerts name the loop's own step (as ``trainwatch run`` counts them)."""
        if unwatched:
            self.load_state_dict({"step": self._step + unwatched})
        for optimizer in optimizers:
            self.add_optimizer(optimizer)

    def _stepped_before(self, optimizer: Optimizer, step: int) -> None:
        """``optimizer``, watched now, took ``step`` before it was (found stepping the
        model by trainwatch/optimizer_not_given.py): its latest step, as its own
        watched step would have noted it (a missing ``zero_grad()`` names it)."""
        for index, opt in enumerate(self._optimizers):
            if opt is optimizer:
                self._pipeline.stepped_unwatched(index, step)
                return

    def _step_not_watched(self) -> int:
        """A step of an optimizer found stepping the model while others are watched
        already, to be watched from its next step (see trainwatch/optimizer_not_given.py):
        counted as a watched optimizer's step is, so the steps after it are numbered
        as with every optimizer passed. Returns its number. The watched optimizer's
        gradients are no longer all that steps use."""
        self._others_step = True
        self._one_optimizer = False
        self._step += 1
        PROCESS_STEPS.taken += 1
        PROCESS_STEPS.now = self._step
        return self._step - 1

    def _release_dropped_optimizers(self) -> None:
        """A new optimizer comes: those the script no longer holds (built anew every
        epoch or round) are let go, so their state is freed with them; each keeps
        its place as a :class:`ReleasedOptimizer`. Asked only as one is added."""
        for index in release_dropped(self, self._optimizers, stop=(Monitor,)):
            # Its last norms are no layer's latest any more (a finished phase's).
            self._pipeline.latest_by_source.pop(index, None)
            self._pending.pop(index, None)
            self._held_early.discard(index)
            self._clipping.forget(index)

    def watch_data(self, loader: Any) -> None:
        """The DataLoader that feeds training now (the data checks judge its sampler).

        Only the training loader belongs here: a validation loader read in
        order is normal.
        """
        self._pipeline.data_order = self._guarded("data order", sequential_order, loader)
        self._pipeline.own_batching = self._guarded("data order", own_batching, loader)

    def data_restarted(self) -> None:
        """A new pass over the training data begins (an epoch, another loader).

        Its batches may be of another make than the last pass's (a curriculum's
        second loader, a collate changed for a fine-tuning phase): the labels a
        token loss gives padding are looked at on the next step
        (``loss_on_padding``), not only at their sampled cadence. ``trainwatch run``
        and the Lightning and Hugging Face callbacks call it at each epoch; a loop
        under ``tw.watch`` has it called as each ``DataLoader`` pass begins.
        """
        if not self.closed:
            self._pipeline.batches_may_change()

    def loader_started(self) -> None:
        """A ``DataLoader`` pass began with gradients on (:mod:`trainwatch.loader_hook`):
        with the model in training mode, a new pass over the training data."""
        if not self.closed and self.model.training:
            self.data_restarted()

    def new_evaluation_data(self) -> None:
        """A dataset is evaluated for the first time (a test set after fitting,
        Lightning's ``trainer.test`` or ``predict``): its first passes are followed
        into the metrics computed from them, as a new phase's are, whatever the
        earlier evaluations spent."""
        behaviour = self._pipeline.behaviour
        if behaviour is not None and not self.closed:
            self._guarded("broadcast audit", behaviour.rearm_evaluations)

    @property
    def data_order(self) -> str | None:
        """How the training loader reads its data in order; None: shuffled, or not seen."""
        return self._pipeline.data_order

    def refresh_layers(self) -> None:
        """Name parameters put into the model since the last step (a new head) now.

        The step does this itself; a caller about to ask who owns a parameter
        (``trainwatch run`` meeting a new optimizer) calls it first.
        """
        if not self.closed and self._pipeline.structure.changed():
            self._guarded("layer map", self._pipeline.rebuild_layers)

    def flush(self) -> None:
        """Land a step still on its way to the host (lagged readback) and apply ``halt_on``.

        Reading ``alerts`` or ``grad_norms()`` lands it too, but never halts:
        a halt found that way is raised here or at the next step boundary.
        """
        self._ensure_open()
        self._land_in_flight()
        if isinstance(self.halt_sync, HaltSync):
            return  # under torch.distributed every rank halts together, at a step's end
        self._dispatcher.raise_held()

    def step(self, loss: torch.Tensor | float | None = None) -> None:
        """Mark a step boundary when no optimizer is watched; pass the loss in any mode."""
        self._ensure_open()
        if loss is not None:
            value = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)
            if self._optimizers and self._step > 0 and not self._pipeline.tracker.backward_seen:
                # Called after optimizer.step(): the loss is the step just taken's.
                self._pipeline.late_loss = (self._step - 1, value)
            else:
                self._pipeline.loss = value
        if self._optimizers:
            return  # the optimizers' own hooks mark the steps
        if "step collector" in self._disabled:
            self._advance()
            return
        self._guarded("step collector", self._manual_step)

    def loss_out_of_reach(self) -> None:
        """The training code cannot hand the loss over (``trainwatch run`` watches a
        script that knows nothing of trainwatch): messages stop asking for it."""
        for rule in self._rules:
            rule.loss_out_of_reach = True

    def record_loss(self, loss: torch.Tensor | float) -> None:
        """Hand over the loss of the step in progress, before its backward.

        For adapters that know which step a loss belongs to (Lightning calls
        back before each backward), unlike :meth:`step`, which must guess from
        whether backward already ran. Several losses in one step (gradient
        accumulation) add up, so a non-finite micro-batch is not overwritten
        by a finite one after it.
        """
        self._ensure_open()
        if isinstance(loss, torch.Tensor):
            value: torch.Tensor | float = loss.detach()
            if self._pipeline.probe is not None:
                # Its graph, for the probe to look into should its backward turn
                # out non-finite (the training code's frames no longer hold it);
                # weakly, so a graph kept for a second backward goes when the
                # framework lets it go.
                self._pipeline.probe.handed_loss = weakref.ref(loss)
        else:
            value = float(loss)
        if self._pipeline.loss is None:
            self._pipeline.loss = value
        elif isinstance(self._pipeline.loss, torch.Tensor) and isinstance(value, torch.Tensor):
            self._pipeline.loss = (
                self._pipeline.loss.reshape(-1)[:1]
                + value.to(self._pipeline.loss.device).reshape(-1)[:1]
            )
        else:
            self._pipeline.loss = _as_number(self._pipeline.loss) + _as_number(value)

    def close(self) -> None:
        """Remove every hook, flush the sinks and print the summary; idempotent."""
        if self.closed:
            return
        self._drop_trial()  # closed inside a trial (it failed): the run's own sinks
        try:
            self._land_in_flight(may_halt=False)  # closing never raises a halt
            for alerts in findings_at_close(self._pipeline, self._rules, self._guard, self._step):
                self._dispatcher.publish(alerts, may_halt=False)
            for hook in self.before_close:
                self._guarded("relay", hook)
        finally:
            self.closed = True
            _OPEN.discard(self)
            if not _OPEN:
                PROCESS_STEPS.now = 0  # no training under way: the next run starts at 0
                ORIGINS_TOLD.clear()  # nor any NaN/Inf it reported
                COPIES_TOLD.clear()  # nor any copy in an optimizer
            clip_hook.release(self)
            loader_hook.release(self)
            try:
                self._shut()
            finally:
                termination.release(self)

    def _shut(self) -> None:
        self._detach()
        registry.release(self)
        summary = self._dispatcher.summary(self._step, self._latest_norms)
        if not self._step and self.passes_seen:
            not_given = self._not_given.closing_words() if self._not_given is not None else None
            summary.idle = _idle_note(self.passes_seen, bool(self._optimizers), not_given)
        self._dispatcher.close(summary)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if len(exc_info) > 1 and isinstance(exc_info[1], Exception):
            self._guarded("error note", self._name_the_module, exc_info[1])
        self.close()

    def _name_the_module(self, exc: BaseException) -> None:
        """Note on ``exc`` the module of this model it escaped from, read from its traceback."""
        note_raise(exc, [self._root])

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"Monitor({type(self.model).__name__}, {len(self._optimizers)} optimizer(s), "
            f"step {self._step}, {len(self._memory.alerts)} alert(s), {state})"
        )

    # -- driven by a framework (the Lightning callback) -----------------------
    def on_backward_end(self, callback: Any) -> Any:
        """Call ``callback()`` once each backward pass that reached the model has ended,
        every gradient of it in place: where a loop without an optimizer steps.
        Returns a handle whose ``remove()`` stops it."""
        return self._pipeline.tracker.on_backward_end(callback)

    def on_model_not_called(self, callback: Any) -> None:
        """Call ``callback(since)`` at each optimizer step found stepping while the model
        is no longer called (none of its parameters got a gradient, and no forward
        pass came between two of its steps; ``since``: the first such step):
        ``trainwatch run`` looks for the model that replaced it."""
        self._pipeline.on_not_called = callback

    def tell_replaced(self, replaced: ReplacedModel, since: int | None = None) -> None:
        """This model (hand-trained, no optimizer holding it) replaced another one after
        the optimizer was built: that optimizer steps the old model's parameters
        (``replaced``). Told as ``not_optimized``, dated at ``since``, the step the
        model's training without an optimizer began (None: the latest step); the
        model's own later findings of the same cause (its weights never updated,
        its training stalled) are not."""
        self._ensure_open()
        alerts = self._guarded("step collector", self._pipeline.replaced_alerts, replaced, since)
        if alerts:
            self._dispatcher.publish(alerts, may_halt=False)

    def tell_loose_training(self, loose: LooseTraining, step: int) -> None:
        """This model (frozen whole, no optimizer holding it) is what an optimizer of
        tensors outside it was meant to train (``trainwatch run``): told as
        ``trainable_parameters``, dated at ``step``."""
        self._ensure_open()
        alerts = self._guarded("setup audit", self._pipeline.loose_training_alerts, loose, step)
        if alerts:
            self._dispatcher.publish(alerts, may_halt=False)

    def watch_parts(self) -> None:
        """The model is only ever called through its parts (a LightningModule with no
        ``forward`` of its own calls ``self.net(x)``): from now on each outermost call
        of a child holding parameters is one of the model's passes.

        Without this, parts are found after a training step whose gradients came
        from no pass of the whole model; an evaluation run first (``trainer.validate``
        before ``fit``) would be seen by no check."""
        self._guarded("model passes", self._pipeline.passes.widen)

    def part_called_alone(self, name: str) -> None:
        """The model's part ``name`` was called on its own before the model's first call
        (``trainwatch run`` watched it as a model of its own until then: a teacher the
        loop calls before the model): the checks that ask whether a part runs (is a
        frozen teacher run in training mode?) know it does from that first step."""
        behaviour = self._pipeline.behaviour
        if behaviour is not None:
            self._guarded("behaviour checks", behaviour.part_called_alone, name)

    def found_part_of_a_model(self) -> None:
        """This model turned out to be a part of one ``trainwatch run`` found at its first
        call, before any step: the part was called on its own first (a teacher the loop
        calls before the model, an encoder's shape check). That model's monitor
        watches it from now on, and this one closes: its passes without gradients so
        far, too few to be an evaluation loop, were that model's before its first
        training pass, and are let go as such passes are there."""
        behaviour = self._pipeline.behaviour
        if behaviour is not None:
            self._guarded("behaviour checks", behaviour.eval_passes.found_part_of_a_model)

    def pass_started(self, module: nn.Module, args: Any) -> None:
        """``module``'s call, already begun, is one of the model's passes.

        A monitor made inside the model's first call (``trainwatch run`` finds
        the model there) missed that call's start: PyTorch had gathered the
        module's own pre-hooks already. Called from that call's pre-hook, before
        any submodule runs, so this pass is seen whole.
        """
        self._guarded("model passes", self._pipeline.passes.started, module, args)

    def collect_before_step(self, optimizer: Optimizer, *, hold: bool = False) -> None:
        """Gather ``optimizer``'s gradients now instead of in its step pre-hook.

        Frameworks that pass a closure to ``optimizer.step`` (Lightning) run
        backward and gradient clipping inside it, after the pre-hook: calling
        this between backward and clipping gives the norms before clipping.
        ``hold``: the next ``step()`` comes without a closure, after clipping
        (the ``transformers`` Trainer): its pre-hook keeps this gathering.
        """
        for index, opt in enumerate(self._optimizers):
            if opt is optimizer:
                if (self._held_early or self._clipping.kept_over_closure) and self._guarded(
                    "step collector", self._gathered_before_clipping, index
                ):
                    return
                self._guarded("step collector", self._gather_into_pending, index)
                if index in self._pending:
                    self._gathered_at_pass[index] = self._pipeline.passes.passes
                    if hold:
                        self._held_early.add(index)
                return

    def _gathered_before_clipping(self, index: int) -> bool:
        """Whether the step was gathered already, before the loop's own clip, with
        no pass since: a framework's hook after that clip (Lightning's, in manual
        optimization, runs inside the step) keeps that gathering. Gathered again,
        the step would read the clipped gradients and lose what its pass found."""
        kept = self._clipping.take_kept(index)
        if kept is not None:  # the loop clipped, then stepped with a closure
            self._pending[index] = kept
            return True
        passes = self._pipeline.passes.passes
        if index not in self._pending or self._gathered_at_pass.get(index) != passes:
            return False
        if index not in self._held_early:
            return False
        # The loop clipped inside its closure, before the framework's hook.
        self._held_early.discard(index)
        if index in self._clipping.reset_after_clip:
            self._clipping.regather_if_reset(index, self._step)
        return True

    def closure_step_began(self, optimizer: Optimizer) -> None:
        """``optimizer``, just added, is inside its own ``step(closure)`` already:
        ``trainwatch run`` finds a model first called inside the closure (LBFGS),
        after that step's pre-hook. The step's remaining evaluations are followed
        as its pre-hook would have had them (see ``_before_optimizer_step``)."""
        for index, opt in enumerate(self._optimizers):
            if opt is inner_optimizer(optimizer):
                self._pending.pop(index, None)
                self._guarded(
                    "step collector", self._pipeline.closure_step_begins, index, self._step
                )
                return

    def before_clipping(self, param: torch.Tensor, max_norm: Any = None) -> None:
        """``clip_grad_norm_`` is about to rescale the gradients ``param`` is among
        to at most ``max_norm``.

        The optimizer holding ``param`` is gathered now, and its step keeps
        that gathering: the norms and the rules see the gradients backward
        made, not the clipped ones. Not when it was gathered already for these
        passes (a framework's hook before its own clipping), nor while a
        GradScaler has not unscaled them yet (clipping scaled gradients).
        """
        # What the clip lets through to the weights: exploding_gradient reads it.
        self._clipping.max_norm = max_norm
        if not self.closed and "step collector" not in self._disabled:
            self._guarded("step collector", self._clipping.gather_before_clipping, param)

    def after_clipping(self, param: torch.Tensor) -> None:
        """``clip_grad_norm_`` has rescaled the gradients ``param`` is among.

        Where the step was gathered before that clip with backward's gradients
        noted, they are noted again as clipped: a ``zero_grad()`` between the
        clip and the step is then told at the step, as one right after
        backward is. Nothing to do on the usual step (none noted).
        """
        if self._clipping.reset_after_clip and not self.closed:
            self._guarded("step collector", self._clipping.note_clipped, param)

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs: the step count, which (rule, module) already
        fired, and each rule's own state (streaks, gradient history)."""
        self._land_in_flight(may_halt=False)
        return {
            "step": self._step,
            "tallies": self._dispatcher.state_dict(),
            "rules": {rule.id: rule.state_dict() for rule in self._rules},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Carry on from ``state_dict()``: steps continue, old findings are not re-reported."""
        if self._trial is not None:
            # The tuner's checkpoint, loaded back as its trial ends (the Lightning
            # callback's state in it): end_trial goes back to where the trial began.
            return
        self._step = int(state.get("step", self._step))
        self._pipeline.judge.first_step = self._step
        if self._pipeline.stall is not None:
            # The resumed run compares from its own first batch.
            self._pipeline.stall.restart(self._step)
        self._memory.alerts.extend(self._dispatcher.load_state_dict(state.get("tallies", [])))
        saved = state.get("rules", {})
        for rule in self._rules:
            if rule.id in saved:
                self._guarded(rule.component, rule.load_state_dict, saved[rule.id])

    # -- a tuner's trial steps (trainwatch/tuner_trials.py) ---------------------
    @property
    def in_trial(self) -> bool:
        """Whether the steps now are a tuner's trials, set aside (see ``begin_trial``)."""
        return self._trial is not None

    def begin_trial(self) -> None:
        """The steps from now to :meth:`end_trial` are a tuner's trials (Lightning's
        learning-rate range test, its batch-size search), which the tuner undoes
        after: they are not judged. Their alerts go nowhere and halt nothing; what
        the rules learn from them, the step count and the findings are put back as
        they were at :meth:`end_trial`. Their hooks run as on any step (the usual
        step pays nothing for this)."""
        if self._trial is not None or self.closed:
            return
        self._trial = (self.state_dict(), self._steps_here)
        self._dispatcher.set_aside()
        self._guarded("step collector", self._pipeline.trial_begins)

    def end_trial(self) -> None:
        """The tuner has loaded its checkpoint back: the monitor is where the trial
        began, and the fit's next step begins a phase (warm-ups, gradient history,
        the setup audit and the first steps' audits start over), as training that
        started over with the same optimizer does."""
        trial = self._drop_trial()
        if trial is None:
            return
        state, self._steps_here = trial
        self.load_state_dict(state)
        PROCESS_STEPS.now = self._step
        self._guarded("step collector", self._pipeline.trial_over)

    def _drop_trial(self) -> tuple[dict[str, Any], int] | None:
        """The trial's last step landed (set aside) and the dispatcher taken back."""
        if self._trial is None:
            return None
        try:
            self._land_in_flight(may_halt=False)
            self._pending.clear()  # a step gathered that never came (a failed trial)
            self._held_early.clear()
        finally:
            trial, self._trial = self._trial, None
            self._dispatcher.take_back()
        return trial

    # -- step lifecycle ------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """An optimizer step hook failed: the step collector goes off, training goes on."""
        self._disabled.add("step collector")
        self._internal_error("step hooks", exc)

    def internal_failure(self, component: str, exc: BaseException) -> None:
        """A part of trainwatch around this monitor failed (the stand-in for a monitor
        that could not attach, an adapter restoring its state): told once, as an
        ``internal_error`` through this monitor's sinks; training goes on."""
        self._internal_error(component, exc)

    def _before_optimizer_step(
        self, index: int, optimizer: Optimizer, args: Any, kwargs: Any
    ) -> None:
        if self.closed:
            return
        # The step hooks see step()'s own arguments: (optimizer, closure?).
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is not None:
            if self._held_early:  # gathered before the loop clipped: kept over the closure
                self._keep_over_closure(index)
            # LBFGS & co compute gradients inside step(): gather them after it.
            self._pending.pop(index, None)
            # Their updates and forwards interleave inside step(): a weight's
            # version counter then moves between passes by the optimizer's doing,
            # and each evaluation's backward uses the gradients.
            self._guarded("step collector", self._pipeline.closure_step_begins, index, self._step)
            return
        if "step collector" in self._disabled:
            return
        if self._held_early:
            if index in self._held_early and index in self._pending:
                self._held_early.discard(index)
                if index in self._clipping.reset_after_clip:
                    self._guarded(
                        "step collector", self._clipping.regather_if_reset, index, self._step
                    )
                return  # gathered at backward's end, before clipping
            self._held_early.discard(index)
        try:  # the guard written out: this runs at every step
            self._pending[index] = self._pipeline.gather(index, self._step)
        except TrainingHealthError:
            raise
        except Exception as exc:
            self._guard.fail("step collector", exc)

    def _watch_loads(self, optimizer: Optimizer, index: int) -> None:
        """Its ``load_state_dict`` seen: a state loaded back to an earlier one says
        training started over with it (see trainwatch.collect.optimizer_restarts).
        Its ``state_dict`` seen: a tuner saving it begins its trial steps."""
        self._handles.add(
            optimizer.register_state_dict_pre_hook(WeakHook(self, "_before_optimizer_save"))
        )
        self._handles.add(
            optimizer.register_load_state_dict_pre_hook(
                WeakHook(self, "_before_optimizer_load", index)
            )
        )
        self._handles.add(
            optimizer.register_load_state_dict_post_hook(
                WeakHook(self, "_after_optimizer_load", index)
            )
        )

    def _before_optimizer_save(self, optimizer: Optimizer) -> None:
        if not self.closed and self._trial is None and tuner_trial_running():
            self.begin_trial()  # the tuner's checkpoint, saved before its trials

    def _before_optimizer_load(self, index: int, optimizer: Optimizer, state: Any) -> None:
        if not self.closed:
            self._guarded("optimizer restarts", self._pipeline.restarts.loading, index, optimizer)

    def _after_optimizer_load(self, index: int, optimizer: Optimizer) -> None:
        if self._trial is not None:
            self.end_trial()  # the tuner's checkpoint loaded back: its trials undone
            return
        if not self.closed:
            self._guarded("optimizer restarts", self._pipeline.optimizer_loaded, index)

    def _keep_over_closure(self, index: int) -> None:
        """``step(closure)`` after the loop clipped (Lightning's manual optimization):
        the step gathered before the clip is kept for the step to end with."""
        if index in self._held_early:
            self._held_early.discard(index)
            if index in self._pending and "step collector" not in self._disabled:
                self._guarded("step collector", self._clipping.keep_over_closure, index, self._step)

    def _gather_into_pending(self, index: int) -> None:
        stale = self._pending.get(index)
        if (
            stale is not None
            and self._pipeline.probe is not None
            # Gathered again by a later evaluation of the same closure step: not skipped.
            and not self._pipeline.in_closure_step()
        ):
            self._guarded("amp skip count", self._pipeline.carry_skipped, stale)
        pending = self._pipeline.gather(index, self._step)
        self._pending[index] = pending
        if self._pipeline.in_closure_step():  # inside a framework's closure (Lightning)
            self._pipeline.name_closure_accumulation(pending)

    def _after_optimizer_step(
        self, index: int, optimizer: Optimizer | None = None, args: Any = (), kwargs: Any = None
    ) -> None:
        if self.closed:
            return
        step = self._advance()
        pending = self._pending.pop(index, None)
        if pending is None and "step collector" not in self._disabled:
            gather = self._pipeline.gather
            if _closure_of(args, kwargs) is not None:
                gather = self._closure_step
            # Counted as a step gathered before it was (the step's own number, as
            # the pre-step hook sees it): a closure's step, an optimizer adopted
            # at its first step.
            pending = self._guarded("step collector", gather, index, step)
        if pending is None:
            self._pipeline.applied(
                step, None, self._pipeline.optimizer_params(index), self._one_optimizer
            )
        else:
            self._pipeline.applied(step, pending, pending.params, self._one_optimizer)
        self._finish(step, pending)

    def _closure_step(self, index: int, step: int) -> PendingStep:
        """A closure's step, once ``step()`` returned: the one gathered before the
        loop clipped where the closure ran no pass (``trainwatch run`` of a Lightning
        loop in manual optimization: no hook inside the step), else gathered now."""
        if self._clipping.kept_over_closure:
            kept = self._clipping.take_kept(index)
            if kept is not None:
                self._pipeline.tracker.closure_step_over()
                return kept
        return self._pipeline.gather_closure_step(index, step)

    def _manual_step(self) -> None:
        # The step just ended is gathered before the look turns to the next one:
        # its loss's function mode comes off and its class targets are taken
        # while the look still listens to it.
        step = self._advance(listen=False)
        pending = self._pipeline.gather(
            None, self._step, at_backward_end=self.steps_end_at_backward
        )
        self._listen_for_targets()
        self._pipeline.applied(
            step, pending, self._pipeline.layers.parameters(), False, self.steps_end_at_backward
        )
        self._finish(step, pending)

    def _advance(self, listen: bool = True) -> int:
        """Count the step first, so a failure or a halt later cannot lose it.

        ``listen``: the class target look turns to the next step now (an
        optimizer's step, gathered before it was applied); ``_manual_step``
        gathers first and turns it after."""
        self._step += 1
        self._steps_here += 1
        PROCESS_STEPS.taken += 1
        PROCESS_STEPS.now = self._step
        if listen:  # _listen_for_targets, written out: this runs at every step
            look = self._pipeline.class_targets
            if look is not None and (self._step % look.every == 0) != look.listening:
                self._guarded("class target look", self._pipeline.listen_for_targets, look)
        return self._step - 1

    def _listen_for_targets(self) -> None:
        look = self._pipeline.class_targets
        if look is not None and (self._step % look.every == 0) != look.listening:
            self._guarded("class target look", self._pipeline.listen_for_targets, look)

    def _finish(self, step: int, pending: PendingStep | None) -> None:
        sync = self.halt_sync
        if sync is False:
            sync = self._halt_sync_for_run()
        if sync is None:
            if pending is not None:
                self._stage_and_land(step, pending)
            self._dispatcher.raise_held()  # a halt found by reading a property: now
            return
        try:
            if pending is not None:
                self._stage_and_land(step, pending)
            self._dispatcher.raise_held()
        except TrainingHealthError as halt:
            sync.hold(halt)  # every rank stops together, at the next check
        sync.at_step(step)

    def _halt_sync_for_run(self) -> HaltSync | None:
        """The step-end collective across ranks, decided once, at the first step
        boundary (see ``halt_sync_for_run``)."""
        self.halt_sync = halt_sync_for_run(
            self.config,
            self._root,
            self._pipeline,
            self._dispatcher,
            relayed=self.relayed,
            after_step=self.at_boundary,
            before_halt=self.before_halt,
            on_error=weak_callback(self._internal_error),
        )
        return self.halt_sync

    def _stage_and_land(self, step: int, pending: PendingStep) -> None:
        pending.record.step = step
        lag = pending.frame.wants_lag(self.config.readback)
        if "step collector" in self._disabled:
            return
        try:
            pending.frame.read(lag)
        except Exception as exc:
            self._guard.fail("step collector", exc)
            return
        previous, self._in_flight = self._in_flight, None
        if lag:
            self._in_flight = pending
        if previous is not None:
            self._land(previous)
        if not lag:
            self._land(pending)

    def _land_in_flight(self, may_halt: bool = True) -> None:
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._land(previous, may_halt)

    def _land(self, pending: PendingStep, may_halt: bool = True) -> None:
        if "step collector" in self._disabled:
            return
        try:
            alerts = self._pipeline.evaluate(pending, self.steps_end_at_backward)
        except TrainingHealthError:
            raise
        except Exception as exc:
            self._guard.fail("step collector", exc)
            return
        if alerts:
            self._dispatcher.publish(alerts, may_halt=may_halt)  # may raise TrainingHealthError

    # -- failure containment -------------------------------------------------
    def _guarded(self, component: str, fn: Any, *args: Any) -> Any:
        return self._guard.run(component, fn, *args)

    def _internal_error(self, component: str, exc: BaseException) -> None:
        self._dispatcher.internal_error(component, exc, self._step)

    def _claim(self, params: list[nn.Parameter]) -> None:
        registry.claim(params, self)

    def _ensure_open(self) -> None:
        if self.closed:
            raise WatchError("this trainwatch monitor is closed; call tw.watch again")


class _NameWhileSeveral:
    """The model's name for its console lines while several monitors are open in the
    process (a GAN's generator and discriminator watched apart), else None. Holds
    the monitor weakly: the sink must not keep it alive."""

    __slots__ = ("_monitor",)

    def __init__(self, monitor: weakref.ref[Monitor]) -> None:
        self._monitor = monitor

    def __call__(self) -> str | None:
        monitor = self._monitor()
        if monitor is None or len(_OPEN) < 2:
            return None
        return monitor.model_name


def _idle_note(passes: int, has_optimizer: bool, not_given: str | None = None) -> str:
    """What the console says at close when the model ran but no step came to judge
    (``not_given``: the optimizers seen stepping the model though never passed)."""
    if has_optimizer:
        why = "its optimizer never stepped"
    elif not_given is not None:
        why = not_given
    else:
        why = (
            "no optimizer stepped and monitor.step() was never called (a loop that "
            "updates the weights without a torch.optim optimizer calls monitor.step() "
            "after each update)"
        )
    runs = "pass" if passes == 1 else "passes"
    return f"trainwatch: no training step watched: the model ran {passes} forward {runs}, but {why}"


def _closure_of(args: Any, kwargs: Any) -> Any:
    """The closure an optimizer step hook's ``step()`` was given (None: none)."""
    return args[1] if len(args) > 1 else (kwargs or {}).get("closure")


def _any_lazy(model: nn.Module) -> bool:
    return any(map(is_lazy, model.parameters()))


def _as_number(value: torch.Tensor | float) -> float:
    return float(value.reshape(-1)[0]) if isinstance(value, torch.Tensor) else value


def _remove_handles(handles: HookGroup, *parts: Any) -> None:
    handles.remove_all()
    for part in parts:
        if part is not None:
            part.detach()


def _collected(handles: HookGroup, *parts: Any) -> None:
    """A monitor garbage-collected without close(): its hooks and claims go with it."""
    _remove_handles(handles, *parts)
    registry.forget_collected()


@atexit.register
def _close_open_monitors() -> None:
    for monitor in list(_OPEN):
        try:
            monitor.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def __getattr__(name: str) -> Any:
    """Keeps ``trainwatch.monitor.watch`` working; imported on use (watching imports us)."""
    if name == "watch":
        from trainwatch.watching import watch

        return watch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
