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
user's batch and the values their backward needs are never touched twice,
and the arguments as the call received them: a list or dict its forward
emptied (``items.pop(0)``) as it was when the pass began (``received``).

State lives in two small records replaced wholesale: one per pass
(identity matches, what a backward replay needs) and one per step (sums,
calls, origins, the flags of backward passes no step used).

Here: the probe, its records, and what every healthy pass and step runs.
Beside it, one job each: ``nonfinite_forward`` (each module call checked on
its own), ``nonfinite_sums`` (a tensor's sum, taken once, and its verdict),
``nonfinite_gradients`` (each checked call's gradients),
``nonfinite_negative_inf`` (a -inf let pass as a mask that turned into a
NaN), ``nonfinite_entering`` (the gradient the loss sent into the model),
``nonfinite_loss_backward`` (whether that loss was finite, and the op of its
backward that made the NaN/Inf),
``nonfinite_replay`` (re-running a pass), ``nonfinite_hooks`` (the global
module hooks) and ``nonfinite_locate`` (origins from sums read back later).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from trainwatch.collect import (
    nonfinite_entering,
    nonfinite_forward,
    nonfinite_gradients,
    nonfinite_replay,
)
from trainwatch.collect.nonfinite_entering import entering_flag
from trainwatch.collect.nonfinite_forward import (
    CANNOT_ORIGINATE,
    CallStart,
    cpu_rng_state,
    graph_task_id,
)
from trainwatch.collect.nonfinite_hooks import register_global_hooks
from trainwatch.collect.nonfinite_locate import (
    FINITE,
    INF,
    NAN,
    NEG_INF,
    ForwardCall,
    NonfiniteFinding,
    StepWindow,
    locate_backward,
    locate_forward,
    sums_as_codes,
)
from trainwatch.collect.nonfinite_negative_inf import NegativeInfMaker
from trainwatch.collect.nonfinite_replay import (
    REPLAY_STREAK,
    FirstNonfiniteBackward,
    replay_forward,
    replay_target,
)
from trainwatch.collect.nonfinite_sums import output_code
from trainwatch.collect.rerun_effects import generators_held
from trainwatch.collect.tensors import finite_exact, finite_inexact, inexact_list
from trainwatch.compiled import unwrap
from trainwatch.fresh import fresh_maker
from trainwatch.hooks import HookGroup, PlacedHook, WeakHook, hook_pass_tensor, take_out
from trainwatch.rng import DrawsAtStart, PassDraws

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

# The id of the backward pass running on this thread, -1 for none (always so on a
# torch that cannot tell): a C call either way, asked as every pass begins.
_backward_task = graph_task_id if graph_task_id is not None else partial(int, -1)
# Passes whose verdict may wait for the step boundary; past it (a long
# evaluation between steps) they are read at once.
_MAX_WAITING = 16
_STRIDED = torch.strided
# Backward passes without a step kept per step (their flags); past it the oldest go.
NOTED_PASSES = 64


@dataclass
class _WaitingPass:
    """A pass whose output sums wait for the step boundary, with what a replay needs."""

    module: nn.Module
    args: Any
    kwargs: Any
    codes: torch.Tensor  # fp64 sum of each floating output (device); -inf: a mask
    rng: PassDraws  # the generators' states as the pass began


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
    calls_in_progress: list[CallStart] = field(default_factory=list)
    # References to the batch (not copies) until the next pass: what a
    # backward replay needs if this step's gradients turn out bad.
    last_call: tuple[nn.Module, Any, Any, PassDraws] | None = None
    grad_entering: list[torch.Tensor | None] = field(default_factory=list)
    backward: bool = False  # a backward pass reached the model
    bad: bool = False  # and what entered it was non-finite
    grads: list[torch.Tensor] = field(default_factory=list)  # its gradient sums (deferred)
    # Which awaited pass (its number) last_call is, once a backward reached one.
    replay_seq: int = -1


# A pass with grad whose backward may come: (its number, its call and the CPU
# generator's state as it began, what entered it, by output position). A plain
# tuple: one is made per pass.
_AwaitedPass = tuple[int, tuple[nn.Module, Any, Any, PassDraws], list[torch.Tensor | None]]


@dataclass(slots=True)
class _StepState:
    """What one step gathered; handed over (``take``) and replaced at the boundary."""

    sums: list[torch.Tensor] = field(default_factory=list)
    calls: list[ForwardCall] = field(default_factory=list)
    # Exact verdicts of sums read at once, index-aligned with ``sums`` (None: not read).
    finite: list[bool | None] = field(default_factory=list)
    forward_origin: NonfiniteFinding | None = None
    negative_inf_makers: list[NegativeInfMaker] = field(default_factory=list)
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
    """Where the first NaN/Inf of a step was born, for one model.

    The probe holds the state (per pass, per step, and what outlasts both)
    and what runs on every healthy pass and step: the model's output summed
    as a pass ends, the gradient entering the model kept, the step's window
    handed over. What runs only where each module is checked, or once
    something is off, lives beside it as functions of the probe.
    """

    # Called on the probe by name (its hooks, the step pipeline): bound here as
    # methods, so no call stands between the caller and the check.
    module_starts = nonfinite_forward.module_starts
    module_ends = nonfinite_forward.module_ends
    module_keywords = nonfinite_forward.module_keywords
    on_grad = nonfinite_gradients.on_grad
    replay_backward = nonfinite_replay.replay_backward
    entering_all_zero = nonfinite_entering.entering_all_zero
    entering_bad = nonfinite_entering.entering_bad
    on_inexact_grad_entering = nonfinite_entering.on_inexact_grad_entering
    outputs_without_signal = nonfinite_entering.outputs_without_signal
    outputs_unreached = nonfinite_entering.outputs_unreached

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
        # few kilobytes, no op dispatched; forked state is put back after. With
        # the states of the model's own generators where it holds any (a VAE's
        # ``self.gen``): ``_pass_starts_drawing``.
        self._rng_at_start: PassDraws = None
        # The random generators the model holds (found as it is attached).
        self._generators: list[Any] = []
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
        # The loss a framework handed over before its backward (Lightning), with
        # its graph: looked into only when what entered the model was non-finite.
        self.handed_loss: weakref.ref[torch.Tensor] | None = None
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
        written = self.written_each(params)
        if written is None:
            return None
        # A weight the update did not touch (None) was written whenever it went bad.
        return any(w is not False for w in written)

    def written_each(self, params: list[torch.Tensor]) -> list[bool | None] | None:
        """For each of ``params``, whether it was written since the last update was
        applied (see :meth:`written_since_update`), None for one that update did not
        touch; None for all: no update seen yet."""
        updated = self.updated
        if updated is None:
            return None
        listed, versions, storages = updated
        after_update = dict(zip(map(id, listed), zip(versions, storages)))  # the rare path only
        return [
            None if id(p) not in after_update else (p._version, p.data_ptr()) != after_update[id(p)]
            for p in params
        ]

    # -- lifecycle -------------------------------------------------------
    def attach(self, model: nn.Module) -> None:
        self._ids.clear()
        for index, (_, module) in enumerate(model.named_modules()):
            self._modules.append(weakref.ref(module))
            self._ids[id(module)] = index
            if not isinstance(module, CANNOT_ORIGINATE) or module is model:
                self._checkable.add(index)
        self.find_device(model)
        self._hold_generators(generators_held(model.modules()))

    def _hold_generators(self, generators: list[Any]) -> None:
        """A model drawing from generators of its own (a VAE's ``torch.randn(...,
        generator=self.gen)``, token dropout from a ``torch.Generator``): a NaN
        replay must draw what the pass drew, so their states are read as each
        pass begins, with the CPU generator's. A method swapped in for such a
        model alone (before the probe subscribes to the passes): any other's
        pass reads what it read."""
        self._generators = generators
        if generators:
            self.pass_starts = self._pass_starts_drawing  # type: ignore[method-assign]
        else:
            self.__dict__.pop("pass_starts", None)

    def _pass_starts_drawing(self, module: nn.Module) -> None:
        """``pass_starts``, for a model holding generators: their states join the CPU
        generator's as the pass begins."""
        NonfiniteProbe.pass_starts(self, module)
        rng = self._rng_at_start
        if type(rng) is torch.Tensor:  # read just now: this pass's
            self._rng_at_start = DrawsAtStart(rng, self._generators)

    def module_hooks(self) -> list[Any]:
        """Hooks on every module call: always in deferred mode, else only for a replay."""
        return register_global_hooks(self)

    # -- the model's passes (ModelPasses), where modules are not hooked -------
    def pass_starts(self, module: nn.Module) -> None:
        if self._handles or self._replaying or not self.enabled or self.suspended:
            return  # the module hooks see the pass
        self._rng_at_start = cpu_rng_state()
        if not torch.is_grad_enabled():
            # No backward comes of a pass under no_grad (an evaluation, a DQN
            # target made between a prediction and its backward): the pass
            # whose backward may still come stays the one a replay would use.
            self._recomputing = False
            self._this_step.saw_pass = True
            return
        # Gradient checkpointing of the whole model re-runs it inside backward:
        # that is no new pass.
        if _backward_task() == -1:  # inside_backward(), written out: once per pass
            self._recomputing = False
            self._new_pass()
        else:
            self._recomputing = True

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
    def _new_pass(self) -> None:
        """An outermost call of the model begins (a forward pass)."""
        self._this_step.saw_pass = True
        done = self._this_pass
        if done.grads:  # device passes: one flag per backward, read later
            self._note_pass(torch.stack(done.grads).isfinite().all().logical_not())
        elif done.backward:
            # A backward no step used since (GradScaler skipped it, or gradient
            # accumulation): only then is what entered the model summed.
            self._note_pass(entering_flag(self))
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
        if type(output) is torch.Tensor and not self.at_step:
            # The usual pass: one plain tensor out, checked on the spot.
            if output.is_floating_point() and output.layout is _STRIDED and output.numel():
                if self._this_step.forward_origin is None and not finite_exact(output):
                    self._forward_bad(module, args, kwargs, self._rng_at_start)
                if output.grad_fn is not None and output.requires_grad and torch.is_grad_enabled():
                    self._await_backward(module, args, kwargs, [output])
                return
            if output.is_complex():
                self._end_complex_pass(module, args, kwargs, inexact_list(output)[0])
            return
        outs, complex_ = inexact_list(output)
        if complex_:
            self._end_complex_pass(module, args, kwargs, outs)
            return
        if self.at_step:
            if self._this_step.forward_origin is None and outs:
                codes = torch.stack([o.detach().sum(dtype=torch.float64) for o in outs])
                self._waiting.append(_WaitingPass(module, args, kwargs, codes, self._rng_at_start))
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

    def _end_complex_pass(
        self, module: nn.Module, args: Any, kwargs: Any, outs: list[torch.Tensor]
    ) -> None:
        """A pass whose outputs hold a complex tensor ended (an FNO or a complex layer
        handing out its spectrum): checked as any pass is, a complex output non-finite
        where either part of a value is, and the complex gradient backward hands it
        kept as the real view of its parts (``on_inexact_grad_entering``). Apart from
        the real outputs' path, which pays nothing for it."""
        if self.at_step:
            if self._this_step.forward_origin is None:
                codes = torch.stack([output_code(o) for o in outs])
                self._waiting.append(_WaitingPass(module, args, kwargs, codes, self._rng_at_start))
                if len(self._waiting) >= _MAX_WAITING:
                    self.settle(None)
        elif self._this_step.forward_origin is None and not all(map(finite_inexact, outs)):
            self._forward_bad(module, args, kwargs, self._rng_at_start)
        needs_grad = [o for o in outs if o.requires_grad and o.grad_fn is not None]
        if needs_grad and torch.is_grad_enabled():
            self._await_backward(module, args, kwargs, needs_grad, "on_inexact_grad_entering")

    def _await_backward(
        self,
        module: nn.Module,
        args: Any,
        kwargs: Any,
        needs_grad: list[torch.Tensor],
        on_grad: str = "on_grad_entering",
    ) -> None:
        """Hook where backward enters this pass: the pass a backward replay would run.

        References to the batch (not copies), kept with the pass's own record
        of what entered it. The pass whose hook fires becomes the pass to
        replay, so a pass with grad left out of the loss (a metric taken
        without ``no_grad``) does not stand in for the one backpropagated, and
        passes summed into one loss each keep their own gradient. Until a
        backward comes, the latest pass stands. The hooks of the last two
        passes stay: a batch-of-one loop's tens of passes call into Python
        twice in backward, not once per pass. ``on_grad``: the probe's method
        each hook calls (a pass with complex outputs names its own).
        """
        self._pass_seq += 1
        call, entering = (module, args, kwargs, self._rng_at_start), [None] * len(needs_grad)
        candidate = (self._pass_seq, call, entering)
        this = self._this_pass
        if this.replay_seq < 0:  # no backward has reached a pass since this one began
            this.last_call, this.grad_entering = call, entering
        if len(needs_grad) == 1:  # the usual pass: one output
            hook = WeakHook(self, on_grad, candidate, 0)
            where = hook_pass_tensor(needs_grad[0], hook)
            placed: list[PlacedHook] = [] if where is None else [where]
        else:
            placed = []
            for position, tensor in enumerate(needs_grad):
                hook = WeakHook(self, on_grad, candidate, position)
                where = hook_pass_tensor(tensor, hook)
                if where is not None:
                    placed.append(where)
        awaiting = self._this_step.awaiting
        awaiting.append(placed)
        if len(awaiting) > 2:
            for hook in awaiting.pop(0):
                take_out(hook)

    def _forward_bad(self, module: nn.Module, args: Any, kwargs: Any, rng: PassDraws) -> None:
        self._step_bad = self._this_step.output_bad = True
        if self._bad_streak < REPLAY_STREAK:
            replay_forward(self, module, args, kwargs, rng)

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
        # The step's one sync. A total of -inf holds no NaN or +inf (either would
        # make it NaN/+inf): only masks' -inf, so a masked policy's every pass
        # is not read back one by one.
        if float(total) < math.inf:
            return False
        for w in waiting:
            for value in w.codes.tolist():
                if not (math.isfinite(value) or value == -math.inf):  # -inf: a mask
                    if self._this_step.forward_origin is None:
                        self._forward_bad(w.module, w.args, w.kwargs, w.rng)
                    break
        return norms is not None and not math.isfinite(float(norms.double().sum()))

    def note_norm_overflow(self, finding: NonfiniteFinding) -> None:
        """The step's gradient norms overflowed while every gradient is finite: what
        the trigger found, handed over with the step in place of a backward origin."""
        if self._this_step.backward_origin is None:
            self._this_step.backward_origin = finding

    def note_entering_alone(self) -> None:
        """The gradient that entered the model was non-finite while every parameter's
        is finite (the model zeroed it there: a ReLU or clamp at its output): what
        entered stands in for a backward origin, so the step is judged on it."""
        step = self._this_step
        if step.backward_origin is None and step.entering_origin is not None:
            step.backward_origin = step.entering_origin

    def on_grad_entering(self, candidate: _AwaitedPass, position: int, grad: torch.Tensor) -> None:
        """Kept, not summed: the step's gradient norms (which take its norm beside
        the parameters') show whether anything is off.

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

    def keep(self) -> tuple[Any, ...]:
        """What the step under way has gathered so far, to put back with :meth:`resume`
        after a :meth:`take` that was no step boundary (an optimizer attached between a
        step's backward and its ``step()``: ``trainwatch run`` attaches one there)."""
        return (self._this_step, self._this_pass, self._bad_streak, self._step_bad)

    def resume(self, kept: tuple[Any, ...]) -> None:
        """Put back what :meth:`keep` held: the step's passes are judged at its own boundary."""
        self._this_step, self._this_pass, self._bad_streak, self._step_bad = kept
