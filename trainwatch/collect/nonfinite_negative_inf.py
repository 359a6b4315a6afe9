"""Where a -inf let pass as a mask came from, once it turned into a NaN/+inf.

A sum of -inf is taken for a mask built on purpose (``masked_fill(mask,
-inf)`` before a softmax, or on a policy's logits) and judged finite, with
or without grad. When a
later module turns it into a NaN/+inf (a BatchNorm after ``torch.log`` of a
count of 0), that module took in a non-finite value, so it is no origin: the
call whose own arithmetic made the -inf is. Only in a replay, where every
call is checked and may be re-run under an op trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainwatch.collect.nonfinite_locate import ForwardCall, NonfiniteFinding
from trainwatch.collect.nonfinite_sums import exactly_finite
from trainwatch.collect.op_trace import (
    OpFinding,
    trace_negative_inf_maker,
    trace_negative_inf_turned_nonfinite,
)
from trainwatch.collect.tensors import detached_copies, floating_tensors, input_range

if TYPE_CHECKING:
    from trainwatch.collect.nonfinite import NonfiniteProbe

# Calls of a replay that made -inf from finite inputs, kept to be traced if a
# NaN/+inf follows; past it, later ones are not kept.
MAX_MAKERS = 16


@dataclass
class NegativeInfMaker:
    """A replayed call whose output held -inf (no NaN, no +inf) from finite inputs:
    a mask, or arithmetic that overflowed to -inf; traced only if a NaN follows."""

    call: ForwardCall
    module: nn.Module
    args: Any
    kwargs: Any


def note_negative_inf(
    probe: NonfiniteProbe,
    call: ForwardCall,
    module: nn.Module,
    args: Any,
    kwargs: Any,
    ins: list[torch.Tensor],
) -> None:
    """Keep a replayed call that made -inf (let pass as a mask) from finite inputs."""
    sums = probe._this_step.sums
    makers = probe._this_step.negative_inf_makers
    if len(makers) >= MAX_MAKERS or not any(float(sums[i]) == -math.inf for i in call.outputs):
        return
    if exactly_finite(probe, call.inputs, ins):
        args, kwargs = detached_copies((args, kwargs))
        makers.append(NegativeInfMaker(call, module, args, kwargs))


def negative_inf_origin(probe: NonfiniteProbe, victim: ForwardCall) -> NonfiniteFinding | None:
    """The earlier call whose own arithmetic made the -inf that ``victim`` turned
    into a NaN/+inf, named with its op; None when only masks were made.

    Calls whose output ``victim`` took in directly are tried first.
    """
    makers = probe._this_step.negative_inf_makers
    fed = set(victim.inputs)
    ordered = [m for m in makers if fed & set(m.call.outputs)]
    ordered += [m for m in makers if m not in ordered]
    for maker in ordered:
        found = _traced(probe, trace_negative_inf_maker, maker.module, maker.args, maker.kwargs)
        if found is not None:
            call = maker.call
            return _made_negative_inf(call.module, call, found, [maker.args, maker.kwargs])
    return None


def negative_inf_around(probe: NonfiniteProbe, victim: ForwardCall) -> NonfiniteFinding | None:
    """The -inf came from no module's output: functional code in the forward of a
    module around ``victim`` (``torch.log(counts)`` in the model's own forward).

    The innermost call in progress whose inputs were finite made it; it is
    re-run to find the op, and named only if that op's -inf is where the
    NaN/+inf came from.
    """
    for start in reversed(probe._this_pass.calls_in_progress):
        if start.given is None or not exactly_finite(probe, start.sums, start.inputs):
            continue
        module = probe._modules[start.position]() if start.position < len(probe._modules) else None
        if module is None:
            return None
        found = _traced(probe, trace_negative_inf_turned_nonfinite, module, start.given, {})
        if found is None:
            return None
        return _made_negative_inf(start.position, victim, found, [start.given])
    return None


def _traced(
    probe: NonfiniteProbe, trace: Any, module: nn.Module, args: Any, kwargs: Any
) -> OpFinding | None:
    """An op trace of a re-run, unseen by the probe's own checks."""
    probe.suspended = True
    try:
        return trace(module, args, kwargs)
    finally:
        probe.suspended = False


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
