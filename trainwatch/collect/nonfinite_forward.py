"""Each call of the model's modules checked on its own, where one is checked.

A healthy pass on the spot sums only the model's output (``NonfiniteProbe``).
Every module call is checked in deferred mode and during a replay: the global
module hooks (``nonfinite_hooks``), which exist only then, call
``module_starts`` and ``module_ends`` here.
A call's positional inputs are summed as it begins, so a module that changes
its input in place is judged on what it was given. Where sums may be read at
once (CPU, a replay) the first call whose outputs went non-finite from finite
inputs is named on the spot, with its op when a re-run can trace it; else the
calls and sums wait in the step's state for ``locate_forward``.
Complex inputs and outputs are checked like floating ones (``inexact_tensors``):
a module handing on a complex NaN (a spectral layer, a complex activation) is
where it was born, and the module after it, which reads it, is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainwatch.collect.nonfinite_gradients import hook_gradients
from trainwatch.collect.nonfinite_locate import ForwardCall, NonfiniteFinding
from trainwatch.collect.nonfinite_negative_inf import (
    negative_inf_around,
    negative_inf_origin,
    note_negative_inf,
)
from trainwatch.collect.nonfinite_sums import (
    MAX_SUMS,
    exactly_finite,
    is_finite,
    reads_now,
    sum_index,
    unchanged,
)
from trainwatch.collect.op_trace import OpFinding, trace_first_nonfinite_op
from trainwatch.collect.received import as_received
from trainwatch.collect.tensors import detached_copies, inexact_tensors, input_range
from trainwatch.compiled import transform_level, unwrap
from trainwatch.layers import own_parameters
from trainwatch.rng import PassDraws, draws_now

if TYPE_CHECKING:
    from trainwatch.collect.nonfinite import NonfiniteProbe

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

# The id of the backward pass running on this thread (-1: none), if torch says.
graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
# The CPU generator's state, copied (bound once: taken as every pass begins).
cpu_rng_state = torch.default_generator.get_state


def inside_backward() -> bool:
    """Whether autograd is running a backward pass on this thread right now."""
    return graph_task_id is not None and graph_task_id() != -1


@dataclass
class CallStart:
    """A module call as it began: its positional inputs and their sums."""

    position: int
    inputs: list[torch.Tensor]
    sums: list[int]
    given: Any = None  # copies of its positional arguments (replays only)
    # The CPU generator's state then, with the model's own generators' (replays only).
    rng: PassDraws = None
    # Its keyword arguments as the call received them, where one held a container
    # its forward may empty (replays only: ``module_keywords``).
    kwargs: Any = None


def _position(probe: NonfiniteProbe, module: nn.Module) -> int | None:
    """The module's index in the model's ``named_modules()`` (None: not the model's)."""
    position = probe._ids.get(id(module))
    if position is None:
        # torch.compile(model)'s wrapper runs eagerly around the compiled
        # model: it stands for the model (or submodule) it wraps.
        inner = unwrap(module)
        if inner is not module:
            position = probe._ids.get(id(inner))
    return position


def module_starts(probe: NonfiniteProbe, module: nn.Module, args: Any) -> None:
    """Global forward pre-hook: every module call in the process comes here."""
    position = _position(probe, module)
    if position is not None and _follows_call(probe):
        before_call(probe, position, args)


def module_ends(probe: NonfiniteProbe, module: nn.Module, args: Any, *rest: Any) -> None:
    """Global forward hook: ``rest`` is ``(kwargs, output)``, or ``(output,)`` on a
    torch whose global hooks see positional arguments only."""
    position = _position(probe, module)
    if position is not None and _follows_call(probe):
        kwargs, output = rest if len(rest) == 2 else ({}, rest[0])
        after_call(probe, position, module, args, kwargs, output)


def module_keywords(probe: NonfiniteProbe, module: nn.Module, args: Any, kwargs: Any) -> None:
    """A checked module's own pre-hook, in a replay: its keyword arguments as the
    call received them, kept with the call's start (which the global pre-hook,
    run first, just made). A list handed by keyword that the forward empties is
    then judged and re-run as it came in."""
    if not kwargs or not probe._replaying:
        return
    stack = probe._this_pass.calls_in_progress
    if stack and stack[-1].position == _position(probe, module):
        received = as_received((), kwargs)[1]
        if received is not kwargs:
            stack[-1].kwargs = received


def _follows_call(probe: NonfiniteProbe) -> bool:
    """Whether a call of one of the model's modules is checked on its own.

    Not inside a torch.func transform (an ensemble's template run under
    vmap + functional_call): its tensors are wrapped, with no value to
    read; the outermost call, made outside the transform, still is.
    """
    return probe.enabled and not probe.suspended and transform_level() is None


def before_call(probe: NonfiniteProbe, position: int, args: Any) -> None:
    """A call of the model's module ``position`` begins: an outermost one starts a
    pass; a checked one has its positional inputs summed before it can change them."""
    if probe._depth == 0 and not probe._replaying:
        # Gradient checkpointing re-runs blocks inside backward: that is
        # no new pass.
        probe._recomputing = inside_backward()
        if not probe._recomputing:
            probe._new_pass()
    probe._depth += 1
    if _checks_each_module(probe) and position in probe._checkable:
        if len(probe._this_step.sums) <= MAX_SUMS:
            ins = list(inexact_tensors(args))
            ids = [sum_index(probe, t) for t in ins]
            # In a replay (cost is no object there) the op trace may need
            # to re-run the module on what it was given, before it changed it.
            given = rng = None
            if probe._replaying and probe.trace_ops:
                given, rng = detached_copies(args), draws_now(probe._generators)
            probe._this_pass.calls_in_progress.append(CallStart(position, ins, ids, given, rng))


def after_call(
    probe: NonfiniteProbe, position: int, module: nn.Module, args: Any, kwargs: Any, output: Any
) -> None:
    """A call of the model's module ``position`` ended (an outermost one ends the pass)."""
    probe._depth = max(0, probe._depth - 1)
    if _checks_each_module(probe) and position in probe._checkable:
        _after_forward(probe, position, module, args, kwargs, output)
    if probe._depth == 0 and probe.on_the_spot and not probe._replaying and not probe._recomputing:
        probe._end_spot_pass(module, args, kwargs, output)


def _checks_each_module(probe: NonfiniteProbe) -> bool:
    """Replays and device passes check every module; so does a recomputation,
    even on the spot: a reentrant checkpoint's recomputed tensors are the ones
    its backward flows through, and a replay cannot re-enter it (it refuses
    torch.autograd.grad)."""
    return probe._replaying or not probe.on_the_spot or probe._recomputing


def _after_forward(
    probe: NonfiniteProbe, index: int, module: nn.Module, args: Any, kwargs: Any, output: Any
) -> None:
    """A checked call ended: its sums recorded, judged at once where they may be
    read, and its gradients hooked."""
    start = _started(probe, index)
    if start is not None and start.kwargs is not None:
        kwargs = start.kwargs  # as the call received them: its forward emptied one
    ins = list(start.inputs) if start is not None else []
    in_ids = list(start.sums) if start is not None else []
    outs = list(inexact_tensors(output))
    if not outs or len(probe._this_step.sums) > MAX_SUMS:
        return
    # Positional inputs were summed as the call began; keyword ones now.
    kw_ins = list(inexact_tensors(kwargs))
    ins += kw_ins
    in_ids += [sum_index(probe, t) for t in kw_ins]
    first = outs[0]
    immediate = reads_now(probe, first)
    out_ids = [sum_index(probe, t) for t in outs]
    call = ForwardCall(
        index, in_ids, out_ids, tuple(first.shape), str(first.dtype), str(first.device)
    )
    probe._this_step.calls.append(call)
    if immediate:
        given = start.given if start is not None and start.given is not None else args
        rng = start.rng if start is not None else None
        _check_now(probe, call, module, given, kwargs, ins, outs, rng)
        if probe._replaying and probe.trace_ops:
            note_negative_inf(probe, call, module, given, kwargs, ins)
    if torch.is_grad_enabled():
        hook_gradients(probe, call, ins, outs)


def _started(probe: NonfiniteProbe, position: int) -> CallStart | None:
    """What ``before_call`` recorded for the call that just ended."""
    stack = probe._this_pass.calls_in_progress
    if stack and stack[-1].position == position:
        return stack.pop()
    return None


def _check_now(
    probe: NonfiniteProbe,
    call: ForwardCall,
    module: nn.Module,
    args: Any,
    kwargs: Any,
    ins: list[torch.Tensor],
    outs: list[torch.Tensor],
    rng: PassDraws = None,
) -> None:
    """Read a call's sums now: outputs gone non-finite from finite inputs make it the
    forward origin, told with its weights, its input range and (re-run under a
    trace) its op. ``rng``: the CPU generator's state as the call began (the
    trace re-runs the call from it)."""
    bad_out = [t for i, t in zip(call.outputs, outs) if not is_finite(probe, i, t)]
    if not bad_out:
        return
    # The sums taken as the call began: a module that changed its input in
    # place is judged on what it was given (the exact check only while
    # the tensor still holds those values).
    call.inputs_finite = all(
        is_finite(probe, i, t if unchanged(probe, i, t) else None) for i, t in zip(call.inputs, ins)
    )
    if not call.inputs_finite or probe._this_step.forward_origin is not None:
        return  # propagated: an earlier module (or the data) made it
    # One look at the module's own weights: its nn.Parameters, and the stand-ins
    # functional_call puts in their place (a MAML inner loop's fast weights,
    # made outside the model: non-finite, they carried the value in).
    bad_weights, given_bad = _nonfinite_weights(module)
    if probe._replaying and probe.trace_ops and not exactly_finite(probe, call.inputs, ins):
        # A -inf taken for a mask came in: if an earlier module's own
        # arithmetic made it, that module is the origin.
        maker = negative_inf_origin(probe, call) or negative_inf_around(probe, call)
        if maker is not None:
            probe._this_step.forward_origin = maker
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
        finding.weights_written = probe.written_since_update(bad_weights)
    given = list(inexact_tensors([args, kwargs]))
    found = input_range(given)
    if found is not None:
        finding.input_min, finding.input_max = found
    if probe.trace_ops and not given_bad:
        probe.suspended = True
        try:
            found: OpFinding | None = trace_first_nonfinite_op(module, args, kwargs, rng)
        finally:
            probe.suspended = False
        if found is not None:
            finding.op, finding.source, finding.op_basis = found.op, found.source, "re-run"
            finding.op_inputs_masked = found.inputs_masked
            if found.shape is not None:
                # Told as the op made it: the tensor the alert says it made.
                finding.kind, finding.count = found.kind, found.count
                finding.shape, finding.dtype = found.shape, found.dtype or finding.dtype
    probe._this_step.forward_origin = finding


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
