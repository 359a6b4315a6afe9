"""The Monitor: wires collectors, rules and sinks, owns the step.

One step, as data: the optimizer's pre-step hook gathers the gradients it is
about to apply and launches their norms on the device; the post-step hook
reads everything back in one transfer, runs the rules and hands their alerts
to the sinks. Plain loops (through ``tw.watch``, in trainwatch/watching.py),
the Lightning callback and ``trainwatch run`` drive this same object.
"""

from __future__ import annotations

import atexit
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from trainwatch import registry, termination
from trainwatch.alert import Alert
from trainwatch.collect.accumulation import GradResetTracker
from trainwatch.collect.behaviour import BehaviourToken, BehaviourWatch
from trainwatch.collect.calls import CallTracker, runs_distributed
from trainwatch.collect.class_targets import ClassTargetLook
from trainwatch.collect.data_order import sequential_order
from trainwatch.collect.grads import gradient_norms, layer_norms, norms_with_weights
from trainwatch.collect.hand_updates import HandUpdates
from trainwatch.collect.loss_scale import loss_scale, scale_tensor
from trainwatch.collect.nonfinite import NonfiniteProbe, StepWindow
from trainwatch.collect.passes import ModelPasses
from trainwatch.collect.small_norms import SmallGradientNorms
from trainwatch.collect.stall import FirstBatchProbe
from trainwatch.collect.step_gradients import read_gradients
from trainwatch.collect.structure import StructureWatch
from trainwatch.compiled import CompiledHookWarning, is_wrapper, unwrap, user_name, wrappers_of
from trainwatch.config import Config
from trainwatch.dispatch import Dispatcher
from trainwatch.errors import TrainingHealthError, WatchError
from trainwatch.frame import Slot, StepFrame
from trainwatch.guard import Guard
from trainwatch.halt_sync import HaltSync, running_distributed
from trainwatch.hooks import HookGroup, WeakHook
from trainwatch.layers import LayerMap, ParamInfo
from trainwatch.preflight import check_optimizer, check_optimizer_matches, preflight
from trainwatch.raised import note_raise
from trainwatch.record import AmpReport, ClassTargets, NonfiniteReport, StepRecord
from trainwatch.rules import build_rules
from trainwatch.rules.nonfinite_origin import NonfiniteJudge, knock_on
from trainwatch.rules.rule_set import RuleSet
from trainwatch.setup_audit import SetupAudit, build_audit
from trainwatch.setup_watch import SetupWatch
from trainwatch.sinks import MemorySink, Sink, StepNumbers
from trainwatch.whole_layers import WholeLayerNorms, fully_sharded

_OPEN: weakref.WeakSet[Monitor] = weakref.WeakSet()
# Steps with gradients but no pass seen after which the search for a
# torch.compile wrapper made after watching (around which the passes run) stops.
_WRAPPER_SEARCHES = 3


