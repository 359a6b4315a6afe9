"""Where the first NaN/Inf of a step was born, in forward and in backward.

Trigger, then diagnose. A healthy pass costs one sum of the model's output
(a reduction: any NaN/Inf makes it NaN/Inf), and a healthy step a look at the
gradient norms the step computes anyway. Only when one of them is off is the
pass replayed module by module (``nonfinite_replay``): the first module whose
output went non-finite from finite inputs is the forward origin, and is run
once more under a dispatch trace that names the op and the source line; for a
backward fault the gradient that entered the model is fed back in, and the
module whose input gradient went non-finite while its output gradient was
finite is the origin (``nonfinite_locate``).

When the verdict is taken:
- ``auto`` on CPU: as the pass ends (reading a CPU scalar costs no sync).
- ``auto`` on a GPU, and ``step`` anywhere: at the step boundary, before the
  optimizer applies the step, from one scalar read back (one sync per step).
- ``deferred`` (no sync): every module's output and gradient is summed on the
  device (``nonfinite_hooks``) and read back with the step's numbers, one
  step later; module and step are exact, the op is not traced.
- ``auto`` on a model no one rank can replay alone (FSDP-sharded modules or
  SyncBatchNorm talk to the other ranks inside their own forward): as
  ``deferred``, so the layer is still named.

Backward uses tensor hooks, never full backward hooks (about 150 us a module
and broken by in-place ops). In-place ops (``nn.ReLU(inplace=True)``,
``x += r``) change a tensor and keep its identity, so sums are matched by
identity and version counter; a module's inputs are summed as its call
begins; and every re-run gets copies of the tensors it is handed, so the
user's batch and the values their backward needs are never touched twice.

State lives in two small records replaced wholesale: one per pass
(identity matches, what a backward replay needs) and one per step (sums,
calls, origins, the flags of backward passes no step used).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainwatch.collect.nonfinite_hooks import register_global_hooks
from trainwatch.collect.nonfinite_locate import (
    FINITE,
    INF,
    NAN,
    NEG_INF,
    ForwardCall,
    NonfiniteFinding,
    StepWindow,
    backward_op,
    innermost_holding,
    locate_backward,
    locate_forward,
    op_of_node,
    sums_as_codes,
)
from trainwatch.collect.nonfinite_replay import (
    FirstNonfiniteBackward,
    Replay,
    backward_leaving_grads,
    node_source,
    replay_target,
    unreplayed_origin,
)
from trainwatch.collect.op_trace import (
    OpFinding,
    trace_first_nonfinite_op,
    trace_negative_inf_maker,
    trace_negative_inf_turned_nonfinite,
)
from trainwatch.collect.tensors import (
    detached_copies,
    finite_exact,
    finite_or_mask,
    floating_list,
    floating_tensors,
    input_range,
    non_leaf,
    version_of,
)
from trainwatch.compiled import transform_level, unwrap
from trainwatch.fresh import fresh_maker
from trainwatch.hooks import HookGroup, PlacedHook, WeakHook, hook_pass_tensor, take_out
from trainwatch.layers import own_parameters

__all__ = [
    "FINITE",
    "INF",
    "NAN",
    "NEG_INF",
    "ForwardCall",
    "NonfiniteFinding",
    "NonfiniteProbe",
    "StepWindow",
    "locate_backward",
    "locate_forward",
]

_MAX_SUMS = 20000  # per step; past it, checks pause until the next step
# Calls of a replay that made -inf from finite inputs, kept to be traced if a
# NaN/+inf follows; past it, later ones are not kept.
_MAX_MAKERS = 16
_REPLAY_STREAK = 3  # bad steps in a row after which replays stop
# Passes whose verdict may wait for the step boundary; past it (a long
# evaluation between steps) they are read at once.
_MAX_WAITING = 16
# Backward passes without a step kept per step (their flags); past it the oldest go.
NOTED_PASSES = 64

# Modules that cannot turn finite inputs into NaN/Inf, forward or backward:
# left unhooked, they cost nothing, and the next checked module still sees
# whatever they pass on.
CANNOT_ORIGINATE: tuple[type[nn.Module], ...] = (
    nn.Identity,
    nn.Flatten,
    nn.Unflatten,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Hardtanh,
    nn.Hardsigmoid,
    nn.Hardswish,
    nn.GELU,
    nn.SiLU,
    nn.Softsign,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
)


@dataclass
class _WaitingPass:
    """A pass whose output sums wait for the step boundary, with what a replay needs."""

    module: nn.Module
    args: Any
    kwargs: Any
    codes: torch.Tensor  # fp64 sum of each floating output (device)
    masks: list[bool]  # per output: outside autograd, so a -inf sum is a mask
    rng: torch.Tensor | None  # the CPU generator's state as the pass began


@dataclass
class _NegativeInfMaker:
    """A replayed call whose output held -inf (outside autograd) from finite inputs:
    a mask, or arithmetic that overflowed to -inf; traced only if a NaN follows."""

    call: ForwardCall
    module: nn.Module
    args: Any
    kwargs: Any


@dataclass
class _CallStart:
    """A module call as it began: its positional inputs and their sums."""

    position: int
    inputs: list[torch.Tensor]
    sums: list[int]
    given: Any = None  # copies of its positional arguments (replays only)
    rng: torch.Tensor | None = None  # the CPU generator's state then (replays only)


@dataclass(slots=True)
class _PassState:
    """What matters within one forward pass and its backward; replaced at the next."""

    # Sums already taken, by tensor identity, with the version counter they
    # saw: a tensor changed in place since (ReLU(inplace=True), ``x += r``)
    # gets a new sum.
    known: dict[int, tuple[weakref.ref[torch.Tensor], int, int | None]] = field(
        default_factory=dict
    )
    grad_known: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = field(default_factory=dict)
    grad_fns: dict[int, Any] = field(default_factory=dict)
    # Calls in progress, innermost last: a module that changes its input in
    # place is judged on the input it was given.
    calls_in_progress: list[_CallStart] = field(default_factory=list)
    # References to the batch (not copies) until the next pass: what a
    # backward replay needs if this step's gradients turn out bad.
    last_call: tuple[nn.Module, Any, Any, torch.Tensor | None] | None = None
    grad_entering: list[torch.Tensor | None] = field(default_factory=list)
    backward: bool = False  # a backward pass reached the model
    bad: bool = False  # and what entered it was non-finite
    grads: list[torch.Tensor] = field(default_factory=list)  # its gradient sums (deferred)
    # Which awaited pass (its number) last_call is, once a backward reached one.
    replay_seq: int = -1


# A pass with grad whose backward may come: (its number, its call and the CPU
# generator's state as it began, what entered it, by output position). A plain
# tuple: one is made per pass.
_AwaitedPass = tuple[
    int, tuple[nn.Module, Any, Any, torch.Tensor | None], list[torch.Tensor | None]
]


@dataclass(slots=True)
class _StepState:
    """What one step gathered; handed over (``take``) and replaced at the boundary."""

    sums: list[torch.Tensor] = field(default_factory=list)
    calls: list[ForwardCall] = field(default_factory=list)
    # Exact verdicts of sums read at once, index-aligned with ``sums`` (None: not read).
    finite: list[bool | None] = field(default_factory=list)
    maskable: list[bool] = field(default_factory=list)
    forward_origin: NonfiniteFinding | None = None
    negative_inf_makers: list[_NegativeInfMaker] = field(default_factory=list)
    grad_sums: list[torch.Tensor] = field(default_factory=list)
    grad_events: list[tuple[ForwardCall, str, int]] = field(default_factory=list)
    grad_ok: list[bool | None] = field(default_factory=list)
    backward_origin: NonfiniteFinding | None = None
    out_bad: set[int] = field(default_factory=set)
    # Calls whose output gradient arrived: only those can be an origin (a
    # checkpoint's recomputed outputs are not in the graph backward runs).
    out_seen: set[int] = field(default_factory=set)
    immediate_grads: bool = True
    any_bad_grad: bool = False
    # The first non-finite gradient entering the model, as it was (None: all
    # finite): its dtype and kind tell an fp16 overflow from a non-finite loss.
    entering_origin: NonfiniteFinding | None = None
    # Where the entering hooks of this step's last two passes with grad sit
    # (one list a pass): an earlier pass's are taken out.
    awaiting: list[list[PlacedHook]] = field(default_factory=list)
    output_bad: bool = False
    # A backward replay of this step ran (and found what it found).
    backward_replayed: bool = False
    # A backward replay was due but the model may not be replayed on one rank
    # (FSDP-sharded or SyncBatchNorm modules), with the pass and its entering
    # gradient finite.
    backward_unreplayable: bool = False
    # One flag per backward pass since the step: "its gradients had a NaN/Inf".
    bad_backward_passes: list[torch.Tensor | float] = field(default_factory=list)
    # A forward pass of the model was seen this step. Not so when the model
    # was compiled in place (model.compile()): its hooks run inside the graph.
    saw_pass: bool = False


# Made at every pass and step (trainwatch.fresh).
_new_pass_state = fresh_maker(_PassState)
_new_step_state = fresh_maker(_StepState)
# A step's window, the same way: (calls, finite, forward_origin, backward_origin,
# grad_events), the rest at its defaults.
_new_window = fresh_maker(StepWindow)


class NonfiniteProbe:
    def __init__(
        self, names: list[str], on_error: Any, trace_ops: bool = True, mode: str = "auto"
    ) -> None:
        self.names = names
        # "auto" / "step": trigger, then diagnose (one sum of the model's
        # output per pass, a replay module by module when it or a gradient is
        # off); the verdict is taken as the pass ends on CPU ("auto") and at
        # the step boundary on other devices, or always there ("step").
        # "deferred": every module's sums, read back with the step, no sync.
        self.mode = mode
        self.on_the_spot = mode != "deferred"
        # The current passes' verdicts wait for the step boundary.
        self.at_step = mode == "step"
        # Passes whose output sums wait for the step boundary (step verdicts).
        self._waiting: list[_WaitingPass] = []
        # The CPU generator's state as the current pass began: a replay draws the
        # same dropout masks (and ``torch.rand`` in a forward) as the pass did, so
        # a NaN/Inf that hangs on them (every token of a text dropped, two
        # embeddings made equal) is found again where it was born. A copy of a
        # few kilobytes, no op dispatched; forked state is put back after.
        self._rng_at_start: torch.Tensor | None = None
        self.enabled = True
        self.suspended = False
        self.trace_ops = trace_ops
        self._on_error = on_error
        self.on_new_pass: Any = None
        # Told when a pass without gradients met a NaN/Inf (its verdict taken on the spot).
        self.on_nograd_finding: Any = None
        self._pass_seq = 0  # passes awaiting a backward, counted
        # During a backward replay: the node that made its first NaN/Inf, once seen.
        self._backward_watch: FirstNonfiniteBackward | None = None
        self.passes_worth_a_look = 1
        self._handles = HookGroup()  # module hooks: deferred mode only
        self._modules: list[weakref.ref[nn.Module]] = []
        self._ids: dict[int, int] = {}  # id(module) -> its index in named_modules()
        self._checkable: set[int] = set()
        self._first_param: torch.Tensor | None = None
        # Outermost calls of the model's modules in progress (a pass starts at 0).
        self._depth = 0
        self._replaying = False
        self._recomputing = False
        # Consecutive steps with a non-finite output or gradient: past a few,
        # replays stop (a broken model would otherwise pay one every step).
        self._bad_streak = 0
        self._step_bad = False
        # The parameters the last update applied to, and their version counters
        # and storages then (set at every step boundary: C loops).
        self.updated: tuple[list[torch.Tensor], list[int], list[int]] | None = None
        self.reset()

    def mark_weights_written(self) -> None:
        """The model takes no update of its own (an EMA copy): non-finite weights its
        pass met were written by the training code."""
        origin = self._this_step.forward_origin
        if origin is not None and origin.weights_nonfinite:
            origin.weights_written = True

    def written_since_update(self, params: list[torch.Tensor]) -> bool | None:
        """Whether any of ``params`` was written in place since the last update was
        applied (None: no update seen yet). One the update did not touch (a frozen
        weight, held by no optimizer) was written whenever it went non-finite.

        An optimizer's update moves a parameter's version counter, and so does
        every later in-place write (a clamp, ``load_state_dict``, a copy from
        another model); ``param.data = ...`` gives it a new storage. A write in
        place through ``.data`` moves neither: such a weight is taken for the
        update's doing, and the alert says so.
        """
        updated = self.updated
        if updated is None:
            return None
        listed, versions, storages = updated
        after_update = dict(zip(map(id, listed), zip(versions, storages)))  # the rare path only
        known = [p for p in params if id(p) in after_update]
        if len(known) < len(params):
            return True  # a weight no update moved: a write made it so
        return any((p._version, p.data_ptr()) != after_update[id(p)] for p in known)

    # -- lifecycle -------------------------------------------------------
    def attach(self, model: nn.Module) -> None:
        self._ids.clear()
        for index, (_, module) in enumerate(model.named_modules()):
            self._modules.append(weakref.ref(module))
            self._ids[id(module)] = index
            if not isinstance(module, CANNOT_ORIGINATE) or module is model:
                self._checkable.add(index)
        self.find_device(model)

    def module_hooks(self) -> list[Any]:
        """Hooks on every module call: always in deferred mode, else only for a replay."""
        return register_global_hooks(self)

    # -- the model's passes (ModelPasses), where modules are not hooked -------
    def pass_starts(self, module: nn.Module) -> None:
        if self._handles or self._replaying or not self.enabled or self.suspended:
            return  # the module hooks see the pass
        self._rng_at_start = _cpu_rng_state()
        if not torch.is_grad_enabled():
            # No backward comes of a pass under no_grad (an evaluation, a DQN
            # target made between a prediction and its backward): the pass
            # whose backward may still come stays the one a replay would use.
            self._recomputing = False
            self._this_step.saw_pass = True
            return
        # Gradient checkpointing of the whole model re-runs it inside backward:
        # that is no new pass.
        task = _graph_task_id  # _inside_backward(), written out: once per pass
        self._recomputing = task is not None and task() != -1
        if not self._recomputing:
            self._new_pass()

    def pass_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._handles or self._replaying or not self.enabled or self.suspended:
            return
        if self.on_the_spot and not self._recomputing:
            self._end_spot_pass(module, args, kwargs, output)
            if (
                self.on_nograd_finding is not None
                and not torch.is_grad_enabled()
                and not self.at_step
                and self.found_in_step()
            ):
                self.on_nograd_finding()  # no backward will follow this pass

    def find_device(self, model: nn.Module) -> None:
        """Keep a parameter to tell where the model runs (CPU: checks on the spot).

        Called again when the parameters were replaced (``module.to()`` in
        overwrite mode), so a model moved to a GPU stops being checked on the spot.
        """
        self._first_param = next(model.parameters(), None)
        first = self._first_param
        on_cpu = first is None or first.device.type == "cpu"
        self.at_step = self.mode == "step" or (self.mode == "auto" and not on_cpu)
        if self.mode == "auto":
            # Without a replay only the model could be named: every module's
            # sums, as in deferred mode, name the layer where a replay is barred.
            self.on_the_spot = replay_target(model) is not None
        # Deferred (no-sync) mode: every module's sums, every step. Otherwise
        # only the model's output, and the modules only in a replay.
        wanted = not self.on_the_spot
        if wanted and not self._handles:
            self._handles.extend(self.module_hooks())
        elif not wanted and self._handles:
            self._handles.remove_all()

    def cuda_devices(self) -> list[int]:
        """The CUDA devices the model runs on (whose RNG a replay forks)."""
        first = self._first_param
        if first is None or first.device.type != "cuda":
            return []
        return [first.device.index if first.device.index is not None else 0]

    def detach(self) -> None:
        self._handles.remove_all()
        self.reset()

    def fail(self, exc: BaseException) -> None:
        self.enabled = False
        self.reset()
        self._on_error("non-finite probe", exc)

    def reset(self) -> None:
        """Start a new step: drop everything the last one gathered."""
        self._this_step = _new_step_state()
        self._this_pass = _new_pass_state()

    # -- passes ----------------------------------------------------------
    # -- every module call (global hooks: deferred mode and replays) ----------
    def _position(self, module: nn.Module) -> int | None:
        position = self._ids.get(id(module))
        if position is None:
            # torch.compile(model)'s wrapper runs eagerly around the compiled
            # model: it stands for the model (or submodule) it wraps.
            inner = unwrap(module)
            if inner is not module:
                position = self._ids.get(id(inner))
        return position

    def module_starts(self, module: nn.Module, args: Any) -> None:
        position = self._position(module)
        if position is not None and self._follows_call():
            self.before_call(position, args)

    def module_ends(self, module: nn.Module, args: Any, *rest: Any) -> None:
        position = self._position(module)
        if position is not None and self._follows_call():
            kwargs, output = rest if len(rest) == 2 else ({}, rest[0])
            self.after_call(position, module, args, kwargs, output)

    def _follows_call(self) -> bool:
        """Whether a call of one of the model's modules is checked on its own.

        Not inside a torch.func transform (an ensemble's template run under
        vmap + functional_call): its tensors are wrapped, with no value to
        read; the outermost call, made outside the transform, still is.
        """
        return self.enabled and not self.suspended and transform_level() is None

    def before_call(self, position: int, args: Any) -> None:
        if self._depth == 0 and not self._replaying:
            # Gradient checkpointing re-runs blocks inside backward: that is
            # no new pass.
            self._recomputing = _inside_backward()
            if not self._recomputing:
                self._new_pass()
        self._depth += 1
        if self._checks_each_module() and position in self._checkable:
            if len(self._this_step.sums) <= _MAX_SUMS:
                ins = list(floating_tensors(args))
                ids = [self._sum_index(t) for t in ins]
                # In a replay (cost is no object there) the op trace may need
                # to re-run the module on what it was given, before it changed it.
                given = rng = None
                if self._replaying and self.trace_ops:
                    given, rng = detached_copies(args), _cpu_rng_state()
                self._this_pass.calls_in_progress.append(_CallStart(position, ins, ids, given, rng))

    def after_call(
        self, position: int, module: nn.Module, args: Any, kwargs: Any, output: Any
    ) -> None:
        self._depth = max(0, self._depth - 1)
        if self._checks_each_module() and position in self._checkable:
            self.after_forward(position, module, args, kwargs, output)
        if self._depth == 0 and self.on_the_spot and not self._replaying and not self._recomputing:
            self._end_spot_pass(module, args, kwargs, output)

    def _checks_each_module(self) -> bool:
        """Replays and device passes check every module; so does a recomputation,
        even on the spot: a reentrant checkpoint's recomputed tensors are the ones
        its backward flows through, and a replay cannot re-enter it (it refuses
        torch.autograd.grad)."""
        return self._replaying or not self.on_the_spot or self._recomputing

    def _new_pass(self) -> None:
        """An outermost call of the model begins (a forward pass)."""
        self._this_step.saw_pass = True
        done = self._this_pass
        if done.grads:  # device passes: one flag per backward, read later
            self._note_pass(torch.stack(done.grads).isfinite().all().logical_not())
        elif done.backward:
            # A backward no step used since (GradScaler skipped it, or gradient
            # accumulation): only then is what entered the model summed.
            self._note_pass(self._entering_flag())
        else:
            self._this_pass = _new_pass_state()
            return  # no backward since the last pass: nothing noted
        # Identity matches and autograd nodes only matter within one pass:
        # a new record keeps memory flat across many passes per step.
        self._this_pass = _new_pass_state()
        # Told only once enough backward passes went without a step (GradScaler
        # skipping, an optimizer the monitor does not watch): the monitor sets
        # the count (at a step's end, when the step's list of passes is new, so
        # only a pass noted here can reach it); no more than the list keeps.
        if self.on_new_pass is not None and (
            len(self._this_step.bad_backward_passes) >= min(self.passes_worth_a_look, NOTED_PASSES)
        ):
            self.on_new_pass()

    def _note_pass(self, flag: torch.Tensor | float) -> None:
        self._this_step.bad_backward_passes.append(flag)
        if len(self._this_step.bad_backward_passes) > NOTED_PASSES:
            del self._this_step.bad_backward_passes[0]

    def note_skipped_pass(self, flag: torch.Tensor | float) -> None:
        """A backward pass no step used, seen by the monitor (a framework's skipped step)."""
        self._note_pass(flag)

    def _end_spot_pass(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """A pass ended: one sum of its output; a replay only if it is bad.

        On CPU the sum is read at once (no device to wait for); otherwise it
        waits, with references to the pass's inputs, for the step boundary.
        """
        module = unwrap(module)  # a replay runs the model itself, eagerly
        outs = floating_list(output)
        if self.at_step:
            if self._this_step.forward_origin is None and outs:
                codes = torch.stack([o.detach().sum(dtype=torch.float64) for o in outs])
                masks = [not o.requires_grad for o in outs]
                self._waiting.append(
                    _WaitingPass(module, args, kwargs, codes, masks, self._rng_at_start)
                )
                if len(self._waiting) >= _MAX_WAITING:
                    self.settle(None)  # a long evaluation between two steps
        elif self._this_step.forward_origin is None:
            for out in outs:
                if not finite_exact(out):
                    self._forward_bad(module, args, kwargs, self._rng_at_start)
                    break
        needs_grad = [o for o in outs if o.requires_grad and o.grad_fn is not None]
        if needs_grad and torch.is_grad_enabled():
            self._await_backward(module, args, kwargs, needs_grad)

    def _await_backward(
        self, module: nn.Module, args: Any, kwargs: Any, needs_grad: list[torch.Tensor]
    ) -> None:
        """Hook where backward enters this pass: the pass a backward replay would run.

        References to the batch (not copies), kept with the pass's own record
        of what entered it. The pass whose hook fires becomes the pass to
        replay, so a pass with grad left out of the loss (a metric taken
        without ``no_grad``) does not stand in for the one backpropagated, and
        passes summed into one loss each keep their own gradient. Until a
        backward comes, the latest pass stands. The hooks of the last two
        passes stay: a batch-of-one loop's tens of passes call into Python
        twice in backward, not once per pass.
        """
        self._pass_seq += 1
        call, entering = (module, args, kwargs, self._rng_at_start), [None] * len(needs_grad)
        candidate = (self._pass_seq, call, entering)
        this = self._this_pass
        if this.replay_seq < 0:  # no backward has reached a pass since this one began
            this.last_call, this.grad_entering = call, entering
        placed: list[PlacedHook] = []
        for position, tensor in enumerate(needs_grad):
            hook = WeakHook(self, "on_grad_entering", candidate, position)
            where = hook_pass_tensor(tensor, hook)
            if where is not None:
                placed.append(where)
        awaiting = self._this_step.awaiting
        awaiting.append(placed)
        if len(awaiting) > 2:
            for hook in awaiting.pop(0):
                take_out(hook)

    def _forward_bad(
        self, module: nn.Module, args: Any, kwargs: Any, rng: torch.Tensor | None
    ) -> None:
        self._step_bad = self._this_step.output_bad = True
        if self._bad_streak < _REPLAY_STREAK:
            self._replay_forward(module, args, kwargs, rng)

    def settle(self, norms: torch.Tensor | None) -> bool:
        """Step verdicts: one scalar read back says whether a pass or a gradient was off.

        Only then are the waiting passes read one by one and the bad one
        replayed, before the optimizer applies the step. Returns whether the
        gradient norms were non-finite (the caller replays the backward).
        """
        waiting, self._waiting = self._waiting, []
        parts = [w.codes.sum() for w in waiting]
        if norms is not None and norms.numel():
            parts.append(norms.double().sum())
        if not parts:
            return False
        total = torch.stack([p.to(parts[0].device) for p in parts]).sum()
        if math.isfinite(float(total)):  # the step's one sync
            return False
        for w in waiting:
            for value, mask in zip(w.codes.tolist(), w.masks):
                if not (math.isfinite(value) or (value == -math.inf and mask)):
                    if self._this_step.forward_origin is None:
                        self._forward_bad(w.module, w.args, w.kwargs, w.rng)
                    break
        return norms is not None and not math.isfinite(float(norms.double().sum()))

    def note_norm_overflow(self, finding: NonfiniteFinding) -> None:
        """The step's gradient norms overflowed while every gradient is finite: what
        the trigger found, handed over with the step in place of a backward origin."""
        if self._this_step.backward_origin is None:
            self._this_step.backward_origin = finding

    def on_grad_entering(self, candidate: _AwaitedPass, position: int, grad: torch.Tensor) -> None:
        """Kept, not summed: the step's gradient norms show whether anything is off.

        Of the passes backward reaches, the latest is the one a replay runs.
        """
        if not self.enabled or self.suspended:
            return
        seq, call, entering = candidate
        entering[position] = grad
        this = self._this_pass
        this.backward = True
        if seq > this.replay_seq:
            this.replay_seq = seq
            this.last_call, this.grad_entering = call, entering

    def entering_all_zero(self) -> bool:
        """Whether the gradient that entered the model in the step's last backward was
        exactly zero everywhere (a loss that sent nothing back). Asked only on a step
        whose every gradient is zero: one small reduction per output, read at once."""
        grads = [
            g for g in self._this_pass.grad_entering if g is not None and g.is_floating_point()
        ]
        return bool(grads) and not any(bool(g.detach().any()) for g in grads)

    def outputs_without_signal(self) -> list[int]:
        """The output positions whose entering gradient in the step's last backward
        was exactly zero, where another output's was not: a loss that weighs one
        task by zero. Asked only on a step with some gradient exactly zero."""
        entering = self._this_pass.grad_entering
        zero, sent = [], False
        for position, g in enumerate(entering):
            if g is None or not g.is_floating_point():
                continue
            if bool(g.detach().any()):
                sent = True
            else:
                zero.append(position)
        return zero if sent else []

    def outputs_unreached(self) -> list[int]:
        """The output positions (of those needing a gradient) that the step's last
        backward never reached, where it reached another: an output the loss left
        out on this step. Host-side only (no read of any tensor)."""
        entering = self._this_pass.grad_entering
        unreached = [position for position, g in enumerate(entering) if g is None]
        return unreached if len(unreached) < len(entering) else []

    def _entering_flag(self) -> torch.Tensor | float:
        """Whether the gradient that entered the model in the last backward was non-finite:
        a device flag when verdicts wait for the step, else a host float."""
        grads = [
            g for g in self._this_pass.grad_entering if g is not None and g.is_floating_point()
        ]
        if self.at_step and grads:
            sums = torch.stack([g.detach().sum(dtype=torch.float64) for g in grads])
            return sums.isfinite().all().logical_not().float()
        return float(self._entering_bad())

    def _entering_bad(self) -> bool:
        """Whether the gradient that entered the model in the last backward was non-finite."""
        if not self._this_pass.bad:
            bad = next(
                (
                    g
                    for g in self._this_pass.grad_entering
                    if g is not None and g.is_floating_point() and not finite_exact(g)
                ),
                None,
            )
            if bad is not None:
                self._this_pass.bad = True
                if self._this_step.entering_origin is None:
                    self._this_step.entering_origin = _entering_origin(bad)
        return self._this_pass.bad

    def _replaying_context(self, grad: bool, rng: torch.Tensor | None = None) -> Any:
        return Replay(self, grad, rng)

    def _replay_forward(
        self, module: nn.Module, args: Any, kwargs: Any, rng: torch.Tensor | None = None
    ) -> None:
        """Run the pass again module by module to find where its NaN/Inf was born."""
        # Grad mode as in the pass itself, so masks and real values are told
        # apart the same way (requires_grad) in the replay.
        target = replay_target(module)
        if target is None:
            # Collective-free: the inputs and this rank's weights, read as they are.
            self._this_step.forward_origin = unreplayed_origin(module, args, kwargs)
            return
        module = target
        with self._replaying_context(grad=torch.is_grad_enabled(), rng=rng):
            args, kwargs = detached_copies((args, kwargs))
            module(*args, **kwargs)

    def replay_backward(self) -> bool:
        """This step's gradients are bad: run the last pass again, forward and backward.

        The gradient that entered the model is fed back in, and every module's
        gradients are checked on the way; the real ``.grad`` is left alone
        (``torch.autograd.grad``). Returns whether a replay ran.
        """
        if self._this_pass.last_call is None or self._this_step.backward_origin is not None:
            return False
        self._entering_bad()
        self._step_bad = True
        if self._bad_streak >= _REPLAY_STREAK:
            return False  # still broken: what follows is the cascade, already reported
        if (
            self._this_step.forward_origin is not None
            or self._this_step.entering_origin is not None
        ):
            return False
        module, args, kwargs, rng = self._this_pass.last_call
        module = replay_target(module)
        if module is None:
            self._this_step.backward_unreplayable = True
            return False
        with self._replaying_context(grad=True, rng=rng):
            args, kwargs = detached_copies((args, kwargs))
            # Anomaly mode keeps, with every node, the stack that made it: the
            # line of the op whose derivative turns out to make the NaN/Inf.
            with torch.autograd.set_detect_anomaly(True, check_nan=False):
                output = module(*args, **kwargs)
            outs = [o for o in floating_tensors(output) if non_leaf(o)]
            pairs = [(o, g) for o, g in zip(outs, self._this_pass.grad_entering) if g is not None]
            params = [p for p in module.parameters() if p.requires_grad]
            if pairs and params:
                watch = self._backward_watch = FirstNonfiniteBackward()
                try:
                    with watch:
                        watch.watch_graph([o for o, _ in pairs])
                        backward_leaving_grads([o for o, _ in pairs], params, [g for _, g in pairs])
                finally:
                    self._backward_watch = None  # the graph it saw goes with the replay
                if watch.node is not None:
                    self._place_backward_birth(watch.node, watch.made)
                self._this_step.backward_replayed = True
        return True

    # -- forward ---------------------------------------------------------
    def _reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """One reduction that any NaN/Inf turns NaN/Inf.

        On the spot an fp32 sum will do: a sum that overflows is caught by the
        exact check that follows. Judged later there is no exact check, so the
        sum is taken in fp64, where finite fp32/fp16/bf16 values cannot overflow.
        """
        exact = self._reads_now(tensor)
        return tensor.detach().sum(dtype=torch.float32 if exact else torch.float64)

    def _reads_now(self, tensor: torch.Tensor) -> bool:
        """Whether a value may be read on the host now: in a replay (it runs only once
        something is off), and on CPU when verdicts are taken as passes end."""
        if not self.on_the_spot:
            return False
        return self._replaying or (not self.at_step and tensor.device.type == "cpu")

    def _sum_index(self, tensor: torch.Tensor) -> int:
        known = self._this_pass.known.get(id(tensor))
        version = version_of(tensor)
        if known is not None and known[0]() is tensor and known[2] == version:
            return known[1]
        index = len(self._this_step.sums)
        self._this_step.sums.append(self._reduce(tensor))
        self._this_step.finite.append(None)
        # Outside autograd, a sum of -inf (-inf entries, no NaN, no +inf) is a
        # mask built on purpose: judged finite (see _finite_or_mask).
        self._this_step.maskable.append(not tensor.requires_grad)
        self._this_pass.known[id(tensor)] = (weakref.ref(tensor), index, version)
        return index

    def _unchanged(self, index: int, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` still holds the values its sum ``index`` was taken of."""
        known = self._this_pass.known.get(id(tensor))
        return known is not None and known[1] == index and known[2] == version_of(tensor)

    def _is_finite(self, index: int, tensor: torch.Tensor | None = None) -> bool:
        """Exact verdict for a CPU sum; a non-finite sum of finite values is an overflow."""
        verdict = self._this_step.finite[index]
        if verdict is None:
            value = float(self._this_step.sums[index])
            verdict = math.isfinite(value) or (
                value == -math.inf and self._this_step.maskable[index]
            )
            if not verdict and tensor is not None:
                verdict = finite_or_mask(tensor)
            self._this_step.finite[index] = verdict
        return verdict

    def after_forward(
        self, index: int, module: nn.Module, args: Any, kwargs: Any, output: Any
    ) -> None:
        start = self._started(index)
        ins = list(start.inputs) if start is not None else []
        in_ids = list(start.sums) if start is not None else []
        outs = list(floating_tensors(output))
        if not outs or len(self._this_step.sums) > _MAX_SUMS:
            return
        # Positional inputs were summed as the call began; keyword ones now.
        kw_ins = list(floating_tensors(kwargs))
        ins += kw_ins
        in_ids += [self._sum_index(t) for t in kw_ins]
        first = outs[0]
        immediate = self._reads_now(first)
        out_ids = [self._sum_index(t) for t in outs]
        call = ForwardCall(
            index, in_ids, out_ids, tuple(first.shape), str(first.dtype), str(first.device)
        )
        self._this_step.calls.append(call)
        if immediate:
            given = start.given if start is not None and start.given is not None else args
            rng = start.rng if start is not None else None
            self._check_now(call, module, given, kwargs, ins, outs, rng)
            if self._replaying and self.trace_ops:
                self._note_negative_inf(call, module, given, kwargs, ins)
        if torch.is_grad_enabled():
            self._hook_gradients(call, ins, outs)

    def _started(self, position: int) -> _CallStart | None:
        """What ``before_call`` recorded for the call that just ended."""
        stack = self._this_pass.calls_in_progress
        if stack and stack[-1].position == position:
            return stack.pop()
        return None

    def _check_now(
        self,
        call: ForwardCall,
        module: nn.Module,
        args: Any,
        kwargs: Any,
        ins: list[torch.Tensor],
        outs: list[torch.Tensor],
        rng: torch.Tensor | None = None,
    ) -> None:
        """``rng``: the CPU generator's state as the call began (an op trace re-runs it)."""
        bad_out = [t for i, t in zip(call.outputs, outs) if not self._is_finite(i, t)]
        if not bad_out:
            return
        # The sums taken as the call began: a module that changed its input in
        # place is judged on what it was given (the exact check only while
        # the tensor still holds those values).
        call.inputs_finite = all(
            self._is_finite(i, t if self._unchanged(i, t) else None)
            for i, t in zip(call.inputs, ins)
        )
        if not call.inputs_finite or self._this_step.forward_origin is not None:
            return  # propagated: an earlier module (or the data) made it
        # One look at the module's own weights: its nn.Parameters, and the stand-ins
        # functional_call puts in their place (a MAML inner loop's fast weights,
        # made outside the model: non-finite, they carried the value in).
        bad_weights, given_bad = _nonfinite_weights(module)
        if self._replaying and self.trace_ops and not self._exactly_finite(call.inputs, ins):
            # A -inf taken for a mask came in: if an earlier module's own
            # arithmetic made it, that module is the origin.
            maker = self._negative_inf_origin(call) or self._negative_inf_around(call)
            if maker is not None:
                self._this_step.forward_origin = maker
                return
        bad = bad_out[0].detach()
        nan = torch.isnan(bad)
        finding = NonfiniteFinding(
            module=call.module,
            direction="forward",
            cause="given_weights" if given_bad else "module",
            kind="nan" if bool(nan.any()) else "inf",
            count=int((~torch.isfinite(bad)).sum()),
            shape=tuple(bad.shape),
            dtype=str(bad.dtype),
            device=str(bad.device),
        )
        finding.weights_nonfinite = bool(bad_weights)
        if bad_weights:
            finding.nonfinite_weights = bad_weights
            finding.weights_written = self.written_since_update(bad_weights)
        given = list(floating_tensors([args, kwargs]))
        found = input_range(given)
        if found is not None:
            finding.input_min, finding.input_max = found
        if self.trace_ops and not given_bad:
            self.suspended = True
            try:
                found: OpFinding | None = trace_first_nonfinite_op(module, args, kwargs, rng)
            finally:
                self.suspended = False
            if found is not None:
                finding.op, finding.source, finding.op_basis = found.op, found.source, "re-run"
                if found.shape is not None:
                    # Told as the op made it: the tensor the alert says it made.
                    finding.kind, finding.count = found.kind, found.count
                    finding.shape, finding.dtype = found.shape, found.dtype or finding.dtype
        self._this_step.forward_origin = finding

    def _exactly_finite(self, indices: list[int], tensors: list[torch.Tensor]) -> bool:
        """No -inf either, masks included (read in a replay only)."""
        for index, tensor in zip(indices, tensors):
            if not math.isfinite(float(self._this_step.sums[index])) and not bool(
                torch.isfinite(tensor.detach()).all()
            ):
                return False
        return True

    def _note_negative_inf(
        self, call: ForwardCall, module: nn.Module, args: Any, kwargs: Any, ins: list[torch.Tensor]
    ) -> None:
        """Keep a replayed call that made -inf (let pass as a mask) from finite inputs."""
        sums, maskable = self._this_step.sums, self._this_step.maskable
        makers = self._this_step.negative_inf_makers
        if len(makers) >= _MAX_MAKERS or not any(
            maskable[i] and float(sums[i]) == -math.inf for i in call.outputs
        ):
            return
        if self._exactly_finite(call.inputs, ins):
            args, kwargs = detached_copies((args, kwargs))
            makers.append(_NegativeInfMaker(call, module, args, kwargs))

    def _negative_inf_origin(self, victim: ForwardCall) -> NonfiniteFinding | None:
        """The earlier call whose own arithmetic made the -inf that ``victim`` turned
        into a NaN/+inf, named with its op; None when only masks were made.

        Calls whose output ``victim`` took in directly are tried first.
        """
        makers = self._this_step.negative_inf_makers
        fed = set(victim.inputs)
        ordered = [m for m in makers if fed & set(m.call.outputs)]
        ordered += [m for m in makers if m not in ordered]
        for maker in ordered:
            found = self._traced(trace_negative_inf_maker, maker.module, maker.args, maker.kwargs)
            if found is not None:
                call = maker.call
                return _made_negative_inf(call.module, call, found, [maker.args, maker.kwargs])
        return None

    def _negative_inf_around(self, victim: ForwardCall) -> NonfiniteFinding | None:
        """The -inf came from no module's output: functional code in the forward of a
        module around ``victim`` (``torch.log(counts)`` in the model's own forward).

        The innermost call in progress whose inputs were finite made it; it is
        re-run to find the op, and named only if that op's -inf is where the
        NaN/+inf came from.
        """
        for start in reversed(self._this_pass.calls_in_progress):
            if start.given is None or not self._exactly_finite(start.sums, start.inputs):
                continue
            module = (
                self._modules[start.position]() if start.position < len(self._modules) else None
            )
            if module is None:
                return None
            found = self._traced(trace_negative_inf_turned_nonfinite, module, start.given, {})
            if found is None:
                return None
            return _made_negative_inf(start.position, victim, found, [start.given])
        return None

    def _traced(self, trace: Any, module: nn.Module, args: Any, kwargs: Any) -> OpFinding | None:
        """An op trace of a re-run, unseen by the probe's own checks."""
        self.suspended = True
        try:
            return trace(module, args, kwargs)
        finally:
            self.suspended = False

    def _hook_gradients(
        self, call: ForwardCall, ins: list[torch.Tensor], outs: list[torch.Tensor]
    ) -> None:
        # Leaves (a parameter handed to a module, or returned by one) are left
        # alone: a hook on one would stay on it after the step, one more each
        # step, and its gradient sums every use, so it names no single call;
        # the step's gradient norms check parameters anyway.
        for tensor in outs:
            if non_leaf(tensor):
                tensor.register_hook(WeakHook(self, "on_grad", call, "out"))
                stop = {id(t.grad_fn) for t in ins if t.grad_fn is not None}
                self._this_pass.grad_fns[id(call)] = (tensor.grad_fn, stop)
                break
        for tensor in ins:
            if non_leaf(tensor):
                tensor.register_hook(WeakHook(self, "on_grad", call, "in"))

    # -- backward ----------------------------------------------------------
    def on_grad(self, call: ForwardCall, side: str, grad: torch.Tensor) -> None:
        if not self.enabled:
            return
        if not grad.is_floating_point() or grad.layout != torch.strided:
            return
        index = self._grad_index(grad)
        if index is None:
            return
        self._this_step.grad_events.append((call, side, index))
        if side == "out":
            self._this_step.out_seen.add(id(call))
        on_the_spot = self._reads_now(grad)
        if not on_the_spot or self._this_step.backward_origin is not None:
            self._this_step.immediate_grads = self._this_step.immediate_grads and on_the_spot
            return
        if self._grad_finite(index, grad):
            return
        self._this_step.any_bad_grad = True
        if side == "out":
            self._this_step.out_bad.add(id(call))
            return
        if id(call) in self._this_step.out_bad or id(call) not in self._this_step.out_seen:
            return  # its output gradient was already bad (propagated), or never came
        finding = NonfiniteFinding(
            module=call.module,
            direction="backward",
            cause="module",
            kind="nan" if bool(torch.isnan(grad).any()) else "inf",
            count=int((~torch.isfinite(grad)).sum()),
            shape=tuple(grad.shape),
            dtype=str(grad.dtype),
            device=str(grad.device),
        )
        watch = self._backward_watch
        grad_fn, stop = self._this_pass.grad_fns.get(id(call), (None, set()))
        seen = watch.node if watch is not None else None
        op = backward_op(grad_fn, stop, seen_bad=seen)
        if op is not None:
            finding.op, finding.op_basis = op
            if finding.op_basis == "re-run":
                finding.source = node_source(seen)
        self._this_step.backward_origin = finding

    def _place_backward_birth(self, node: Any, made: torch.Tensor | None = None) -> None:
        """The replay saw the autograd node that made the first NaN/Inf from finite
        values: the innermost module call whose part of the graph holds it made it.

        The gradient hooks alone can name the wrong module when the NaN is born
        in a module's own code (``torch.sqrt`` in its ``forward``): a child
        reading the same tensor sees that tensor's whole gradient, every
        reader's share summed, and looks like the origin; with no child
        around the op, the NaN would look as if it came from the loss.
        """
        found = innermost_holding(self._this_step.calls, self._this_pass.grad_fns, node)
        if found is None:
            return  # outside every module: the gradient entering the model says so
        origin = self._this_step.backward_origin
        if origin is not None and origin.module == found.module:
            return
        finding = NonfiniteFinding(
            module=found.module,
            direction="backward",
            cause="module",
            kind=origin.kind if origin is not None else None,
            dtype=found.dtype,  # its output's: the gradient through it has that dtype
            device=found.device,
        )
        finding.op, finding.op_basis = op_of_node(node), "re-run"
        finding.source = node_source(node)
        if made is not None:  # told as the node made it
            finding.kind = "nan" if bool(torch.isnan(made).any()) else "inf"
            finding.count = int((~torch.isfinite(made)).sum())
            finding.shape = tuple(made.shape)
        self._this_step.backward_origin = finding

    def _grad_index(self, grad: torch.Tensor) -> int | None:
        """The sum of this gradient: one module's output is the next one's input,
        so the same gradient reaches two hooks and is summed once."""
        known = self._this_pass.grad_known.get(id(grad))
        version = version_of(grad)
        # Autograd may accumulate into a gradient buffer it already handed to a
        # hook: the same tensor, new values, a new version.
        if known is not None and known[0]() is grad and known[2] == version:
            return known[1]
        if len(self._this_step.grad_sums) > _MAX_SUMS:
            return None
        total = self._reduce(grad)
        index = len(self._this_step.grad_sums)
        self._this_step.grad_sums.append(total)
        self._this_step.grad_ok.append(None)
        if not self._replaying:
            self._this_pass.grads.append(total)
        self._this_pass.grad_known[id(grad)] = (weakref.ref(grad), index, version)
        return index

    def _grad_finite(self, index: int, grad: torch.Tensor) -> bool:
        verdict = self._this_step.grad_ok[index]
        if verdict is None:
            verdict = math.isfinite(float(self._this_step.grad_sums[index])) or bool(
                torch.isfinite(grad).all()
            )
            self._this_step.grad_ok[index] = verdict
        return verdict

    # -- step boundary -----------------------------------------------------
    @property
    def bad_backward_passes(self) -> list[torch.Tensor | float]:
        """Per backward pass no step used since the last one: whether it was non-finite."""
        return self._this_step.bad_backward_passes

    def modules(self) -> list[nn.Module | None]:
        return [ref() for ref in self._modules]

    def found_in_step(self) -> bool:
        """Whether the step in progress met a NaN/Inf already (or has outputs still to
        be read: on a device, until the step's one scalar is read)."""
        step = self._this_step
        return bool(
            step.forward_origin is not None
            or step.backward_origin is not None
            or step.output_bad
            or step.entering_origin
            or self._waiting
            or step.sums
        )

    def take(self) -> StepWindow:
        """Hand over what this step gathered and start the next one."""
        step = self._this_step
        window = _new_window(
            step.calls, step.finite, step.forward_origin, step.backward_origin, step.grad_events
        )
        window.maskable = step.maskable
        # The rest at the window's defaults on a usual step: set where they differ.
        if step.entering_origin is not None:
            window.entering_origin = step.entering_origin
        if step.output_bad:
            window.output_bad = True
        if not step.saw_pass:
            window.forward_seen = False
        if step.backward_replayed:
            window.backward_replayed = True
        if step.backward_unreplayable:
            window.backward_unreplayable = True
        finite = step.finite
        needs_forward = (
            bool(finite)
            and any(v is None for v in finite)
            and any(not all(finite[i] is True for i in c.outputs) for c in step.calls)
        )
        if needs_forward:
            window.sums = sums_as_codes(step.sums)
        if step.grad_sums and (
            not step.immediate_grads or (step.any_bad_grad and step.backward_origin is None)
        ):
            window.grad_sums = sums_as_codes(step.grad_sums)
        self._bad_streak = self._bad_streak + 1 if self._step_bad else 0
        self._step_bad = False
        flags = step.bad_backward_passes
        if flags and any(isinstance(f, torch.Tensor) for f in flags):
            device = next(f.device for f in flags if isinstance(f, torch.Tensor))
            window.skipped = torch.stack([torch.as_tensor(f, device=device) for f in flags])
        elif flags:
            window.skipped_host = list(flags)
        # The pass the step used counts as not skipped; its batch is let go.
        self.reset()
        return window


def _entering_origin(grad: torch.Tensor) -> NonfiniteFinding:
    """The gradient non-finite where it enters the model, as it is: an Inf in fp16
    is the loss's gradient past fp16's range, a NaN more likely the loss itself."""
    grad = grad.detach()
    return NonfiniteFinding(
        module=0,
        direction="backward",
        cause="loss",
        kind="nan" if bool(torch.isnan(grad).any()) else "inf",
        count=int((~torch.isfinite(grad)).sum()),
        shape=tuple(grad.shape),
        dtype=str(grad.dtype),
        device=str(grad.device),
    )


def _made_negative_inf(
    module: int, call: ForwardCall, found: OpFinding, given: Any
) -> NonfiniteFinding:
    """The origin: ``module``'s own ``found`` op made -inf from finite inputs."""
    finding = NonfiniteFinding(
        module=module,
        direction="forward",
        cause="module",
        kind="-inf",
        shape=call.shape if call.module == module else None,
        dtype=call.dtype,
        device=call.device,
        op=found.op,
        source=found.source,
        op_basis="re-run: made -inf from finite inputs",
    )
    finding.weights_nonfinite = False
    found = input_range(floating_tensors(given))
    if found is not None:
        finding.input_min, finding.input_max = found
    return finding


# The id of the backward pass running on this thread (-1: none), if torch says.
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
# The CPU generator's state, copied (bound once: taken as every pass begins).
_cpu_rng_state = torch.default_generator.get_state


def _inside_backward() -> bool:
    """Whether autograd is running a backward pass on this thread right now."""
    return _graph_task_id is not None and _graph_task_id() != -1


def _nonfinite_weights(module: nn.Module) -> tuple[list[torch.Tensor], bool]:
    """The module's own non-finite ``nn.Parameter``s (a ParameterList's it holds
    included), and whether a stand-in for one (a plain tensor ``functional_call``
    put in its place) is non-finite. Asked only after an output went non-finite."""
    own: list[torch.Tensor] = []
    given = False
    for weight in own_parameters(module):
        if not bool(torch.isfinite(weight.detach()).all()):
            if isinstance(weight, nn.Parameter):
                own.append(weight)
            else:
                given = True
    return own, given
