"""One model's step pipeline: its collectors, what a step boundary gathers, how it is judged.

The collectors attached are those the enabled rules need. At a step
boundary :meth:`StepPipeline.gather` reads the gradients the step is about
to apply, launches their norms and every other device number the step's
checks need onto one :class:`~trainwatch.frame.StepFrame`; once the frame is
read back (one transfer), :meth:`StepPipeline.evaluate` turns it into a
:class:`~trainwatch.record.StepRecord` and runs the rules over it. The
Monitor decides when each of these happens (the optimizer's hooks, a
lagged readback, a halt); this module decides what each one does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import chain
from operator import attrgetter, is_not, itemgetter, methodcaller
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from trainwatch import clip_hook, registry
from trainwatch.alert import Alert
from trainwatch.callers import names_in_caller
from trainwatch.collect.accumulation import GradResetTracker
from trainwatch.collect.backward_end_norms import BackwardEndNorms
from trainwatch.collect.backwards_anywhere import BackwardsAnywhere
from trainwatch.collect.batch_norm_batches import BatchNormBatches
from trainwatch.collect.behaviour import BehaviourToken, BehaviourWatch
from trainwatch.collect.between_backwards import IDLE_STEPS as WIPES_IDLE_STEPS
from trainwatch.collect.between_backwards import WipedSteps
from trainwatch.collect.calls import CallTracker, runs_distributed, weights_read_by_holder
from trainwatch.collect.class_targets import ClassTargetLook
from trainwatch.collect.copies import copied_model, near_copy
from trainwatch.collect.copies_in_optimizer import COPIES_TOLD, copy_of_another, copy_outside
from trainwatch.collect.double_steps import DoubleSteps, shared_parameters
from trainwatch.collect.dropped_gradients import LeavingsNotes, dropped_to_none, rewritten_since
from trainwatch.collect.frozen_moves import FrozenMoves
from trainwatch.collect.gradless_updates import GradlessUpdates
from trainwatch.collect.grads import gradient_norms, layer_norms, weight_norms
from trainwatch.collect.hand_updates import HandUpdates
from trainwatch.collect.idle_optimizer import LOOK_AHEAD as IDLE_LOOK_AHEAD
from trainwatch.collect.idle_optimizer import PATIENCE as IDLE_PATIENCE
from trainwatch.collect.idle_optimizer import (
    STOPPED_LOOK_AHEAD,
    STOPPED_STEPPING,
    GradientsSeen,
    IdleOptimizer,
    fresh_gradients,
    gradients_seen,
)
from trainwatch.collect.joined_layers import JoinedLayers
from trainwatch.collect.left_out_model import a_loss_module, left_out_model
from trainwatch.collect.loss_kind import LossKinds, loss_kind
from trainwatch.collect.loss_scale import loss_scale, scale_tensor
from trainwatch.collect.lost_gradients import LostGradients, LostGradientWatches
from trainwatch.collect.mode_stack import LOSS_MODES
from trainwatch.collect.nonfinite import NonfiniteFinding, NonfiniteProbe, StepWindow
from trainwatch.collect.norm_overflow import norm_overflow
from trainwatch.collect.optimizer_restarts import OptimizerRestarts
from trainwatch.collect.output_layer import OutputLayerLook
from trainwatch.collect.padded_labels import PaddingLook
from trainwatch.collect.parameter_reads import ParameterReads
from trainwatch.collect.part_copies import PartCopies
from trainwatch.collect.passes import ModelPasses
from trainwatch.collect.small_norms import SmallGradientNorms
from trainwatch.collect.stall import FirstBatchProbe
from trainwatch.collect.step_calls import StepCalls
from trainwatch.collect.step_gradients import read_gradients
from trainwatch.collect.structure import StructureWatch
from trainwatch.collect.unwatched_updates import UnwatchedUpdates
from trainwatch.collect.updated_elsewhere import UpdatedElsewhere
from trainwatch.collect.weights_at_alert import HeldParameters
from trainwatch.collect.zero_derivatives import ZeroDerivativeLook
from trainwatch.collect.zeroed_updates import ZeroedUpdates
from trainwatch.compiled import CompiledHookWarning, is_wrapper, unwrap, user_name, wrappers_of
from trainwatch.config import Config
from trainwatch.dispatch import Dispatcher
from trainwatch.frame import Slot, StepFrame
from trainwatch.fresh import fresh_maker
from trainwatch.guard import Guard
from trainwatch.layers import EXTERNAL, LayerMap, ParamInfo, names_outside
from trainwatch.optimizer_wrappers import inner_optimizer
from trainwatch.outside_owners import tells_loose, told_elsewhere, watched_by_another
from trainwatch.process_steps import PROCESS_STEPS
from trainwatch.record import (
    AmpReport,
    BetweenBackwardsRecord,
    ClassTargets,
    CopiedFrom,
    FrozenOutput,
    HandUpdateRecord,
    LearningRates,
    LooseTraining,
    NonfiniteReport,
    ReplacedModel,
    SetupCheck,
    SteppedTwice,
    StepRecord,
)
from trainwatch.rules.gradient_scale import ExplodingGradientRule
from trainwatch.rules.nonfinite_origin import NonfiniteJudge, knock_on
from trainwatch.rules.rule_set import RuleSet
from trainwatch.rules.zero_gradient import ZeroGradientRule
from trainwatch.setup_audit import SetupAudit, table_content
from trainwatch.setup_watch import SetupWatch
from trainwatch.sinks import StepNumbers
from trainwatch.trained_elsewhere_note import trained_elsewhere_words
from trainwatch.weak import weak_callback, weak_getter, weak_method
from trainwatch.whole_layers import WholeLayerNorms

# An optimizer's step whose every parameter had a gradient.
_NONE_MISSING: frozenset[str] = frozenset()
_NONE_HELD: frozenset[str] = frozenset()  # no copy in that optimizer

# Step boundaries with unreset gradients and unmoved weights, without an
# optimizer, while other models' optimizers took as many steps, before the
# model's parameters are taken for left out of every optimizer (a hand-written
# accumulation of this many backward passes beside an optimizer's model is rare).
NEVER_MOVED = 50

# Steps with gradients but no pass seen after which the search for a
# torch.compile wrapper made after watching (around which the passes run) stops.
_WRAPPER_SEARCHES = 3
_NEVER = 1 << 62  # a step count no run reaches


_PARAMS = itemgetter("params")  # a param group's parameters
_GROUPS = attrgetter("param_groups")  # an optimizer's
_VERSION = attrgetter("_version")  # a tensor's in-place write counter
_OWNER = attrgetter("owner")  # a parameter record's module
_DATA_PTR = methodcaller("data_ptr")  # its storage: new after ``param.data = ...``
_IS_TENSOR = partial(is_not, None)  # a gradient that entered an output (None: none did)
# No gradient entering the model to check (shared, never written).
_NO_ENTERING: list[torch.Tensor] = []
# The pipeline's parts that attach hooks: each has detach(); what close() takes off.
_PARTS = (
    "passes",
    "tracker",
    "structure",
    "_calls",
    "_step_calls",
    "_zero_look",
    "_reads",
    "_leavings",
    "_backward_norms",
    "_output_look",
    "_compile_warning",
    "probe",
    "behaviour",
    "class_targets",
    "stall",
    "idle",
    "lost_gradients",
    "unwatched",
    "_backwards_anywhere",
)


@dataclass
class PendingStep:
    """A step gathered at its start, waiting for its readback.

    Each device number it needs is a handle on the step's frame.
    """

    record: StepRecord
    params: list[torch.Tensor] = field(default_factory=list)  # the optimizer's, in order
    frame: StepFrame = field(default_factory=StepFrame)
    norms: Slot | None = None
    norm_tensor: torch.Tensor | None = None  # the norms on the device, before the readback
    # How many norms at the end of ``norms`` are of the gradients that entered the
    # model (dropped from the parameters' as the step is read).
    entering_norms: int = 0
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
    padded_labels: Slot | None = None  # its labels at padding, when read on the device
    # stalled_training's re-run follows this step, with the weights before its update.
    stall_due: bool = False
    weights_before: list[torch.Tensor] | None = None


# Made at every step (trainwatch.fresh): _new_pending_step(record), the rest at defaults.
_new_pending_step = fresh_maker(PendingStep)


class StepPipeline:
    """The collectors of one watched model and the two halves of each step's work.

    It holds no reference to its Monitor: the step count, the steps taken in
    this process and the error report come in as callables that do not keep
    the Monitor alive (a monitor dropped unclosed is still collected).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Built as :meth:`_build` says; a failure part way takes off what was attached
        (a global module hook left behind would run at every module call of the
        process, long after the monitor that failed)."""
        try:
            self._build(*args, **kwargs)
        except BaseException:
            for name in _PARTS:
                part = getattr(self, name, None)
                if part is not None:
                    part.detach()
            raise

    def _build(
        self,
        model: nn.Module,
        root: nn.Module,
        layers: LayerMap,
        config: Config,
        rules: RuleSet,
        needs: frozenset[str],
        optimizers: list[Optimizer],
        dispatcher: Dispatcher,
        guard: Guard,
        *,
        scaler: Any,
        step_count: Callable[[], int],
        steps_taken: Callable[[], int],
        on_error: Callable[[str, BaseException], None],
        on_raise: Callable[[BaseException], None],
        claim: Callable[[list[nn.Parameter]], None],
    ) -> None:
        self.model = model
        self._root = root
        self.layers = layers
        self.config = config
        self.rules = rules
        self._rule_ids = {rule.id for rule in rules}
        self._checks_not_optimized = "not_optimized" in self._rule_ids
        # Every N-th step, the weights just updated are checked too (0: never).
        self._parameter_every = (
            config.nonfinite_parameter.check_every if "nonfinite_parameter" in self._rule_ids else 0
        )
        self._optimizers = optimizers  # the Monitor's own list: it adds to it
        held = HeldParameters(
            weak_getter(self, "layers", None), optimizers, weak_getter(self, "_root", None)
        )
        for rule in rules:
            rule.held = held  # looked at only as an alert is built
        self.held = held
        # How the model trains under DDP (collect.calls.runs_distributed), once known.
        self._distributed = ""
        # The last optimizer step had every learning rate at 0: the weights stayed.
        self._moved_none = False
        self._dispatcher = dispatcher
        self._guard = guard
        self.scaler = scaler
        self._step_count = step_count
        self._steps_taken = steps_taken
        self._taken_before = PROCESS_STEPS.taken  # other monitors' steps before this one
        self._claim = claim  # parameters found in a rebuilt layer map belong to the monitor
        # Layers whose gradient history starts over at the next step, and the
        # optimizers among theirs that started training over (their state
        # emptied or loaded back: a k-fold loop reusing them).
        self.restarted: set[str] = set()
        self.restarted_optimizers: set[int] = set()
        self.restarts = OptimizerRestarts()
        # Per-layer norms of the latest step of each optimizer (None: manual steps).
        self.latest_by_source: dict[int | None, dict[str, float]] = {}
        self.total_norm: float | None = None
        # The loss handed over for the step in progress, and one handed over after its step.
        self.loss: torch.Tensor | float | None = None
        self.late_loss: tuple[int, torch.Tensor | float] | None = None
        # Under FSDP2: the whole-layer norms, summed across ranks at a cadence
        # (None: gradients are not sharded, the norms measured are the layers').
        self.whole: WholeLayerNorms | None = None
        self._membership_key: tuple[Any, ...] | None = None
        self._unoptimized: list[nn.Parameter] = []
        # Of those, the ones seen frozen while no optimizer held them (a backbone
        # frozen for a linear probe as the optimizer was built over the head), by
        # id: unfrozen later, they are what that optimizer never got.
        self._frozen_unheld: set[int] = set()
        # The setup audit: redone when a step's parameter counts differ from the
        # last audited ones (per optimizer; None: without one), then the first
        # step after it checks that some trainable parameter got a gradient.
        self._audits_setup = "trainable_parameters" in self._rule_ids
        self.setup = SetupWatch()
        self._table_shown: str | None = None  # the last setup table shown, as table_content
        self._setup_before_trial: tuple[SetupAudit | None, str | None] = (None, None)
        # The model's passes, seen from its outermost call only (a compile
        # wrapper watched in its place stands for it).
        self.passes = ModelPasses(on_error)
        self.passes.hook(model if is_wrapper(model) else root)
        self.passes.on_raise = on_raise
        # Whether the output comes straight from a frozen layer (a head frozen by
        # mistake): looked for on one step's passes after each change of the setup.
        self._output_look: OutputLayerLook | None = None
        if self._audits_setup:
            self._output_look = OutputLayerLook(
                self.passes,
                root,
                optimizers,
                step_count,
                weak_callback(self._frozen_output),
                on_error,
            )
            self._output_look.arm()
        self._wrapper_search = _WRAPPER_SEARCHES
        self._passes_at_step = 0
        # Per optimizer: the passes counted, and the step, when it stepped with no
        # gradient at all (see _not_called); and who is told when that holds at two
        # of its steps in a row with no pass between them (``trainwatch run``).
        self._not_called_at: dict[int, tuple[int, int]] = {}
        # Whether any backward ran in the process after such a step (a skipped
        # batch has none): armed only then.
        self._backwards_anywhere = BackwardsAnywhere()
        self.on_not_called: Callable[[int], None] | None = None
        self._small_norms = SmallGradientNorms()
        # Each layer's norm told once: parameters outside the model that another
        # monitor tells are left out of this one's (asked per new set of them).
        self._small_norms.told_elsewhere = weak_method(self._outside_told_elsewhere, frozenset())
        # Always there (what backward reached: manual steps, a late loss); it
        # checks for stale gradients only for accumulated_gradient.
        self.tracker = GradResetTracker(on_error, "accumulation_tracker" in needs)
        self.tracker.attach(layers.parameters())
        self.tracker.watch_passes(self.passes)
        if "zero_gradient" in self._rule_ids:
            # zero_grad() between the backward passes of a step is looked for.
            self.tracker.follow_wipes = self.passes
        self._wiped_steps = WipedSteps(config.zero_gradient.patience)
        # Per optimizer whose micro-batches are wiped: its layers only earlier ones reached.
        self._wiped_away: dict[int, frozenset[str]] = {}
        self._check_accumulation = "accumulated_gradient" in self._rule_ids
        # A later backward cancelling what an earlier one left while another optimizer
        # stepped is looked for (see OtherBackwardLook), at the model's optimizer steps.
        if self._check_accumulation and self.tracker.check_resets:
            self.tracker.look_for_cancels(self._optimizers)
        # PROCESS_STEPS.taken when the latest optimizer step with a closure began.
        self._closure_taken = -1
        # Each optimizer's latest step (None: monitor.step()): with several, the
        # step before this one is often another optimizer's.
        self._applied_at: dict[int | None, int] = {}
        self._hand_updates = HandUpdates()
        # The model an optimizer trains that this one copies (see _copied_model).
        self._copy_looked = False
        self._copy_of: CopiedFrom | None = None
        self._copy_told = False
        # Parts of the model that copy another part, and those told as targets.
        self._part_copies = PartCopies()
        self._part_copies_told: set[str] = set()
        # The optimizers (by index) that hold this whole model as a copy of another
        # model they train (see _find_copy_held).
        self._held_as_copy: set[int] = set()
        # Per optimizer: the names of a copy's parameters it holds beside those of
        # the model copied (an EMA copy in its model's optimizer), told once and
        # left out of the step's missing ones; _NONE_HELD where none was found.
        self._copies_held: dict[int | None, frozenset[str]] = {}
        self._frozen_moves = FrozenMoves()
        # Parameters no watched optimizer holds that one not given may train.
        self._updated_elsewhere = UpdatedElsewhere()
        self._gradless_updates = GradlessUpdates()
        # Without an optimizer: hand-written updates that applied gradients zeroed
        # before them (zero_gradient's reset_before_step), looked at on the first
        # boundaries (None: that rule is off).
        self.zeroed_updates: ZeroedUpdates | None = None
        if "zero_gradient" in self._rule_ids:
            self.zeroed_updates = ZeroedUpdates(config.zero_gradient.patience)
        # Names found for frozen parameters outside the model, by their placeholder.
        self._outside_names: dict[str, str] = {}
        self.structure = StructureWatch()
        self._compile_warning = CompiledHookWarning()
        self._calls = CallTracker(step_count)
        self._tracks_calls = "call_tracker" in needs
        if self._tracks_calls:
            self._calls.track(root, layers.layers)
            self._calls.listen(self.passes)
        # Layers that went without a gradient, followed to see whether they run;
        # per optimizer, the layers without one at its last step.
        self._step_calls = StepCalls() if "zero_gradient" in self._rule_ids else None
        # The latest pass's graph, kept only while zero_gradient asks (a zero streak
        # not yet told): the op with a zero derivative behind it is named.
        self._zero_look: ZeroDerivativeLook | None = None
        # Which of the model's own parameters a pass reads, only while zero_gradient
        # asks (one without a gradient from the first step: read or not yet used).
        self._reads: ParameterReads | None = None
        # Has the tracker note what each backward leaves over the first steps and
        # while zero_gradient asks: a gradient the loop drops after backward.
        self._leavings = LeavingsNotes(self.tracker)
        if "zero_gradient" in self._rule_ids:
            self._zero_look = ZeroDerivativeLook(self.passes, weak_getter(self, "layers", None))
            self._reads = ParameterReads(self.passes, weak_getter(self, "layers", None))
            for rule in rules:
                if isinstance(rule, ZeroGradientRule):
                    rule.zero_look = self._zero_look  # looked at only as an alert is built
                    rule.reads = self._reads  # asked off the healthy step only
                    rule.leavings = self._leavings  # asked off the healthy step only
        # The gradients' norms as backward left them, taken at its end while
        # exploding_gradient asks (after a jump): a loop that writes into them
        # before the step (Langevin noise) is judged by what backward made.
        self._backward_norms = BackwardEndNorms(self.tracker)
        for rule in rules:
            if isinstance(rule, ExplodingGradientRule):
                rule.backward_norms = self._backward_norms  # asked off the healthy step only
        self._missing_before: dict[int | None, frozenset[str]] = {}
        self.probe: NonfiniteProbe | None = None
        if "nonfinite_probe" in needs:
            self.probe = NonfiniteProbe(
                [user_name(name) for name, _ in root.named_modules()],
                on_error,
                trace_ops=config.nonfinite_forward.trace_op,
                mode=config.nonfinite_forward.check,
            )
            self.probe.attach(root)
            self.probe.on_new_pass = weak_callback(self._on_new_pass)
            self.probe.on_nograd_finding = weak_callback(self._nograd_finding)
            self.probe.passes_worth_a_look = config.amp_skipped_steps.patience
            self.passes.subscribe("non-finite probe", self.probe)
        self.judge = NonfiniteJudge(self.probe.names if self.probe else [])
        # Modes, loss shapes and sampled activations: only for their rules.
        self.behaviour: BehaviourWatch | None = None
        if needs & {"modes", "broadcast_audit", "activation_sampler"}:
            self.behaviour = BehaviourWatch(
                root,
                config,
                self._rule_ids,
                step_count,
                weak_callback(self._publish_pass),
                on_error,
            )
            self.behaviour.attach_passes(self.passes)
            # The Monitor's own list, less those holding this model only as a copy
            # of another beside it (an EMA copy in its model's optimizer): no
            # optimizer of its own, whose steps would make its passes a generator's.
            as_copy = self._held_as_copy
            self.behaviour.optimized = lambda: len(optimizers) > len(as_copy)
            self.behaviour.a_target = weak_method(self._a_target, False)
            if self._tracks_calls:
                self.behaviour.calls = self._calls
            self.passes.subscribe("behaviour checks", self.behaviour)
            if self.behaviour.broadcast is not None:
                held.losses = weak_getter(self.behaviour.broadcast, "losses", ())
                held.unbounded_loss = weak_getter(self.behaviour.broadcast, "unbounded_nll", None)
        # When the broadcast audit is armed again (the step count at a boundary, the
        # one compare a healthy step makes for it): a new phase of training began
        # (``_new_phase``), or the step before a sampled one.
        self._audits = self.behaviour is not None and self.behaviour.broadcast is not None
        self._phase_began = False
        self._setups_seen: set[tuple[Any, ...]] = set()  # (optimizer, setup signature)
        first = config.broadcast.recheck_from
        self._sample_at = first - 1 if self._audits and first > 0 else _NEVER
        self._audit_at = self._sample_at
        # Layers whose first gradient comes on a step the audit did not watch (a
        # rare task's head, an auxiliary loss switched on): their loss is audited
        # when they get a gradient again. Asked only when a new set of parameters
        # gets gradients.
        self._joins: JoinedLayers | None = None
        if self._audits and config.broadcast.audit_steps > 0:
            self._joins = JoinedLayers()
            self._small_norms.on_new_layout = weak_callback(self._new_layout)
        # A loss whose kind changes with no other sign (a term a curriculum adds): the
        # class target look reads its kind on its sampled steps, the audit on its own,
        # and a new kind has the audit follow the next steps (``collect/loss_kind.py``).
        self._kinds: LossKinds | None = None
        kinds_every = config.broadcast.loss_kind_every
        if self._audits and config.broadcast.audit_steps > 0 and kinds_every > 0:
            self._kinds = LossKinds()
        # Which parameters no optimizer holds: not_optimized's, and the mode checks'
        # (a part never frozen but held by none and given no gradient is frozen).
        self._reads_membership = self._checks_not_optimized or (
            self.behaviour is not None and self.behaviour.modes is not None
        )
        # The loss's class targets on sampled steps, and the training loader's order.
        # The same look measures the labels a token loss gives padding (loss_on_padding).
        # It also reads the loss's kind for the broadcast audit.
        self.class_targets: ClassTargetLook | None = None
        if needs & {"class_targets", "padded_labels"} or self._kinds is not None:
            counts = "class_targets" in needs
            padding = "padded_labels" in needs
            cadences = [config.unshuffled_data.every] if counts else []
            if padding:
                cadences.append(config.loss_on_padding.every)
            self.class_targets = ClassTargetLook(
                min(cadences, default=kinds_every),
                config.unshuffled_data.max_classes,
                step_count,
                on_error,
                counts=counts,
                padding=PaddingLook(weak_getter(self, "_root", None)) if padding else None,
                audit=weak_getter(self.behaviour, "broadcast", None) if self._audits else None,
                kinds_every=kinds_every,
            )
            if self._kinds is not None:
                told = weak_callback(self._loss_kind)
                self.class_targets.read_loss_kinds(told)
                self.behaviour.read_loss_kinds(told)  # type: ignore[union-attr]
            # Listens to the passes of sampled steps only, this one first: a wrong
            # target (padding counted, data sorted by label) is there from the first
            # batch. On a step the broadcast audit follows too (the first steps, its
            # rechecks) the look rides the audit's mode, so the loss is not seen twice.
            self.listen_for_targets(self.class_targets)
        self.data_order: str | None = None
        self.own_batching: str | None = None
        # Whether training changes the output on the first batch: its own sampled steps.
        self.stall: FirstBatchProbe | None = None
        if "first_batch" in needs:
            section = config.stalled_training
            self.stall = FirstBatchProbe(
                self.passes, section.every, section.rows, section.loss_window, optimizers
            )
            self.stall.restart(0)
        # An optimizer that holds the model but never steps: seen from its passes
        # until its first step.
        self.idle: IdleOptimizer | None = None
        if self._checks_not_optimized:
            self.idle = IdleOptimizer(
                root,
                optimizers,
                steps_taken,
                weak_callback(self._optimizer_idle),
                weak_callback(self._optimizer_idle_lost),
            )
            self.passes.subscribe("idle optimizer", self.idle)
        # Weights updated while no watched optimizer steps (an optimizer the loop
        # built later and never handed over): looked at from the probe's count of
        # backward passes without a step, so only past such a gap. The monitor is
        # told (``on_unwatched``) and looks for the optimizer.
        self.unwatched: UnwatchedUpdates | None = None
        self.on_unwatched: Callable[[int], None] | None = None
        if self._checks_not_optimized and self.probe is not None:
            self.unwatched = UnwatchedUpdates(self.passes)
        # Each step's batch through the model's batch norm in training mode, where it
        # has one: an exploding gradient on a batch far smaller than the usual one
        # (the epoch's last, drop_last=False) is that batch's, told so.
        self.batch_norm_batches: BatchNormBatches | None = None
        if "exploding_gradient" in self._rule_ids:
            self.batch_norm_batches = BatchNormBatches(step_count)
            held.small_batch = self.batch_norm_batches.small_at
            self._follow_batch_norm()
        # Per optimizer of the model's, the model's steps when it was first seen not
        # stepping; one that never stepped while others of the model did is told once.
        self._attached_at: dict[int, int] = {}
        # Per such optimizer, the gradients its parameters held at the last look
        # (see _sibling_idle).
        self._sibling_seen: dict[int, GradientsSeen] = {}
        # Per such optimizer, over its first IDLE_LOOK_AHEAD steps idle: its own
        # gradients, followed for ones the loop throws away unapplied.
        self.lost_gradients = LostGradientWatches()
        # With several optimizers: when to look next for one that stopped stepping,
        # and those already told. The first look notes the gradients of any optimizer
        # idle since the start, for the next look to judge.
        self._stopped_check_at = STOPPED_LOOK_AHEAD
        self._stopped_told: set[int] = set()
        # Parameters two of the model's optimizers hold (found as the membership is
        # read): their steps looked at for one gradient stepped twice, for a while;
        # once told, never again.
        self._double_steps: DoubleSteps | None = None
        self._double_told = False
        # Without an optimizer: other models' steps at this model's last step (-1:
        # none yet), and whether it is a model of its own (None: not asked yet).
        self._elsewhere_at_boundary = -1
        self._left_out: bool | None = None
        # The step from which a step of a model with several optimizers is looked
        # at (see _optimizer_looks): the next look for one that stopped, or every
        # step while parameters held twice are looked at.
        self._multi_look_at = STOPPED_LOOK_AHEAD
        # Per optimizer idle long enough to be looked at, the gradients its own
        # parameters held at the last look (see fresh_gradients).
        self._grads_seen: dict[int, GradientsSeen] = {}
        # What close() (or the finalizer, for a monitor dropped unclosed) detaches.
        self.parts = attrgetter(*_PARTS)(self)

    def _guarded(self, component: str, fn: Any, *args: Any) -> Any:
        return self._guard.run(component, fn, *args)

    def carry_skipped(self, stale: PendingStep) -> None:
        """A framework gathered a step that never came: GradScaler skipped it.

        Lightning gathers before its precision plugin's GradScaler decides, so
        the probe's record of backward passes no step used was handed to a
        step that did not happen. It goes back to the probe, with one flag for
        the skipped pass (its gradient norms were non-finite), and is judged
        like a plain loop's skips.
        """
        probe = self.probe
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
        if (
            window.forward_origin is not None
            or window.backward_origin is not None
            or window.output_bad
        ):
            # Where the skipped step's NaN/Inf was born (a corrupt batch overflowing
            # fp16, a NaN in the input itself, which no module makes), located
            # before the scaler or the loop's own guard skipped it: told now, as
            # no step boundary of its own will come.
            self._dispatcher.publish(self._window_alerts(window, self._step_count()))
        self._on_new_pass()

    def judge_unwatched_step(self, params: list[torch.Tensor], step: int) -> None:
        """``step`` is about to apply the gradients of ``params`` with no watched
        optimizer (one found stepping the model under ``tw.watch(model)``, watched
        from its next step: trainwatch/optimizer_not_given.py): no boundary of its
        own comes, so what its passes met is judged now, before the update, as a
        boundary judges it. A new phase's optimizer whose first batch holds a NaN
        target is told at that step as a non-finite loss (a NaN feature as the
        input), not a step later as weights the training code wrote: the update it
        makes then is that origin's knock-on. Checked on the spot, a healthy step
        leaves its passes to the next boundary, as before. Runs once per optimizer
        found; the rules that follow the steps' gradients (their scale, zeros) pass
        over its record (its source)."""
        probe = self.probe
        if probe is None or not probe.enabled:
            return
        # The trigger a boundary pulls: the gradients' norms, with those of the
        # gradient that entered the model last (kept where checks are on the spot).
        used = [p for p in params if p.grad is not None]
        entering = [g for g in probe._this_pass.grad_entering if g is not None]
        norms = gradient_norms([p.grad for p in used] + entering) if used or entering else None
        listed = [] if norms is None else norms.tolist()
        if probe.on_the_spot:
            self._locate_if_off(norms, entering)
            if not probe.found_in_step() and all(map(math.isfinite, listed)):
                return
        # (Deferred checks: every module's sums, read now. They are this step's own:
        # left to the next boundary, they would be read as that step's.)
        record = StepRecord(step=step, source="unwatched_step")
        info = self.layers.info
        record.present = [info(p) for p in used]
        record.param_norms = listed[: len(used)]
        self._dispatcher.publish(self._window_alerts(probe.take(), step, record))

    def _locate_if_off(
        self, norms: torch.Tensor | None, entering: list[torch.Tensor]
    ) -> list[float] | None:
        """Trigger, then diagnose: bad gradients (or, on a device, a bad output) get
        located now, before the optimizer applies the step.

        On CPU the norms are read on the host for free; on a device the probe
        reads one scalar (``settle``). The backward replay must not look like
        training to the accumulation tracker, so it is paused meanwhile.
        ``norms`` end with those of ``entering``, the gradients that entered
        the model.

        Returns the norms read on the host (None where they were not): the
        step's frame keeps them instead of reading them again.
        """
        probe = self.probe
        if probe is None or not probe.on_the_spot:
            return
        listed = None
        if probe.at_step:
            bad_grads = probe.settle(norms)
        else:
            listed = norms.tolist() if norms is not None else None
            bad_grads = listed is not None and not all(map(math.isfinite, listed))
        if bad_grads:
            entering_bad = bool(entering) and self._guarded("non-finite probe", probe.entering_bad)
            if not entering_bad:
                if entering and not self._parameters_off(norms, listed, len(entering)):
                    # A finite gradient entering the model, too large for its fp32
                    # norm: nothing non-finite anywhere.
                    return listed
                overflow = self._guarded("non-finite probe", self._norm_overflow)
                if overflow is not None:
                    probe.note_norm_overflow(overflow)  # nothing for a replay to locate
                    return listed
            paused, self.tracker.enabled = self.tracker.enabled, False
            try:
                probe.replay_backward()
            finally:
                self.tracker.enabled = paused
            if entering_bad and not self._parameters_off(norms, listed, len(entering)):
                # The model's own forward (a ReLU or clamp at its output) zeroed the
                # gradient where it was non-finite: every parameter's is finite, and
                # the step is judged on what entered the model.
                probe.note_entering_alone()
        return listed

    @staticmethod
    def _parameters_off(norms: torch.Tensor, listed: list[float] | None, entering: int) -> bool:
        """Whether a parameter's gradient norm is non-finite, the entering gradients'
        (the last ``entering`` norms) aside: read again on a device (a rare step)."""
        if listed is not None:
            return not all(map(math.isfinite, listed[: len(listed) - entering]))
        own = norms[: norms.numel() - entering]
        return not math.isfinite(float(own.double().sum()))

    def _norm_overflow(self) -> NonfiniteFinding | None:
        """The norms came out non-finite: whether the gradients are all finite, only
        too large for the norm's fp32 sum of squares (a corrupt target of 1e21)."""
        return norm_overflow(
            self.layers.parameters(), self.layers.info, clip_hook.total_in_progress()
        )

    def stepped_unwatched(self, index: int, step: int) -> None:
        """Optimizer ``index`` took ``step`` before it was watched (found stepping the
        model though not given to ``tw.watch``): its latest step, as its own watched
        step would have noted it."""
        self._applied_at.setdefault(index, step)

    def applied(
        self,
        step: int,
        pending: PendingStep | None,
        params: list[torch.Tensor],
        whole: bool,
        at_backward_end: bool = False,
    ) -> None:
        """The optimizer (or the loop, without one) has applied ``step``'s update.

        The tracker starts watching the gradients just used for a reset
        (``whole``: they are every parameter any step uses; ``at_backward_end``:
        the step was marked where backward ended, before the loop's clip and
        update); the sampled checks of the weights just updated are launched
        onto the step's frame.
        """
        if self.tracker.enabled:
            self.tracker.arm(params, whole=whole, writes_may_follow=at_backward_end)
        if self.probe is not None:
            # Where the update left the version counters: a weight written after
            # it (by the training code) is told from one the update blew up.
            self.probe.updated = (params, list(map(_VERSION, params)), list(map(_DATA_PTR, params)))
        if pending is None:
            return
        if self.idle is not None:  # the model trains: nothing more to watch for
            self.passes.unsubscribe(self.idle)
            self.idle.detach()
            self.idle = None
        applied_at = self._applied_at
        applied_at[pending.record.optimizer] = step
        if self._checks_not_optimized and (
            len(applied_at) < len(self._optimizers) + (None in applied_at)
            or (step >= self._multi_look_at and len(self._optimizers) > 1)
        ):
            # Some optimizer of the model's never stepped, or it is time to see
            # whether one stopped, or two step the same parameters (usually
            # none of them: C compares).
            self._guarded("idle optimizer", self._optimizer_looks, step, pending)
        every = self._parameter_every
        if every and step % every == 0:
            self._guarded("parameter check", self._check_parameters, pending, params)
        if pending.stall_due:
            self._guarded("stalled training", self._measure_stall, step, pending)

    def _take_dropped(self, record: StepRecord, params: list[torch.Tensor]) -> None:
        """Gradients the step's latest backward made that the loop dropped before the
        step, while it kept others (SwAV's prototypes, DINO's last layer, kept out
        of the first updates): set to None, they leave ``missing`` for ``dropped``;
        written since, they are noted (``rewritten_after_backward``), and an exactly
        zero one among them is zeroed by the loop (zero_gradient asks, reading the
        norms). Every gradient the step's backward left rewritten is no such drop."""
        left = self.tracker.left
        if not left:
            return
        if record.missing:
            dropped = dropped_to_none(params, left)
            if dropped:
                info = self.layers.info
                record.dropped = tuple(map(info, dropped))
                names = {d.name for d in record.dropped}
                record.missing = [i for i in record.missing if i.name not in names]
        if self._leavings.listening and not record.rewritten_since_backward:
            info = self.layers.info
            record.rewritten_after_backward = frozenset(
                info(p).name for p in rewritten_since(params, left)
            )

    def _take_backward_norms(self, pending: PendingStep, params: list[torch.Tensor]) -> None:
        """The norms the step's last backward left, read back with the step where the
        loop wrote into some gradient since (see trainwatch.collect.backward_end_norms);
        not under an enabled GradScaler (backward left them scaled)."""
        record = pending.record
        record.backward_end_seen, record.backward_layer_norms = self._backward_norms.read_with_step(
            params,
            pending.frame,
            self.layers.info,
            self.layers.layers,
            scaled=getattr(self.scaler, "_enabled", False),
        )

    def _follow_calls(self, index: int | None, record: StepRecord) -> None:
        """From the next pass on, see whether the layers without a gradient run at all.

        Layers with a gradient at this optimizer's last step ran then. Which
        layers to follow is ``StepCalls.without_gradient``'s decision; here
        they are found in the model.
        """
        step_calls = self._step_calls
        owners = frozenset(info.owner for info in record.missing if info.in_model)
        before = self._missing_before.get(index)
        self._missing_before[index] = owners
        wanted = step_calls.without_gradient(
            owners,
            ran=owners - before if before is not None else frozenset(),
            called=record.called_now,
            never_called=record.never_called,
            outputs_unreached=bool(record.unreached_outputs),
        )
        if not wanted:
            return
        found = {}
        read_only = weights_read_by_holder(self._root)  # never called: nothing to follow
        names: dict[int, str] = {}
        for raw, module in self._root.named_modules():
            name = names[id(module)] = user_name(raw)
            if name not in wanted or is_wrapper(module):
                continue
            holder = read_only.get(id(module))
            if holder is None:
                found[name] = module
            elif id(holder) in names:
                step_calls.held_by[name] = names[id(holder)]  # judged by its holder's calls
        step_calls.follow(found)
        if step_calls.following and not self.passes.listens(step_calls):
            self.passes.subscribe("step calls", step_calls)

    def _skipped_batch(self, index: int, now: int, closure: bool) -> bool:
        """The optimizer steps with no gradient on any of its parameters: was this a
        batch skipped before its backward (Lightning's ``training_step`` returning
        None, a loss found NaN and left without ``backward()``)? Only with no
        backward since its last step: none reached the model, no loss was handed
        over, and none ran anywhere in the process (``BackwardsAnywhere``, armed at
        such a step for the next: a model replaced after the optimizer was built,
        or one cut off whole while another model's backward runs, is no skip).
        Where no look covered the time since its last step (the first such step),
        a closure step is one: the closure is the step's forward and backward
        (Lightning's automatic optimization), and it ran none; else the step counts
        as before."""
        tracker = self.tracker
        if tracker.backward_seen or not tracker.enabled or self.loss is not None:
            return False
        seen = self._backwards_anywhere.look(index, now)
        if seen is None:
            return closure or self.in_closure_step()
        return not seen

    def _not_called(self, index: int | None, now: int, passes: int, record: StepRecord) -> None:
        """The optimizer steps with no gradient on any of its parameters: noted, with the
        passes of the model counted so far. At its next step, the same again with no
        pass of the model between the two, the model is no longer called (replaced
        by a copy the loop trains, while this optimizer still steps the old one),
        since the step noted. A step without gradients of a model that ran (a head
        unused on this batch, gradients wiped before the step) is followed by a pass.
        """
        if index is None:
            return
        seen = self._not_called_at.get(index)
        if seen is None or seen[0] != passes:
            self._not_called_at[index] = (passes, now)  # noted: judged at its next step
            return
        record.not_called_since = seen[1]
        if self.on_not_called is not None:
            self.on_not_called(seen[1])

    def _updated_without_grad(
        self, record: StepRecord, params: list[torch.Tensor], now: int
    ) -> None:
        """No parameter holds a gradient: those the loop's own update moved since the
        last boundary (gradients computed outside .grad: torch.func,
        torch.autograd.grad) are trained, and leave ``record.missing``. Once some
        moved so, a boundary where none did had no update: it says nothing of any
        layer."""
        trainable = [p for p in params if p.requires_grad]  # in the order of record.missing
        pairs = [(info.name, p) for info, p in zip(record.missing, trainable)]
        updates = self._gradless_updates
        moved = updates.look(now, pairs)
        if moved is None:
            record.weights_unseen = True
            return
        record.moved_without_grad = moved
        if moved or updates.moving:
            record.missing = [info for info in record.missing if info.name not in moved]

    def _custom_functions(self, record: StepRecord, params: list[torch.Tensor]) -> None:
        """Layers that ran this step without a gradient, looked at once in the step's
        graph: a custom autograd Function between them and the output whose
        backward returns None for them (``StepCalls.explain``)."""
        step_calls = self._step_calls
        ran = record.called_now or frozenset()
        missing = {info.name for info in record.missing if info.owner in ran}
        targets: dict[str, list[torch.Tensor]] = {}
        known = self.layers.known()
        for param in params:
            info = known.get(id(param))
            if info is not None and info.name in missing:
                targets.setdefault(info.owner, []).append(param)
        step_calls.explain(targets)  # type: ignore[union-attr]

    def _judge_wipes(self, index: int, now: int, params: list[torch.Tensor]) -> None:
        """Whether this step of optimizer ``index`` applied only its last backward's
        gradients, zero_grad() having wiped each earlier one's; told (zero_gradient,
        ``reset_between_backwards``) once that held for ``patience`` steps in a row."""
        tracker = self.tracker
        look = tracker.wipes
        if look is None or index in self._wiped_steps.told:
            return
        verdict = look.verdict(params)
        found = self._wiped_steps.judge(index, look.run, now, verdict)
        if verdict[2]:
            known = self.layers.known()
            away = {known[id(p)].name for p in look.dropped(params) if id(p) in known}
            self._wiped_away[index] = self._wiped_away.get(index, frozenset()) | away
        elif index not in self._wiped_steps.told:
            self._wiped_away.pop(index, None)
        if look.idle >= WIPES_IDLE_STEPS:
            # A one-off second backward (a probe) started it, or a backward that is
            # no micro-batch comes at every step: a rest, doubled each time.
            tracker.rest_following(WIPES_IDLE_STEPS)
        if all(map(self._wiped_steps.settled, range(len(self._optimizers)))):
            # Every optimizer told, or accumulating as intended: nothing left to look for.
            tracker.stop_following()
            tracker.follow_wipes = None
        if found is None:
            return
        record = BetweenBackwardsRecord(
            step=found.since,
            source="between_backwards",
            optimizer=index,
            optimizer_class=type(self._optimizers[index]).__name__,
        )
        record.present = [self.layers.info(p) for p in params if p in self.layers]
        record.wiped = found
        self._dispatcher.publish(self.rules.evaluate(record))

    def _look_at_update(self, step: int, at_backward_end: bool, record: StepRecord) -> None:
        """Whether the hand-written updates keep writing the weights without moving
        them, their gradients zeroed before them: told (zero_gradient,
        ``reset_before_step``) once that held for ``patience`` updates in a row."""
        look = self.zeroed_updates
        assert look is not None
        weights, names = self._hand_updates.watched(self.layers)
        found = look.look(step, weights, at_backward_end, record.rewritten, names)
        if not look.looking:
            self.zeroed_updates = None  # told, or the loop's updates seen: no more looks
        if found is None:
            return
        told = HandUpdateRecord(step=found.since, source="hand_update")
        known = self.layers.known()
        told.present = [known[id(p)] for p in weights if p.requires_grad and id(p) in known]
        told.zeroed = found
        self._dispatcher.publish(self.rules.evaluate(told))

    def start_zeroed_updates(self) -> None:
        """Watching begins without an optimizer: the weights as they are, for the
        first boundary to compare with."""
        if self.zeroed_updates is not None:
            self.zeroed_updates.start(self._hand_updates.watched(self.layers)[0])

    def _judge_cancels(
        self, index: int, now: int, params: list[torch.Tensor], frame: StepFrame
    ) -> None:
        """Optimizer ``index`` is about to step: what a later backward cancelled of the
        gradients an earlier one left on its parameters while another optimizer
        stepped (see OtherBackwardLook), figured with this step's frame; the steps
        whose frames have landed judged, and told (accumulated_gradient,
        ``other_optimizers_backward``) once most of the latest were cancelled."""
        tracker = self.tracker
        look = tracker.cancels
        if look is None:
            tracker.start_cancels_if_left_aside(params)
            return
        try:
            look.take(index, params, now, frame.add)
            found = look.judge()
        except Exception as exc:  # the look's hooks go with it
            tracker.cancels_failed(exc)
            return
        if look.settled:
            tracker.stop_cancels()
        if found is None:
            return
        record = BetweenBackwardsRecord(
            step=found.since,
            source="between_backwards",
            optimizer=found.optimizer,
            optimizer_class=type(self._optimizers[found.optimizer]).__name__,
        )
        known = self.layers.known()
        record.accumulated = [known[pid] for pid in found.ids if pid in known]
        if not record.accumulated:
            return
        record.present = record.accumulated
        record.cancelled = found
        self._dispatcher.publish(self.rules.evaluate(record))

    def _check_parameters(self, pending: PendingStep, params: list[torch.Tensor]) -> None:
        """Norms of the weights just updated: one batched kernel, read with the step."""
        trainable = [p for p in params if p.requires_grad and p.grad is not None]
        if not trainable:
            return
        pending.checked_params = [self.layers.info(p) for p in trainable]
        pending.param_norms = pending.frame.add(gradient_norms([p.detach() for p in trainable]))

    def _measure_stall(self, step: int, pending: PendingStep) -> None:
        """A sampled step's update is applied: how far it and the phase moved the model."""
        if self.stall is None:
            return
        before, pending.weights_before = pending.weights_before, None
        pending.stall_due = False
        report = self.stall.report(step, pending.params, before, self.layers)
        if report is None:
            return  # no update since the weights were copied: measured at a later boundary
        pending.record.stall = report
        # A param group holding no trainable parameter (a finished phase's optimizer
        # over a model frozen since) updates nothing: its rate says nothing of a stall.
        groups = [
            group
            for opt in self._optimizers
            for group in opt.param_groups
            if isinstance(group.get("lr"), (int, float))
            and any(p.requires_grad for p in group["params"])
        ]
        report.learning_rates = [float(group["lr"]) for group in groups]
        report.initial_learning_rates = [
            float(group["initial_lr"])
            if isinstance(group.get("initial_lr"), (int, float))
            else float(group["lr"])
            for group in groups
        ]
        # Those holding the model's own weights: all of them at 0 while another
        # group trains (the head beside a backbone watched as a model of its own)
        # is a freeze by learning rate. A C loop over a group until its first own.
        own = self.layers.known().__contains__
        report.model_learning_rates = [
            float(group["lr"]) for group in groups if any(map(own, map(id, group["params"])))
        ]
        report.left_out_told = self._left_out_told() or self._a_target()

    def _read_rates(self, record: StepRecord, stepping: int | None, step: int) -> None:
        """Every watched optimizer's learning rates, one sampled step in ten: a
        schedule that collapsed them (a per-epoch one stepped every batch) is told
        from them long before the re-runs see the updates stop. Each optimizer
        comes with the latest step it applied, as a rate that collapsed counts
        only while its optimizer still steps."""
        self.stall.rates_read(step)  # type: ignore[union-attr]
        applied_at = self._applied_at
        record.optimizer_rates = [
            LearningRates(
                index,
                type(optimizer).__name__,
                list(map(_group_rate, optimizer.param_groups)),
                step if index == stepping else applied_at.get(index),
            )
            for index, optimizer in enumerate(self._optimizers)
        ]

    def _left_out_told(self) -> bool:
        """Whether not_optimized has told that nothing updates any of the model's
        trainable weights (a loss module's learned weights left out of the
        optimizer): a stall then is that finding again, not a second one. The
        parameters are named only once such a finding was told (usually none)."""
        told: set[str] = set()
        for tally in self._dispatcher.tallies.values():
            alert = tally.first
            if alert.rule == "not_optimized" and not _still_updated(alert):
                told.update(alert.data.get("parameters", ()))
        if not told:
            return False
        trainable = [self.layers.info(p).name for p in self._trainable()]
        return bool(trainable) and told.issuperset(trainable)

    def closure_step_begins(self, index: int, step: int) -> None:
        """An optimizer step with a closure (LBFGS, Lightning's automatic
        optimization) begins: its updates and passes interleave inside ``step()``.

        Where the last update left the weights no longer says who wrote them;
        each backward of the step is followed as a use of the gradients (see
        ``GradResetTracker.closure_step_begins``); and its passes are the step's
        own evaluations, not steps a GradScaler skipped (``in_closure_step``).
        The step is gathered once ``step()`` returned, after its update: on
        stalled_training's re-run step, and on a phase's first (whose weights the
        reference is taken with), the weights before it are copied now.
        """
        self._closure_taken = PROCESS_STEPS.taken
        stall = self.stall
        if stall is not None and (step == stall.due or stall.first_step_open):  # (plain attributes)
            self._guarded(
                "stalled training", stall.closure_step_begins, self.optimizer_params(index), step
            )
        if self.probe is not None:
            self.probe.updated = None
        if self.tracker.enabled:
            self.tracker.closure_step_begins(
                self.optimizer_params(index), len(self._optimizers) == 1
            )

    def in_closure_step(self) -> bool:
        """An optimizer step with a closure is in progress (no step has ended since it
        began): a pass without a step boundary is one more evaluation of it."""
        return self._closure_taken == PROCESS_STEPS.taken

    def gather_closure_step(self, index: int, now: int) -> PendingStep:
        """The step of an optimizer with a closure, gathered after ``step()`` returned.

        Its evaluations' backward passes came with no step boundary between
        them, as a GradScaler's skipped steps do; they were all this step's
        own (LBFGS reads each), so the probe forgets them as skipped passes.
        """
        if self.probe is not None:
            self.probe.bad_backward_passes.clear()
        pending = self.gather(index, now, closure=True)
        self.name_closure_accumulation(pending)
        self.tracker.closure_step_over()
        return pending

    def name_closure_accumulation(self, pending: PendingStep) -> None:
        """Where this closure step's backward added onto gradients an earlier
        evaluation of the same step had used, the alert says so (not the previous
        step's use)."""
        if self.tracker.closure_evaluations_accumulated:
            pending.record.accumulation_method = "closure"

    def _nograd_finding(self) -> None:
        """A pass without gradients met a NaN/Inf in a model with no steps of its own
        (an EMA copy, a target network run under no_grad): no step boundary of its
        will come to report it, so it is reported now, dated by the step the
        process's training is in. A model that trains waits for its boundary."""
        if self._optimizers or self._step_count() or self.tracker.backward_seen:
            return
        step = max(self._step_count(), PROCESS_STEPS.now)
        self.probe.mark_weights_written()
        alerts = self._guarded("step collector", self.unfinished_alerts, step)
        if alerts:
            # Inside the model's forward: a halt waits for a boundary or flush().
            self._dispatcher.publish(alerts, may_halt=False)

    def _on_new_pass(self) -> None:
        """A forward pass of the whole model begins after backward passes no step
        followed: GradScaler may have skipped steps, or an optimizer the monitor
        does not watch may train the model."""
        probe = self.probe
        if probe is None or self.in_closure_step():
            return
        if self.config.amp_skipped_steps.enabled:
            self._amp_skipped(probe)
        look = self.unwatched
        if look is not None and not look.done and self._optimizers:
            self._guarded("unwatched updates", self._look_unwatched, look)

    def _look_unwatched(self, look: UnwatchedUpdates) -> None:
        """The weights, looked at every few passes while no watched step comes: moved
        look after look, something the monitor does not watch updates them.

        The passes a step takes are measured from the second step on; until then
        the first step's own count stands in (Reptile's K inner passes before
        each outer step are no gap)."""
        steps = self._steps_taken()
        per_step = self.judge.passes_per_step
        if steps == 1:
            per_step = max(per_step, self._passes_at_step)
        if look.look(self.passes.passes, steps, per_step, self._trainable):
            if self.on_unwatched is not None:
                self.on_unwatched(self.passes.passes - self._passes_at_step)

    def _trainable(self) -> list[torch.Tensor]:
        """The model's trainable parameters (a pass may start with their gradients reset)."""
        return [p for p in self.layers.parameters() if p.requires_grad]

    def unwatched_alerts(self, passes: int, found: Optimizer | None) -> list[Alert]:
        """The weights moved for ``passes`` passes with no watched step: ``found`` (None:
        no optimizer step over the model's parameters was seen) updates them."""
        taken = self._steps_taken()
        record = StepRecord(
            step=self._step_count(),
            source="unwatched",
            optimizer_class=type(found).__name__ if found is not None else None,
        )
        record.not_optimized = [self.layers.info(p) for p in self._trainable()]
        record.idle_steps = max(passes, 1)
        record.idle_since = self._step_count() - 1 if taken else None
        return self.rules.evaluate(record)

    def loose_training_alerts(self, loose: LooseTraining, step: int) -> list[Alert]:
        """Nothing of the model trains, and an optimizer no model holds trains only
        tensors outside it (seen by ``trainwatch run``), told as the setup audit would."""
        record = StepRecord(step=step, source="setup")
        record.setup = SetupCheck(0, 0, 0, 0, loose=loose, since=step)
        return self.rules.evaluate(record)

    def replaced_alerts(self, replaced: ReplacedModel, since: int | None = None) -> list[Alert]:
        """The model's trainable parameters with a gradient, which no optimizer holds,
        told as the replacement of the model ``replaced`` names: once, dated at
        ``since`` (None: the latest step)."""
        step = max(self._step_count() - 1, 0) if since is None else since
        record = StepRecord(step=step, source="replaced")
        record.not_optimized = [
            self.layers.info(p) for p in self._trainable() if p.grad is not None
        ]
        if not record.not_optimized:
            return []
        record.replaced = replaced
        # The same cause, told: not again as weights never updated.
        self._hand_updates.never_moved = None
        return self.rules.evaluate(record)

    def _amp_skipped(self, probe: NonfiniteProbe) -> None:
        """Enough backward passes went without a step: were they steps GradScaler skipped?"""
        rule = self.config.amp_skipped_steps
        passes = len(probe.bad_backward_passes)
        if passes < rule.patience * self.judge.passes_per_step:
            return
        record = StepRecord(step=self._step_count(), source="passes")
        record.skipped_backward_passes = self.judge.trailing_skips(probe.bad_backward_passes)
        if record.skipped_backward_passes < rule.patience:
            return
        # Read on the host only here, past many passes without a step.
        scale = self._guarded("loss scale", loss_scale, self.scaler)
        warming_up = self._step_count() == self.judge.first_step  # no update applied yet
        if warming_up and (scale is None or scale >= 1.0):
            return  # the scaler's warm-up
        skipped = 0 if warming_up else record.skipped_backward_passes
        record.amp = AmpReport(skipped, self.judge.passes_per_step, scale)
        self._dispatcher.publish(self.rules.evaluate(record))

    def _left_out_whole(self, hand: HandUpdates, stale: list[ParamInfo]) -> bool:
        """A model of its own (not a loss module's weights) whose gradients were not
        reset and whose weights did not move since its last step, while other models'
        optimizers stepped in between: left out of every optimizer, known now (see
        trainwatch.collect.left_out_model); or, where it copies a model an optimizer
        trains, a target or reference fed gradients (a DPO reference or a DQN target
        computed without ``torch.no_grad()``), known now just as well: a hand-written
        update would have moved it."""
        elsewhere = PROCESS_STEPS.taken - self._taken_before - self._steps_taken()
        stepped_between = elsewhere > self._elsewhere_at_boundary >= 0
        self._elsewhere_at_boundary = elsewhere
        if not (stale and hand.never_moved and stepped_between) or self._left_out is False:
            return False
        if self._left_out is None:
            whole = self._guarded("left-out model", a_loss_module, self._root) is False
            # A copy is told now only while it lies near its source (a reference, a
            # target): a fresh instance of the same architecture (a k-fold's new
            # model beside an optimizer left over the last one) is a replaced model,
            # told by the replacement's look.
            self._left_out = whole and (
                self._copied_model() is None
                or self._guarded("target copies", near_copy, self._root) is True
            )
        return bool(self._left_out)

    def _never_updated(self, record: StepRecord, stale: list[ParamInfo]) -> bool:
        """No optimizer, and nothing updates the weights by hand either, while other
        models' optimizers step: parameters left out of every optimizer (whether told)."""
        elsewhere = PROCESS_STEPS.taken - self._taken_before - self._steps_taken()
        whole = self._left_out is True
        if elsewhere < (1 if whole else NEVER_MOVED):
            return False  # no model here trains with an optimizer (yet): hand-written loops
        record.not_optimized = list(stale)
        record.idle_steps = elsewhere
        record.copy_of = self._copied_model()
        if whole and record.copy_of is None:
            record.left_out = self._guarded("left-out model", left_out_model, self._root)
        # A target network told here is not told again once the loop moves it.
        self._copy_told = record.copy_of is not None
        return True

    def _a_target(self) -> bool:
        """Whether the model, without an optimizer of its own, copies one an optimizer
        trains (a DQN's target network, hand-marked steps or boundaries at backward
        under trainwatch run): its weights come from that model, still between
        syncs every few hundred steps, so they tell no stall of its own. Asked on
        sampled steps only."""
        return not self._optimizers and self._copied_model() is not None

    def _name_the_copy(self, record: StepRecord) -> None:
        """Gradients pile up in this model, which no optimizer holds, while the loop
        moves its weights: a copy of a model an optimizer trains is its target network,
        fed gradients by a target computed with them, not a hand-written update that
        forgot its reset."""
        record.copy_of = self._copied_model()
        if record.copy_of is not None and self._copy_told:
            record.accumulated = []  # told when it had not moved yet

    def _tell_part_copies(
        self,
        step: int,
        record: StepRecord,
        trained: list[nn.Parameter],
        unheld: list[nn.Parameter],
    ) -> list[nn.Parameter]:
        """Parameters no optimizer holds got gradients: those of a part that copies
        another part (a target network held inside the model) are told, once, as a
        target fed gradients, not as a part left out of the optimizer, which
        ``add_param_group()`` would train. The rest, left to not_optimized."""
        left, copies = self._part_copies.split(step, self._root, trained, unheld)
        for copy in copies:
            if copy.name in self._part_copies_told:
                continue
            self._part_copies_told.add(copy.name)
            told = StepRecord(copy.since, source=record.source, optimizer=record.optimizer)
            told.accumulated = [self.layers.info(p) for p in copy.params if p in self.layers]
            told.copy_of, told.copy_part = copy.of, copy.name
            # Within the step's hooks: a halt waits for the step's end.
            self._dispatcher.publish(self.rules.evaluate(told), may_halt=False)
        return left

    def _not_held_back(
        self, step: int, told: list[nn.Parameter], resting: Sequence[nn.Parameter] = ()
    ) -> list[nn.Parameter]:
        """Of the parameters no watched optimizer holds that got gradients at ``step``,
        those to tell now: those an optimizer the monitor was not given holds wait
        until their weights show whether it trains them (see UpdatedElsewhere), as do
        those of ``resting`` it holds (frozen now, with a gradient: never told from
        here). A verdict falling now is told here: never updated, dated at the step
        they were first met, or one console note where that optimizer trains them."""
        look = self._updated_elsewhere
        kept = look.held_back(step, told, self._optimizers, resting)
        info = self.layers.info
        for verdict in look.verdicts:
            due = [p for p in verdict.due if p in self.layers]
            if due:
                dated = StepRecord(verdict.since)
                dated.not_optimized = [info(p) for p in due]
                frozen_unheld = self._frozen_unheld
                if frozen_unheld:
                    # (Frozen now, as for the generator's step: not unfrozen since.)
                    dated.unfrozen_unheld = frozenset(
                        info(p).name for p in due if id(p) in frozen_unheld and p.requires_grad
                    )
                # Within the step's hooks: a halt waits for the step's end.
                self._dispatcher.publish(self.rules.evaluate(dated), may_halt=False)
            trained = [info(p) for p in verdict.trained if p in self.layers]
            if trained:
                self._dispatcher.note(
                    trained_elsewhere_words(trained, verdict.optimizers, self._model_name())
                )
        return kept

    def _copy_held(
        self, index: int, now: int, record: StepRecord, params: list[nn.Parameter]
    ) -> None:
        """Parameters without a gradient that copy those of another model the same
        optimizer holds (an EMA or averaged copy handed to its model's optimizer):
        told once, as that, and no layer's missing gradient from then on. Looked
        for at the first step where some parameter of the optimizer went without a
        gradient while others had one (a step with none at all says nothing)."""
        held = self._copies_held.get(index)
        if held is None:
            if not record.present:
                return  # no gradient anywhere: looked at again at the next such step
            held = self._copies_held[index] = self._find_copy_held(index, now, record, params)
        if held:
            record.missing = [info for info in record.missing if info.name not in held]

    def _find_copy_held(
        self, index: int, now: int, record: StepRecord, params: list[nn.Parameter]
    ) -> frozenset[str]:
        """The copy's parameter names (empty: none), told unless told already: the
        model copied tells a copy outside it from its own first step, and under
        ``trainwatch run`` the copy, watched from its first call, is the same one."""
        copied = copy_of_another(self._root, params)
        if copied is not None:
            copy = [info for info in record.missing if info.in_model]
            copy_class: str | None = type(unwrap(self._root)).__name__
            self._held_as_copy.add(index)
            tensors = [p for p in params if p in self.layers and p.grad is None]
        else:
            tensors = copy_outside(self._root, params)
            copy = [info for info in record.missing if not info.in_model]
            if not tensors or len(copy) != len(tensors):
                return _NONE_HELD
            copied, copy_class = CopiedFrom(self._model_name()), None
        if COPIES_TOLD.first_telling(tensors):
            told = StepRecord(now, source="copy_in_optimizer", optimizer=index)
            told.optimizer_class = type(self._optimizers[index]).__name__
            told.missing, told.copy_of, told.copy_part = copy, copied, copy_class
            self._dispatcher.publish(self.rules.evaluate(told), may_halt=False)
        return frozenset(info.name for info in copy)

    def _model_name(self) -> str:
        """What the alerts call this model (its ``trainwatch run`` name, or its class)."""
        first = next(iter(self._root.parameters()), None)
        owner = registry.owner_of(first) if first is not None else None
        return getattr(owner, "model_name", None) or type(unwrap(self._root)).__name__

    def _copied_model(self) -> CopiedFrom | None:
        """The model an optimizer trains that this one is a copy of, looked for once
        (a finding is due: never on the healthy step). Asked as early as the copy's
        first step (its eval mode in a training pass), a look made before any watched
        model has an optimizer finds nothing yet: looked for again then."""
        if not self._copy_looked:
            self._copy_of = self._guarded("target copies", copied_model, self._root)
            self._copy_looked = self._copy_of is not None or any(
                owner.optimizers for owner in registry.owners()
            )
        return self._copy_of

    def _optimizer_idle(self, steps: int, params: list[nn.Parameter]) -> None:
        """The model's optimizer never stepped while other models took ``steps`` steps."""
        record = StepRecord(step=max(self._step_count(), PROCESS_STEPS.now), source="passes")
        record.not_optimized = [self.layers.info(p) for p in params if p in self.layers]
        record.idle_steps = steps
        self._dispatcher.publish(self.rules.evaluate(record))

    def _optimizer_idle_lost(
        self, since: int, steps: int, params: list[nn.Parameter], losses: int
    ) -> None:
        """The model's optimizer never stepped since ``since`` while other models took
        ``steps`` steps, and the loop threw away its gradients ``losses`` times (see
        LostGradients)."""
        self._guarded("idle optimizer", self._tell_idle_lost, since, steps, params, losses)

    def _tell_idle_lost(
        self, since: int, steps: int, params: list[nn.Parameter], losses: int
    ) -> None:
        record = StepRecord(step=since, source="passes")
        record.not_optimized = [self.layers.info(p) for p in params if p in self.layers]
        record.idle_steps = steps
        record.idle_lost = losses
        optimizers = list(self._optimizers)
        named = [self._root, *optimizers]
        names = self._guarded("caller names", names_in_caller, named, _inner_if_optimizer) or {}
        record.idle_model_name = names.get(id(self._root))
        if len(optimizers) == 1:
            record.idle_optimizer_name = names.get(id(optimizers[0]))
            record.optimizer_class = type(optimizers[0]).__name__
        self._dispatcher.publish(self.rules.evaluate(record))

    def _optimizer_looks(self, step: int, pending: PendingStep) -> None:
        """The looks a step of a model with several optimizers is due (see applied)."""
        double = self._double_steps
        if double is not None:
            found = double.stepped(pending.record.optimizer)
            if found is not None:
                self._double_told = True
                self._tell_stepped_twice(step, *found)
            if double.done:
                self._double_steps = None
        self._sibling_idle(step)
        self._multi_look_at = -1 if self._double_steps is not None else self._stopped_check_at

    def _look_for_double_steps(self) -> None:
        """The membership changed: parameters of the model two optimizers hold are
        looked at from the next step (none: nothing is)."""
        self._double_steps = None
        if not self._double_told and len(self._optimizers) > 1:
            ours = set(map(id, self.layers.parameters()))
            shared = shared_parameters(self._optimizers, ours)
            if shared:
                self._double_steps = DoubleSteps(self._optimizers, shared, self.tracker.enabled)
        self._multi_look_at = -1 if self._double_steps is not None else self._stopped_check_at

    def _tell_stepped_twice(
        self, step: int, found: SteppedTwice, params: list[torch.Tensor]
    ) -> None:
        """Two optimizers stepped ``params`` on one gradient, at ``step``."""
        record = StepRecord(
            step=step,
            source="passes",
            optimizer=found.second,
            optimizer_class=found.second_class,
        )
        record.not_optimized = [self.layers.info(p) for p in params if p in self.layers]
        first, second = self._optimizers[found.first], self._optimizers[found.second]
        named = [first, second, self._root]
        names = self._guarded("caller names", names_in_caller, named, _inner_if_optimizer) or {}
        record.stepped_twice = replace(
            found,
            first_name=names.get(id(first)),
            second_name=names.get(id(second)),
            model_name=names.get(id(self._root)),
        )
        self._dispatcher.publish(self.rules.evaluate(record))

    def _sibling_idle(self, step: int) -> None:
        """One of the model's optimizers has not stepped once while its others took
        :data:`IDLE_PATIENCE` steps, and its parameters hold gradients (a sparse
        embedding's ``SparseAdam`` beside the dense ``Adam``, its ``step()`` forgotten).

        Gradients some backward wrote since the look before: a ``.grad`` merely
        left behind (a body frozen for a linear probe, the rest of the model
        first trained under an earlier optimizer or reached by one diagnostic
        backward) is no training. So its gradients are noted from
        :data:`IDLE_LOOK_AHEAD` steps, and judged against that note.
        """
        taken = self._steps_taken()
        stepping: set[int] | None = None  # parameters of the optimizers that step
        for index in range(len(self._optimizers)):
            if index in self._applied_at:
                continue
            since = self._attached_at.setdefault(index, taken)
            if since < 0:
                continue
            if taken - since < IDLE_LOOK_AHEAD:
                if stepping is None:
                    stepping = self._stepping_params()
                self._look_for_lost(index, step, stepping)
                continue
            self.lost_gradients.end(index)  # the longer wait takes over
            due = taken - since >= IDLE_PATIENCE
            if not due and index in self._sibling_seen:
                continue  # noted: judged when due
            if stepping is None:
                stepping = self._stepping_params()
            # Those another optimizer steps are updated (Adam first, L-BFGS later
            # over the same parameters): only the ones no stepping optimizer holds.
            # Frozen or not: Lightning's toggle_optimizer(opt_g) freezes the
            # discriminator's parameters around the generator's step, and a
            # gradient written since the last look on a parameter of an optimizer
            # that never stepped came from some backward all the same.
            own = [
                p
                for p in self.optimizer_params(index)
                if p.grad is not None and id(p) not in stepping
            ]
            seen = gradients_seen(own)
            before = self._sibling_seen.get(index, {})
            self._sibling_seen[index] = seen
            if not due:
                continue  # noted for the look that judges it
            held = fresh_gradients(own, before, seen)
            if not held:
                self._attached_at[index] = taken  # not trained now (a later phase's)
                continue
            self._attached_at[index] = -1  # told once
            self._sibling_seen.pop(index, None)
            self._tell_idle(step, index, held, taken - since)
        if step >= self._stopped_check_at:
            self._stopped_check_at = step + STOPPED_STEPPING // 4
            self._stopped_stepping(step)

    def _stepping_params(self) -> set[int]:
        """The parameters (by id) of the model's optimizers that have stepped."""
        return {
            id(p)
            for other in self._applied_at
            if other is not None
            for p in self.optimizer_params(other)
        }

    def _look_for_lost(self, index: int, step: int, stepping: set[int]) -> None:
        """Optimizer ``index`` has not stepped by ``step``, another one's: its own
        parameters' gradients looked at for ones thrown away unapplied (a forgotten
        ``critic_opt.step()``), from the first such step on, over the first
        :data:`IDLE_LOOK_AHEAD` (the longer wait takes over after them)."""
        watches = self.lost_gradients.by_index
        watch = watches.get(index)
        if watch is not None and watch.done:
            return  # ended: made once per optimizer
        # Those another optimizer steps are updated by it: only the ones no stepping
        # optimizer holds (frozen or not, as around the step of sibling_idle).
        own = [p for p in self.optimizer_params(index) if id(p) not in stepping]
        # Its writes are followed once it was idle at an earlier step too, or holds
        # gradients its step has not applied yet; a healthy loop's first iteration,
        # its backward and step after this one's, gets no hook.
        follow = watch is not None or any(p.grad is not None for p in own)
        if watch is None:
            watch = watches[index] = LostGradients(
                partial(weak_method(self._has_stepped, True), index),
                partial(weak_callback(self._gradients_lost), index, step),
            )
        watch.look(own, PROCESS_STEPS.taken - 1, follow)  # this step came after them

    def _has_stepped(self, index: int) -> bool:
        return index in self._applied_at

    def _gradients_lost(
        self, index: int, since_step: int, params: list[torch.Tensor], losses: int
    ) -> None:
        """Optimizer ``index``, idle since ``since_step``, let the loop throw away its
        parameters' gradients ``losses`` times (see LostGradients)."""
        since = self._attached_at.get(index, -1)
        if since < 0 or index in self._applied_at:
            return
        self._attached_at[index] = -1  # told once
        self._sibling_seen.pop(index, None)
        taken = self._steps_taken()
        self._guarded(
            "idle optimizer",
            self._tell_idle,
            since_step,
            index,
            params,
            taken - since + 1,
            None,
            losses,
        )

    def _stopped_stepping(self, step: int) -> None:
        """An optimizer of the model's stepped, then stopped for :data:`STOPPED_STEPPING`
        steps while others step, and parameters only it holds still get gradients:
        a second phase's optimizer built over part of the model (the head) while
        the rest still trains, never updated again.

        "Still get gradients" means written by some backward since the previous
        look: a ``.grad`` merely left behind (the first phase's head, which no
        later ``zero_grad()`` reaches) is no training. So an optimizer idle for
        :data:`STOPPED_LOOK_AHEAD` steps has its gradients noted one look before
        it is judged; an optimizer neither stale nor near it is not looked at.
        """
        applied_at = self._applied_at
        idle = [
            index
            for index, last in applied_at.items()
            if index is not None
            and step - last >= STOPPED_LOOK_AHEAD
            and index not in self._stopped_told
        ]
        seen_before = self._grads_seen
        self._grads_seen = {}
        for index in idle:
            # Parameters of the others that stepped lately are updated by them.
            recent = {
                id(p)
                for other, last in applied_at.items()
                if other is not None and other != index and step - last < STOPPED_STEPPING
                for p in self.optimizer_params(other)
            }
            if not recent:
                continue  # nothing steps now: the training paused, or ended
            own = [
                p
                for p in self.optimizer_params(index)
                if p.grad is not None and id(p) not in recent
            ]
            seen = self._grads_seen[index] = gradients_seen(own)
            if step - applied_at[index] < STOPPED_STEPPING:
                continue  # noted for the next look
            # Frozen or not: a gradient written since the last look came from a
            # backward all the same (Lightning's toggle_optimizer freezes the
            # discriminator around the generator's step, whose look this is).
            held = fresh_gradients(own, seen_before.get(index, {}), seen)
            if not held:
                continue
            self._stopped_told.add(index)
            self._grads_seen.pop(index, None)
            self._tell_idle(step, index, held, step - applied_at[index], applied_at[index])

    def _tell_idle(
        self,
        step: int,
        index: int,
        held: list[torch.Tensor],
        idle_steps: int,
        last_step: int | None = None,
        lost: int = 0,
    ) -> None:
        """Optimizer ``index`` left ``held`` unapplied for ``idle_steps`` steps (since
        ``last_step``, its last; None: it never stepped), ``lost``: their gradients
        thrown away that many times (0: not known)."""
        optimizer = self._optimizers[index]
        record = StepRecord(
            step=step,
            source="passes",
            optimizer=index,
            optimizer_class=type(optimizer).__name__,
        )
        record.not_optimized = [self.layers.info(p) for p in held if p in self.layers]
        record.idle_steps = idle_steps
        record.idle_optimizer = index
        record.idle_since = last_step
        record.idle_lost = lost
        names = self._guarded("caller names", names_in_caller, [optimizer], _inner_if_optimizer)
        record.idle_optimizer_name = (names or {}).get(id(optimizer))
        self._dispatcher.publish(self.rules.evaluate(record))

    def _frozen_output(self, found: FrozenOutput) -> None:
        """The output comes from frozen layers: told with the audit, or now when it was made."""
        record = self.setup.frozen_output_found(found)
        if record is not None:
            self._dispatcher.publish(self.rules.evaluate(record))

    def _publish_pass(self, record: StepRecord) -> None:
        """A forward pass found something on its own (an evaluation in training mode)."""
        self._dispatcher.publish(self.rules.evaluate(record))

    def optimizer_params(self, index: int) -> list[torch.Tensor]:
        """Every parameter of the optimizer's groups, in order, gathered in C."""
        return list(chain.from_iterable(map(_PARAMS, self._optimizers[index].param_groups)))

    def _end_loss_modes(self) -> None:
        """The loss is behind us: the function modes that followed it come off before
        the step's own reads. Under a mode every tensor attribute read (each
        gradient, twice) and every op of the per-layer norms is dispatched through
        it, and costs and keeps memory there."""
        look = self.class_targets
        if look is not None and look.listening:
            self._guarded("class target look", look.end_span)
        audit = self.behaviour.broadcast if self.behaviour is not None else None
        if audit is not None:
            self._guarded("broadcast audit", audit.stop)
        target = self.behaviour.output_target if self.behaviour is not None else None
        if target is not None:
            self._guarded("output target look", target.pause)

    def _take_padding(
        self, look: ClassTargetLook, record: StepRecord, pending: PendingStep
    ) -> None:
        """A sampled step's padding measurement: judged now, or read back with the step."""
        taken = self._guarded("class target look", look.take_padding)
        if taken is None:
            return
        found, figures = taken
        record.padded_labels = found
        if figures is not None:
            pending.padded_labels = pending.frame.add(figures)

    def gather(
        self,
        index: int | None,
        now: int,
        attach: bool = False,
        again: bool = False,
        closure: bool = False,
        at_backward_end: bool = False,
    ) -> PendingStep:
        """What the step about to apply its gradients needs read back, launched now.

        ``index``: the optimizer stepping (None: ``monitor.step()`` without one,
        already counted). ``now``: the monitor's step count. ``attach``: an
        optimizer being attached, not a step. ``again``: the step was gathered
        already (its gradients were reset since): no pass of it is missing.
        ``closure``: a step with a closure, gathered after ``step()`` returned.
        ``at_backward_end``: without an optimizer, the step boundary is where
        backward ended (``trainwatch run``), before the loop's update.
        """
        if LOSS_MODES:  # a sampled step: a list read, no call on the others
            self._end_loss_modes()
        if self.structure.changed():
            self.rebuild_layers()
        params = self.layers.parameters() if index is None else self.optimizer_params(index)
        record, grads = read_gradients(params, index, self.layers, self.tracker)
        if index is not None and not attach:
            optimizer = self._optimizers[index]
            record.same_weights = self._moved_none
            self._moved_none = _moves_none(optimizer)
            if not optimizer.state and index not in self.restarts.stateless:
                # No state at this boundary: a new optimizer, one that keeps none,
                # or one emptied since its last step (training started over).
                self._guarded("optimizer restarts", self._state_empty, index, now)
        passes = self.passes.passes
        if (
            grads
            and not attach  # gradients left from before watching came from no pass of ours
            and passes == self._passes_at_step
            and self._wrapper_search
            and not again
        ):
            # Gradients without a pass seen: compiled after watching, perhaps.
            self._wrapper_search -= 1
            wrappers = wrappers_of(self._root)
            for wrapper in wrappers:
                self.passes.hook(wrapper)
            if not wrappers:
                self.passes.widen()  # parts of the model called on their own
        self._passes_at_step = passes
        if record.missing and self.layers.outdated():
            # module.to() in overwrite mode swapped in new Parameter objects:
            # name them (and see whether any optimizer still holds the old ones).
            self.rebuild_layers()
            params = self.layers.parameters() if index is None else self.optimizer_params(index)
            record, grads = read_gradients(params, index, self.layers, self.tracker)
        pending = _new_pending_step(record)
        pending.params = params
        frame = pending.frame
        if self.tracker.left is not None and index is not None and not attach:
            # Noted off the usual step only: the first step, gradients not reset
            # in the usual place, several optimizers, a look at what a later
            # backward cancelled.
            record.rewritten_since_backward = (
                self._guarded("gradient reset check", self.tracker.rewritten_since_backward, params)
                is True
            )
            if self.tracker.wipes is not None:  # a step with several backward passes
                self._guarded("reset between backwards", self._judge_wipes, index, now, params)
            if self.tracker.follow_cancels and not again:
                self._guarded(
                    "other optimizer's backward", self._judge_cancels, index, now, params, frame
                )
            if record.present and (record.missing or self._leavings.listening):
                # Some gradient kept: did the loop drop the others backward made?
                self._guarded("dropped gradients", self._take_dropped, record, params)
            if self._leavings.listening:
                self._leavings.step_gathered()
            if self._backward_norms.listening:
                self._guarded("norms at backward's end", self._take_backward_norms, pending, params)
        if self.restarted:
            record.restarted_layers = frozenset(self.restarted)
            self.restarted.clear()
            if self.restarted_optimizers:
                record.restarted_optimizers = frozenset(self.restarted_optimizers)
                self.restarted_optimizers.clear()
            if self.stall is not None:
                self.stall.restart(now)  # a new phase, compared from its own first batch
            self._new_phase(now)
        manual = index is None
        if manual:
            if self.tracker.track_reached:
                known = self.layers.known()
                record.rewritten = frozenset(
                    known[id(p)].name for p in self.tracker.rewritten() if id(p) in known
                )
                if self.zeroed_updates is not None and (record.rewritten or at_backward_end):
                    # Gradients zeroed before monitor.step(), or trainwatch run's boundary:
                    # did the update since the last one apply zeros? (the first boundaries)
                    self._guarded(
                        "hand-written updates",
                        self._look_at_update,
                        now - 1,
                        at_backward_end,
                        record,
                    )
            behaviour = self.behaviour
            gradients = behaviour.eval_gradients if behaviour is not None else None
            if gradients is not None and gradients.in_backward:
                # A step ended at a backward's end (trainwatch run's hand-written
                # updates): what that backward's eval-mode passes found is this
                # step's, though their own end callback comes after this one.
                self._guarded("behaviour checks", behaviour.step_ends_in_backward)
        step_calls = self._step_calls
        if step_calls is not None and step_calls.following:
            record.calls_followed = step_calls.followed
            record.called_now, record.called_gradless = step_calls.take()
            record.calls_ran = frozenset(step_calls.ran)
            record.calls_held_by = step_calls.held_by
            if record.missing and step_calls.roots is not None:
                self._guarded("custom functions", self._custom_functions, record, params)
            step_calls.roots = None  # the step's graph is let go
        if record.missing:
            if not manual and not attach and self._copies_held.get(index) is not _NONE_HELD:
                # An EMA copy handed to its model's optimizer? (looked at once)
                self._guarded(
                    "copies in the optimizer", self._copy_held, index, now, record, params
                )
            if manual and len(record.missing) + record.frozen_count == len(params) and not attach:
                # No gradient anywhere and backward reached nothing: did the loop's
                # own update move the weights all the same?
                self._guarded(
                    "updates outside .grad", self._updated_without_grad, record, params, now
                )
            if not grads and index is not None and not attach:
                # No gradient at all: a batch skipped before its backward?
                record.skipped_batch = (
                    self._guarded("skipped batches", self._skipped_batch, index, now, closure)
                    is True
                )
            if not grads and passes and not attach and not record.skipped_batch:
                # No gradient at all: was the model called since this optimizer's last step?
                self._guarded("model not called", self._not_called, index, now, passes, record)
            if self._wiped_away and index is not None and not record.rewritten_since_backward:
                # Reached only by micro-batches zero_grad() wiped (told as
                # reset_between_backwards): no layer's story.
                away = self._wiped_away.get(index, frozenset())
                record.missing = [info for info in record.missing if info.name not in away]
            # Parameters without a gradient: under DDP the next iteration fails.
            record.never_called = self._calls.never_called()
            if step_calls is not None and step_calls.through_functions:
                record.through_functions = step_calls.through_functions
            if step_calls is not None and step_calls.cut_off:
                record.cut_off = frozenset(step_calls.cut_off)
            if self.probe is not None:
                # Was some output of the model left out of the loss this step?
                unreached = self._guarded("zero signal", self.probe.outputs_unreached)
                record.unreached_outputs = unreached or []
            if not self._distributed:  # asked once a process group is up, then kept
                self._distributed = runs_distributed(self.model)
            record.distributed = self._distributed
            # Gradients wiped between backward and the step say nothing of any layer.
            wiped = record.rewritten_since_backward and record.gradients_reset_after_backward()
            # (Not at a first boundary without gradients: those the loop's own update
            # moves are known at the next, and only the others are followed.)
            if (
                step_calls is not None
                and not attach
                and not wiped
                and not record.weights_unseen
                and not record.skipped_batch  # no layer went without a gradient: none ran
            ):
                self._guarded("step calls", self._follow_calls, index, record)
        elif step_calls is not None and self._missing_before.get(index) is not _NONE_MISSING:
            self._missing_before[index] = _NONE_MISSING
        info = self.layers.info
        if record.frozen:
            # Moved by the training code (a momentum encoder)? Watched over the
            # first boundaries only; decided, a dict lookup.
            moved = self._guarded(
                "frozen moves", self._frozen_moves.look, index, params, record.frozen
            )
            if moved is None:
                record.frozen_pending = True
            else:
                record.frozen_moved = moved
                if index is not None and EXTERNAL in map(_OWNER, record.frozen):
                    self._guarded(
                        "frozen outside the model", self._frozen_outside, record, index, params
                    )
            for param in params:
                if param.requires_grad:
                    owner = info(param).owner
                    record.trainable_by_module[owner] = record.trainable_by_module.get(owner, 0) + 1
        if not manual and self._reads_membership:
            unoptimized = self._unoptimized_params()
            if unoptimized:  # usually none: every parameter is some optimizer's
                graded = [p for p in unoptimized if p.grad is not None]
                trained = [p for p in graded if p.requires_grad] if graded else graded
                if self._checks_not_optimized and len(trained) < len(graded):
                    # Frozen at this step, their gradients written while they trained (a
                    # discriminator frozen for the generator's step): those an optimizer
                    # not given holds wait for its verdict as the trainable ones do, and
                    # none is told from here.
                    step = now if index is not None else now - 1  # monitor.step() counted
                    resting = [p for p in graded if not p.requires_grad]
                    self._guarded("updated elsewhere", self._not_held_back, step, [], resting)
                if self._checks_not_optimized and trained:
                    left = None
                    if self._check_accumulation:  # whose story a target part is
                        step = now if index is not None else now - 1  # monitor.step() counted
                        left = self._guarded(
                            "part copies",
                            self._tell_part_copies,
                            step,
                            record,
                            trained,
                            unoptimized,
                        )
                    told = trained if left is None else left
                    step = now if index is not None else now - 1  # monitor.step() counted
                    # Those an optimizer not given may train wait for its verdict.
                    held = self._guarded("updated elsewhere", self._not_held_back, step, told)
                    kept = told if held is None else held
                    record.not_optimized = [info(p) for p in kept]
                    frozen_unheld = self._frozen_unheld
                    if frozen_unheld:
                        record.unfrozen_unheld = frozenset(
                            info(p).name for p in kept if id(p) in frozen_unheld
                        )
                    # A target or reference part fed gradients trains no more for
                    # them: it stays a frozen part, kept in eval on purpose.
                    trained = told
                if trained and self.behaviour is not None:
                    self._guarded("behaviour checks", self.behaviour.got_gradients, trained)
        if self._audits_setup:
            # Counts the step has already made: a requires_grad flip, a param
            # group or a parameter added changes them. No call on a healthy step.
            signature = (
                len(params),
                len(record.frozen),
                record.frozen_count,
                len(self.layers.layers),
            )
            setup = self.setup
            if setup.signatures.get(index) != signature:
                if index in setup.signatures and (index, signature) not in self._setups_seen:
                    # Parameters frozen or unfrozen into a setup not trained before: a
                    # new phase (a loop toggling between two setups re-arms no more).
                    self._new_phase(now)
                self._setups_seen.add((index, signature))
                setup.signatures[index] = signature
                setup.due = True
                frozen_now = {info.name: info for info in record.frozen}
                before = setup.frozen_names.get(index)
                if before:
                    # Frozen parameters trainable again (a warm-up freeze undone).
                    record.unfrozen = [p for name, p in before.items() if name not in frozen_now]
                setup.frozen_names[index] = frozen_now
                if self.behaviour is not None:
                    self._guarded("behaviour checks", self.behaviour.parameters_changed)
            if not attach:
                if setup.due:
                    step = now - 1 if manual else now
                    self._guarded("setup audit", self.audit_setup, step)
                if index in setup.reach_due and not record.gradients_reset_after_backward():
                    # A backward ran: it reached the model's output, or a loss was
                    # handed over (Lightning, whose module's own forward may never run).
                    ran = self.tracker.backward_seen or self.loss is not None
                    step = now - 1 if manual else now
                    self._guarded(
                        "setup audit",
                        setup.check_reach,
                        record,
                        index,
                        step,
                        ran,
                        len(self._optimizers),
                    )
        stall = self.stall
        step = now if index is not None else now - 1  # monitor.step() counted it
        if stall is not None and (step < stall.loss_until or step >= stall.look_from):
            # One of its sampled steps (plain attributes: no call on the others).
            found = self._guarded("stalled training", stall.sample, record, params, step)
            if found is not None:
                pending.stall_due, pending.weights_before = found
            if step >= stall.rates_due and not attach:
                self._guarded("stalled training", self._read_rates, record, index, step)
        probe = self.probe
        entering = _NO_ENTERING
        if probe is not None and probe.on_the_spot:
            # The gradient that entered the model in the backward the step uses (the
            # probe's reference, read as an attribute: no call) rides with the
            # gradients' norms, in the same kernel: a NaN/Inf the loss sent in turns
            # them non-finite even where the model's own ReLU kept it from every
            # parameter.
            entering = probe._this_pass.grad_entering
            # An output backward did not reach (rare). By identity, in C: `None in`
            # would compare each tensor with None, a TypeError raised and caught
            # inside torch for each (tens of microseconds a step).
            if not all(map(_IS_TENSOR, entering)):
                entering = list(filter(_IS_TENSOR, entering))
        norms = self._small_norms.norms(record, grads, entering) if grads else None
        if manual and self._check_accumulation and self.tracker.enabled:
            # No optimizer marks the update: the weights' norms show whether one ran.
            weights, names = self._hand_updates.watched(self.layers)
            pending.weights = (names, frame.add(weight_norms(weights)))
        listed = self._locate_if_off(norms, entering)
        if listed and probe is not None and 0.0 in listed:
            own = listed[: len(listed) - len(entering)]  # the parameters' norms
            if not any(own):
                # Every gradient exactly zero (rare; read on the host already): did
                # the loss send anything into the model at all?
                no_signal = self._guarded("zero signal", probe.entering_all_zero)
                record.no_signal = no_signal is True
            elif 0.0 in own:
                # Some exactly zero: did some output of the model get none (a task
                # whose loss weight is 0 for now)?
                silent = self._guarded("zero signal", probe.outputs_without_signal)
                record.silent_outputs = silent or []
        if norms is not None:
            pending.norms = frame.add(norms, listed)
            pending.norm_tensor = norms
            # Read back with the parameters' norms, and dropped as read.
            pending.entering_norms = len(entering)
        if self._check_accumulation:
            record.accumulation_method = "monitor.step" if manual else "optimizer_step"
            record.used_at = self._applied_at.get(index)
            flags = []
            for param, content in self.tracker.suspects(params):
                if self.tracker.perturbed(param):
                    # Used by moving the weights between two backward passes (SAM).
                    record.accumulation_method = "perturbation"
                slot = None
                if content is not None:
                    slot = len(flags)
                    flags.append(content.reshape(1))
                pending.suspects.append((info(param), slot))
            if flags:
                pending.suspect_flags = frame.add(torch.cat([f.to(flags[0].device) for f in flags]))
        if probe is not None and probe.enabled:
            window = probe.take()
            pending.window = window
            if (
                window.sums is not None
                or window.grad_sums is not None
                or window.skipped is not None
            ):
                for name in ("sums", "grad_sums", "skipped"):
                    tensor = getattr(window, name)
                    if tensor is not None:
                        pending.window_slots[name] = frame.add(tensor)
        if self.scaler is not None:
            scale = self._guarded("loss scale", scale_tensor, self.scaler)
            if scale is not None:
                pending.scale = frame.add(scale)
        look = self.class_targets
        if look is not None and look.listening:  # a sampled step
            counts = self._guarded("class target look", look.take)
            if isinstance(counts, torch.Tensor):
                pending.class_counts = frame.add(counts)
            record.class_targets = ClassTargets(
                counts if isinstance(counts, list) else [],
                look.per_position,
                self.data_order,
                self.own_batching,
            )
            if look.measured:  # the labels a token loss gives padding
                self._take_padding(look, record, pending)
        if self.behaviour is not None:
            pending.behaviour = self._guarded(
                "behaviour checks", self.behaviour.gather, record, frame
            )
            if now >= self._audit_at:
                self._guarded("broadcast audit", self._rearm_audit, now, record)
        if isinstance(self.loss, torch.Tensor):
            pending.loss = frame.add(self.loss.reshape(-1)[:1])
        elif self.loss is not None:
            record.loss = self.loss
        self.loss = None
        if self.late_loss is not None:
            late_step, value = self.late_loss
            if isinstance(value, torch.Tensor):
                pending.late_loss = (late_step, frame.add(value.reshape(-1)[:1]))
            else:
                pending.late_loss = (late_step, value)
            self.late_loss = None
        return pending

    def hand_loss_again(self, pending: PendingStep | None) -> None:
        """The loss ``pending`` took as it was gathered, handed over again for the
        gathering that replaces it (the step's gradients were reset since the clip
        it was gathered before): without it that step, and stalled_training's
        look at the loss, would go without the loss the loop handed over."""
        if pending is None or self.loss is not None:
            return
        if pending.loss is not None:
            self.loss = pending.frame.piece(pending.loss)
        else:
            self.loss = pending.record.loss

    def evaluate(self, pending: PendingStep, steps_end_at_backward: bool = False) -> list[Alert]:
        """The step read back, as a record, judged by the rules (and the numbers to the sinks)."""
        record = pending.record
        if pending.norms is not None:
            record.param_norms = pending.norms.values()
            if pending.entering_norms:
                del record.param_norms[-pending.entering_norms :]
            if record.layout is not None:
                per_layer, total = record.layout.layer_norms(record.param_norms, self.layers.layers)
            else:
                per_layer, total = layer_norms(
                    record.present, record.param_norms, self.layers.layers
                )
            record.layer_norms, record.total_norm = per_layer, total
            if self.whole is None:
                self.latest_by_source[record.optimizer] = per_layer
                self.total_norm = total
            else:  # shard norms, for the rules; the whole layers' come at the cadence
                record.sharded = True
                self.whole.note(record)
        if pending.loss is not None:
            record.loss = pending.loss.value()
        scale = pending.scale.value() if pending.scale is not None else None
        if pending.window is not None or pending.param_norms is not None:
            self.judge.judge(
                record,
                pending.window,
                # (none: the empty dict itself, made for nothing new)
                pending.window_slots
                and {name: slot.values() for name, slot in pending.window_slots.items()},
                pending.checked_params,
                pending.param_norms.values() if pending.param_norms is not None else [],
                self.probe.modules if self.probe is not None else list,
                self._dispatcher.reported,
                self.layers.info,
            )
        elif record.loss is not None:
            self.judge.judge(record, None, {}, [], [], list, self._dispatcher.reported)
        if scale is not None and (scale < 1.0 or record.amp is not None):
            record.amp = record.amp or AmpReport(0, self.judge.passes_per_step)
            record.amp.scale = scale
        if self.probe is not None:
            self.probe.passes_worth_a_look = (
                self.config.amp_skipped_steps.patience * self.judge.passes_per_step
            )
        if self.behaviour is not None and pending.behaviour is not None:
            self._guarded("behaviour checks", self.behaviour.land, record, pending.behaviour)
        if record.class_targets is not None:  # a sampled step
            if pending.class_counts is not None:
                record.class_targets.counts = pending.class_counts.values()
            if pending.padded_labels is not None:
                record.padded_labels = self._guarded(
                    "class target look",
                    self.class_targets.land_padding,  # type: ignore[union-attr]
                    pending.padded_labels.values(),
                )
        if pending.suspects:  # (the record's own list stays empty on the usual step)
            flags = pending.suspect_flags.values() if pending.suspect_flags is not None else []
            record.accumulated = [
                info for info, slot in pending.suspects if slot is None or flags[slot] > 0.0
            ]
        if pending.weights is not None:
            # Several backward passes onto the same gradients are accumulation
            # unless the weights changed in between.
            names, slot = pending.weights
            stale = record.accumulated
            hand = self._hand_updates
            record.accumulated = hand.keep_moved(
                stale, names, slot.values(), steps_end_at_backward, record.step
            )
            if record.accumulated and steps_end_at_backward:
                record.accumulated_since = hand.suspected_since
            if record.accumulated:
                self._name_the_copy(record)
            if (
                hand.never_moved is not None
                and self._checks_not_optimized
                and (hand.never_moved >= NEVER_MOVED or self._left_out_whole(hand, stale))
                and self._never_updated(record, stale)
            ):
                hand.never_moved = None  # told once
        sharded = self.whole is not None
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
        alerts = self.rules.evaluate(record)
        if late is not None:
            alerts.extend(self.late_loss_alerts(*late))
        return alerts

    def unfinished_alerts(self, step: int) -> list[Alert]:
        """What the passes of a step that never reached its boundary found.

        A loop that stops on a NaN itself (``if not torch.isfinite(loss):
        raise``), or that a NaN makes fail (a distribution refusing NaN
        logits), never steps its optimizer: the origin its forward found
        would wait for a boundary that does not come. Asked at close.
        """
        probe = self.probe
        if probe is None or not probe.enabled or not probe.found_in_step():
            return []
        if probe.at_step:
            probe.settle(None)  # the waiting passes' one scalar, and a replay if bad
        return self._window_alerts(probe.take(), step)

    def _window_alerts(
        self, window: StepWindow, step: int, record: StepRecord | None = None
    ) -> list[Alert]:
        """What a window of passes no step boundary will judge found (read back now).
        ``record``: the step's own, where one applies them (else none followed)."""
        values = {
            name: tensor.reshape(-1).float().tolist()
            for name in ("sums", "grad_sums", "skipped")
            if (tensor := getattr(window, name)) is not None
        }
        if record is None:
            record = StepRecord(step=step, source="passes")
        self.judge.judge(
            record,
            window,
            values,
            [],
            [],
            self.probe.modules if self.probe is not None else list,
            self._dispatcher.reported,
            self.layers.info,
        )
        return self.rules.evaluate(record)

    def late_loss_alerts(self, step: int, value: float | None) -> list[Alert]:
        """A loss handed over after its optimizer step, judged with the next one."""
        if value is None or math.isfinite(value):
            return []
        if knock_on(self._dispatcher.reported):
            return []  # a NaN already reported upstream explains it
        record = StepRecord(step=step, source="loss", loss=value)
        record.nonfinite_loss = NonfiniteReport(module=None, cause="value")
        return self.rules.evaluate(record)

    def audit_optimizer(self, index: int) -> None:
        """Checks that need no gradients, made when an optimizer is attached.

        An optimizer whose parameters are all frozen now is judged at its own
        first step instead: it was found while another one's update runs
        (Lightning's ``toggle_optimizer`` freezes every parameter but that
        optimizer's), which says nothing of its own.
        """
        # Attached between a step's backward and its step() (`trainwatch run` attaches
        # an optimizer at its first step, a new phase's mid-run): what the step's passes
        # left (the NaN/Inf window, the passes counted) is that step's, judged at its own
        # boundary, which follows.
        probe = self.probe
        kept = probe.keep() if probe is not None else None
        passes_at_step = self._passes_at_step
        try:
            pending = self.gather(index, self._step_count(), attach=True)
        finally:
            self._passes_at_step = passes_at_step
            if kept is not None:
                probe.resume(kept)
        self.setup.due = True  # a new optimizer: which one holds what changed
        frozen = pending.record.frozen
        if frozen and not pending.record.present and not pending.record.missing:
            frozen = []  # every parameter frozen: toggled off, for now
        record = StepRecord(
            step=self._step_count(),
            source="attach",
            optimizer=index,
            optimizer_class=type(self._optimizers[index]).__name__,
            frozen=frozen,
            frozen_pending=pending.record.frozen_pending,
            frozen_moved=pending.record.frozen_moved,
            frozen_outside=pending.record.frozen_outside,
            trainable_by_module=pending.record.trainable_by_module,
            restarted_layers=pending.record.restarted_layers,
        )
        self._dispatcher.publish(self.rules.evaluate(record))

    def audit_setup(self, step: int) -> None:
        """The setup table to the sinks, and its rule's verdict on optimizer coverage."""
        audit, record = self.setup.audit(step, self._root, self._optimizers)
        if audit.revision and self._output_look is not None:
            # The first setup's passes were looked at since attach; a changed one's are next.
            self._output_look.arm()
        if self.config.trainable_parameters.table:
            shown = table_content(audit)
            if shown != self._table_shown:
                # (An optimizer built anew each epoch, over the same parameters, in
                # place of the last: the same table again, not shown again.)
                self._table_shown = shown
                self._dispatcher.setup(audit)
        self._dispatcher.publish(self.rules.evaluate(record))

    def _frozen_outside(self, record: StepRecord, index: int, params: list[torch.Tensor]) -> None:
        """The optimizer's frozen parameters outside the model, sorted for the rule.

        One that another monitor holding this optimizer watches in its own model
        is that monitor's to judge: under ``trainwatch run`` a loss module with a
        parameter becomes a model of its own, and each model's monitor sees the
        other's parameters in the shared optimizer. One no such monitor watches
        (a loss module's parameter beside the model's under ``tw.watch``, a bare
        tensor) is judged by one monitor of those holding the optimizer (see
        trainwatch.outside_owners), and named once, by the module holding it or by
        its place in the optimizer: its placeholder counter says nothing.
        """
        optimizer = self._optimizers[index]
        frozen = (p for p in params if not p.requires_grad)  # in the order of record.frozen
        told: dict[str, str | None] = {}
        unnamed = []
        loose_ours: bool | None = None  # asked on the first loose one
        for info, param in zip(record.frozen, frozen):
            if info.owner != EXTERNAL:
                continue
            if watched_by_another(param, optimizer):
                told[info.name] = None
                continue
            if loose_ours is None:
                loose_ours = tells_loose(self.layers, optimizer)
            if not loose_ours:
                told[info.name] = None
            elif info.name in self._outside_names:
                told[info.name] = self._outside_names[info.name]
            else:
                unnamed.append((info.name, param))
        if unnamed:
            found = names_outside([param for _, param in unnamed])
            for name, param in unnamed:
                named = found.get(id(param)) or _place_in(optimizer, param)
                told[name] = self._outside_names[name] = named
        record.frozen_outside = told

    def _outside_told_elsewhere(self, index: int | None) -> frozenset[str]:
        """The names of optimizer ``index``'s parameters outside the model whose
        gradient norms another monitor tells (see trainwatch.outside_owners): a head
        ``trainwatch run`` watches as a model of its own, beside this model in one
        optimizer, is that monitor's layer, not this one's ``<outside the model>``.
        Asked as a new set of parameters with gradients is met, and once who
        watches what changed."""
        if index is None or index >= len(self._optimizers):
            return frozenset()
        found = self._guarded(
            "outside parameters", told_elsewhere, self.layers, self._optimizers[index]
        )
        return found if found is not None else frozenset()

    def _unoptimized_params(self) -> list[nn.Parameter]:
        # What membership depends on, in C loops: each group's list of
        # parameters (replaced or grown in place) and the layer map.
        lists = list(map(_PARAMS, chain.from_iterable(map(_GROUPS, self._optimizers))))
        key = (id(self.layers), *map(id, lists), *map(len, lists))
        if key != self._membership_key:
            held = {
                id(p) for opt in self._optimizers for g in opt.param_groups for p in g["params"]
            }
            self._unoptimized = [p for p in self.layers.parameters() if id(p) not in held]
            self._membership_key = key
            # Frozen now, or seen frozen at an earlier look and held by none since.
            # (Lightning's toggle_optimizer freezes only parameters some optimizer
            # holds: one the monitor does not know yet leaves this list once known.)
            before = self._frozen_unheld
            self._frozen_unheld = {
                id(p) for p in self._unoptimized if not p.requires_grad or id(p) in before
            }
            if self.behaviour is not None:
                self._guarded("behaviour checks", self.behaviour.held_by_none, self._unoptimized)
            if self._checks_not_optimized:
                self._guarded("double steps", self._look_for_double_steps)
        return self._unoptimized

    def rebuild_layers(self) -> None:
        """The model's tree changed (a module or parameter was (re)assigned or replaced)."""
        layers = LayerMap(self._root, previous=self.layers)
        fresh = [p for p in layers.parameters() if p not in self.layers]
        if fresh and self._steps_taken():
            # A head replaced (same name, new parameters) or added after steps
            # were taken: the model computes something new, and every layer's
            # gradients flow through it. Their history starts over.
            self.restarted.update(layers.layers)
        if self._tracks_calls:
            self._calls.track(self._root, layers.layers)
            self._calls.listen(self.passes)
        self.layers = layers
        if self._step_calls is not None:
            self._step_calls.forget_explained()  # the layers may be other ones now
        self.tracker.attach(fresh)
        self._claim(fresh)
        if self.probe is not None:
            self.probe.find_device(self._root)
        if self.batch_norm_batches is not None:
            self._follow_batch_norm()  # the layer may be another one now

    def _follow_batch_norm(self) -> None:
        """Hear the model's passes for their batch sizes while it holds batch norm."""
        look = self.batch_norm_batches
        if look is None:
            return
        holds, listens = look.find(self._root), self.passes.listens(look)
        if holds and not listens:
            self.passes.subscribe("batch norm batches", look, starts=False)
        elif listens and not holds:
            self.passes.unsubscribe(look)

    def _state_empty(self, index: int, now: int) -> None:
        """The optimizer's state is empty at step ``now``'s boundary: a restart when
        it kept state after its previous step."""
        if self.restarts.emptied(index, now, self._applied_at.get(index)):
            self.restart_optimizer(index)

    def optimizer_loaded(self, index: int) -> None:
        """``load_state_dict`` ran on a watched optimizer: a restart when it took the
        optimizer back to an earlier state after it stepped here."""
        optimizer = self._optimizers[index]
        stepped = index in self._applied_at
        rewritten = partial(self._weights_rewritten, index)
        if self.restarts.loaded(index, optimizer, stepped, rewritten):
            self.restart_optimizer(index)

    def _weights_rewritten(self, index: int) -> bool:
        """Every weight the optimizer trains was written in place (or given a new
        storage) since the last update left it: a model's ``load_state_dict``,
        ``reset_parameters()``. False when that is not known (no probe)."""
        if self.probe is None:
            return False
        params = self.optimizer_params(index)
        written = self.probe.written_each(params)
        return bool(params) and written is not None and all(w is True for w in written)

    def restart_optimizer(self, index: int) -> None:
        """Training starts over with this optimizer (a new fold or trial reusing it):
        at the next step the layers it trains begin a new phase, as under a new
        optimizer, and its warm-up checks start over as at a run's start."""
        info = self.layers.info
        self.restarted.update(info(p).owner for p in self.optimizer_params(index))
        self.restarted_optimizers.add(index)

    def trial_begins(self) -> None:
        """A tuner's trial steps begin (see trainwatch/tuner_trials.py): the setup
        audit and the table shown, as they stand, for ``trial_over``."""
        self._setup_before_trial = (self.setup.latest, self._table_shown)

    def trial_over(self) -> None:
        """A tuner's trial steps ended, undone: the fit's next step begins a phase
        for every optimizer, as after a restart, so no warm-up or gradient history
        carries the trials' divergence over; and the setup is audited again there,
        its table shown (unless shown before them) as if the trials' audits, which
        went nowhere, never were."""
        for index in range(len(self._optimizers)):
            self.restart_optimizer(index)
        before, self._setup_before_trial = self._setup_before_trial, (None, None)
        self.setup.latest, self._table_shown = before
        self.setup.due = True

    def _new_phase(self, now: int) -> None:
        """A new phase of training (a new optimizer, a part of the model replaced,
        parameters frozen or unfrozen) may bring a new loss: the broadcast audit
        runs its first steps again, armed at this step's boundary. It may bring
        batches of another make too: the padding look comes at the next step (the
        monitor subscribes it as it turns to that step)."""
        look = self.class_targets
        if look is not None:
            self._guarded("class target look", look.look_soon)
        if self._audits:
            self._phase_began = True
            self._audit_at = min(self._audit_at, now)

    def _rearm_audit(self, now: int, record: StepRecord) -> None:
        """Arm the broadcast audit for the steps after this one: ``audit_steps`` of
        a new phase, one sampled step (a loss changed with no other sign), or the
        next while layers that joined the loss unaudited wait for their next gradient,
        or a loss of a new kind waits for its audit."""
        behaviour = self.behaviour
        section = self.config.broadcast
        if self._phase_began:
            self._phase_began = False
            behaviour.rearm_audit(section.audit_steps, phase=True)
        if now >= self._sample_at:
            behaviour.rearm_audit(1, phase=False)
            while self._sample_at <= now:
                step = self._sample_at + 1
                self._sample_at += min(step, section.recheck_every)
        self._audit_at = self._sample_at
        joins = self._joins
        if joins is not None and joins.waiting and joins.keep_armed(record.present, now):
            behaviour.rearm_audit(1, phase=False)
            self._audit_at = now  # asked again at the next boundary
        kinds = self._kinds
        if kinds is not None and kinds.waiting is not None:
            if kinds.keep_armed(now):
                behaviour.rearm_audit(1, phase=False)
                self._audit_at = now
            elif kinds.exhausted:
                self._stop_reading_kinds()

    def _loss_kind(self, roots: Sequence[torch.Tensor], after: int, audited: bool) -> None:
        """A step's loss reached ``backward`` (from ``roots``; the nodes of its passes
        are numbered up to ``after``): its kind is read, and a new one the audit did
        not follow has the audit armed from the next step, until a step with that
        kind is audited."""
        kinds = self._kinds
        if kinds is None:
            return
        kind = self._guarded("loss kind", loss_kind, roots, after)
        if kind is None:  # failed (told): no more kinds read
            self._stop_reading_kinds()
        elif kinds.seen(kind, audited):
            self._audit_at = 0  # at this boundary: whatever step it is
        elif kinds.waits_left <= 0 and kinds.exhausted:
            self._stop_reading_kinds()

    def _stop_reading_kinds(self) -> None:
        """The run's waits are spent (or reading one failed): the look and the audit
        stop handing losses over, and the look slows down as it would without."""
        self._kinds = None
        if self.class_targets is not None:
            self.class_targets.read_loss_kinds(None)
        if self.behaviour is not None:
            self.behaviour.read_loss_kinds(None)

    def _new_layout(self, present: list[ParamInfo]) -> None:
        """Gradients reached a new set of parameters (told before the step's audit
        ends): a layer joining the loss on a step the audit did not watch has the
        audit armed from the next step, until it gets a gradient again."""
        joins = self._joins
        if joins is None:
            return
        audit = self.behaviour.broadcast
        audited = audit is not None and audit.live
        if self._guarded("broadcast audit", joins.new_layout, present, audited):
            self._audit_at = 0  # at this boundary: whatever step it is
        if joins.exhausted:
            self._joins = None
            self._small_norms.on_new_layout = None

    @property
    def looks_at_padding(self) -> bool:
        """Whether the labels a token loss gives padding are looked at (loss_on_padding)."""
        look = self.class_targets
        return look is not None and look.padding is not None

    def batches_may_change(self) -> None:
        """Between steps: the training data starts a new pass (an epoch, another
        loader), whose batches may be of another make (a collate of its own): the
        padding look comes at the next step."""
        look = self.class_targets
        if look is not None and self._guarded("class target look", look.look_soon):
            self._guarded("class target look", self.listen_for_targets, look)

    def listen_for_targets(self, look: ClassTargetLook) -> None:
        """Only the passes of sampled steps reach the look: others pay nothing for it."""
        due = self._step_count() % look.every == 0 and not look.finished and not look.broken
        if due and not look.listening:
            self.passes.subscribe("class target look", look)
        elif look.listening and not due:
            self.passes.unsubscribe(look)
        look.listening = due