@dataclass
class _Pending:
    """A step gathered at its start, waiting for its readback.

    Each device number it needs is a handle on the step's frame.
    """

    record: StepRecord
    params: list[torch.Tensor] = field(default_factory=list)  # the optimizer's, in order
    frame: StepFrame = field(default_factory=StepFrame)
    norms: Slot | None = None
    norm_tensor: torch.Tensor | None = None  # the norms on the device, before the readback
    suspects: list[tuple[ParamInfo, int | None]] = field(default_factory=list)
    suspect_flags: Slot | None = None
    loss: Slot | None = None
    # A loss handed over after its step: (that step, its value or its handle).
    late_loss: tuple[int, float | Slot | None] | None = None
    window: StepWindow | None = None
    window_slots: dict[str, Slot] = field(default_factory=dict)
    checked_params: list[ParamInfo] = field(default_factory=list)
    param_norms: Slot | None = None
    behaviour: BehaviourToken | None = None
    # Without an optimizer: the weights' names and norms at this step boundary.
    weights: tuple[list[str], Slot] | None = None
    scale: Slot | None = None  # the GradScaler's loss scale, when one is visible
    class_counts: Slot | None = None  # a sampled step's class targets, per class
    # stalled_training's re-run follows this step, with the weights before its update.
    stall_due: bool = False
    weights_before: list[torch.Tensor] | None = None


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
        # A torch.amp.GradScaler whose loss scale the AMP check reads (None: not visible).
        self.scaler = scaler
        self._root = root
        self.closed = False
        self._layers = layers
        self._memory = MemorySink()
        self._dispatcher = Dispatcher([self._memory, *sinks], self.config.halt_on)
        if running_distributed():
            # Each rank's alerts say which rank they are from (a relay, if any,
            # stamps the same number); set again at the first step boundary for
            # a process group set up after watching.
            self._dispatcher.rank = torch.distributed.get_rank()
        rules = build_rules(self.config)
        self._rule_ids = {rule.id for rule in rules}
        # The collectors the enabled rules need: nothing else is attached.
        needs = frozenset().union(*(rule.needs for rule in rules))
        self._handles = HookGroup()
        self._optimizers: list[Optimizer] = []
        self._step = 0
        # Under torch.distributed with halt_on: the check that stops every rank
        # together (False: not decided yet; None: not needed).
        self.halt_sync: HaltSync | bool | None = False
        # Run by every rank together before a distributed halt is raised; an
        # adapter whose relay carries alerts to rank zero sets `relayed`.
        self.before_halt: list[Any] = []
        self.relayed = False
        # Under FSDP2: the whole-layer norms, summed across ranks at a cadence
        # (None: gradients are not sharded, the norms measured are the layers').
        self._whole: WholeLayerNorms | None = None
        # Under torch.distributed: run at each step's end (rank zero reads the
        # other ranks' alerts there), and at close before the sinks close.
        self.at_boundary: list[Any] = []
        self.before_close: list[Any] = []
        self._steps_here = 0  # steps taken in this process (a resumed run restores _step)
        # Layers whose gradient history starts over at the next step.
        self._restarted: set[str] = set()
        self._pending: dict[int, _Pending] = {}
        # Optimizers whose pending step was gathered before clipping (collect_before_step).
        self._held_early: set[int] = set()
        self._in_flight: _Pending | None = None  # lagged readback: read at the next step
        # Per-layer norms of the latest step of each optimizer (None: manual steps).
        self._latest_by_source: dict[int | None, dict[str, float]] = {}
        self._total_norm: float | None = None
        self._loss: torch.Tensor | float | None = None
        self._late_loss: tuple[int, torch.Tensor | float] | None = None
        self._guard = Guard(_weak_callback(self._internal_error))
        self._disabled = self._guard.disabled
        self._rules = RuleSet(rules, self._guard)
        self._membership_key: tuple[Any, ...] | None = None
        self._unoptimized: list[nn.Parameter] = []
        # The setup audit: redone when a step's parameter counts differ from the
        # last audited ones (per optimizer; None: without one), then the first
        # step after it checks that some trainable parameter got a gradient.
        self._audits_setup = "trainable_parameters" in self._rule_ids
        self._setup = SetupWatch()
        self._attaching = True
        # The model's passes, seen from its outermost call only (a compile
        # wrapper watched in its place stands for it).
        self._passes = ModelPasses(_weak_callback(self._internal_error))
        self._passes.hook(model if is_wrapper(model) else root)
        self._passes.on_raise = _weak_callback(self._name_the_module)
        self._wrapper_search = _WRAPPER_SEARCHES
        self._passes_at_step = 0
        # Always there (what backward reached: manual steps, a late loss); it
        # checks for stale gradients only for accumulated_gradient.
        self._small_norms = SmallGradientNorms()
        self._tracker = GradResetTracker(
            _weak_callback(self._internal_error), "accumulation_tracker" in needs
        )
        self._tracker.attach(layers.parameters())
        self._passes.subscribe("accumulation tracker", self._tracker)
        self._check_accumulation = "accumulated_gradient" in self._rule_ids
        self._hand_updates = HandUpdates()
        self._structure = StructureWatch()
        self._compile_warning = CompiledHookWarning()
        self._calls = CallTracker(_weak_getter(self, "step_count", 0))
        if "call_tracker" in needs:
            self._calls.track(root, layers.layers)
            self._passes.subscribe("call tracker", self._calls)
        self._probe: NonfiniteProbe | None = None
        if "nonfinite_probe" in needs:
            self._probe = NonfiniteProbe(
                [user_name(name) for name, _ in root.named_modules()],
                _weak_callback(self._internal_error),
                trace_ops=self.config.nonfinite_forward.trace_op,
                mode=self.config.nonfinite_forward.check,
            )
            self._probe.attach(root)
            self._probe.on_new_pass = _weak_callback(self._on_new_pass)
            self._probe.passes_worth_a_look = self.config.amp_skipped_steps.patience
            self._passes.subscribe("non-finite probe", self._probe)
        self._judge = NonfiniteJudge(self._probe.names if self._probe else [])
        # Modes, loss shapes and sampled activations: only for their rules.
        self._behaviour: BehaviourWatch | None = None
        if needs & {"modes", "broadcast_audit", "activation_sampler"}:
            self._behaviour = BehaviourWatch(
                root,
                self.config,
                self._rule_ids,
                _weak_getter(self, "step_count", 0),
                _weak_callback(self._publish_pass),
                _weak_callback(self._internal_error),
            )
            self._behaviour.passes = self._passes
            self._passes.subscribe("behaviour checks", self._behaviour)
        # The loss's class targets on sampled steps, and the training loader's order.
        self._class_targets: ClassTargetLook | None = None
        if "class_targets" in needs:
            section = self.config.unshuffled_data
            self._class_targets = ClassTargetLook(
                section.every,
                section.max_classes,
                _weak_getter(self, "step_count", 0),
                _weak_callback(self._internal_error),
            )
            # Listens to the passes of sampled steps only, from step ``every`` on:
            # the first steps are the broadcast audit's.
        self._data_order: str | None = None
        if data is not None:
            self.watch_data(data)
        # Whether training changes the output on the first batch: its own sampled steps.
        self._stall: FirstBatchProbe | None = None
        if "first_batch" in needs:
            section = self.config.stalled_training
            self._stall = FirstBatchProbe(
                self._passes, section.every, section.rows, section.loss_window
            )
            self._stall.restart(0)
        registry.claim(layers.parameters(), self)
        # What close() (or the finalizer, for a monitor dropped unclosed) detaches.
        self._parts = (
            self._passes,
            self._tracker,
            self._structure,
            self._calls,
            self._compile_warning,
            self._probe,
            self._behaviour,
            self._class_targets,
            self._stall,
        )
        weakref.finalize(self, _collected, self._handles, *self._parts)
        _OPEN.add(self)
        for opt in optimizers:
            self.add_optimizer(opt)
        self._attaching = False
        if self._setup.due and self._optimizers:
            self._guarded("setup audit", self._audit_setup, self._step)

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
    def step_count(self) -> int:
        """Optimizer steps seen (or ``monitor.step()`` calls without an optimizer)."""
        return self._step

    @property
    def optimizers(self) -> list[Optimizer]:
        return list(self._optimizers)

    @property
    def setup_audit(self) -> SetupAudit | None:
        """The latest setup table: trainable and frozen parameters by location,
        adapters, and which optimizer holds what (made now if no step made one)."""
        if self._setup.latest is not None:
            return self._setup.latest
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
        for norms in self._latest_by_source.values():
            merged.update(norms)
        return merged

    @property
    def total_grad_norm(self) -> float | None:
        """L2 norm over every gradient of the latest step (under FSDP2, as ``grad_norms``)."""
        self._land_in_flight(may_halt=False)
        return self._total_norm

    def add_optimizer(self, optimizer: Optimizer) -> None:
        """Watch one more optimizer (one created after ``tw.watch``, a GAN's second)."""
        self._ensure_open()
        optimizer = _unwrapped_optimizer(optimizer)
        check_optimizer(optimizer)
        if any(opt is optimizer for opt in self._optimizers):
            return
        if self._layers.outdated():  # an optimizer built after module.to() replaced them
            self._rebuild_layers()
        check_optimizer_matches(optimizer, self._layers, len(self._optimizers))
        if self._steps_here:
            # A new optimizer after steps taken in this process: a new phase
            # (fine-tuning after pre-training) for the layers it trains. One
            # added before any step (a resumed run) continues the old history.
            info = self._layers.info
            self._restarted.update(
                info(p).owner for group in optimizer.param_groups for p in group["params"]
            )
        index = len(self._optimizers)
        self._optimizers.append(optimizer)
        self._tracker.track_reached = False  # its steps say what the gradients were
        self._handles.add(
            optimizer.register_step_pre_hook(WeakHook(self, "_before_optimizer_step", index))
        )
        self._handles.add(
            optimizer.register_step_post_hook(WeakHook(self, "_after_optimizer_step", index))
        )
        self._guarded("optimizer audit", self._audit_optimizer, index)

    def watch_data(self, loader: Any) -> None:
        """The DataLoader that feeds training now (the data checks judge its sampler).

        Only the training loader belongs here: a validation loader read in
        order is normal.
        """
        self._data_order = self._guarded("data order", sequential_order, loader)

    @property
    def data_order(self) -> str | None:
        """How the training loader reads its data in order; None: shuffled, or not seen."""
        return self._data_order

    def refresh_layers(self) -> None:
        """Name parameters put into the model since the last step (a new head) now.

        The step does this itself; a caller about to ask who owns a parameter
        (``trainwatch run`` meeting a new optimizer) calls it first.
        """
        if not self.closed and self._structure.changed():
            self._guarded("layer map", self._rebuild_layers)

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
            if self._optimizers and self._step > 0 and not self._tracker.backward_seen:
                # Called after optimizer.step(): the loss is the step just taken's.
                self._late_loss = (self._step - 1, value)
            else:
                self._loss = value
        if self._optimizers:
            return  # the optimizers' own hooks mark the steps
        if "step collector" in self._disabled:
            self._advance()
            return
        self._guarded("step collector", self._manual_step)

    def record_loss(self, loss: torch.Tensor | float) -> None:
        """Hand over the loss of the step in progress, before its backward.

        For adapters that know which step a loss belongs to (Lightning calls
        back before each backward), unlike :meth:`step`, which must guess from
        whether backward already ran. Several losses in one step (gradient
        accumulation) add up, so a non-finite micro-batch is not overwritten
        by a finite one after it.
        """
        self._ensure_open()
        value = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)
        if self._loss is None:
            self._loss = value
        elif isinstance(self._loss, torch.Tensor) and isinstance(value, torch.Tensor):
            self._loss = self._loss.reshape(-1)[:1] + value.to(self._loss.device).reshape(-1)[:1]
        else:
            self._loss = _as_number(self._loss) + _as_number(value)

    def close(self) -> None:
        """Remove every hook, flush the sinks and print the summary; idempotent."""
        if self.closed:
            return
        try:
            self._land_in_flight(may_halt=False)  # closing never raises a halt
            if self._behaviour is not None:
                for record in self._behaviour.eval_passes.flush():
                    self._dispatcher.publish(self._rules.evaluate(record), may_halt=False)
            if self._late_loss is not None:
                step, value = self._late_loss
                self._late_loss = None
                number = float(value) if value is not None else None
                alerts = self._guarded("step collector", self._late_loss_alerts, step, number)
                if alerts:
                    self._dispatcher.publish(alerts, may_halt=False)
            for hook in self.before_close:
                self._guarded("relay", hook)
        finally:
            self.closed = True
            _OPEN.discard(self)
            try:
                self._shut()
            finally:
                termination.release(self)

    def _shut(self) -> None:
        _remove_handles(self._handles, *self._parts)
        registry.release(self)
        self._dispatcher.close(self._dispatcher.summary(self._step, self._latest_norms))

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
        return self._tracker.on_backward_end(callback)

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
                self._guarded("step collector", self._gather_into_pending, index)
                if hold and index in self._pending:
                    self._held_early.add(index)
                return

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
        self._step = int(state.get("step", self._step))
        self._judge.first_step = self._step
        if self._stall is not None:
            self._stall.restart(self._step)  # the resumed run compares from its own first batch
        self._memory.alerts.extend(self._dispatcher.load_state_dict(state.get("tallies", [])))
        saved = state.get("rules", {})
        for rule in self._rules:
            if rule.id in saved:
                self._guarded(rule.component, rule.load_state_dict, saved[rule.id])

    # -- step lifecycle ------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """An optimizer step hook failed: the step collector goes off, training goes on."""
        self._disabled.add("step collector")
        self._internal_error("step hooks", exc)

    def _before_optimizer_step(
        self, index: int, optimizer: Optimizer, args: Any, kwargs: Any
    ) -> None:
        if self.closed:
            return
        # The step hooks see step()'s own arguments: (optimizer, closure?).
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is not None:
            # LBFGS & co compute gradients inside step(): gather them after it.
            self._pending.pop(index, None)
            return
        if "step collector" in self._disabled:
            return
        if self._held_early:
            if index in self._held_early and index in self._pending:
                self._held_early.discard(index)
                return  # gathered at backward's end, before clipping
            self._held_early.discard(index)
        try:  # the guard written out: this runs at every step
            self._pending[index] = self._gather(index)
        except TrainingHealthError:
            raise
        except Exception as exc:
            self._guard.fail("step collector", exc)

    def _gather_into_pending(self, index: int) -> None:
        stale = self._pending.get(index)
        if stale is not None and self._probe is not None:
            self._guarded("amp skip count", self._carry_skipped, stale)
        self._pending[index] = self._gather(index)

    def _carry_skipped(self, stale: _Pending) -> None:
        """A framework gathered a step that never came: GradScaler skipped it.

        Lightning gathers before its precision plugin's GradScaler decides, so
        the probe's record of backward passes no step used was handed to a
        step that did not happen. It goes back to the probe, with one flag for
        the skipped pass (its gradient norms were non-finite), and is judged
        like a plain loop's skips.
        """
        probe = self._probe
        window = stale.window
        if probe is None or window is None:
            return
        flags: list[torch.Tensor | float] = list(window.skipped_host)
        if window.skipped is not None:
            flags = list(window.skipped.unbind())
        norms = stale.norm_tensor
        flags.append(
            torch.isfinite(norms).all().logical_not().float() if norms is not None else 0.0
        )
        for flag in flags:
            probe.note_skipped_pass(flag)
        self._on_new_pass()

    def _after_optimizer_step(
        self, index: int, optimizer: Optimizer | None = None, args: Any = (), kwargs: Any = None
    ) -> None:
        if self.closed:
            return
        step = self._advance()
        pending = self._pending.pop(index, None)
        if pending is None and "step collector" not in self._disabled:
            pending = self._guarded("step collector", self._gather, index)
        params = pending.params if pending is not None else self._optimizer_params(index)
        if self._tracker.enabled:
            self._tracker.arm(params, whole=len(self._optimizers) == 1)
        if pending is not None and self._parameter_check_due(step):
            self._guarded("parameter check", self._check_parameters, pending, params)
        if pending is not None and pending.stall_due:
            self._guarded("stalled training", self._measure_stall, step, pending)
        self._finish(step, pending)

    def _manual_step(self) -> None:
        step = self._advance()
        pending = self._gather(None)
        if self._tracker.enabled:
            self._tracker.arm(self._layers.parameters())
        if self._parameter_check_due(step):
            self._guarded(
                "parameter check", self._check_parameters, pending, self._layers.parameters()
            )
        if pending.stall_due:
            self._guarded("stalled training", self._measure_stall, step, pending)
        self._finish(step, pending)

    def _locate_if_off(self, norms: torch.Tensor | None) -> None:
        """Trigger, then diagnose: bad gradients (or, on a device, a bad output) get
        located now, before the optimizer applies the step.

        On CPU the norms are read on the host for free; on a device the probe
        reads one scalar (``settle``). The backward replay must not look like
        training to the accumulation tracker, so it is paused meanwhile.
        """
        probe = self._probe
        if probe is None or not probe.on_the_spot:
            return
        if probe.at_step:
            bad_grads = probe.settle(norms)
        else:
            bad_grads = norms is not None and not all(map(math.isfinite, norms.tolist()))
        if not bad_grads:
            return
        paused, self._tracker.enabled = self._tracker.enabled, False
        try:
            probe.replay_backward()
        finally:
            self._tracker.enabled = paused

    def _parameter_check_due(self, step: int) -> bool:
        every = self.config.nonfinite_parameter.check_every
        return "nonfinite_parameter" in self._rule_ids and every > 0 and step % every == 0

    def _check_parameters(self, pending: _Pending, params: list[torch.Tensor]) -> None:
        """Norms of the weights just updated: one batched kernel, read with the step."""
        trainable = [p for p in params if p.requires_grad and p.grad is not None]
        if not trainable:
            return
        pending.checked_params = [self._layers.info(p) for p in trainable]
        pending.param_norms = pending.frame.add(gradient_norms([p.detach() for p in trainable]))

    def _measure_stall(self, step: int, pending: _Pending) -> None:
        """A sampled step's update is applied: how far it and the phase moved the model."""
        if self._stall is None:
            return
        before, pending.weights_before = pending.weights_before, None
        pending.stall_due = False
        pending.record.stall = self._stall.report(step, pending.params, before, self._layers)
        pending.record.stall.learning_rates = [
            float(group["lr"])
            for opt in self._optimizers
            for group in opt.param_groups
            if isinstance(group.get("lr"), (int, float))
        ]

    def _on_new_pass(self) -> None:
        """A forward pass of the whole model begins: GradScaler may have skipped a step."""
        probe = self._probe
        rule = self.config.amp_skipped_steps
        if probe is None or not rule.enabled:
            return
        passes = len(probe.bad_backward_passes)
        if passes < rule.patience * self._judge.passes_per_step:
            return
        record = StepRecord(step=self._step, source="passes")
        record.skipped_backward_passes = self._judge.trailing_skips(probe.bad_backward_passes)
        if record.skipped_backward_passes < rule.patience:
            return
        # Read on the host only here, past many passes without a step.
        scale = self._guarded("loss scale", loss_scale, self.scaler)
        warming_up = self._step == self._judge.first_step  # no update applied yet
        if warming_up and (scale is None or scale >= 1.0):
            return  # the scaler's warm-up
        skipped = 0 if warming_up else record.skipped_backward_passes
        record.amp = AmpReport(skipped, self._judge.passes_per_step, scale)
        self._dispatcher.publish(self._rules.evaluate(record))

    def _publish_pass(self, record: StepRecord) -> None:
        """A forward pass found something on its own (an evaluation in training mode)."""
        self._dispatcher.publish(self._rules.evaluate(record))

    def _advance(self) -> int:
        """Count the step first, so a failure or a halt later cannot lose it."""
        self._step += 1
        self._steps_here += 1
        look = self._class_targets
        if look is not None and (self._step % look.every == 0) != look.listening:
            self._guarded("class target look", self._listen_for_targets, look)
        return self._step - 1

    def _finish(self, step: int, pending: _Pending | None) -> None:
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
        """The step-end collective across ranks (the halt check; under FSDP2 the
        whole-layer norms too), decided at the first step boundary (the process
        group is often set up after the model is watched)."""
        sync = self.halt_sync
        if sync is False:
            sync = None
            distributed = running_distributed()
            if distributed and not self.relayed:
                # Each rank writes its own sinks: say which rank each alert is from.
                self._dispatcher.rank = torch.distributed.get_rank()
            if distributed and fully_sharded(self._root):
                self._whole = WholeLayerNorms(
                    self.config.distributed.gather_every,
                    self._layers.layers,
                    _weak_callback(self._whole_layer_norms),
                    _weak_callback(self._internal_error),
                )
            if distributed and (self.config.halt_on or self._whole is not None or self.at_boundary):
                sync = HaltSync(
                    self.config.distributed.halt_check_every,
                    halting=bool(self.config.halt_on),
                    layers=self._whole,
                )
                sync.after_step = self.at_boundary
                sync.before_halt = self.before_halt
                sync.report_remote = None if self.relayed else self._report_remote
            self.halt_sync = sync
        return sync

    def _whole_layer_norms(
        self, step: int, optimizer: int | None, norms: dict[str, float], total: float
    ) -> None:
        """Under FSDP2, a step's whole-layer norms, summed across ranks: what is reported."""
        self._latest_by_source[optimizer] = norms
        self._total_norm = total
        self._dispatcher.numbers(StepNumbers(step, norms, total))

    def _report_remote(self, alert: Alert) -> None:
        """Another rank's halting alert, written by this rank's sinks (rank zero)."""
        self._dispatcher.publish([alert], may_halt=False)

    def _stage_and_land(self, step: int, pending: _Pending) -> None:
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

    def _land(self, pending: _Pending, may_halt: bool = True) -> None:
        if "step collector" in self._disabled:
            return
        try:
            alerts = self._evaluate(pending)
        except TrainingHealthError:
            raise
        except Exception as exc:
            self._guard.fail("step collector", exc)
            return
        if alerts:
            self._dispatcher.publish(alerts, may_halt=may_halt)  # may raise TrainingHealthError

    # -- collection ----------------------------------------------------------
    def _optimizer_params(self, index: int) -> list[torch.Tensor]:
        return [p for group in self._optimizers[index].param_groups for p in group["params"]]

    def _gather(self, index: int | None, attach: bool = False) -> _Pending:
        look = self._class_targets
        if look is not None and look.listening:
            # The loss is behind us: the look's function mode comes off before
            # the step's own reads (tensor attributes read under a function
            # mode are dispatched through it, and cost and keep memory there).
            self._guarded("class target look", look.end_span)
        if self._structure.changed():
            self._rebuild_layers()
        params = self._layers.parameters() if index is None else self._optimizer_params(index)
        record, grads = read_gradients(params, index, self._layers, self._tracker.reached)
        if grads and self._passes.passes == self._passes_at_step and self._wrapper_search:
            # Gradients without a pass seen: compiled after watching, perhaps.
            self._wrapper_search -= 1
            wrappers = wrappers_of(self._root)
            for wrapper in wrappers:
                self._passes.hook(wrapper)
            if not wrappers:
                self._passes.widen()  # parts of the model called on their own
        self._passes_at_step = self._passes.passes
        if record.missing and self._layers.outdated():
            # module.to() in overwrite mode swapped in new Parameter objects:
            # name them (and see whether any optimizer still holds the old ones).
            self._rebuild_layers()
            params = self._layers.parameters() if index is None else self._optimizer_params(index)
            record, grads = read_gradients(params, index, self._layers, self._tracker.reached)
        if self._restarted:
            record.restarted_layers = frozenset(self._restarted)
            self._restarted.clear()
            if self._stall is not None:
                self._stall.restart(self._step)  # a new phase, compared from its own first batch
        manual = index is None
        if manual and self._tracker.track_reached:
            known = self._layers.known()
            record.rewritten = frozenset(
                known[id(p)].name for p in self._tracker.rewritten() if id(p) in known
            )
        if record.missing:
            # Parameters without a gradient: under DDP the next iteration fails.
            record.never_called = self._calls.never_called()
            record.distributed = runs_distributed(self.model)
        info = self._layers.info
        if record.frozen:
            for param in params:
                if param.requires_grad:
                    owner = info(param).owner
                    record.trainable_by_module[owner] = record.trainable_by_module.get(owner, 0) + 1
        if not manual and "not_optimized" in self._rule_ids:
            record.not_optimized = [
                info(p)
                for p in self._unoptimized_params()
                if p.requires_grad and p.grad is not None
            ]
        if self._audits_setup:
            # Counts the step has already made: a requires_grad flip, a param
            # group or a parameter added changes them. No call on a healthy step.
            signature = (
                len(params),
                len(record.frozen),
                record.frozen_count,
                len(self._layers.layers),
            )
            setup = self._setup
            if setup.signatures.get(index) != signature:
                setup.signatures[index] = signature
                setup.due = True
            if not attach:
                if setup.due:
                    step = self._step - 1 if manual else self._step
                    self._guarded("setup audit", self._audit_setup, step)
                if index in setup.reach_due:
                    setup.reach_due.discard(index)
                    # A backward ran: it reached the model's output, or a loss was
                    # handed over (Lightning, whose module's own forward may never run).
                    ran = self._tracker.backward_seen or self._loss is not None
                    self._guarded(
                        "setup audit", setup.check_reach, record, ran, len(self._optimizers)
                    )
        pending = _Pending(record, params)
        frame = pending.frame
        stall = self._stall
        step = self._step if index is not None else self._step - 1  # monitor.step() counted it
        if stall is not None and (step < stall.loss_until or step >= stall.loss_from):
            # One of its sampled steps (plain attributes: no call on the others).
            found = self._guarded("stalled training", stall.sample, record, params, step)
            if found is not None:
                pending.stall_due, pending.weights_before = found
        if manual and self._check_accumulation and self._tracker.enabled:
            # No optimizer marks the update: the weights' norms show whether one ran.
            weights, names = self._hand_updates.watched(self._layers)
            norms, weight_norms = norms_with_weights(grads, weights)
            pending.weights = (names, frame.add(weight_norms))
        else:
            norms = self._small_norms.norms(record, grads) if grads else None
        if norms is not None:
            pending.norms = frame.add(norms)
            pending.norm_tensor = norms
        self._locate_if_off(norms)
        if self._check_accumulation:
            record.accumulation_method = "monitor.step" if manual else "optimizer_step"
            flags = []
            for param, content in self._tracker.suspects(params):
                slot = None
                if content is not None:
                    slot = len(flags)
                    flags.append(content.reshape(1))
                pending.suspects.append((info(param), slot))
            if flags:
                pending.suspect_flags = frame.add(torch.cat([f.to(flags[0].device) for f in flags]))
        if self._probe is not None and self._probe.enabled:
            window = self._probe.take()
            pending.window = window
            for name in ("sums", "grad_sums", "skipped"):
                tensor = getattr(window, name)
                if tensor is not None:
                    pending.window_slots[name] = frame.add(tensor)
        if self.scaler is not None:
            scale = self._guarded("loss scale", scale_tensor, self.scaler)
            if scale is not None:
                pending.scale = frame.add(scale)
        look = self._class_targets
        if look is not None and look.listening:  # a sampled step
            counts = self._guarded("class target look", look.take)
            if counts is not None:
                pending.class_counts = frame.add(counts)
            record.class_targets = ClassTargets([], look.per_position, self._data_order)
        if self._behaviour is not None:
            pending.behaviour = self._guarded(
                "behaviour checks", self._behaviour.gather, record, frame
            )
        if isinstance(self._loss, torch.Tensor):
            pending.loss = frame.add(self._loss.reshape(-1)[:1])
        elif self._loss is not None:
            record.loss = self._loss
        self._loss = None
        if self._late_loss is not None:
            late_step, value = self._late_loss
            if isinstance(value, torch.Tensor):
                pending.late_loss = (late_step, frame.add(value.reshape(-1)[:1]))
            else:
                pending.late_loss = (late_step, value)
            self._late_loss = None
        return pending

    def _evaluate(self, pending: _Pending) -> list[Alert]:
        record = pending.record
        if pending.norms is not None:
            record.param_norms = pending.norms.values()
            per_layer, total = layer_norms(record.present, record.param_norms, self._layers.layers)
            record.layer_norms, record.total_norm = per_layer, total
            if self._whole is None:
                self._latest_by_source[record.optimizer] = per_layer
                self._total_norm = total
            else:  # shard norms, for the rules; the whole layers' come at the cadence
                record.sharded = True
                self._whole.note(record)
        if pending.loss is not None:
            record.loss = pending.loss.value()
        scale = pending.scale.value() if pending.scale is not None else None
        if pending.window is not None or pending.param_norms is not None:
            self._judge.judge(
                record,
                pending.window,
                {name: slot.values() for name, slot in pending.window_slots.items()},
                pending.checked_params,
                pending.param_norms.values() if pending.param_norms is not None else [],
                self._probe.modules if self._probe is not None else list,
                self._dispatcher.reported,
                self._layers.info,
            )
        elif record.loss is not None:
            self._judge.judge(record, None, {}, [], [], list, self._dispatcher.reported)
        if scale is not None and (scale < 1.0 or record.amp is not None):
            record.amp = record.amp or AmpReport(0, self._judge.passes_per_step)
            record.amp.scale = scale
        if self._probe is not None:
            self._probe.passes_worth_a_look = (
                self.config.amp_skipped_steps.patience * self._judge.passes_per_step
            )
        if self._behaviour is not None and pending.behaviour is not None:
            self._guarded("behaviour checks", self._behaviour.land, record, pending.behaviour)
        if pending.class_counts is not None and record.class_targets is not None:
            record.class_targets.counts = pending.class_counts.values()
        flags = pending.suspect_flags.values() if pending.suspect_flags is not None else []
        record.accumulated = [
            info for info, slot in pending.suspects if slot is None or flags[slot] > 0.0
        ]
        if pending.weights is not None:
            # Several backward passes onto the same gradients are accumulation
            # unless the weights changed in between.
            names, slot = pending.weights
            record.accumulated = self._hand_updates.keep_moved(
                record.accumulated, names, slot.values(), self.steps_end_at_backward
            )
        sharded = self._whole is not None
        self._dispatcher.numbers(
            StepNumbers(
                record.step,
                {} if sharded else record.layer_norms,
                None if sharded else record.total_norm,
                record.loss,
                record.stall.update_ratios if record.stall is not None else {},
                record.stall.change if record.stall is not None else None,
            )
        )
        late: tuple[int, float | None] | None = None
        if pending.late_loss is not None:
            late_step, value = pending.late_loss
            late = (late_step, value.value() if isinstance(value, Slot) else value)
            record.late_loss = late[1]
        alerts = self._rules.evaluate(record)
        if late is not None:
            alerts.extend(self._late_loss_alerts(*late))
        return alerts

    def _late_loss_alerts(self, step: int, value: float | None) -> list[Alert]:
        """A loss handed over after its optimizer step, judged with the next one."""
        if value is None or math.isfinite(value):
            return []
        if knock_on(self._dispatcher.reported):
            return []  # a NaN already reported upstream explains it
        record = StepRecord(step=step, source="loss", loss=value)
        record.nonfinite_loss = NonfiniteReport(module=None, cause="value")
        return self._rules.evaluate(record)

    def _audit_optimizer(self, index: int) -> None:
        """Checks that need no gradients, made when an optimizer is attached."""
        pending = self._gather(index, attach=True)
        self._setup.due = True  # a new optimizer: which one holds what changed
        record = StepRecord(
            step=self._step,
            source="attach",
            optimizer=index,
            frozen=pending.record.frozen,
            trainable_by_module=pending.record.trainable_by_module,
            restarted_layers=pending.record.restarted_layers,
        )
        self._dispatcher.publish(self._rules.evaluate(record))

    def _audit_setup(self, step: int) -> None:
        """The setup table to the sinks, and its rule's verdict on optimizer coverage."""
        audit, record = self._setup.audit(step, self._root, self._optimizers)
        if self.config.trainable_parameters.table:
            self._dispatcher.setup(audit)
        self._dispatcher.publish(self._rules.evaluate(record))

    def _unoptimized_params(self) -> list[nn.Parameter]:
        key = tuple(
            [
                (id(group["params"]), len(group["params"]))
                for opt in self._optimizers
                for group in opt.param_groups
            ]
        ) + (id(self._layers),)
        if key != self._membership_key:
            held = {
                id(p) for opt in self._optimizers for g in opt.param_groups for p in g["params"]
            }
            self._unoptimized = [p for p in self._layers.parameters() if id(p) not in held]
            self._membership_key = key
        return self._unoptimized

    def _rebuild_layers(self) -> None:
        """The model's tree changed (a module or parameter was (re)assigned or replaced)."""
        layers = LayerMap(self._root, previous=self._layers)
        fresh = [p for p in layers.parameters() if p not in self._layers]
        if fresh and self._steps_here:
            # A head replaced (same name, new parameters) or added after steps
            # were taken: the model computes something new, and every layer's
            # gradients flow through it. Their history starts over.
            self._restarted.update(layers.layers)
        if "call tracker" in self._passes.listener_names():
            self._calls.track(self._root, layers.layers)
        self._layers = layers
        self._tracker.attach(fresh)
        registry.claim(fresh, self)
        if self._probe is not None:
            self._probe.find_device(self._root)

    def _listen_for_targets(self, look: ClassTargetLook) -> None:
        """Only the passes of sampled steps reach the look: others pay nothing for it."""
        due = self._step % look.every == 0 and not look.per_position and not look.broken
        if due and not look.listening:
            self._passes.subscribe("class_targets", look)
        elif look.listening and not due:
            self._passes.unsubscribe(look)
        look.listening = due

    # -- failure containment -------------------------------------------------
    def _guarded(self, component: str, fn: Any, *args: Any) -> Any:
        return self._guard.run(component, fn, *args)

    def _internal_error(self, component: str, exc: BaseException) -> None:
        self._dispatcher.internal_error(component, exc, self._step)

    def _ensure_open(self) -> None:
        if self.closed:
            raise WatchError("this trainwatch monitor is closed; call tw.watch again")


def _unwrapped_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a wrapper that shares its state.

    Lightning's ``LightningOptimizer`` is a dynamic subclass of the wrapped
    optimizer's class holding a copy of its ``__dict__``: the same
    ``param_groups``, ``state`` and hook tables. Watching both would count every
    step twice, so the wrapped one (``_optimizer``) is the one watched.
    """
    inner = vars(optimizer).get("_optimizer") if hasattr(optimizer, "__dict__") else None
    if isinstance(inner, Optimizer) and inner.param_groups is optimizer.param_groups:
        return inner
    return optimizer


def _as_number(value: torch.Tensor | float) -> float:
    return float(value.reshape(-1)[0]) if isinstance(value, torch.Tensor) else value


def _weak_callback(method: Any) -> Any:
    """A bound method that does not keep its object alive (for the finalizer)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        target = ref()
        if target is not None:
            target(*args)

    return call


def _weak_getter(target: Any, name: str, default: Any) -> Any:
    """Reads an attribute of an object without keeping the object alive."""
    ref = weakref.ref(target)

    def get() -> Any:
        obj = ref()
        return default if obj is None else getattr(obj, name)

    return get


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
