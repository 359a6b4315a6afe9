"""Watches every model and optimizer a script creates, without touching the script.

PyTorch's global hooks make this possible. A module called while no other
module is running is a model: it gets a Monitor as that first call starts,
and alert names are relative to it; optimizers that already hold its
parameters join at once. An optimizer is found at its first ``step()`` (the
global pre-step hook runs before the per-instance hooks, so a monitor attached
there still sees that first step) and joins the monitor of every model whose
parameters it holds. A model nobody builds an optimizer for is trained by
hand: its steps end where a backward pass that reached it ends.

The global hooks cost a few microseconds per module call; they are removed by
:meth:`AutoWatch.close`.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from trainwatch import dispatch, loader_hook, registry, termination
from trainwatch.alert import Alert, standing_worst
from trainwatch.callers import called_from
from trainwatch.child_processes import ChildProcesses
from trainwatch.collect import quiet
from trainwatch.collect.loose_training import FrozenModelLooks
from trainwatch.compiled import (
    CompiledHookWarning,
    compiling,
    transform_level,
    unwrap,
    user_name,
)
from trainwatch.config import Config
from trainwatch.dispatch import Dispatcher
from trainwatch.errors import TrainingHealthError
from trainwatch.held import held_only_by
from trainwatch.late_models import NoGradLookout
from trainwatch.layers import EXTERNAL
from trainwatch.model_names import class_name, unique_name
from trainwatch.monitor import Monitor
from trainwatch.optimizer_wrappers import inner_optimizer, takes_step_hooks
from trainwatch.overwrite_conversion import conversion_between, overwrite_mode
from trainwatch.patches import MethodPatch
from trainwatch.record import LooseTraining, ReplacedModel
from trainwatch.relay import RelaySink
from trainwatch.replaced_part import replaced_part
from trainwatch.setup_audit import SetupAudit, table_content
from trainwatch.sinks import AlertTally, ConsoleSink, JsonlSink, Sink, StepNumbers, Summary
from trainwatch.store_relay import RankZeroReceiver, StoreLink

# The model label of alerts raised by the script's own tw.watch or callback.
_SCRIPTS_OWN = "(script's own monitor)"
# Steps after which, every model found training with an optimizer (or never
# trained at all), the global forward hooks come off.
_SETTLED_AFTER = 2
# Said at the end of a run in which no step was watched, rather than nothing at all.
_NOTHING_WATCHED = (
    "trainwatch: no training step watched: no optimizer stepped and no backward pass "
    "reached a model during the run (gradients taken outside .grad, with torch.func or "
    "autograd.grad, and applied by hand are watched with tw.watch(model) and "
    "monitor.step() after each update)"
)
# Said instead where backward passes reached models paired with optimizers, none of
# which stepped (manual optimisation that never calls opt.step()): tw.watch's note.
_NEVER_STEPPED = (
    "trainwatch: no training step watched: {ran} and backward passes reached {them}, "
    "but {their} never stepped"
)
# Said instead where optimizers stepped nonetheless, over parameters of no model watched.
_STEPPED_UNWATCHED = (
    "trainwatch: no training step watched: {which} stepped {steps} {times}, but over "
    "parameters of no model found training"
)
# Steps of an optimizer whose parameters no model of ours holds after which its
# model is looked for by its parameters (one called only inside torch.func).
_PENDING_STEPS = 2
# Steps of an optimizer over no model of ours, past its first, after which a model
# found holding an optimizer that has not stepped meanwhile is looked at for being
# the one it should train (see AutoWatch._unpair_idle).
_IDLE_PAIRING_STEPS = 1
# Steps of a model's optimizer, stepping while the model is no longer called,
# through which the model replacing it is looked for (the forward hooks kept on).
_REPLACEMENT_WAIT = 50
# Steps of a hand-trained model at which an optimizer stepping the model it
# replaced is looked for (see AutoWatch._look_for_replaced).
_REPLACED_LOOKS = 20
# The share of a model's trainable parameters, by count and by size, that an
# optimizer stepping none of them must match by shape to be taken for the one
# built over the model it replaced: a copy matches them all.
_FITTING_SHARE = 0.5
# Optimizers over no model of ours, met while the forward hooks are off, whose
# model is looked for in the heap at their first step. Each later one waits for
# its model's next call (a loop building a model copy and an optimizer per
# task, as Reptile does, would otherwise scan the heap per task).
_SEARCHES_AT_FIRST_STEP = 4
# Steps of the models watched through which an optimizer built over parameters no
# model of ours holds keeps the forward hooks on for its model's first call.
_BUILT_WAIT = 2
# Scans for the model holding a module called on its own, whose optimizer holds
# more than that module, that may find none (see AutoWatch._holder_called_through).
_PART_SEARCHES = 4


class StopRun(BaseException):
    """Raised from a hook when ``max_steps`` is reached; the runner catches it.

    A BaseException, so a script's ``except Exception`` does not swallow it.
    """


class _ModelView(Sink):
    """One model's monitor feeding the run's shared sinks, tagged with the model."""

    name = "run"

    def __init__(self, owner: AutoWatch, model_name: str) -> None:
        self.owner = weakref.ref(owner)
        self.model_name = model_name
        self.summary: Summary | None = None
        self.monitor: weakref.ref[Monitor] | None = None
        # The models set up like this one (decided at its first alert or table),
        # and the name its alerts are counted under (see _Family).
        self.family: _Family | None = None
        self.tally_name: str | None = None
        # The reference counts of its model and optimizers when last found held
        # by the script (see _dropped).
        self.held_at: tuple[int, ...] = ()
        # The run's steps before this model's own count began: those of the models
        # it came after (an earlier fold's, an earlier stage's). Its count goes on
        # from that of a model it replaced instead (see AutoWatch.steps).
        self.start = 0

    def emit(self, alert: Alert) -> None:
        owner = self.owner()
        if owner is not None:
            owner._view_emitted(self, [self._tag(alert)])

    def emit_many(self, alerts: Sequence[Alert]) -> None:
        owner = self.owner()
        if owner is not None:
            owner._view_emitted(self, [self._tag(alert) for alert in alerts])

    def repeat(self, alert: Alert, count: int) -> None:
        owner = self.owner()
        if owner is not None:
            owner._view_repeated(self, self._tag(alert), count)

    def on_step(self, numbers: StepNumbers) -> None:
        owner = self.owner()
        if owner is not None:
            owner._each_sink("on_step", lambda s: s.on_step(numbers))

    def setup(self, audit: SetupAudit) -> None:
        owner = self.owner()
        if owner is not None:
            owner._view_setup(self, dataclasses.replace(audit, model=self.model_name))

    def close(self, summary: Summary) -> None:
        self.summary = summary

    def _tag(self, alert: Alert) -> Alert:
        return dataclasses.replace(alert, data={**alert.data, "model": self.model_name})


class _Family:
    """The models of a run set up alike (see _setup_key): a meta-learning loop's
    per-task copies, once one of them was dropped (``dropped``). Then a later
    member's alert already told for the family is counted under the first
    member's name (``name``), not told again, and its setup table, the same as
    one shown, is not printed: the tables shown, by their content, with how many
    models were set up like each since (``alike``)."""

    __slots__ = ("name", "dropped", "shown", "alike", "noted")

    def __init__(self, name: str) -> None:
        self.name = name
        self.dropped = False
        self.shown: dict[str, SetupAudit] = {}
        self.alike: dict[str, int] = {}
        self.noted = False


def _setup_key(monitor: Monitor) -> tuple[Any, ...]:
    """What two models set up alike share: the class, each parameter's name, shape,
    dtype and ``requires_grad``, and each optimizer's class, hyperparameters and
    parameters (by their place in the model). A meta-model and its per-task copies
    differ in their optimizers (Adam against SGD, or their learning rates)."""
    root = unwrap(monitor.model)
    params = list(root.named_parameters())
    place = {id(p): i for i, (_, p) in enumerate(params)}
    shapes = tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in params)
    optimizers = tuple(
        (
            type(optimizer).__name__,
            tuple(
                (
                    tuple(place.get(id(p), -1) for p in group["params"]),
                    tuple(sorted((k, repr(v)) for k, v in group.items() if k != "params")),
                )
                for group in optimizer.param_groups
            ),
        )
        for optimizer in monitor.optimizers
    )
    return type(root).__name__, shapes, optimizers


def _dropped(monitor: Monitor, view: _ModelView) -> bool:
    """Whether the script holds neither the monitor's model nor any of its optimizers:
    every reference left to them is the monitor's own (see trainwatch.held). One
    found held is looked at again only once their reference counts have changed
    (the meta-model, held throughout, is walked once)."""
    targets = _distinct(monitor.model, unwrap(monitor.model), *monitor.optimizers)
    counts = tuple(map(sys.getrefcount, targets))
    if counts == view.held_at:
        return False
    if held_only_by(monitor, targets, stop=(Monitor, AutoWatch)):
        return True
    view.held_at = counts
    return False


def _distinct(*objects: Any) -> list[Any]:
    return list({id(obj): obj for obj in objects}.values())


def _to_file(sink: Sink, audit: SetupAudit) -> None:
    """A table already shown, with its count of models set up alike, to setup.json."""
    if isinstance(sink, JsonlSink):
        sink.setup(audit)


class _ScriptsOwn:
    """The alerts of a script's own ``tw.watch`` or Lightning callback (whose monitor
    ours gave way to): the run's findings too. They count for ``--fail-on`` and go
    to the run's files and summary, not its console (the script's own monitor
    printed them where the script chose); their steps count in the run's."""

    def __init__(self, owner: AutoWatch) -> None:
        self.owner = weakref.ref(owner)
        self.steps = 0
        # One of them closed having seen its model run but no step, and said why
        # (its own closing note): the run, which left that model to it, has
        # nothing of its own to add about training that was not watched.
        self.told_idle = False

    def _foreign(self, dispatcher: Dispatcher) -> bool:
        owner = self.owner()
        if owner is None or dispatcher is owner._internal:
            return False
        for sink in dispatcher.sinks:
            if isinstance(sink, _ModelView) and sink.owner() is owner:
                return False  # ours: heard through the view already
            if isinstance(sink, RelaySink):
                return False  # a callback's monitor: heard from its reporter instead
        return True

    def heard(self, dispatcher: Dispatcher, alert: Alert, repeat: bool) -> None:
        owner = self.owner()
        if owner is None or not self._foreign(dispatcher):
            return
        try:
            owner._heard(alert, repeat)
        except Exception as exc:  # never break the script's own monitor
            owner._internal.internal_error("trainwatch run: script's own alerts", exc, 0)

    def closed(self, dispatcher: Dispatcher, summary: Summary) -> None:
        if self._foreign(dispatcher):
            self.steps = max(self.steps, summary.steps)
            self.told_idle = self.told_idle or bool(summary.idle)


class _BackwardEnd:
    """Called when a backward through a hand-trained model has ended: its step boundary."""

    __slots__ = ("owner", "monitor")

    def __init__(self, owner: AutoWatch, monitor: Monitor) -> None:
        self.owner = weakref.ref(owner)
        self.monitor = weakref.ref(monitor)

    def __call__(self) -> None:
        owner, monitor = self.owner(), self.monitor()
        if owner is None or monitor is None or monitor.closed or monitor.optimizers:
            return
        owner._manual_step(monitor)