def _inner_if_optimizer(value: Any) -> Any:
    """The optimizer a wrapper the training code holds trains (Lightning's ``opt_g``)."""
    return inner_optimizer(value) if isinstance(value, Optimizer) else value


def _group_rate(group: dict[str, Any]) -> float:
    """A param group's learning rate; NaN where it is no plain number (a tensor,
    which a GPU would have to be waited on to read)."""
    rate = group.get("lr")
    return float(rate) if isinstance(rate, (int, float)) else math.nan


def _place_in(optimizer: Optimizer, param: torch.Tensor) -> str:
    """Where a tensor no module holds sits in the optimizer, and its shape."""
    for g, group in enumerate(optimizer.param_groups):
        for i, held in enumerate(group["params"]):
            if held is param:
                return f"param_groups[{g}]['params'][{i}] of shape {tuple(param.shape)}"
    return f"a tensor of shape {tuple(param.shape)}"


def _moves_none(optimizer: Optimizer) -> bool:
    """Every group's learning rate exactly 0 (a warm-up from 0, at its first step).

    A tensor learning rate is not read (that would sync a device): it counts
    as moving. Returns at the first group with a rate, at once on the usual step.
    """
    for group in optimizer.param_groups:
        rate = group.get("lr")
        if (type(rate) is not float and type(rate) is not int) or rate != 0:
            return False
    return True


def _still_updated(alert: Alert) -> bool:
    """A not_optimized finding of weights that do move (an optimizer the monitor was
    not given, a hand-written update): it leaves a stall of theirs to be told."""
    return str(alert.data.get("kind", "")).startswith("unwatched")
