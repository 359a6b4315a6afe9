"""Where the first NaN/Inf of a step was born, in forward and in backward.

Every module's floating outputs get one fp32 sum (a reduction, not an
elementwise test: any NaN/Inf makes the sum NaN/Inf). A module is the origin
when its output is non-finite while its inputs were finite; inputs that are
another module's output reuse that module's sum, matched by identity.

Two ways to read the sums:
- CPU tensors are checked on the spot (reading a CPU scalar costs no device
  sync). The first origin is confirmed with an exact check, and its op is
  traced while its inputs still exist.
- Device (CUDA) sums stay on the device and join the step's single readback;
  the origin is located from them when the step lands. No op is traced there
  (the inputs are gone by then); module, step and spread are still exact.

Backward uses tensor hooks (not full backward hooks, which cost ~150 us a
module and break on in-place ops, FACTS.md) on each module's outputs and
inputs: the origin is the module whose input gradient went non-finite while
its output gradient was finite. Leaves (parameters) get none: a hook on a
parameter outlives the step.

In-place ops (``nn.ReLU(inplace=True)``, ``x += r``) change a tensor and keep
its identity, so sums are matched by identity and version counter; a
module's inputs are summed as its call begins, so one that changes its input
in place is judged on the input it was given; and every re-run (a replay, an
op trace) gets copies of the tensors it is handed, so the user's batch and
the values their backward needs are never touched twice.
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_globals
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from trainwatch.collect import quiet
from trainwatch.collect.op_trace import (
    OpFinding,
    _null,
    swapped_buffers,
    trace_first_nonfinite_op,
)
from trainwatch.collect.tensors import (
    detached_copies,
    floating_list,
    floating_tensors,
    only_negative_inf,
    version_of,
)
from trainwatch.compiled import compiling, eager, unwrap

_MAX_SUMS = 20000  # per step; past it, checks pause until the next step
_REPLAY_STREAK = 3  # bad steps in a row after which replays stop
# Passes whose verdict may wait for the step boundary; past it (a long
# evaluation between steps) they are read at once.
_MAX_WAITING = 16

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
class ForwardCall:
    """One module call: which sums are its inputs and its outputs."""

    module: int
    inputs: list[int]
    outputs: list[int]
    shape: tuple[int, ...]
    dtype: str
    device: str
    # Checked on the spot (CPU) only when an output was bad; None: use the sums.
    inputs_finite: bool | None = None


@dataclass
class _WaitingPass:
    """A pass whose output sums wait for the step boundary, with what a replay needs."""

    module: nn.Module
    args: Any
    kwargs: Any
    codes: torch.Tensor  # fp64 sum of each floating output (device)
    masks: list[bool]  # per output: outside autograd, so a -inf sum is a mask


@dataclass
class _CallStart:
    """A module call as it began: its positional inputs and their sums."""

    position: int
    inputs: list[torch.Tensor]
    sums: list[int]
    given: Any = None  # copies of its positional arguments (replays only)


@dataclass
class NonfiniteFinding:
    """What the rules need to name an origin."""

    module: int
    direction: str  # "forward" or "backward"
    cause: str  # "module": born here; "input": the model's input was already bad;
    # "loss": gradient non-finite where it enters the model (the loss's backward)
    kind: str | None = None  # "nan" / "inf" when known exactly
    count: int | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    device: str | None = None
    input_min: float | None = None
    input_max: float | None = None
    op: str | None = None
    source: str | None = None
    op_basis: str | None = None
    spread: list[int] = field(default_factory=list)
    # Whether the module's own weights were non-finite when it ran (None: not seen).
    weights_nonfinite: bool | None = None


class _CallHooks:
    """Global pre- and post-forward hooks that pick out the watched model's modules.

    Global, not per module: hooks stored on the modules would travel with
    ``torch.save(model)``, ``pickle`` and ``copy.deepcopy(model)`` (an EMA or
    teacher copy would then report into this monitor). Every other module
    call in the process pays one dict lookup and a type check.
    """

    __slots__ = ("index", "probe")

    def __init__(self, probe: NonfiniteProbe, index: dict[int, int]) -> None:
        self.probe = weakref.ref(probe)
        self.index = index

    def _position(self, module: nn.Module) -> int | None:
        position = self.index.get(id(module))
        if position is None:
            # torch.compile(model)'s wrapper runs eagerly around the compiled
            # model: it stands for the model (or submodule) it wraps.
            inner = unwrap(module)
            if inner is not module:
                position = self.index.get(id(inner))
        return position

    def before(self, module: nn.Module, args: Any) -> None:
        if compiling():
            return None  # inside a compiled graph: see the module from outside only
        position = self._position(module)
        if position is None:
            return None
        probe = self.probe()
        if probe is not None and probe.enabled and not probe.suspended:
            try:
                probe.before_call(position, args)
            except Exception as exc:  # never break the user's forward
                probe.fail(exc)
        return None

    def after(self, module: nn.Module, args: Any, *rest: Any) -> None:
        if compiling():
            return None
        position = self._position(module)
        if position is None:
            return None
        probe = self.probe()
        if probe is not None and probe.enabled and not probe.suspended:
            kwargs, output = rest if len(rest) == 2 else ({}, rest[0])
            try:
                probe.after_call(position, module, args, kwargs, output)
            except Exception as exc:
                probe.fail(exc)
        return None


class _KwargsHookHandle:
    """Removes a global forward hook registered ``with_kwargs`` completely.

    PyTorch's handle forgets the hook's entry in the global ``with_kwargs``
    table, and one stale entry there makes ``torch.compile(module)`` warn
    about global hooks at every call, long after trainwatch has closed.
    """

    __slots__ = ("handle",)

    def __init__(self, handle: RemovableHandle) -> None:
        self.handle = handle

    def remove(self) -> None:
        self.handle.remove()
        table = getattr(module_globals, "_global_forward_hooks_with_kwargs", None)
        if table is not None:
            table.pop(self.handle.id, None)


def _register_global_hooks(hooks: _CallHooks) -> list[Any]:
    handles: list[Any] = [register_module_forward_pre_hook(hooks.before)]
    try:
        handle = register_module_forward_hook(hooks.after, with_kwargs=True, always_call=True)
        handles.append(_KwargsHookHandle(handle))
    except TypeError:  # torch < 2.6: global hooks see positional arguments only
        handles.append(register_module_forward_hook(hooks.after, always_call=True))
    return handles


class _GradOutHook:
    """Tensor hook on the model's output: keeps the gradient that enters the model.

    It is what a backward replay needs, and a non-finite one means the loss
    (or its backward) made the NaN/Inf before it reached the model.
    """

    __slots__ = ("position", "probe")

    def __init__(self, probe: NonfiniteProbe, position: int) -> None:
        self.probe = weakref.ref(probe)
        self.position = position

    def __call__(self, grad: torch.Tensor) -> None:
        probe = self.probe()
        if probe is not None and probe.enabled and not probe.suspended:
            try:
                probe.on_grad_entering(self.position, grad)
            except Exception as exc:
                probe.fail(exc)
        return None


class _GradHook:
    """Tensor hook: the gradient of a module's output ("out") or input ("in")."""

    __slots__ = ("call", "probe", "side")

    def __init__(self, probe: NonfiniteProbe, call: ForwardCall, side: str) -> None:
        self.probe = weakref.ref(probe)
        self.call = call
        self.side = side

    def __call__(self, grad: torch.Tensor) -> None:
        probe = self.probe()
        if probe is not None and probe.enabled:
            try:
                probe.on_grad(self.call, self.side, grad)
            except Exception as exc:
                probe.fail(exc)
        return None


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
        self.enabled = True
        self.suspended = False
        self.trace_ops = trace_ops
        self._on_error = on_error
        self.on_new_pass: Any = None
        self._handles: list[Any] = []
        self._modules: list[weakref.ref[nn.Module]] = []
        self._ids: dict[int, int] = {}  # id(module) -> its index in named_modules()
        self._checkable: set[int] = set()
        self._first_param: torch.Tensor | None = None
        # Outermost calls of the model's modules in progress (a pass starts at 0).
        self._depth = 0
        # "spot" passes (CPU) check only the outermost output and replay the
        # pass module by module when something is off; other passes sum every
        # module's output for the step's readback.
        self._replaying = False
        self._recomputing = False
        self._last_call: tuple[nn.Module, Any, Any] | None = None
        self._grad_entering: list[torch.Tensor | None] = []
        self._pass_backward = False
        self._pass_bad = False
        # Consecutive steps with a non-finite output or gradient: past a few,
        # replays stop (a broken model would otherwise pay one every step).
        self._bad_streak = 0
        self._step_bad = False
        self.reset()

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
        return _register_global_hooks(_CallHooks(self, self._ids))

    # -- the model's passes (ModelPasses), where modules are not hooked -------
    def pass_starts(self, module: nn.Module) -> None:
        if self._handles or self._replaying or not self.enabled or self.suspended:
            return  # the module hooks see the pass
        # Gradient checkpointing of the whole model re-runs it inside backward:
        # that is no new pass.
        self._recomputing = _inside_backward()
        if not self._recomputing:
            self._new_pass()

    def pass_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._handles or self._replaying or not self.enabled or self.suspended:
            return
        if self.on_the_spot and not self._recomputing:
            self._end_spot_pass(module, args, kwargs, output)

    def find_device(self, model: nn.Module) -> None:
        """Keep a parameter to tell where the model runs (CPU: checks on the spot).

        Called again when the parameters were replaced (``module.to()`` in
        overwrite mode), so a model moved to a GPU stops being checked on the spot.
        """
        self._first_param = next(model.parameters(), None)
        first = self._first_param
        on_cpu = first is None or first.device.type == "cpu"
        self.at_step = self.mode == "step" or (self.mode == "auto" and not on_cpu)
        # Deferred (no-sync) mode: every module's sums, every step. Otherwise
        # only the model's output, and the modules only in a replay.
        wanted = not self.on_the_spot
        if wanted and not self._handles:
            self._handles.extend(self.module_hooks())
        elif not wanted and self._handles:
            _remove_all(self._handles)
            self._handles.clear()

    def cuda_devices(self) -> list[int]:
        """The CUDA devices the model runs on (whose RNG a replay forks)."""
        first = self._first_param
        if first is None or first.device.type != "cuda":
            return []
        return [first.device.index if first.device.index is not None else 0]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.reset()

    def fail(self, exc: BaseException) -> None:
        self.enabled = False
        self.reset()
        self._on_error("non-finite probe", exc)

    def reset(self) -> None:
        """Start a new step: drop everything the last one gathered."""
        self.sums: list[torch.Tensor] = []
        self.calls: list[ForwardCall] = []
        # Sums already taken, by tensor identity, with the version counter they
        # saw: a tensor changed in place since (ReLU(inplace=True), ``x += r``)
        # gets a new sum.
        self._known: dict[int, tuple[weakref.ref[torch.Tensor], int, int | None]] = {}
        # Calls in progress, innermost last: a module that changes its input
        # in place is judged on the input it was given.
        self._calls_in_progress: list[_CallStart] = []
        self._grad_fns: dict[int, Any] = {}
        # Exact verdicts of CPU sums, index-aligned with self.sums (None: not checked).
        self.finite: list[bool | None] = []
        self.maskable: list[bool] = []
        self.forward_origin: NonfiniteFinding | None = None
        self.grad_sums: list[torch.Tensor] = []
        self.grad_events: list[tuple[ForwardCall, str, int]] = []
        self._grad_ok: list[bool | None] = []
        self._grad_known: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}
        self.backward_origin: NonfiniteFinding | None = None
        self._out_bad: set[int] = set()
        # Calls whose output gradient arrived: only those can be an origin (a
        # checkpoint's recomputed outputs are not in the graph backward runs).
        self._out_seen: set[int] = set()
        self._immediate_grads = True
        self._any_bad_grad = False
        self.grad_entering_bad = False
        self._output_bad = False
        self._pass_grads: list[torch.Tensor] = []
        # One device flag per backward pass since the step: "its gradients had a NaN/Inf".
        self.bad_backward_passes: list[torch.Tensor | float] = []
        # A forward pass of the model was seen this step. Not so when the model
        # was compiled in place (model.compile()): its hooks run inside the graph.
        self.saw_pass = False

    # -- passes ----------------------------------------------------------
    def before_call(self, position: int, args: Any) -> None:
        if self._depth == 0 and not self._replaying:
            # Gradient checkpointing re-runs blocks inside backward: that is
            # no new pass.
            self._recomputing = _inside_backward()
            if not self._recomputing:
                self._new_pass()
        self._depth += 1
        if self._checks_each_module() and position in self._checkable:
            if len(self.sums) <= _MAX_SUMS:
                ins = list(floating_tensors(args))
                ids = [self._sum_index(t) for t in ins]
                # In a replay (cost is no object there) the op trace may need
                # to re-run the module on what it was given, before it changed it.
                given = detached_copies(args) if self._replaying and self.trace_ops else None
                self._calls_in_progress.append(_CallStart(position, ins, ids, given))

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
        self.saw_pass = True
        # Identity matches and autograd nodes only matter within one pass;
        # dropping them here keeps memory flat across many passes per step.
        self._known.clear()
        self._grad_known.clear()
        self._grad_fns.clear()
        self._calls_in_progress.clear()
        if self._pass_grads:  # device passes: one flag per backward, read later
            flag = torch.stack(self._pass_grads).isfinite().all().logical_not()
            self._note_pass(flag)
            self._pass_grads = []
        elif self._pass_backward:
            # A backward no step used since (GradScaler skipped it, or gradient
            # accumulation): only then is what entered the model summed.
            self._note_pass(self._entering_flag())
        self._pass_backward = self._pass_bad = False
        self._last_call = None
        self._grad_entering = []
        if self.on_new_pass is not None:
            self.on_new_pass()

    def _note_pass(self, flag: torch.Tensor | float) -> None:
        self.bad_backward_passes.append(flag)
        if len(self.bad_backward_passes) > 64:
            del self.bad_backward_passes[0]

    def _end_spot_pass(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """A pass ended: one sum of its output; a replay only if it is bad.

        On CPU the sum is read at once (no device to wait for); otherwise it
        waits, with references to the pass's inputs, for the step boundary.
        """
        module = unwrap(module)  # a replay runs the model itself, eagerly
        outs = floating_list(output)
        if self.at_step:
            if self.forward_origin is None and outs:
                codes = torch.stack([o.detach().sum(dtype=torch.float64) for o in outs])
                masks = [not o.requires_grad for o in outs]
                self._waiting.append(_WaitingPass(module, args, kwargs, codes, masks))
                if len(self._waiting) >= _MAX_WAITING:
                    self.settle(None)  # a long evaluation between two steps
        elif self.forward_origin is None:
            for out in outs:
                if not _finite_exact(out):
                    self._forward_bad(module, args, kwargs)
                    break
        needs_grad = [o for o in outs if _non_leaf(o)]
        if needs_grad and torch.is_grad_enabled():
            # References to the batch (not copies) until the next pass: what a
            # backward replay needs if this step's gradients turn out bad.
            self._last_call = (module, args, kwargs)
            self._grad_entering = [None] * len(needs_grad)
            for position, tensor in enumerate(needs_grad):
                tensor.register_hook(_GradOutHook(self, position))

    def _forward_bad(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._step_bad = self._output_bad = True
        if self._bad_streak < _REPLAY_STREAK:
            self._replay_forward(module, args, kwargs)

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
                    if self.forward_origin is None:
                        self._forward_bad(w.module, w.args, w.kwargs)
                    break
        return norms is not None and not math.isfinite(float(norms.double().sum()))

    def on_grad_entering(self, position: int, grad: torch.Tensor) -> None:
        """Kept, not summed: the step's gradient norms show whether anything is off."""
        self._pass_backward = True
        if position < len(self._grad_entering):
            self._grad_entering[position] = grad

    def _entering_flag(self) -> torch.Tensor | float:
        """Whether the gradient that entered the model in the last backward was non-finite:
        a device flag when verdicts wait for the step, else a host float."""
        grads = [g for g in self._grad_entering if g is not None and g.is_floating_point()]
        if self.at_step and grads:
            sums = torch.stack([g.detach().sum(dtype=torch.float64) for g in grads])
            return sums.isfinite().all().logical_not().float()
        return float(self._entering_bad())

    def _entering_bad(self) -> bool:
        """Whether the gradient that entered the model in the last backward was non-finite."""
        if not self._pass_bad:
            self._pass_bad = any(
                g is not None and g.is_floating_point() and not _finite_exact(g)
                for g in self._grad_entering
            )
            self.grad_entering_bad = self.grad_entering_bad or self._pass_bad
        return self._pass_bad

    def _replaying_context(self, grad: bool) -> Any:
        return _Replay(self, grad)

    def _replay_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """Run the pass again module by module to find where its NaN/Inf was born."""
        # Grad mode as in the pass itself, so masks and real values are told
        # apart the same way (requires_grad) in the replay.
        module = replay_target(module)
        if module is None:
            return
        with self._replaying_context(grad=torch.is_grad_enabled()):
            args, kwargs = detached_copies((args, kwargs))
            module(*args, **kwargs)

    def replay_backward(self) -> bool:
        """This step's gradients are bad: run the last pass again, forward and backward.

        The gradient that entered the model is fed back in, and every module's
        gradients are checked on the way; the real ``.grad`` is left alone
        (``torch.autograd.grad``). Returns whether a replay ran.
        """
        if self._last_call is None or self.backward_origin is not None:
            return False
        self._entering_bad()
        self._step_bad = True
        if self._bad_streak >= _REPLAY_STREAK:
            return False  # still broken: what follows is the cascade, already reported
        if self.forward_origin is not None or self.grad_entering_bad:
            return False
        module, args, kwargs = self._last_call
        module = replay_target(module)
        if module is None:
            return False
        with self._replaying_context(grad=True):
            args, kwargs = detached_copies((args, kwargs))
            output = module(*args, **kwargs)
            outs = [o for o in floating_tensors(output) if _non_leaf(o)]
            pairs = [(o, g) for o, g in zip(outs, self._grad_entering) if g is not None]
            params = [p for p in module.parameters() if p.requires_grad]
            if pairs and params:
                _backward_leaving_grads([o for o, _ in pairs], params, [g for _, g in pairs])
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
        known = self._known.get(id(tensor))
        version = version_of(tensor)
        if known is not None and known[0]() is tensor and known[2] == version:
            return known[1]
        index = len(self.sums)
        self.sums.append(self._reduce(tensor))
        self.finite.append(None)
        # Outside autograd, a sum of -inf (-inf entries, no NaN, no +inf) is a
        # mask built on purpose: judged finite (see _finite_or_mask).
        self.maskable.append(not tensor.requires_grad)
        self._known[id(tensor)] = (weakref.ref(tensor), index, version)
        return index

    def _unchanged(self, index: int, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` still holds the values its sum ``index`` was taken of."""
        known = self._known.get(id(tensor))
        return known is not None and known[1] == index and known[2] == version_of(tensor)

    def _is_finite(self, index: int, tensor: torch.Tensor | None = None) -> bool:
        """Exact verdict for a CPU sum; a non-finite sum of finite values is an overflow."""
        verdict = self.finite[index]
        if verdict is None:
            value = float(self.sums[index])
            verdict = math.isfinite(value) or (value == -math.inf and self.maskable[index])
            if not verdict and tensor is not None:
                verdict = _finite_or_mask(tensor)
            self.finite[index] = verdict
        return verdict

    def after_forward(
        self, index: int, module: nn.Module, args: Any, kwargs: Any, output: Any
    ) -> None:
        start = self._started(index)
        ins = list(start.inputs) if start is not None else []
        in_ids = list(start.sums) if start is not None else []
        outs = list(floating_tensors(output))
        if not outs or len(self.sums) > _MAX_SUMS:
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
        self.calls.append(call)
        if immediate:
            given = start.given if start is not None and start.given is not None else args
            self._check_now(call, module, given, kwargs, ins, outs)
        if torch.is_grad_enabled():
            self._hook_gradients(call, ins, outs)

    def _started(self, position: int) -> _CallStart | None:
        """What ``before_call`` recorded for the call that just ended."""
        stack = self._calls_in_progress
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
    ) -> None:
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
        if not call.inputs_finite or self.forward_origin is not None:
            return  # propagated: an earlier module (or the data) made it
        bad = bad_out[0].detach()
        nan = torch.isnan(bad)
        finding = NonfiniteFinding(
            module=call.module,
            direction="forward",
            cause="module",
            kind="nan" if bool(nan.any()) else "inf",
            count=int((~torch.isfinite(bad)).sum()),
            shape=tuple(bad.shape),
            dtype=str(bad.dtype),
            device=str(bad.device),
        )
        finding.weights_nonfinite = not all(
            bool(torch.isfinite(p.detach()).all()) for p in module.parameters(recurse=False)
        )
        given = list(floating_tensors([args, kwargs]))
        if given:
            finding.input_min = min(float(t.detach().min()) for t in given)
            finding.input_max = max(float(t.detach().max()) for t in given)
        if self.trace_ops:
            self.suspended = True
            try:
                found: OpFinding | None = trace_first_nonfinite_op(module, args, kwargs)
            finally:
                self.suspended = False
            if found is not None:
                finding.op, finding.source, finding.op_basis = found.op, found.source, "re-run"
        self.forward_origin = finding

    def _hook_gradients(
        self, call: ForwardCall, ins: list[torch.Tensor], outs: list[torch.Tensor]
    ) -> None:
        # Leaves (a parameter handed to a module, or returned by one) are left
        # alone: a hook on one would stay on it after the step, one more each
        # step, and its gradient sums every use, so it names no single call;
        # the step's gradient norms check parameters anyway.
        for tensor in outs:
            if _non_leaf(tensor):
                tensor.register_hook(_GradHook(self, call, "out"))
                stop = {id(t.grad_fn) for t in ins if t.grad_fn is not None}
                self._grad_fns[id(call)] = (tensor.grad_fn, stop)
                break
        for tensor in ins:
            if _non_leaf(tensor):
                tensor.register_hook(_GradHook(self, call, "in"))

    # -- backward ----------------------------------------------------------
    def on_grad(self, call: ForwardCall, side: str, grad: torch.Tensor) -> None:
        if not grad.is_floating_point() or grad.layout != torch.strided:
            return
        index = self._grad_index(grad)
        if index is None:
            return
        self.grad_events.append((call, side, index))
        if side == "out":
            self._out_seen.add(id(call))
        on_the_spot = self._reads_now(grad)
        if not on_the_spot or self.backward_origin is not None:
            self._immediate_grads = self._immediate_grads and on_the_spot
            return
        if self._grad_finite(index, grad):
            return
        self._any_bad_grad = True
        if side == "out":
            self._out_bad.add(id(call))
            return
        if id(call) in self._out_bad or id(call) not in self._out_seen:
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
        op = _backward_op(*self._grad_fns.get(id(call), (None, set())))
        if op is not None:
            finding.op, finding.op_basis = op, "autograd graph"
        self.backward_origin = finding

    def _grad_index(self, grad: torch.Tensor) -> int | None:
        """The sum of this gradient: one module's output is the next one's input,
        so the same gradient reaches two hooks and is summed once."""
        known = self._grad_known.get(id(grad))
        version = version_of(grad)
        # Autograd may accumulate into a gradient buffer it already handed to a
        # hook: the same tensor, new values, a new version.
        if known is not None and known[0]() is grad and known[2] == version:
            return known[1]
        if len(self.grad_sums) > _MAX_SUMS:
            return None
        total = self._reduce(grad)
        index = len(self.grad_sums)
        self.grad_sums.append(total)
        self._grad_ok.append(None)
        if not self._replaying:
            self._pass_grads.append(total)
        self._grad_known[id(grad)] = (weakref.ref(grad), index, version)
        return index

    def _grad_finite(self, index: int, grad: torch.Tensor) -> bool:
        verdict = self._grad_ok[index]
        if verdict is None:
            verdict = math.isfinite(float(self.grad_sums[index])) or bool(
                torch.isfinite(grad).all()
            )
            self._grad_ok[index] = verdict
        return verdict

    # -- step boundary -----------------------------------------------------
    @property
    def spot(self) -> bool:
        """Whether the current passes are checked on the spot (CPU)."""
        return self.on_the_spot

    def modules(self) -> list[nn.Module | None]:
        return [ref() for ref in self._modules]

    def take(self) -> StepWindow:
        """Hand over what this step gathered and start the next one."""
        window = StepWindow(
            calls=self.calls,
            finite=self.finite,
            maskable=self.maskable,
            forward_origin=self.forward_origin,
            backward_origin=self.backward_origin,
            grad_events=self.grad_events,
            grad_entering_bad=self.grad_entering_bad,
            output_bad=self._output_bad,
            forward_seen=self.saw_pass,
        )
        needs_forward = (
            bool(self.finite)
            and any(v is None for v in self.finite)
            and any(not all(self.finite[i] is True for i in c.outputs) for c in self.calls)
        )
        if needs_forward:
            window.sums = _codes(self.sums)
        if self.grad_sums and (
            not self._immediate_grads or (self._any_bad_grad and self.backward_origin is None)
        ):
            window.grad_sums = _codes(self.grad_sums)
        self._bad_streak = self._bad_streak + 1 if self._step_bad else 0
        self._step_bad = False
        # The pass the step used counts as not skipped; its batch is let go.
        self._pass_grads = []
        self._pass_backward = self._pass_bad = False
        self._last_call = None
        self._grad_entering = []
        flags = self.bad_backward_passes
        if any(isinstance(f, torch.Tensor) for f in flags):
            device = next(f.device for f in flags if isinstance(f, torch.Tensor))
            window.skipped = torch.stack([torch.as_tensor(f, device=device) for f in flags])
        else:
            window.skipped_host = list(flags)
        self.reset()
        return window


FINITE, INF, NAN, NEG_INF = 0.0, 1.0, 2.0, 3.0


def replay_target(module: nn.Module) -> nn.Module | None:
    """What a one-rank replay may run: never anything that issues a collective.

    ``DistributedDataParallel`` syncs buffers and reduces gradients with the
    other ranks: its ``.module`` is replayed instead. ``SyncBatchNorm`` and
    FSDP-sharded modules talk to the other ranks inside their own forward:
    they are not replayed at all (None), and the origin stays unlocated.
    """
    inner = getattr(module, "module", None)
    if isinstance(inner, nn.Module) and type(module).__name__ == "DistributedDataParallel":
        module = inner
    for part in module.modules():
        if isinstance(part, nn.SyncBatchNorm) or type(part).__name__.startswith("FSDP"):
            return None
    return module


def _inside_backward() -> bool:
    """Whether autograd is running a backward pass on this thread right now."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _non_leaf(tensor: torch.Tensor) -> bool:
    """Made by autograd in this pass: a tensor hook on it goes when the graph goes."""
    return tensor.requires_grad and tensor.grad_fn is not None


def _finite_exact(tensor: torch.Tensor) -> bool:
    """One fp32 sum; only when it is not finite, the exact elementwise check."""
    if math.isfinite(float(tensor.detach().sum(dtype=torch.float32))):
        return True
    return _finite_or_mask(tensor)


def _finite_or_mask(tensor: torch.Tensor) -> bool:
    """Finite, or a deliberate mask: outside autograd, its only non-finite entries -inf.

    Causal and padding masks are built with -inf on purpose (``torch.full``,
    ``masked_fill``) and never require grad; a -inf that training made does
    (it came from the weights), and NaN or +inf is never a mask. Under
    ``no_grad`` (evaluation) nothing requires grad, so a -inf alone is let
    pass there: the NaN it turns into downstream is still caught.
    """
    # Detached: inside a checkpoint's recomputation, any op that saves a
    # tensor for backward (isfinite's abs does) breaks the recompute's match.
    if bool(torch.isfinite(tensor.detach()).all()):
        return True
    return not tensor.requires_grad and only_negative_inf(tensor)


class _Replay:
    """Re-running a pass must not change training: RNG forked, buffers swapped."""

    def __init__(self, probe: NonfiniteProbe, grad: bool) -> None:
        self.probe = probe
        self.grad = grad
        self._stack: Any = None

    def __enter__(self) -> _Replay:
        from contextlib import ExitStack

        probe = self.probe
        self._stack = ExitStack()
        root = probe._modules[0]() if probe._modules else None
        self._stack.enter_context(swapped_buffers(root) if root is not None else _null())
        # The CUDA generators too: a replay's dropout must not move training's RNG.
        self._stack.enter_context(torch.random.fork_rng(devices=probe.cuda_devices()))
        self._stack.enter_context(torch.enable_grad() if self.grad else torch.no_grad())
        self._stack.enter_context(quiet.replay())
        self._stack.enter_context(eager())  # compiled modules run (and are seen) one by one
        if not probe._handles:
            # Module hooks only for the replay: healthy passes run without them.
            handles = probe.module_hooks()
            self._stack.callback(_remove_all, handles)
        probe._replaying = True
        probe._known.clear()
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.probe._replaying = False
        self.probe._known.clear()
        self.probe._calls_in_progress.clear()
        self._stack.close()
        return True  # a replay that fails only means no finer location


def _backward_leaving_grads(
    outputs: list[torch.Tensor], params: list[torch.Tensor], grads: list[torch.Tensor]
) -> None:
    """Backward from ``outputs`` with the parameters' real ``.grad`` left as they are.

    ``torch.autograd.grad`` never touches ``.grad``; a reentrant checkpoint
    refuses it, so there the gradients are set aside around a plain backward
    and put back (the replay only happens once a step's gradients were bad).
    """
    try:
        # The graph is kept for the second try: the refusal comes mid-way.
        torch.autograd.grad(outputs, params, grads, allow_unused=True, retain_graph=True)
        return
    except RuntimeError as exc:
        if "checkpoint" not in str(exc):
            raise
    saved = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        torch.autograd.backward(outputs, grads)
    finally:
        for p, grad in zip(params, saved):
            p.grad = grad


def _remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def _codes(sums: list[torch.Tensor]) -> torch.Tensor:
    """Sums as finite/Inf/NaN codes: they survive the fp32 readback unchanged."""
    stacked = torch.stack([s.to(device=sums[0].device, dtype=torch.float64) for s in sums])
    inf = torch.isinf(stacked).to(torch.float32) * INF
    inf = torch.where(stacked == -math.inf, torch.full_like(inf, NEG_INF), inf)
    return torch.where(torch.isnan(stacked), torch.full_like(inf, NAN), inf)


@dataclass
class StepWindow:
    """Everything the probe saw between two step boundaries."""

    calls: list[ForwardCall]
    finite: list[bool | None]
    forward_origin: NonfiniteFinding | None
    backward_origin: NonfiniteFinding | None
    # (call, "out" or "in", index of the gradient's sum)
    grad_events: list[tuple[ForwardCall, str, int]]
    # Per sum: the tensor was outside autograd, so a sum of -inf is a mask.
    maskable: list[bool] = field(default_factory=list)
    grad_entering_bad: bool = False
    # A spot pass's output was non-finite (whether or not a replay located it).
    output_bad: bool = False
    # Some forward pass of the model ran where the hooks see it.
    forward_seen: bool = True
    # Codes (FINITE / INF / NAN / NEG_INF) of the sums, when they must be read back.
    sums: torch.Tensor | None = None
    grad_sums: torch.Tensor | None = None
    skipped: torch.Tensor | None = None
    # The same flags where they are known on the host already (checked on the spot).
    skipped_host: list[float] = field(default_factory=list)


def locate_forward(
    calls: Iterable[ForwardCall], finite: list[bool], codes: list[float] | None = None
) -> NonfiniteFinding | None:
    """The first call (in completion order) with bad outputs and finite inputs.

    With none such but bad outputs somewhere, the model's input was bad.
    Pure, so the device path and the tests share it.
    """
    calls = list(calls)
    bad_calls = [c for c in calls if not all(finite[i] for i in c.outputs)]
    if not bad_calls:
        return None
    spread = sorted({c.module for c in bad_calls})
    for call in bad_calls:
        inputs_ok = call.inputs_finite
        if inputs_ok is None:
            inputs_ok = all(finite[i] for i in call.inputs)
        if inputs_ok:
            return NonfiniteFinding(
                call.module,
                "forward",
                "module",
                kind=_kind(call.outputs, codes),
                shape=call.shape,
                dtype=call.dtype,
                device=call.device,
                spread=spread,
            )
    first = bad_calls[0]
    return NonfiniteFinding(
        first.module,
        "forward",
        "input",
        shape=first.shape,
        dtype=first.dtype,
        device=first.device,
        spread=spread,
    )


def _kind(indices: list[int], codes: list[float] | None) -> str | None:
    """From a sum alone: Inf for sure, or NaN (which +Inf and -Inf together also give)."""
    if not codes:
        return None
    values = [codes[i] for i in indices if i < len(codes)]
    if NAN in values:
        return "nan_or_inf"
    return "inf" if INF in values or NEG_INF in values else None


def locate_backward(
    events: list[tuple[ForwardCall, str, int]],
    finite: list[bool],
    codes: list[float] | None = None,
) -> NonfiniteFinding | None:
    """The first module whose input gradient went bad while its output gradient was fine.

    With none such, the gradient was already bad where it entered the model:
    the loss's backward made it.
    """
    out_bad: set[int] = set()
    out_seen: set[int] = set()
    first_bad: ForwardCall | None = None
    for call, side, index in events:
        if side == "out":
            out_seen.add(id(call))
        if index >= len(finite) or finite[index]:
            continue
        if first_bad is None:
            first_bad = call
        if side == "out":
            out_bad.add(id(call))
        elif id(call) not in out_bad and id(call) in out_seen:
            return NonfiniteFinding(
                call.module,
                "backward",
                "module",
                kind=_kind([index], codes),
                device=call.device,
            )
    if first_bad is not None:
        return NonfiniteFinding(first_bad.module, "backward", "loss", device=first_bad.device)
    return None


_DOMAIN_EDGE = re.compile(
    r"^(Sqrt|Rsqrt|Pow|Div|Log|Log2|Log10|Log1p|Reciprocal|LinalgVectorNorm|Norm|Acos|Asin|"
    r"Atanh|Acosh|Cdist|Std|Var|Tan|Exp|Erfinv|Lgamma|Digamma|Polygamma)Backward\d*$"
)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _backward_op(grad_fn: Any, stop: set[int], limit: int = 64) -> str | None:
    """The op inside a module whose backward most likely made the NaN/Inf.

    Autograd keeps no values to test, so this names the first op (walking from
    the module's output towards its inputs) whose derivative is known to blow
    up at the edge of its domain (sqrt at 0, the norm of a zero vector, log at
    0, division by 0), or else the output's own op.
    """
    if grad_fn is None:
        return None
    seen: set[int] = set()
    queue = [grad_fn]
    first_name: str | None = None
    while queue and len(seen) < limit:
        node = queue.pop(0)
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen.add(id(node))
        name = type(node).__name__
        if name == "AccumulateGrad":
            continue
        if first_name is None:
            first_name = name
        if _DOMAIN_EDGE.match(name):
            return "aten::" + _snake(re.sub(r"Backward\d*$", "", name))
        queue.extend(fn for fn, _ in getattr(node, "next_functions", ()))
    if first_name is None:
        return None
    return "aten::" + _snake(re.sub(r"Backward\d*$", "", first_name))