class _NotCalled:
    """Called when a model's optimizer steps while the model is no longer called."""

    __slots__ = ("owner", "monitor")

    def __init__(self, owner: AutoWatch, monitor: Monitor) -> None:
        self.owner = weakref.ref(owner)
        self.monitor = weakref.ref(monitor)

    def __call__(self, since: int) -> None:
        owner, monitor = self.owner(), self.monitor()
        if owner is not None and monitor is not None and not monitor.closed:
            owner._model_not_called(monitor, since)


def _parameters_of(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _shapes(params: Sequence[torch.Tensor]) -> Counter[tuple[int, ...]]:
    return Counter(tuple(p.shape) for p in params)


def _fits(held: Sequence[torch.Tensor], model: Sequence[torch.Tensor]) -> bool:
    """The parameters ``held`` by an optimizer are those of a copy of the ``model``
    parameters (a deep copy, a QAT-prepared copy, a new instance of its class), or
    of most of it: each has a counterpart of its shape among them, and they make
    more than half of them by count and by size. A shape shared with a part only
    is no evidence: a learned temperature of shape (1,) matches any bias of one
    output (SAC's critic)."""
    if not held or _shapes(held) - _shapes(model):
        return False
    share = len(held) / len(model)
    size = sum(p.numel() for p in held) / max(1, sum(p.numel() for p in model))
    return share > _FITTING_SHARE and size > _FITTING_SHARE


def _module_parameters(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Those of ``params`` a module may have held: a module holds only ``nn.Parameter``
    (``register_parameter`` refuses a plain tensor), so a bare tensor made with
    ``requires_grad=True`` (a learned temperature, a loss weight) was never one's."""
    return [p for p in params if isinstance(p, nn.Parameter)]


def _module_holding(params: list[torch.Tensor]) -> nn.Module | None:
    """The outermost live module holding any of ``params`` (one scan of live objects)."""
    wanted = {id(p) for p in params}
    holders = [
        obj
        for obj in gc.get_objects()
        if issubclass(type(obj), nn.Module) and any(id(p) in wanted for p in obj.parameters())
    ]
    inner = {id(sub) for holder in holders for sub in holder.modules() if sub is not holder}
    return next((holder for holder in holders if id(holder) not in inner), None)


_LIGHTNING_LOOPS = ("/lightning/pytorch/", "/pytorch_lightning/")
_HF_TRAINER = ("/transformers/trainer",)


def _lightning_module_holding(module: nn.Module) -> nn.Module | None:
    """The LightningModule holding ``module`` as a part (one scan of live objects),
    when Lightning's loop runs the call; None when there is none or ``module`` is one.

    Only a call from inside Lightning's loop (``training_step`` calling its parts)
    is looked at: a script that merely imports Lightning and builds a model copy
    per task (Reptile) would otherwise scan the heap at each copy's first call.
    """
    bases = tuple(
        found.LightningModule
        for found in (sys.modules.get("lightning.pytorch"), sys.modules.get("pytorch_lightning"))
        if found is not None and hasattr(found, "LightningModule")
    )
    if not bases or issubclass(type(module), bases) or not called_from(_LIGHTNING_LOOPS):
        return None
    for obj in gc.get_objects():
        if issubclass(type(obj), bases) and any(sub is module for sub in obj.modules()):
            return obj
    return None


def _lightning_overfits(model: nn.Module) -> bool:
    """A LightningModule fitted by ``Trainer(overfit_batches=...)``: Lightning swaps a
    ``SequentialSampler`` into the training loader itself (the same few batches every
    epoch, a debugging run), so its order is no choice of the script's."""
    trainer = getattr(model, "_trainer", None)
    return trainer is not None and bool(getattr(trainer, "overfit_batches", 0))


def _steps_before(model: nn.Module) -> int:
    """Steps the model's trainer took before this process: a fit resumed from a
    checkpoint starts at the checkpoint's global step, as the callbacks' steps do.

    Read at the first optimizer step, once Lightning has restored its loops or
    the Hugging Face Trainer its state.
    """
    trainer = getattr(model, "_trainer", None)
    step = getattr(trainer, "global_step", 0) if trainer is not None else 0
    if not step:
        step = _hf_global_step(model)
    return step if isinstance(step, int) and step > 0 else 0


def _steps_of_sharers(optimizer: Optimizer, monitor: Monitor, monitors: list[Monitor]) -> int:
    """The steps the optimizer already took for another model of ours: a module first
    called mid-run whose parameters that optimizer holds too (an EMA copy handed to
    the model's optimizer by mistake, found at its first evaluation) takes its steps
    from there, so what it finds is dated at the step the training is in, not from 0.
    Asked as an optimizer joins a monitor that has none, never per step."""
    return max(
        (
            other.step_count
            for other in monitors
            if other is not monitor and not other.closed and optimizer in other.optimizers
        ),
        default=0,
    )


def _hf_global_step(model: nn.Module) -> int:
    """The global step of the Hugging Face Trainer training ``model`` (one scan of
    live objects, when the Trainer is in use; 0 when none holds it).

    The Trainer keeps no reference on the model, so it is looked for.
    """
    found = sys.modules.get("transformers.trainer")
    trainer_class = getattr(found, "Trainer", None)
    if trainer_class is None or not called_from(_HF_TRAINER):
        return 0  # (not inside a Trainer's loop: no Trainer trains the model)
    for obj in gc.get_objects():
        # By type: isinstance asks a dead weak proxy among the live objects and raises.
        if issubclass(type(obj), trainer_class) and (
            getattr(obj, "model", None) is model or getattr(obj, "model_wrapped", None) is model
        ):
            return getattr(getattr(obj, "state", None), "global_step", 0) or 0
    return 0


def _modules_holding(params: list[torch.Tensor]) -> bool:
    """Whether any live module holds one of ``params`` as its own (one scan of live objects)."""
    wanted = {id(p) for p in params}
    return any(
        issubclass(type(obj), nn.Module)
        and any(id(p) in wanted for p in obj.parameters(recurse=False))
        for obj in gc.get_objects()
    )


def _optimizers_over(params: list[torch.Tensor]) -> list[Optimizer]:
    """The live optimizers holding any of ``params`` (one scan of live objects).

    One whose steps no hook sees (it never ran ``Optimizer.__init__`` and wraps
    no optimizer that did) is left out: the model's steps are then its backward
    ends, as for hand-written updates.
    """
    wanted = {id(p) for p in params}
    return [
        obj
        for obj in gc.get_objects()
        if issubclass(type(obj), Optimizer)
        and _holds_any(obj, wanted)
        and takes_step_hooks(inner_optimizer(obj))
    ]


def _live_optimizers() -> list[Optimizer]:
    """The live optimizers whose steps the hooks see (one scan of live objects)."""
    return [
        obj
        for obj in gc.get_objects()
        if issubclass(type(obj), Optimizer) and takes_step_hooks(inner_optimizer(obj))
    ]


def _holds_any(optimizer: Optimizer, wanted: set[int]) -> bool:
    return any(id(p) in wanted for g in optimizer.param_groups for p in g["params"])


def _holds_more(optimizer: Optimizer, params: list[torch.Tensor]) -> bool:
    """The optimizer holds every trainable one of ``params`` and others besides."""
    held = {id(p) for p in _parameters_of(optimizer)}
    trainable = [id(p) for p in params if p.requires_grad]
    return bool(trainable) and held.issuperset(trainable) and bool(held - {id(p) for p in params})


def _smallest_holder(module: nn.Module, optimizers: list[Optimizer]) -> nn.Module | None:
    """The live module with the fewest parameters that contains ``module`` and
    holds every parameter of ``optimizers`` (one scan of live objects); None when
    they are spread over separate models."""
    wanted = {id(p) for optimizer in optimizers for p in _parameters_of(optimizer)}
    best, size = None, 0
    for obj in gc.get_objects():
        # By type: isinstance asks a dead weak proxy among the live objects and raises.
        if obj is module or not issubclass(type(obj), nn.Module):
            continue
        if not any(sub is module for sub in obj.modules()):
            continue
        held = {id(p) for p in obj.parameters()}
        if held.issuperset(wanted) and (best is None or len(held) < size):
            best, size = obj, len(held)
    return best


def _part_of(monitor: Monitor, module: nn.Module) -> bool:
    """The monitor is ours, has watched no step, and watches a submodule of ``module``."""
    if monitor.closed or monitor.step_count:
        return False
    part = monitor.model
    return any(sub is part for sub in module.modules())


# Steps of a new model's optimizer, with the model it shares parameters with not
# run meanwhile, before that one's monitor gives way to the new model's.
_OVERLAP_STEPS = 2


class _Overlap:
    """A module sharing parameters with other models of ours, and those models'
    passes when last looked at (whether they still run)."""

    __slots__ = ("module", "_others", "_passes", "steps", "_steps_it")

    def __init__(self, module: nn.Module, others: list[Monitor]) -> None:
        self.module = weakref.ref(module)
        self._others = [weakref.ref(m) for m in others]
        self._passes: list[int] = []
        self.steps = 0
        # By id(optimizer): whether it holds some of the module's parameters,
        # looked up once per optimizer (not at each of its steps).
        self._steps_it: dict[int, bool] = {}
        self.mark()

    def stepped_by(self, optimizer: Optimizer, module: nn.Module) -> bool:
        known = self._steps_it.get(id(optimizer))
        if known is None:
            params = {id(p) for g in optimizer.param_groups for p in g["params"]}
            known = self._steps_it[id(optimizer)] = any(
                id(p) in params for p in module.parameters()
            )
        return known

    def others(self) -> list[Monitor]:
        return [m for m in (ref() for ref in self._others) if m is not None]

    def mark(self) -> None:
        self._passes = [m.passes_seen for m in self.others()]

    def others_idle(self) -> bool:
        """No pass of the other models since the last mark."""
        return [m.passes_seen for m in self.others()] == self._passes


# Evaluation datasets remembered (by id) before the memory starts over.
_EVALUATED_KEPT = 256


class AutoWatch:
    """Global hooks that give each model a Monitor and each optimizer its monitor."""

    def __init__(
        self,
        *,
        config: Config,
        sinks: Sequence[Sink] = (),
        max_steps: int | None = None,
        relay: StoreLink | None = None,
        script: str = "script.py",
    ) -> None:
        self.config = config
        self.script = script  # as the closing line names it in a command to run
        # Under torchrun: this rank's side of the store relay (rank zero
        # receives there; the others' only sink is a RankSender on it).
        self.relay = relay
        self._receiver: RankZeroReceiver | None = None
        if relay is not None and relay.rank == 0:
            note = next((s.console.file for s in sinks if isinstance(s, ConsoleSink)), None)
            self._receiver = RankZeroReceiver(
                relay, self._received, config.distributed.gather_every, note
            )
        self.sinks: list[Sink] = list(sinks)
        self.max_steps = max_steps
        self.monitors: list[Monitor] = []
        self.views: list[_ModelView] = []
        self.stopped = False
        self._internal = Dispatcher(self.sinks, halt_on=())
        self._internal.sinks = self.sinks  # one list: a sink that fails leaves both
        self._handles: list[RemovableHandle] = []
        self._forward_handles: list[RemovableHandle] = []
        self._compile_warning: CompiledHookWarning | None = None
        self._backward_ends: dict[int, list[RemovableHandle]] = {}  # by id(monitor)
        self._local = threading.local()
        self._seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._handled: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        self._pending: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        self._pending_steps: dict[int, int] = {}  # by id(optimizer): its steps while pending
        # Steps of optimizers while pending, by their class: those no model watched took.
        self._unwatched_steps: Counter[str] = Counter()
        self._first_step_searches = 0  # heap searches made at an optimizer's first step
        # Pending optimizers whose first-step search was left out: their model is
        # looked for by its parameters if its next call has not found it.
        self._unsearched: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        # A pending optimizer inside its step(closure) now (None: none): its model,
        # found inside the closure, joins that step under way.
        self._closure_stepping: weakref.ref[Optimizer] | None = None
        # Modules found sharing parameters with another model of ours without being
        # part of it (a classifier built around a pretrained autoencoder's encoder),
        # by id: see _take_over.
        self._overlapping: dict[int, _Overlap] = {}
        self._transformed_calls = False  # a module was called inside a torch.func transform
        self._compiled_calls = False  # a module was called inside a graph being traced
        self._names: set[str] = set()
        # Monitors whose optimizer steps while their model is no longer called, by
        # id: (the monitor, its passes then, the first such step). The model the
        # loop trains instead is looked for (see _model_not_called).
        self._not_called: dict[int, tuple[weakref.ref[Monitor], int, int]] = {}
        # Hand-trained models looked at for the model they replaced (see
        # _look_for_replaced): the looks each took, and those told.
        self._replaced_looks: weakref.WeakKeyDictionary[Monitor, int] = weakref.WeakKeyDictionary()
        # Optimizers told as stepping the parameters of a model replaced since, with
        # what was told: a later copy trained in the same way (the loop replacing
        # its model again) is told as the same finding.
        self._stale_optimizers: weakref.WeakKeyDictionary[Optimizer, ReplacedModel] = (
            weakref.WeakKeyDictionary()
        )
        self._searched: weakref.WeakSet[Monitor] = weakref.WeakSet()
        # Models frozen whole, looked at for what an optimizer of tensors no module
        # holds trains instead (see _still_pending).
        self._frozen_looks = FrozenModelLooks()
        # Optimizers a search paired with a model, found never stepping while another
        # steps in their place (see _unpair_idle): no later search pairs them again.
        self._idle_optimizers: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        # The Lightning Trainer each LightningModule's monitor last met (see
        # _date_by_trainer).
        self._fitted_by: weakref.WeakKeyDictionary[Monitor, weakref.ref[Any]] = (
            weakref.WeakKeyDictionary()
        )
        # Monitors of a model called through its parts (see _holder_called_through),
        # and the scans for such a model that found none.
        self._through_parts: weakref.WeakSet[Monitor] = weakref.WeakSet()
        self._part_searches = 0
        self._stop_next = False
        self._closed = False
        # Keyed by (model, the alert's own key): a later finding of one (rule,
        # module) told apart (data.finding) keeps the earlier one's tally.
        self._tallies: dict[tuple[str, tuple[Any, ...]], AlertTally] = {}
        # Models set up alike, by _setup_key (see _Family).
        self._families: dict[tuple[Any, ...], _Family] = {}
        # The run's steps when the models closed so far (dropped, or replaced by the
        # model the loop trains in their place) stopped: the most any reached (see steps).
        self._released_steps = 0
        # Steps each optimizer took while no monitor of ours watched it (its model
        # not found yet): its model's count starts there (see _steps_unwatched).
        self._unwatched_by: weakref.WeakKeyDictionary[Optimizer, int] = weakref.WeakKeyDictionary()
        self._scripts_own = _ScriptsOwn(self)
        # The DataLoader last started with gradients on (the training one), and
        # DataLoader.__iter__ as it was before install() with our wrapper of it.
        self._train_loader: weakref.ref[Any] | None = None
        # The datasets read for evaluations so far, by id (see _evaluation_started).
        self._evaluated: set[int] = set()
        self._loader_iter: MethodPatch | None = None
        # Optimizer.__init__ as it was before install() with our wrapper of it, and
        # the optimizers built over parameters no model of ours holds while the
        # forward hooks were off, with the step each was built at (see _optimizer_built).
        self._optimizer_init: MethodPatch | None = None
        self._awaited: weakref.WeakKeyDictionary[Optimizer, int] = weakref.WeakKeyDictionary()
        # Those attached as their model was first called (see _attach_awaited).
        self._met_at_call: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        # Turns the forward hooks on in no_grad / inference_mode blocks once they
        # are off, so a model first evaluated late is found (trainwatch.late_models).
        self._lookout = NoGradLookout(self)
        # The processes the script starts, named by a closing line that saw no step.
        self._children = ChildProcesses()

    # -- lifecycle -------------------------------------------------------
    def install(self) -> None:
        dispatch.OBSERVERS.append(self._scripts_own)
        self._hook_forwards()
        self._handles.append(register_optimizer_step_pre_hook(self._before_step))
        self._handles.append(register_optimizer_step_post_hook(self._after_step))
        self._compile_warning = CompiledHookWarning()
        self._watch_loaders()
        self._watch_optimizers()
        self._children.install()
        self._lookout.install()
        termination.hold(self)  # a SIGTERM'd script still gets its files closed
        _OPEN.add(self)

    def _hook_forwards(self) -> None:
        """Global forward hooks: every module call in the process, to find new models.

        They cost every module call of every model, so they are on only while
        a model may still appear: until every model found trains with an
        optimizer (or is never trained: a target network, an EMA copy) for
        two steps, and again from the building (or, built before they came
        off, the first step) of an optimizer whose parameters no model of ours
        holds. After that, a model first called in
        a ``no_grad`` or ``inference_mode`` block (an EMA copy first validated
        at step 500) is found by the lookout, which turns them on for the block
        (see :mod:`trainwatch.late_models`); one first called outside such a
        block, and never trained with an optimizer, is not.
        """
        if self._forward_handles or self._closed:
            return
        mod = nn.modules.module
        self._forward_handles = [
            mod.register_module_forward_pre_hook(self._before_forward),
            mod.register_module_forward_hook(self._after_forward, always_call=True),
        ]

    def _watch_loaders(self) -> None:
        """See each DataLoader the script iterates, for the data-order check.

        A loader started while gradients are on and the watched models are in
        training mode feeds training; one started under ``no_grad`` or with
        the model in eval mode is a validation loader, read in order by design.
        ``DataLoader.__iter__`` is wrapped until :meth:`close`.
        """
        owner = weakref.ref(self)

        def wrap(original: Any) -> Any:
            def __iter__(loader: DataLoader, *args: Any, **kwargs: Any) -> Any:
                watcher = owner()
                if watcher is not None and not watcher._closed:
                    try:
                        watcher._loader_started(loader)
                    except Exception as exc:  # never break the script's data
                        watcher._internal.internal_error("trainwatch run: data loader", exc, 0)
                return original(loader, *args, **kwargs)

            return __iter__

        self._loader_iter = MethodPatch(DataLoader, "__iter__", wrap)

    def _watch_optimizers(self) -> None:
        """See each optimizer the script builds, so that a model built after the others
        settled is watched from its first pass (see :meth:`_optimizer_built`).

        ``Optimizer.__init__``, which every optimizer class reaches through
        ``super().__init__``, is wrapped until :meth:`close`.
        """
        owner = weakref.ref(self)

        def wrap(original: Any) -> Any:
            @functools.wraps(original)
            def __init__(optimizer: Optimizer, *args: Any, **kwargs: Any) -> None:
                original(optimizer, *args, **kwargs)
                watcher = owner()
                if watcher is not None and not watcher._closed:
                    try:
                        watcher._optimizer_built(optimizer)
                    except Exception as exc:  # never break the script's optimizer
                        watcher._unwatch_optimizers()
                        watcher._internal.internal_error("trainwatch run: optimizer built", exc, 0)

            return __init__

        self._optimizer_init = MethodPatch(Optimizer, "__init__", wrap)

    def _unwatch_optimizers(self) -> None:
        if self._optimizer_init is not None:
            self._optimizer_init.remove()
            self._optimizer_init = None

    def _optimizer_built(self, optimizer: Optimizer) -> None:
        """An optimizer built while the forward hooks are off, over parameters no model
        of ours holds: a second model's (a student distilled from the teacher trained
        first, the next fold's). Scripts build the optimizer before the model's first
        call, so the hooks go on to find the model at that call: its first pass and
        loss are checked, as the first model's are. They go off again once it steps
        (see _after_step), or after :data:`_BUILT_WAIT` steps of the models watched
        if it is not called (at its optimizer's first step it is looked for, as
        before). One built over a watched model's parameters (a new learning rate,
        an LR finder's loop) turns nothing on.
        """
        if self._stale_optimizers:
            self._built_over_a_replacement(optimizer)
        if self._forward_handles or not self._unowned(optimizer):
            return
        self._awaited[optimizer] = self.steps
        self._hook_forwards()

    def _built_over_a_replacement(self, optimizer: Optimizer) -> None:
        """An optimizer built over a model of ours trained by hand (one told as the
        replacement of a model whose optimizer steps on without it): the loop built
        its next optimizer there (a k-fold loop building each fold's optimizer
        before the fold's new model). The optimizers told as stepping a model it
        replaced are no longer the loop's: the next model is not told as replacing
        theirs, but this model, once this optimizer steps without it."""
        built = {id(p) for p in _parameters_of(optimizer)}
        for monitor in self.monitors:
            if monitor.closed or monitor.optimizers:
                continue
            params = [p for p in unwrap(monitor.model).parameters() if p.requires_grad]
            if not any(id(p) in built for p in params):
                continue
            for stale in list(self._stale_optimizers):
                if stale is not optimizer and _fits(_parameters_of(stale), params):
                    del self._stale_optimizers[stale]

    def _awaiting_built(self) -> bool:
        """Whether an optimizer built for a model not found yet still waits for its
        first call; one waited for :data:`_BUILT_WAIT` steps is not."""
        steps = self.steps
        for optimizer, built in list(self._awaited.items()):
            if steps - built >= _BUILT_WAIT:
                del self._awaited[optimizer]
        return bool(self._awaited)

    def _loader_started(self, loader: DataLoader) -> None:
        if not torch.is_grad_enabled():
            self._evaluation_started(loader)
            return
        models = [unwrap(m.model) for m in self.monitors if not m.closed]
        if any(not model.training for model in models):
            self._evaluation_started(loader)
            return
        if any(map(_lightning_overfits, models)):
            return  # Lightning put the sequential sampler in: no order of the script's
        self._train_loader = weakref.ref(loader)
        for monitor in self.monitors:
            if not monitor.closed:
                monitor.watch_data(loader)
                monitor.data_restarted()

    def _evaluation_started(self, loader: DataLoader) -> None:
        """A loader read for an evaluation: a dataset evaluated for the first time (a
        test set after fitting, Lightning's ``test`` or ``predict`` after its
        validations) has its first passes audited for broadcasts, however many the
        validations before it took. Its id is kept, not the dataset: one made anew
        for each validation and given a freed one's id is taken for seen."""
        key = id(getattr(loader, "dataset", loader))
        if key in self._evaluated:
            return
        if len(self._evaluated) >= _EVALUATED_KEPT:
            # A loop building its evaluation data anew each time: the ids stay bounded.
            self._evaluated.clear()
        self._evaluated.add(key)
        for monitor in self.monitors:
            if not monitor.closed:
                monitor.new_evaluation_data()

    # -- the no_grad lookout (trainwatch.late_models) --------------------------
    def look_wanted(self) -> bool:
        return not self._closed and not self._forward_handles and bool(self.monitors)

    def look(self) -> int:
        self._hook_forwards()
        return len(self.monitors)

    def looked(self, models_before: int) -> None:
        """A looking block ended: without a new model the hooks go off again (one that
        was found keeps them until it settles, at a step's end)."""
        if len(self.monitors) == models_before and not self._pending:
            self._unhook_forwards()

    def lookout_failed(self, exc: BaseException) -> None:
        self._internal.internal_error("trainwatch run: no_grad lookout", exc, self.steps)

    def _unhook_forwards(self) -> None:
        if self._compiled_calls and not self._closed:
            # A graph was traced with these hooks in the global tables: dynamo
            # guards on those tables, so taking the hooks off (and putting them
            # back for a no_grad block) would recompile it each time. They stay
            # until the run ends; inside the graph they were traced away.
            return
        handles, self._forward_handles = self._forward_handles, []
        for handle in handles:
            handle.remove()
        self._local.depth = 0

    def close(self) -> None:
        """Remove the global hooks, close every monitor, print one summary."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        self._close_scripts_own()  # heard by the run, whose hooks are still on
        self._uninstall()
        self._close_monitors()

    def _uninstall(self) -> None:
        """Every global hook and wrapper of install() off."""
        if self._scripts_own in dispatch.OBSERVERS:
            dispatch.OBSERVERS.remove(self._scripts_own)
        self._lookout.remove()
        self._unhook_forwards()
        for handle in [*self._handles, *(h for hs in self._backward_ends.values() for h in hs)]:
            handle.remove()
        self._handles.clear()
        self._backward_ends.clear()
        if self._compile_warning is not None:
            self._compile_warning.detach()
        if self._loader_iter is not None:
            self._loader_iter.remove()
            self._loader_iter = None
        self._unwatch_optimizers()
        self._children.remove()

    def _left_to_the_parent(self) -> None:
        """In a process forked from the script's (a ``multiprocessing.Process`` it
        trains in, a DataLoader worker) the run is the parent's, which reports it:
        here the hooks come off and nothing is written (the TensorBoard writer's
        thread was not forked along, and a flush waiting on it never ends)."""
        self._closed = True
        self.sinks.clear()  # the run's sinks, every model's view writes through
        self._uninstall()  # termination's table already tells the child's pid apart

    def _close_monitors(self) -> None:
        """Every monitor, the other ranks' last alerts, then the one summary."""
        for monitor in self.monitors:
            try:
                monitor.close()
            except Exception as exc:  # a failure at close must not hide the script's result
                self._internal.internal_error("monitor close", exc, monitor.step_count)
        if self._receiver is not None:
            try:
                self._receiver.close()  # the other ranks' last alerts, before the summary
            except Exception as exc:
                self._internal.internal_error("relay", exc, self.steps)
        try:
            self._tell_alike()
            shown, raw = self.summary(), self.summary(labelled=False)
            if not shown.steps and not self._scripts_own.steps:
                shown.idle = self._children.note(self.script) or self._nothing_watched()
            self._each_sink(
                "close", lambda s: s.close(shown if isinstance(s, ConsoleSink) else raw)
            )
        finally:
            termination.release(self)

    def _close_scripts_own(self) -> None:
        """The script's own monitors still open as the run ends (a ``tw.watch``
        never closed) close first, as the interpreter's exit closes them under
        plain ``python``: their summary or closing note is told where the script
        chose, their last findings reach the run, and the run's closing line then
        knows what they saw (see _ScriptsOwn)."""
        ours = {id(monitor) for monitor in self.monitors}
        for monitor in registry.owners():
            if id(monitor) in ours or not isinstance(monitor, Monitor):
                continue
            try:
                monitor.close()
            except Exception as exc:  # the script's monitor: never the run's failure
                self._internal.internal_error("script's own monitor close", exc, 0)

    def _nothing_watched(self) -> str | None:
        """The closing line of a run that watched no step. Where optimizers stepped over
        parameters of no model found training (a model replaced after its optimizer
        was built, and not taken for its replacement), it says so, and names the
        models that ran paired with optimizers that never stepped, rather than that
        nothing stepped. None where the script's own monitor, which the run left
        its model to, already said why it watched no step: the run's line would
        claim that no backward reached a model its own monitors never looked at."""
        if self._scripts_own.told_idle:
            return None
        if not self._unwatched_steps:
            return self._never_stepped() or _NOTHING_WATCHED
        kinds = ", ".join(sorted(self._unwatched_steps))
        steps = sum(self._unwatched_steps.values())
        which = (
            f"the {kinds} optimizer" if len(self._unwatched_steps) == 1 else f"optimizers ({kinds})"
        )
        line = _STEPPED_UNWATCHED.format(
            which=which, steps=steps, times="time" if steps == 1 else "times"
        )
        # Models that ran, paired with optimizers none of which stepped.
        idle = [
            m.model_name
            for m in self.monitors
            if m.passes_seen and m.optimizers and not m.step_count
        ]
        if idle:
            return (
                f"{line}; {', '.join(map(str, idle))} ran, but no optimizer holding "
                f"{'its' if len(idle) == 1 else 'their'} parameters stepped: was the model "
                "replaced after its optimizer was built?"
            )
        return (
            f"{line} (was the model replaced after its optimizer was built, or are the "
            "parameters held by no module?)"
        )

    def _never_stepped(self) -> str | None:
        """The closing line of a run whose models ran and were backpropagated through,
        paired with optimizers none of which stepped, as ``tw.watch`` tells such a
        loop; None where no backward reached such a model (the run's usual line)."""
        idle = [
            m
            for m in self.monitors
            if m.passes_seen and m.optimizers and not m.step_count and m.backward_seen
        ]
        if not idle:
            return None
        ran = ", ".join(
            f"{m.model_name} ran {m.passes_seen} forward "
            f"{'pass' if m.passes_seen == 1 else 'passes'}"
            for m in idle
        )
        one = len(idle) == 1
        return _NEVER_STEPPED.format(
            ran=ran,
            them="it" if one else "them",
            their="its optimizer" if one else "their optimizers",
        )

    @property
    def steps(self) -> int:
        """Training steps so far, the summary's and ``--max-steps``'s: models trained
        together (a GAN's two halves) count once, those trained one after another (a
        fold's model after the last one's, a stage's copy) add up. Each model's count
        is its optimizers' steps, as ``tw.watch`` would number them; it starts where
        the models closed before it stopped (``_ModelView.start``)."""
        return max(
            [
                self._released_steps,
                *(view.start + m.step_count for view, m in zip(self.views, self.monitors)),
            ]
        )

    @property
    def worst(self) -> str | None:
        """The highest severity standing, for --fail-on: every model's alerts, the
        script's own monitor's and the other ranks' (on rank zero), internal errors
        aside and those their rule withdrew later (a freeze undone) too."""
        return standing_worst((t.first, t.last_step) for t in self._tallies.values())

    def summary(self, labelled: bool = True) -> Summary:
        """Every model's alerts in one summary; names carry the model when there are several."""
        several = labelled and len(self.views) > 1
        norms: dict[str, float] = {}
        watched = _watched_parameters(self.monitors) if several else set()
        for view, monitor in zip(self.views, self.monitors):
            for layer, value in monitor.grad_norms().items():
                if layer == EXTERNAL and _outside_watched(monitor, watched):
                    continue  # the other models' norms, told under their own names
                norms[self._label(view.model_name, layer) if several else layer] = value
        tallies = []
        for (model, _), tally in self._tallies.items():
            first = tally.first
            if several:
                # Named as told (a copy's finding counted with its family's names that copy).
                model = str(first.data.get("model", model))
                first = dataclasses.replace(first, module=self._label(model, first.module))
            tallies.append(AlertTally(first, tally.count, tally.last_step))
        # The files count the steps of the script's own monitors too (their alerts
        # are there); the console's summary stays the run's own.
        steps = self.steps if labelled else max(self.steps, self._scripts_own.steps)
        return Summary(steps, tallies, norms)

    # -- the shared sinks ---------------------------------------------------
    def _view_emitted(self, view: _ModelView, alerts: list[Alert]) -> None:
        """A model's new alerts; one its family has told already is counted again."""
        name = self._tally_name(view)
        if name == view.model_name:
            self._emit_many(alerts, name)
            return
        new = []
        for alert in alerts:
            tally = self._tallies.get((name, alert.key))
            if tally is None:
                new.append(alert)
            else:
                self._repeat(alert, tally.count + 1, name)
        if new:
            self._emit_many(new, name)

    def _view_repeated(self, view: _ModelView, alert: Alert, count: int) -> None:
        name = self._tally_name(view)
        if name != view.model_name:
            # Counted with the family's: one more, whatever this model's own count.
            tally = self._tallies.get((name, alert.key))
            count = tally.count + 1 if tally is not None else count
        self._repeat(alert, count, name)

    def _view_setup(self, view: _ModelView, audit: SetupAudit) -> None:
        """A model's setup table; one the same as a table its family showed, the
        family's copies being dropped after use, is counted, not shown again."""
        family = self._family(view)
        content = table_content(audit)
        shown = family.shown.get(content)
        if shown is None or not family.dropped:
            family.shown.setdefault(content, audit)
            self._each_sink("setup", lambda s: s.setup(audit))
            return
        if audit.revision == 0:
            family.alike[content] = family.alike.get(content, 0) + 1
        if not family.noted:
            family.noted = True
            self._note(
                f"trainwatch setup of {audit.model}, step {audit.step}: like {shown.model}'s "
                "above; models set up alike, each dropped after use (a copy per task), "
                "get no table of their own"
            )

    def _tell_alike(self) -> None:
        """How many models were set up like each table shown: one console line, and
        the table's ``alike`` count in setup.json."""
        for family in self._families.values():
            for content, count in family.alike.items():
                audit = dataclasses.replace(family.shown[content], alike=count)
                self._each_sink("setup", lambda s, a=audit: _to_file(s, a))
                more = f"{count} more model{'s' if count != 1 else ''}"
                self._note(
                    f"trainwatch: {more} set up like {audit.model} watched; "
                    "setup tables not printed"
                )

    def _note(self, text: str) -> None:
        self._each_sink("note", lambda s: s.note(text) if isinstance(s, ConsoleSink) else None)

    def _tally_name(self, view: _ModelView) -> str:
        """The name a model's alerts are counted under, decided at its first: its
        family's, when the family's copies are dropped after use; else its own."""
        if view.tally_name is None:
            family = self._family(view)
            view.tally_name = family.name if family.dropped else view.model_name
        return view.tally_name

    def _family(self, view: _ModelView) -> _Family:
        if view.family is None:
            monitor = view.monitor() if view.monitor is not None else None
            key = None
            if monitor is not None:
                try:
                    key = _setup_key(monitor)
                except Exception as exc:  # (a lazy module's parameters have no shape yet)
                    self._internal.internal_error("trainwatch run: model setup", exc, self.steps)
            family = self._families.get(key) if key is not None else None
            if family is None:
                family = _Family(view.model_name)
                if key is not None:
                    self._families[key] = family
            view.family = family
        return view.family

    def _emit(self, alert: Alert, model: str) -> None:
        self._emit_many([alert], model)

    def _emit_many(self, alerts: Sequence[Alert], model: str) -> None:
        """One publish of a model's monitor: its console folds a same-step flood."""
        for alert in alerts:
            self._tallies[(model, alert.key)] = AlertTally(alert, 1, alert.step)
        shown = [self._for_console(alert, model) for alert in alerts]
        self._each_sink(
            "emit", lambda s: s.emit_many(shown if isinstance(s, ConsoleSink) else alerts)
        )

    def _heard(self, alert: Alert, repeat: bool) -> None:
        """A new alert (or a repeat) of the script's own monitor (see _ScriptsOwn)."""
        key = (_SCRIPTS_OWN, alert.key)
        tally = self._tallies.get(key)
        if tally is not None:
            if repeat:
                tally.count, tally.last_step = tally.count + 1, alert.step
            return
        self._tallies[key] = AlertTally(alert, 1, alert.step)
        self._each_sink("emit", lambda s: None if isinstance(s, ConsoleSink) else s.emit(alert))

    def _received(self, alert: Alert, repeats: int) -> None:
        """Rank zero: another rank's alert (``repeats``: further firings there)."""
        model = str(alert.data.get("model", ""))
        times = repeats or 1
        key = (model, alert.key)
        if key not in self._tallies:
            self._emit(alert, model)
            times -= 1
        tally = self._tallies[key]
        if times:
            self._repeat(alert, tally.count + times, model)

    def _repeat(self, alert: Alert, count: int, model: str) -> None:
        tally = self._tallies.get((model, alert.key))
        if tally is not None:
            tally.count, tally.last_step = count, alert.step
        self._each_sink("repeat", lambda s: s.repeat(alert, count))

    def _each_sink(self, what: str, call: Any) -> None:
        for sink in list(self.sinks):
            try:
                call(sink)
            except Exception as exc:
                self.sinks.remove(sink)
                self._internal.internal_error(f"{sink.name} sink ({what})", exc, self.steps)

    def _for_console(self, alert: Alert, model: str) -> Alert:
        if len(self.views) < 2:
            return alert
        # The model the alert is of (a copy counted under its family's name names itself).
        model = str(alert.data.get("model", model))
        return dataclasses.replace(alert, module=self._label(model, alert.module))

    @staticmethod
    def _label(model: str, module: str | None) -> str:
        return f"{model}:{module}" if module else model

    # -- discovery -----------------------------------------------------------
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if compiling():
            # Inside a graph being traced (torch.compile(model)'s wrapper, called
            # eagerly around it, is where the model is found): written, never
            # read here, since what a traced hook reads becomes a guard of the
            # graph, and a guard that changes recompiles it.
            self._compiled_calls = True  # model.compile(): its hooks run traced only
            return None
        if quiet.replaying() or transform_level() is not None:
            # trainwatch re-running a watched model, or a torch.func transform
            # (whose functional_call stands other tensors in for the parameters):
            # not the script's call of the model it trains.
            if transform_level() is not None:
                self._transformed_calls = True  # a model may be called there alone
            return None
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth:
            return None
        if self._stop_next:
            self._local.depth = 0
            raise StopRun
        if module in self._seen:
            return None
        self._seen.add(module)
        try:
            # Hooks attached now see this very call (the module's own pre-hooks
            # excepted: PyTorch has already gathered them), so step 0 is checked.
            self._discover(module, args)
        except Exception as exc:
            self._internal.internal_error("trainwatch run: model discovery", exc, self.steps)
        return None

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if compiling() or quiet.replaying() or transform_level() is not None:
            return None
        self._local.depth = max(0, getattr(self._local, "depth", 1) - 1)
        return None

    def _discover(self, module: nn.Module, args: Any = (), called: bool = True) -> None:
        """Watch ``module``; ``called``: found by its call, which is the model's first
        pass (not by a heap search between steps)."""
        if getattr(module, "_is_replica", False):
            return  # a DataParallel replica: its original is the model
        if isinstance(module, torch.jit.ScriptModule):
            return  # TorchScript takes no hooks: not watchable (tw.watch says so)
        params = list(module.parameters())
        if not params:
            return  # a loss module
        part = None
        scanned: list[Optimizer] | None = None  # the optimizers over it, if looked for
        # Parts of it watched as models of their own until now, by name in it: called
        # on their own before it (a teacher the loop calls before the model).
        called_alone: list[str] = []
        if called:
            holder = _lightning_module_holding(module)
            if holder is None and not any(map(registry.owner_of, params)):
                holder, scanned = self._holder_called_through(module, params)
            if holder is not None:
                # A LightningModule's training_step calls its parts (self.encoder(x),
                # self.head(z)) and never the module itself, as a PPO agent's
                # get_value(x) calls self.critic(x): it is the model, and each
                # outermost call of a part is one of its passes.
                if holder in self._seen:
                    return
                self._seen.add(holder)
                part, module = module, holder
                params = list(module.parameters())
                scanned = None  # looked for over the part's parameters only
        owners = {id(o): o for o in map(registry.owner_of, params) if o is not None}
        if owners:
            if called and self._inside_model_of(owners.values(), module):
                return  # another part of a model watched through its parts
            # Already watched: by us as part of a bigger model, or by the
            # script's own tw.watch / Lightning callback; or by us as a part of
            # this module called on its own before any step (a shape check on
            # its encoder, spectral_norm's parametrization run while the layer
            # was built): then this module is the model, and the part's monitor
            # gives way to it.
            parts = [m for m in self.monitors if id(m) in owners and _part_of(m, module)]
            if len(parts) < len(owners):
                others = [o for o in owners.values() if o not in parts and o in self.monitors]
                if others and len(others) == len(owners) - len(parts):
                    # A new model built around part of one of ours: watched once
                    # that one has stopped running (see _take_over).
                    self._overlapping[id(module)] = _Overlap(module, others)
                return
            for given in parts:
                inner = unwrap(given.model)
                called_alone.extend(
                    user_name(raw) for raw, sub in unwrap(module).named_modules() if sub is inner
                )
                given.found_part_of_a_model()
                self._give_way(given)
        if not (self._awaited and self._awaited_over(params)):
            # (One built for it releases them at its first step: see _before_step.)
            self._release_dropped()
        name = unique_name(class_name(module), self._names)  # not "OptimizedModule"
        view = _ModelView(self, name)
        view.start = self._released_steps  # after the models closed so far
        monitor = Monitor(module, [], config=self.config, sinks=[view])
        # Told of each training loader's pass by the run's own wrapper of
        # DataLoader.__iter__ (_loader_started): the monitors' one comes off, so
        # the run's wrapper is the outer one and comes off at its end.
        loader_hook.release(monitor)
        view.monitor = weakref.ref(monitor)
        monitor.model_name = name
        monitor.yields_to_explicit_watch = True
        monitor.steps_end_at_backward = True
        monitor.loss_out_of_reach()
        if self.relay is not None:
            self.relay.connect()  # the process group is up by now (DDP needs it): hold its store
            monitor.relayed = True
            if self._receiver is not None:
                monitor.before_halt.append(self._receiver.receive)
        self.monitors.append(monitor)
        self.views.append(view)
        loader = self._train_loader() if self._train_loader is not None else None
        if loader is not None and not _lightning_overfits(unwrap(module)):
            monitor.watch_data(loader)
        # One listener on the monitor's own end-of-backward, not a hook per parameter.
        self._backward_ends[id(monitor)] = [monitor.on_backward_end(_BackwardEnd(self, monitor))]
        monitor.on_model_not_called(_NotCalled(self, monitor))
        for optimizer in list(self._pending):
            self._attach(optimizer)
        if self._awaited:
            self._attach_awaited(monitor)
        if not monitor.optimizers:
            # The optimizer usually exists already: attach it before the first
            # training forward, so the monitor runs in optimizer mode from the start.
            self._find_optimizers(monitor, scanned)
        if not monitor.optimizers and (self._not_called or self._stale_optimizers):
            self._continue_steps(monitor)
        if not monitor.optimizers and overwrite_mode():
            try:
                self._find_converted_from(monitor)
            except Exception as exc:  # the model is watched as before
                self._internal.internal_error("trainwatch run: converted model", exc, self.steps)
        for name in called_alone:
            monitor.part_called_alone(name)
        if part is not None:
            self._through_parts.add(monitor)
            monitor.watch_parts()
            monitor.pass_started(part, args)  # this very call of the part is a pass
        elif called:
            monitor.pass_started(module, args)  # this very call is the model's first pass

    def _awaited_over(self, params: list[torch.Tensor]) -> bool:
        wanted = {id(p) for p in params}
        return any(_holds_any(optimizer, wanted) for optimizer in list(self._awaited))

    def _attach_awaited(self, monitor: Monitor) -> None:
        """Attach the optimizers built for the monitor's model before its first call
        (see _optimizer_built): known already, so no scan of live objects looks for
        them (a loop building a model copy and an optimizer per task makes none)."""
        mine = {id(p) for p in monitor.model.parameters()}
        for optimizer in list(self._awaited):
            if _holds_any(optimizer, mine):
                del self._awaited[optimizer]  # found: its first step searches nothing
                self._met_at_call.add(optimizer)
                self._attach(optimizer)

    def _release_dropped(self) -> None:
        """Close the monitors whose model and optimizers the script has dropped (a
        meta-learning loop's copy per task, replaced by the next one's), so that the
        copies are freed: their hooks come off, their last findings reach the files.
        Asked as a new model is found, the moment such a loop has moved on."""
        for monitor, view in list(zip(self.monitors, self.views)):
            try:
                if monitor.closed or not _dropped(monitor, view):
                    continue
            except Exception as exc:
                self._internal.internal_error("trainwatch run: dropped models", exc, self.steps)
                return
            self._release(monitor)

    def _release(self, monitor: Monitor) -> None:
        index = self.monitors.index(monitor)
        view = self.views[index]
        self._family(view).dropped = True
        del self.monitors[index]
        del self.views[index]
        for handle in self._backward_ends.pop(id(monitor), []):
            handle.remove()
        for optimizer in monitor.optimizers:
            self._pending_steps.pop(id(optimizer), None)
        self._stopped(view, monitor)
        try:
            monitor.close()
        except Exception as exc:  # its model is gone: nothing of the script's is at stake
            self._internal.internal_error("monitor close", exc, monitor.step_count)

    def _stopped(self, view: _ModelView, monitor: Monitor) -> None:
        """A model's monitor closed, its model dropped (see _release) or replaced (see
        _retire): the run's steps keep where it stopped, and the models found
        meanwhile that have not stepped yet (the next fold's, found at its first call
        while this one was still held) start there: they train after it."""
        end = view.start + monitor.step_count
        if end <= self._released_steps:
            return
        self._released_steps = end
        for other_view, other in zip(self.views, self.monitors):
            if other is not monitor and not other.steps_here:
                other_view.start = max(other_view.start, end)

    def _view_of(self, monitor: Monitor) -> _ModelView:
        return self.views[self.monitors.index(monitor)]

    def _give_way(self, monitor: Monitor, keep_optimizers: bool = True) -> None:
        """A part's monitor, which has watched no step, closes for the model holding it;
        its optimizers wait for the model's monitor. (``keep_optimizers`` False: a
        model whose phase is over gives way, its optimizers with it.)"""
        index = self.monitors.index(monitor)
        del self.monitors[index]
        del self.views[index]
        for handle in self._backward_ends.pop(id(monitor), []):
            handle.remove()
        if keep_optimizers:
            for optimizer in monitor.optimizers:
                self._pending.add(optimizer)
        monitor.close()

    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        # No module runs during an optimizer step's start: repair the depth
        # count if an interrupted forward left it raised.
        self._local.depth = 0
        if optimizer in self._handled:
            if optimizer in self._pending:
                if self._overlapping:
                    self._take_over(optimizer)
                if optimizer in self._pending:
                    self._still_pending(optimizer)
                    self._pending_step_begins(optimizer, args, kwargs)
            return None
        self._handled.add(optimizer)
        if optimizer in self._met_at_call:
            # Its model was found at its first call, while the previous task's copy
            # was still held (by its last loss's graph): dropped by now, it closes
            # before this model's first step.
            self._met_at_call.discard(optimizer)
            self._release_dropped()
        try:
            self._attach(optimizer)
        except Exception as exc:
            self._internal.internal_error("trainwatch run: optimizer discovery", exc, self.steps)
        if optimizer in self._pending:
            self._pending_step_begins(optimizer, args, kwargs)
            self._first_step_of_stale(optimizer)
        return None

    def _first_step_of_stale(self, optimizer: Optimizer) -> None:
        """A pending optimizer's first step, while models of ours train by hand: one
        over module parameters that no module holds any more (a model or a head
        replaced after it was built, the old one freed) can train no model found
        later, so each hand-trained model is looked at now for being what replaced
        them, and told at its own first step (see _look_for_replaced), not two of
        the optimizer's steps later."""
        try:
            for monitor in list(self.monitors):
                if monitor.step_count and not monitor.optimizers and not monitor.closed:
                    self._look_for_replaced(monitor, first_step=optimizer)
        except Exception as exc:
            self._internal.internal_error("trainwatch run: replaced model", exc, self.steps)

    def _pending_step_begins(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """A pending optimizer's step begins: counted (a run that watched no step says
        that optimizers stepped nonetheless); with a closure, its model may be found
        inside it, and then joins this step under way (``_attach``)."""
        self._unwatched_steps[type(optimizer).__name__] += 1
        self._unwatched_by[optimizer] = self._unwatched_by.get(optimizer, 0) + 1
        closure = args[1] if len(args) > 1 else (kwargs or {}).get("closure")
        self._closure_stepping = weakref.ref(optimizer) if closure is not None else None

    def _attach(self, optimizer: Optimizer) -> None:
        """Join the optimizer to every monitor of ours that owns some of its parameters.

        Runs inside the global pre-step hook, before the per-instance hooks, so
        the monitor sees this very step. Parameters no model of ours owns yet
        (a model first called inside the optimizer's closure) keep it pending
        until that model appears.
        """
        unowned = self._unowned(optimizer)
        # Built while the forward hooks were off, and its model not met since (one
        # called only inside a torch.func transform, or never: see _optimizer_built).
        awaited = self._awaited.pop(optimizer, None) is not None
        if unowned and (awaited or not self._forward_handles) and not self._closed:
            # Its model ran while the forward hooks were off (a second model,
            # built after the first had settled): find it now, so that this
            # step, its first, is counted; past the first few, at its next call.
            if self._first_step_searches < _SEARCHES_AT_FIRST_STEP:
                self._first_step_searches += 1
                self._discover_holders(unowned, hooks_on=bool(self._forward_handles))
            else:
                self._unsearched.add(optimizer)
        ours = {id(m): m for m in self.monitors}
        joined: dict[int, Monitor] = {}
        unowned = False
        for group in optimizer.param_groups:
            for param in group["params"]:
                owner = registry.owner_of(param)
                if owner is None:
                    unowned = True
                elif id(owner) in ours:
                    joined[id(owner)] = owner
        for monitor in joined.values():
            if not monitor.closed:
                if not monitor.step_count and not monitor.optimizers:
                    resumed = _steps_before(monitor.model) or max(
                        _steps_of_sharers(optimizer, monitor, self.monitors),
                        self._steps_unwatched(optimizer),
                    )
                    if resumed:
                        monitor.load_state_dict({"step": resumed})
                self._date_by_trainer(monitor)
                monitor.add_optimizer(optimizer)
                stepping = self._closure_stepping
                if stepping is not None and stepping() is optimizer:
                    monitor.closure_step_began(optimizer)  # found inside its closure
                # its optimizer marks its steps from now on: backward ends are not needed
                for handle in self._backward_ends.pop(id(monitor), []):
                    handle.remove()
        if unowned:
            self._pending.add(optimizer)
            self._hook_forwards()  # its model has yet to be found
        else:
            self._pending.discard(optimizer)

    def _steps_unwatched(self, optimizer: Optimizer) -> int:
        """The steps the optimizer took before its model was found (batches skipped
        before the model's first forward, ``optimizer.step()`` still called), which no
        monitor watched: its model's count starts after them, so each step is
        numbered as the optimizer's own, as ``tw.watch(model, optimizer)`` numbers
        it. A step under way, its model found inside its closure, is watched."""
        steps = self._unwatched_by.get(optimizer, 0)
        stepping = self._closure_stepping
        if steps and stepping is not None and stepping() is optimizer:
            steps -= 1
        return steps

    def _date_by_trainer(self, monitor: Monitor) -> None:
        """A LightningModule fitted by a Trainer other than the one before (a second
        stage's ``L.Trainer``): its steps are that Trainer's ``global_step`` from now
        on, counted from its start, as the callback's are. Asked as an optimizer
        joins (each fit builds its own), never per step."""
        trainer = getattr(monitor.model, "_trainer", None)
        if trainer is None:
            return
        seen = self._fitted_by.get(monitor)
        if seen is not None and seen() is trainer:
            return
        self._fitted_by[monitor] = weakref.ref(trainer)
        step = getattr(trainer, "global_step", None)
        if seen is not None and isinstance(step, int) and step != monitor.step_count:
            if step < monitor.step_count and monitor in self.monitors:
                # The run's steps go on: this fit's come after the last one's.
                self._view_of(monitor).start += monitor.step_count - step
            monitor.load_state_dict({"step": step})

    def _unowned(self, optimizer: Optimizer) -> list[torch.Tensor]:
        """The optimizer's parameters that no monitor watches."""
        unowned = [
            p for g in optimizer.param_groups for p in g["params"] if registry.owner_of(p) is None
        ]
        if unowned:
            # A module put into a watched model (a new head): its monitor names it now.
            for monitor in self.monitors:
                if not monitor.closed:
                    monitor.refresh_layers()
            unowned = [p for p in unowned if registry.owner_of(p) is None]
        return unowned

    def _take_over(self, optimizer: Optimizer) -> None:
        """A pending optimizer steps a module that shares parameters with another
        model of ours (a classifier around a pretrained encoder, the autoencoder
        that trained it watched before). Once that model has not run for
        :data:`_OVERLAP_STEPS` of these steps, its phase is over: its monitor closes
        and the new module is watched, its step count going on from those steps.
        A model still running beside it (two heads sharing a trunk) keeps it.
        """
        try:
            for key, overlap in list(self._overlapping.items()):
                module = overlap.module()
                if module is None:
                    del self._overlapping[key]
                    continue
                if not overlap.stepped_by(optimizer, module):
                    continue
                if not overlap.others_idle():
                    overlap.steps = 0
                    overlap.mark()
                    continue
                overlap.steps += 1
                if overlap.steps < _OVERLAP_STEPS:
                    continue
                del self._overlapping[key]
                for other in overlap.others():
                    if other in self.monitors and not other.closed:
                        self._give_way(other, keep_optimizers=False)
                found = len(self.monitors)
                self._discover(module, called=False)
                for monitor in self.monitors[found:]:
                    monitor.load_state_dict({"step": overlap.steps})
        except Exception as exc:
            self._internal.internal_error("trainwatch run: model hand-over", exc, self.steps)

    def _still_pending(self, optimizer: Optimizer) -> None:
        """An optimizer stepping parameters no model of ours holds, step after step.

        Its model never came through the forward hooks: it is called only
        inside a ``torch.func`` transform (``functional_call`` under ``vmap``
        or ``grad``, as in MAML), or it was compiled in place
        (``model.compile()``: its module calls happen inside the compiled
        graph, where the hooks step aside), and the hooks leave those alone. After
        :data:`_PENDING_STEPS` of its steps the model is looked for by its
        parameters instead (one heap scan), and watched from this step on;
        so is the model of an optimizer whose first-step search was left out
        (:data:`_SEARCHES_AT_FIRST_STEP`) when its next call has not found it
        (a meta-model only ever updated, never called, in Reptile).
        An optimizer none of whose tensors any module holds is told then, or the
        model frozen whole it was meant to train (see FrozenModelLooks).
        """
        steps = self._pending_steps.get(id(optimizer), 0) + 1
        self._pending_steps[id(optimizer)] = steps
        if steps == _IDLE_PAIRING_STEPS:
            try:
                # Its steps so far: those counted while pending, and its first.
                self._unpair_idle(optimizer, steps + 1)
            except Exception as exc:
                self._internal.internal_error("trainwatch run: replaced model", exc, self.steps)
            try:
                owned = any(registry.owner_of(p) is not None for p in _parameters_of(optimizer))
                stepping = any(m.optimizers or m.step_count for m in registry.owners())
                if optimizer in self._pending and not owned and not stepping:
                    # A model frozen whole it may have been meant to train: its
                    # layers looked at over this step (told at the next, below).
                    self._frozen_looks.arm(optimizer, self.monitors)
            except Exception as exc:
                self._internal.internal_error("trainwatch run: frozen model", exc, self.steps)
        if steps != _PENDING_STEPS:
            return
        try:
            # The frozen models looked at over the last step: their hooks come off now.
            frozen = self._frozen_looks.verdicts(optimizer)
            if self._transformed_calls or self._compiled_calls or optimizer in self._unsearched:
                self._discover_by_parameters(optimizer, steps)
            # Else its model is yet to run (a later phase's): the forward hooks find it.
            if optimizer in self._pending:
                self._tell_if_held_by_no_module(optimizer, steps - 1, frozen)
        except Exception as exc:
            self._internal.internal_error("trainwatch run: optimizer discovery", exc, self.steps)

    def _discover_by_parameters(self, optimizer: Optimizer, steps: int) -> None:
        unowned = [
            p for g in optimizer.param_groups for p in g["params"] if registry.owner_of(p) is None
        ]
        found = len(self.monitors)
        if unowned:
            self._discover_holders(unowned)
        for monitor in self.monitors[found:]:
            # Its steps so far went by unwatched: the count goes on from them,
            # so a finding names the script's own step.
            monitor.load_state_dict({"step": steps})
        self._attach(optimizer)

    def _tell_if_held_by_no_module(
        self, optimizer: Optimizer, step: int, frozen: Sequence[tuple[Monitor, LooseTraining]] = ()
    ) -> None:
        """One ``info`` line for an optimizer whose tensors no module holds, in a run
        that watches nothing stepping: the ensemble of ``torch.func.stack_module_state``
        (stacked copies of the weights, stepped under ``functional_call`` and
        ``vmap``), or bare tensors. Models are found by their modules, so nothing
        of its training is watched. Tensors stepped beside a watched model that
        steps (a learned loss weight, in its optimizer or one of its own; an
        input image optimized through a frozen network) are not told.
        """
        params = [p for g in optimizer.param_groups for p in g["params"]]
        section = self.config.rule("trainable_parameters")
        if section is None or not section.enabled or not params:
            return
        if any(registry.owner_of(p) is not None for p in params):
            return
        if any(owner.optimizers or owner.step_count for owner in registry.owners()):
            # The run watches a model that steps: these tensors sit beside it (a
            # loss weight), or are what a watched model's gradient flows into (the
            # image of a style transfer, an adversarial perturbation).
            return
        if _modules_holding(params):
            return  # its model has yet to run: the forward hooks will find it
        for monitor, loose in frozen:
            # A model frozen whole by mistake (see FrozenModelLooks): these tensors
            # are all that trains.
            monitor.tell_loose_training(loose, monitor.step_count)
        if frozen:
            return
        kind = type(optimizer).__name__
        count = len(params)
        tensors = f"{count} tensor{'s' if count != 1 else ''}"
        elements = sum(p.numel() for p in params)
        alert = Alert(
            rule="trainable_parameters",
            severity="info",
            step=step,
            module=None,
            message=(
                f"the {kind} optimizer steps {tensors} ({elements:,} elements) "
                "that no module holds (stacked with torch.func.stack_module_state, "
                "or bare tensors): trainwatch run finds models by their modules, so their "
                "training is not watched (no step, gradient or loss is checked)"
            ),
            hint=(
                "hold the tensors in a module: for an ensemble, the stacked tensors as "
                "nn.Parameters of a module whose forward runs the vmap (or its members "
                "as modules), then call that module; trainwatch run finds it, or "
                "tw.watch it (README: trainwatch run)"
            ),
            data={
                "finding": "held by no module",
                "optimizer": kind,
                "tensors": count,
                "elements": elements,
            },
        )
        self._emit(alert, "")

    def _discover_holders(self, params: list[torch.Tensor], hooks_on: bool = False) -> None:
        """Watch the outermost modules holding ``params`` (one heap scan).

        A module holding another found module is the model, as the first
        module called would be; a module holding none of them is left alone.
        ``hooks_on``: the forward hooks were on since the optimizer was built, so
        a holder they met and left unwatched (a model built around part of one of
        ours, see _take_over) was left so on purpose: then none is watched.
        """
        wanted = {id(p) for p in params}
        try:
            watched = {id(sub) for m in self.monitors if not m.closed for sub in m.model.modules()}
            holders = [
                obj
                for obj in gc.get_objects()
                if issubclass(type(obj), nn.Module)
                and id(obj) not in watched
                and any(id(p) in wanted for p in obj.parameters())
            ]
            if hooks_on and any(holder in self._seen for holder in holders):
                return
            holders = [holder for holder in holders if holder not in self._seen]
            inner = {id(sub) for holder in holders for sub in holder.modules() if sub is not holder}
            for holder in holders:
                if id(holder) not in inner:
                    self._seen.add(holder)
                    self._discover(holder, called=False)
        except Exception as exc:
            self._internal.internal_error("trainwatch run: model search", exc, self.steps)

    def _find_optimizers(self, monitor: Monitor, found: list[Optimizer] | None = None) -> bool:
        """Attach live optimizers holding the monitor's parameters (one heap scan,
        none when ``found`` gives those of the scan just made over them)."""
        try:
            if found is None:
                found = _optimizers_over(list(monitor.model.parameters()))
            for optimizer in found:
                if optimizer in self._idle_optimizers:
                    continue
                self._handled.add(optimizer)
                self._attach(optimizer)
        except Exception as exc:
            self._internal.internal_error("trainwatch run: optimizer search", exc, self.steps)
        return bool(monitor.optimizers)

    def _holder_called_through(
        self, module: nn.Module, params: list[torch.Tensor]
    ) -> tuple[nn.Module | None, list[Optimizer] | None]:
        """The model ``module`` is a part of, when the loop calls its parts and never
        the model (a PPO agent's ``get_value(x)`` calling ``self.critic(x)``, a Siamese
        net's ``forward_once``); with the optimizers the heap scan found over
        ``module`` (None: none made, a pending one holds it).

        Told by an optimizer known now that holds all of the module's trainable
        parameters and more: the module containing it whose parameters cover that
        optimizer's is looked for (one scan of live modules), the smallest one.
        An optimizer over exactly the module (a per-task copy's inner SGD) asks
        for no scan; after :data:`_PART_SEARCHES` scans that found no such
        module (an optimizer over two separate models), none is made.
        """
        scanned = None
        try:
            wanted = {id(p) for p in params}
            known = [o for o in (*self._pending, *self._awaited) if _holds_any(o, wanted)]
            if not known:
                known = scanned = _optimizers_over(params)
            wider = [o for o in known if _holds_more(o, params)]
            if not wider or self._part_searches >= _PART_SEARCHES:
                return None, scanned
            holder = _smallest_holder(module, wider)
            if holder is None or not self._may_hold(holder):
                self._part_searches += 1
                return None, scanned
        except Exception as exc:  # the module is watched on its own, as before
            self._internal.internal_error("trainwatch run: model search", exc, self.steps)
            return None, scanned
        return holder, scanned

    def _may_hold(self, holder: nn.Module) -> bool:
        """Whether ``holder`` may be watched: none of its parameters watched yet, or
        only by parts of it that have taken no step (they give way to it)."""
        owners = {id(o): o for o in map(registry.owner_of, holder.parameters()) if o is not None}
        return all(o in self.monitors and _part_of(o, holder) for o in owners.values())

    def _inside_model_of(self, owners: Any, module: nn.Module) -> bool:
        """Whether ``module`` is inside the model of one of ``owners`` watched through
        its parts: then its calls are that model's passes."""
        return any(
            owner in self._through_parts and any(sub is module for sub in owner.model.modules())
            for owner in owners
        )

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self._receiver is not None:
            self._receiver.at_step(self.steps - 1)
        if self.max_steps is not None and self.steps >= self.max_steps:
            self.stopped = True
            raise StopRun
        if self._forward_handles:  # models may still be found (pending optimizers)
            self._closure_stepping = None  # no step under way now
            if (
                self.steps >= _SETTLED_AFTER
                and not self._pending
                and self.monitors
                and all(m.optimizers or m.closed or not m.step_count for m in self.monitors)
                and not (self._not_called and self._awaiting_replacement())
                and not (self._awaited and self._awaiting_built())
            ):
                # Every model found steps with an optimizer, or takes no steps at all
                # (a momentum target, an EMA copy, a frozen teacher: run, never
                # trained by backward; their own pass hooks stay).
                self._unhook_forwards()
        return None

    def _manual_step(self, monitor: Monitor) -> None:
        if monitor.closed or monitor.optimizers:
            return
        if monitor not in self._searched:
            self._searched.add(monitor)
            # The usual loop built its optimizer before this first backward but
            # has not stepped it yet: find it, or this backward would count as
            # a hand-made step on top of the optimizer's.
            if self._find_optimizers(monitor):
                return
        try:
            monitor.step()
        except TrainingHealthError:
            raise
        except Exception as exc:
            self._internal.internal_error("trainwatch run: manual step", exc, self.steps)
        if self._not_called or self._pending or self._stale_optimizers:
            # Some optimizer steps parameters no model trained now holds.
            try:
                self._look_for_replaced(monitor)
            except Exception as exc:
                self._internal.internal_error("trainwatch run: replaced model", exc, self.steps)
        if self.max_steps is not None and self.steps >= self.max_steps:
            # Stop at the next forward, after the script has applied this update.
            self.stopped = True
            self._stop_next = True

    # -- a model replaced after its optimizer was built ------------------------------
    def _model_not_called(self, monitor: Monitor, since: int) -> None:
        """The monitor's optimizer steps while its model is no longer called (told by
        the monitor, see ``Monitor.on_model_not_called``): the loop may train a copy
        made after the optimizer was built (``model = copy.deepcopy(best)``). The
        forward hooks go on (they are often off by then) to find that copy at its
        next call, and stay on while the wait lasts (see _awaiting_replacement)."""
        if monitor not in self.monitors or monitor.step_count - since > _REPLACEMENT_WAIT:
            return  # (waited for long enough: its monitor tells it, see zero_gradient)
        if id(monitor) not in self._not_called:
            self._not_called[id(monitor)] = (weakref.ref(monitor), monitor.passes_seen, since)
        self._hook_forwards()
        try:
            # The model the loop trains instead may be found already, paired with
            # an optimizer that is not the loop's (an unpickled checkpoint's); its
            # steps go on from this one's (counted as it ends).
            for optimizer in monitor.optimizers:
                self._unpair_idle(optimizer, monitor.step_count + 1, stale=monitor)
        except Exception as exc:
            self._internal.internal_error("trainwatch run: replaced model", exc, self.steps)

    def _awaiting_replacement(self) -> bool:
        """Whether a model no longer called still waits for the one replacing it; one
        called again, closed, or waited for :data:`_REPLACEMENT_WAIT` steps is not."""
        for key, (ref, passes, since) in list(self._not_called.items()):
            monitor = ref()
            if (
                monitor is None
                or monitor.closed
                or monitor.passes_seen != passes
                or monitor.step_count - since > _REPLACEMENT_WAIT
            ):
                del self._not_called[key]
        return bool(self._not_called)

    def _stale_monitors(self) -> list[tuple[Monitor, int]]:
        """The models still not called whose optimizers step, with their first such step."""
        found = []
        if self._awaiting_replacement():
            for ref, _, since in self._not_called.values():
                monitor = ref()
                if monitor is not None:
                    found.append((monitor, since))
        return found

    def _continue_steps(self, monitor: Monitor) -> None:
        """A new model without an optimizer, found while one of ours set up alike is no
        longer called: the loop trains it in its place (a copy made after the
        optimizer was built), so its steps go on from that model's."""
        params = [p for p in unwrap(monitor.model).parameters() if p.requires_grad]
        for stale, _ in self._stale_monitors():
            if stale is not monitor and any(
                _fits(_parameters_of(opt), params) for opt in stale.optimizers
            ):
                self._go_on_from(monitor, stale, stale.step_count)
                return
        if any(_fits(_parameters_of(opt), params) for opt in list(self._stale_optimizers)):
            monitor.load_state_dict({"step": self.steps})  # replaced again
            self._view_of(monitor).start = 0  # (its count is the run's)

    def _go_on_from(self, monitor: Monitor, stale: Monitor, step: int) -> None:
        """The monitor's model replaced ``stale``'s (the loop trains it in its place):
        its step count goes on from that model's, at ``step``, and the run counts
        its steps as that model's (see _ModelView.start)."""
        if step > monitor.step_count:
            monitor.load_state_dict({"step": step})
        self._view_of(monitor).start = self._view_of(stale).start

    def _look_for_replaced(self, monitor: Monitor, first_step: Optimizer | None = None) -> None:
        """At a step of a hand-trained model (no optimizer holds it) whose parameters got
        gradients: an optimizer stepping parameters of the same shapes, none of which
        got a gradient, held by a model no longer called (or by a module never called)
        is the optimizer built before the model was replaced by a copy: a deep copy,
        ``prepare_qat`` (``inplace=False``), a new instance loaded. The model is told
        (``not_optimized``), once; the old model's monitor, its model replaced, closes.

        Asked only while some optimizer steps parameters that no model trained now
        holds, at the model's first :data:`_REPLACED_LOOKS` such steps; and at the
        first step of such an optimizer (``first_step``), which is looked at alone.
        """
        looks = self._replaced_looks.get(monitor, 0)
        if looks >= _REPLACED_LOOKS or monitor.closed or monitor.optimizers:
            return
        self._replaced_looks[monitor] = looks + 1
        params = [p for p in unwrap(monitor.model).parameters() if p.requires_grad]
        if not any(p.grad is not None for p in params):
            return
        # The model's first step watched: its training without an optimizer began there.
        began = monitor.step_count - monitor.steps_here
        if first_step is not None:
            replaced = self._stale_pending(params, monitor, first_step)
            if replaced is not None:
                self._tell_replaced(monitor, replaced, began)
            return
        for stale, since in self._stale_monitors():
            if stale is monitor:
                continue
            for optimizer in stale.optimizers:
                held = _parameters_of(optimizer)
                if _fits(held, params) and all(p.grad is None for p in held):
                    root = unwrap(stale.model)
                    replaced = ReplacedModel(
                        type(optimizer).__name__, type(root).__name__, stale.model_name, since
                    )
                    self._stale_optimizers[optimizer] = replaced
                    # The loop trains this model in the stale one's place since
                    # ``since``: its steps are numbered on from there (found late, at
                    # a step of its own, it is behind them), and told from there.
                    self._go_on_from(monitor, stale, since + monitor.steps_here)
                    self._tell_replaced(monitor, replaced, since)
                    self._retire(stale)
                    return
        for optimizer, told in list(self._stale_optimizers.items()):
            held = _parameters_of(optimizer)
            if _fits(held, params) and all(p.grad is None for p in held):
                self._tell_replaced(monitor, told, began)  # the model replaced once more
                return
        replaced = self._stale_pending(params, monitor)
        if replaced is not None:
            self._tell_replaced(monitor, replaced, began)

    def _unpair_idle(self, stepping: Optimizer, steps: int, stale: Monitor | None = None) -> None:
        """``stepping`` steps parameters no model trained now holds: those of no model
        of ours (it is pending), or of ``stale``'s, a model no longer called. A model
        of ours that backward passes reach, paired by a search with optimizers none
        of which has stepped, whose parameters ``stepping``'s match (see _fits) and
        none of them with a gradient, is trained by no optimizer: those it was paired
        with hold its parameters but are not the loop's. So goes a resume from a
        checkpoint of whole objects (``{"model": model, "optimizer": opt}``) that
        takes ``model = ck["model"]`` after the optimizer was built over another
        model: the unpickled optimizer, alive in ``ck``, holds exactly the loaded
        model's parameters and never steps; the one that steps holds the other
        model's. The model is watched anew without them, trained by hand, its step
        count at ``steps`` (one a backward); its next step tells the replacement
        (see _look_for_replaced), as for a model no optimizer ever held.

        A model called only where the forward hooks do not look (a ``torch.func``
        transform, a compiled graph) may be the one ``stepping`` trains: then none
        is unpaired.
        """
        if self._transformed_calls or self._compiled_calls:
            return
        held = _module_parameters(_parameters_of(stepping))
        if any(p.grad is not None for p in held):
            return
        if any(registry.owner_of(p) not in (None, stale) for p in held):
            return
        for monitor in list(self.monitors):
            if monitor is stale or monitor.closed or monitor.step_count or not monitor.optimizers:
                continue
            params = [p for p in unwrap(monitor.model).parameters() if p.requires_grad]
            if not any(p.grad is not None for p in params) or not _fits(held, params):
                continue
            for optimizer in monitor.optimizers:
                self._idle_optimizers.add(optimizer)
                self._handled.discard(optimizer)  # one that steps after all joins then
            # Its count goes on from ``stale``'s, else from ``stepping``'s own steps.
            start = self._view_of(stale if stale in self.monitors else monitor).start
            self._rewatch(monitor, steps, start)
            return

    def _rewatch(self, monitor: Monitor, steps: int, start: int) -> None:
        """The monitor's model watched anew, under its name, its step count at ``steps``
        (its own monitor closes, no step watched: its optimizers go with it), after
        ``start`` steps of the run (see _ModelView.start)."""
        model, name = monitor.model, monitor.model_name
        self._give_way(monitor, keep_optimizers=False)
        if name is not None:
            self._names.discard(name)
        found = len(self.monitors)
        self._discover(model, called=False)
        for new in self.monitors[found:]:
            new.load_state_dict({"step": steps})
            self._view_of(new).start = start

    def _stale_pending(
        self, params: list[torch.Tensor], monitor: Monitor, first_step: Optimizer | None = None
    ) -> ReplacedModel | None:
        """An optimizer that has stepped twice over module parameters that match
        ``params``, the trainable ones of ``monitor``'s model (see _fits), or those
        of one of its parts (a new head, see trainwatch.replaced_part), that no
        model of ours holds, none with a gradient: held by a module never called
        (the float model ``prepare_qat`` copied), or by none any more (the model
        the optimizer was built over, its name bound to a new instance loaded; the
        head it was built over, replaced). Its bare tensors, never a module's, are
        left out (a learned loss weight beside the model's parameters may well get
        gradients): one stepping only those (SAC's temperature ``log_alpha``, its
        own Adam) replaced no model.
        ``first_step``: that optimizer only, at its first step, taken only where no
        module holds its parameters any more (one holding them may yet be called).
        A module called only where the forward hooks do not look (a ``torch.func``
        transform, a compiled graph) may train them: then none is."""
        if self._transformed_calls or self._compiled_calls:
            return None
        looked = [first_step] if first_step is not None else list(self._pending)
        for optimizer in looked:
            if first_step is None and self._pending_steps.get(id(optimizer), 0) < 1:
                continue
            held = _module_parameters(_parameters_of(optimizer))
            if any(p.grad is not None for p in held) or any(
                registry.owner_of(p) is not None for p in held
            ):
                continue
            part = None
            if not _fits(held, params):
                part = replaced_part(held, unwrap(monitor.model))
                if part is None:
                    continue
            holder = _module_holding(held)
            if holder is not None and first_step is not None:
                continue
            stale = type(holder).__name__ if holder is not None else None
            conversion = (
                conversion_between(held, params)
                if holder is None and part is None and overwrite_mode()
                else None
            )
            replaced = ReplacedModel(
                type(optimizer).__name__, stale, conversion=conversion, part=part
            )
            self._stale_optimizers[optimizer] = replaced
            return replaced
        return None

    def _find_converted_from(self, monitor: Monitor) -> None:
        """A model found without an optimizer while conversions put new Parameter
        objects in modules: an optimizer built before its ``.to()`` or ``.double()``
        holds its parameters from before it, which no module holds any more (see
        trainwatch.overwrite_conversion). Looked for now (one scan of live objects,
        made in overwrite mode only), before that optimizer's first step, so the
        model's first step tells it (see _look_for_replaced), as ``tw.watch`` does.
        A model replaced by a copy or a new instance is told as before, once its
        optimizer has stepped (see _stale_pending)."""
        params = [p for p in unwrap(monitor.model).parameters() if p.requires_grad]
        if not params:
            return
        for optimizer in _live_optimizers():
            if optimizer in self._stale_optimizers:
                continue
            held = _module_parameters(_parameters_of(optimizer))
            if (
                not _fits(held, params)
                or any(p.grad is not None for p in held)
                or any(registry.owner_of(p) is not None for p in held)
            ):
                continue
            conversion = conversion_between(held, params)
            if conversion is None or _module_holding(held) is not None:
                continue
            self._stale_optimizers[optimizer] = ReplacedModel(
                type(optimizer).__name__, None, conversion=conversion
            )
            return

    def _tell_replaced(self, monitor: Monitor, replaced: ReplacedModel, since: int) -> None:
        self._replaced_looks[monitor] = _REPLACED_LOOKS  # told: no more looks
        monitor.tell_replaced(replaced, since)

    def _retire(self, monitor: Monitor) -> None:
        """The monitor of a model replaced by the one the loop trains: it closes (its
        findings kept), its step count kept for the run's."""
        self._not_called.pop(id(monitor), None)
        if monitor not in self.monitors:
            return
        view = self._view_of(monitor)
        self._give_way(monitor, keep_optimizers=False)
        self._stopped(view, monitor)


# The runs open in this process. A process forked from it inherits them, hooks
# and all; there they are the parent's to report (see AutoWatch._left_to_the_parent).
_OPEN: weakref.WeakSet[AutoWatch] = weakref.WeakSet()


def _forked() -> None:
    try:
        for watcher in list(_OPEN):
            watcher._left_to_the_parent()
        _OPEN.clear()
    except Exception:  # never stand in the way of the script's own process
        pass


os.register_at_fork(after_in_child=_forked)


def _watched_parameters(monitors: Sequence[Monitor]) -> set[int]:
    """The ids of the parameters of every model the run watches."""
    return {id(param) for monitor in monitors for param in monitor.model.parameters()}


def _outside_watched(monitor: Monitor, watched: set[int]) -> bool:
    """Whether every parameter of ``monitor``'s optimizers outside its model belongs to
    another model the run watches (an EMA target kept in the online network's
    optimizer sees the online network there): its ``<outside the model>`` norm
    is theirs."""
    own = {id(param) for param in monitor.model.parameters()}
    outside = [
        id(param)
        for optimizer in monitor.optimizers
        for group in optimizer.param_groups
        for param in group["params"]
        if id(param) not in own
    ]
    return bool(outside) and all(key in watched for key in outside)
