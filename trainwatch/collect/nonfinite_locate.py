"""Where a step's first NaN/Inf was born, from sums already read back: pure functions.

The probe records every module call of a pass (which sums are its inputs and
which its outputs) and every gradient that reached a module; once the sums
are known finite or not, the origin is the first call with bad outputs and
finite inputs (forward), or the first module whose input gradient went bad
while its output gradient was fine (backward). Pure, so the device path and
the tests share them, and a hand-built window can be judged.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


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
class NonfiniteFinding:
    """What the rules need to name an origin."""

    module: int
    direction: str  # "forward" or "backward"
    cause: str  # "module": born here; "input": the model's input was already bad;
    # "loss": gradient non-finite where it enters the model (the loss's backward);
    # "unreplayed": born inside the model from finite inputs, module not located
    # (a model that may not be replayed on one rank: FSDP-sharded);
    # NORM_OVERFLOW: no NaN/Inf at all, the gradients' norm overflowed
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
    # The op's own inputs held -inf (a mask made inside the module), though
    # the module's inputs (``input_min``/``input_max``) were finite.
    op_inputs_masked: bool = False
    spread: list[int] = field(default_factory=list)
    # Whether the module's own weights were non-finite when it ran (None: not seen).
    weights_nonfinite: bool | None = None
    # Those weights, as they were found then (this step's update may add others).
    nonfinite_weights: list[torch.Tensor] = field(default_factory=list)
    # Whether any of them was written since the last update applied (a version
    # counter moved): by the training code, not the optimizer (None: not known).
    weights_written: bool | None = None
    # NORM_OVERFLOW: the parameter holding the largest gradient element, its
    # magnitude, and the total norm of a clip_grad_norm_ about to rescale them
    # (None: none was in progress).
    parameter: str | None = None
    owner: str | None = None
    largest: float | None = None
    clip_norm: float | None = None
    # "loss": the value of the loss the training code held (None: not found),
    # and whether the op named lies under a torch.where (its masked branch).
    loss: float | None = None
    under_where: bool = False


FINITE, INF, NAN, NEG_INF = 0.0, 1.0, 2.0, 3.0

# The cause of a step whose gradient norms came out non-finite while every
# gradient is finite: too large for the fp32 sum of squares, no NaN/Inf.
NORM_OVERFLOW = "norm_overflow"


def sums_as_codes(sums: list[torch.Tensor]) -> torch.Tensor:
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
    # The first non-finite gradient entering the model, as it was checked when it
    # came (None: every one was finite, or it was not checked there).
    entering_origin: NonfiniteFinding | None = None
    # A spot pass's output was non-finite (whether or not a replay located it).
    output_bad: bool = False
    # Some forward pass of the model ran where the hooks see it.
    forward_seen: bool = True
    # This rank's own forward and backward were replayed (a backward origin,
    # if any, came from it): under torch.distributed, a clean replay means the
    # NaN/Inf arrived through the gradient all-reduce.
    backward_replayed: bool = False
    # A backward replay was due but refused (FSDP-sharded or SyncBatchNorm
    # modules would talk to the other ranks): this rank's forward output and
    # the gradient entering its model were finite all the same.
    backward_unreplayable: bool = False
    # Codes (FINITE / INF / NAN / NEG_INF) of the sums, when they must be read back.
    sums: torch.Tensor | None = None
    grad_sums: torch.Tensor | None = None
    skipped: torch.Tensor | None = None
    # The same flags where they are known on the host already (checked on the spot).
    skipped_host: list[float] = field(default_factory=list)


def locate_forward(
    calls: Iterable[ForwardCall],
    finite: list[bool],
    codes: list[float] | None = None,
) -> NonfiniteFinding | None:
    """The first call (in completion order) with bad outputs and finite inputs.

    With none such but bad outputs somewhere, the model's input was bad.
    Inputs that were -inf (no NaN, no +inf) count as finite (masks), unless
    the call that handed them over made that -inf from finite floating
    inputs (``_negative_inf_maker``): then that call is the origin.
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
            maker = _negative_inf_maker(calls, call, codes)
            if maker is not None:
                return NonfiniteFinding(
                    maker.module,
                    "forward",
                    "module",
                    kind="-inf",
                    shape=maker.shape,
                    dtype=maker.dtype,
                    device=maker.device,
                    spread=spread,
                )
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


def _negative_inf_maker(
    calls: list[ForwardCall],
    victim: ForwardCall,
    codes: list[float] | None,
) -> ForwardCall | None:
    """From sums alone (no values kept): the call that handed ``victim`` a -inf it
    made from finite floating inputs. A mask built from no floating input at
    all (``torch.full(..., -inf)``) is not one; a mask computed from finite
    floats cannot be told from arithmetic here (only a replay's op trace can).
    """
    if not codes:
        return None
    fed = {i for i in victim.inputs if i < len(codes) and codes[i] == NEG_INF}
    if not fed:
        return None
    for call in calls:
        if call is victim:
            return None
        if (
            call.inputs
            and fed & set(call.outputs)
            and all(i < len(codes) and codes[i] == FINITE for i in call.inputs)
        ):
            return call
    return None


def _kind(indices: list[int], codes: list[float] | None) -> str | None:
    """From a sum alone: Inf for sure, or NaN (which +Inf and -Inf together also give)."""
    if not codes:
        return None
    values = [codes[i] for i in indices if i < len(codes)]
    if NAN in values:
        return "nan_or_inf"
    return "inf" if INF in values or NEG_INF in values else None


def owners(names: list[str]) -> list[int | None]:
    """Per module (as ``named_modules`` lists them), the module that holds it
    (None: the model itself): the one whose ``forward`` calls it, as a rule."""
    index: dict[str, int] = {}
    for position, name in enumerate(names):
        index.setdefault(name, position)
    return [index.get(name.rpartition(".")[0]) if name else None for name in names]


def locate_backward(
    events: list[tuple[ForwardCall, str, int]],
    finite: list[bool],
    codes: list[float] | None = None,
    parents: list[int | None] | None = None,
) -> NonfiniteFinding | None:
    """The first module whose input gradient went bad while its output gradient was fine.

    With none such, the first bad gradient reached a module's output: if the
    module holding it (``parents``, per module) got a finite gradient at its
    own output, its own code made the NaN/Inf (``torch.where(h > 0,
    torch.sqrt(h), 0)`` on a child's output, its own input the data, which
    has no gradient to look at). Else the gradient was already bad where it
    entered the model: the loss's backward made it.
    """
    parents = parents or []
    out_bad: set[int] = set()
    out_seen: set[int] = set()
    out_fine: set[int] = set()  # modules that got a finite gradient at an output
    first_bad: ForwardCall | None = None
    first_index = 0
    around: int | None = None  # the module whose own code made the first bad gradient
    for call, side, index in events:
        if side == "out":
            out_seen.add(id(call))
        if index >= len(finite) or finite[index]:
            if side == "out":
                out_fine.add(call.module)
            continue
        if first_bad is None:
            first_bad, first_index = call, index
        parent = parents[call.module] if call.module < len(parents) else None
        if around is None and side == "out" and index == first_index and parent in out_fine:
            # Nested calls return the same tensor (``feat`` returns ``proj``'s
            # output): each of them sees it; the one whose holder was fine counts.
            around = parent
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
    if first_bad is not None and around is not None:
        return NonfiniteFinding(
            around,
            "backward",
            "module",
            kind=_kind([first_index], codes),
            device=first_bad.device,
        )
    if first_bad is not None:
        # Its output's dtype: the gradient entering it has that dtype.
        return NonfiniteFinding(
            first_bad.module,
            "backward",
            "loss",
            kind=_kind([first_index], codes),
            dtype=first_bad.dtype,
            device=first_bad.device,
        )
    return None


# Ops whose derivative is infinite (or 0 * inf) at the edge of their domain.
DOMAIN_EDGE = re.compile(
    r"^(Sqrt|Rsqrt|Pow|Div|Log|Log2|Log10|Log1p|Reciprocal|LinalgVectorNorm|Norm|Acos|Asin|"
    r"Atanh|Acosh|Cdist|Std|Var|Tan|Exp|Erfinv|Lgamma|Digamma|Polygamma)Backward\d*$"
)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def backward_op(
    grad_fn: Any, stop: set[int], limit: int = 64, seen_bad: Any = None
) -> tuple[str, str] | None:
    """The op inside a module whose backward made the NaN/Inf, and how it is known.

    ``seen_bad``: the autograd node a replay's backward saw make the first
    NaN/Inf from finite values; named when it lies inside the module (``re-run``).
    Else autograd keeps no values to test, so this names the first op (walking
    from the module's output towards its inputs) whose derivative is known to
    blow up at the edge of its domain (sqrt at 0, the norm of a zero vector,
    log at 0, division by 0), or else the output's own op (``autograd graph``).
    """
    if grad_fn is None:
        return None
    if seen_bad is not None and _reaches(grad_fn, stop, seen_bad, limit * 4):
        return _node_op(type(seen_bad).__name__), "re-run"
    op = _edge_op(grad_fn, stop, limit)
    return (op, "autograd graph") if op is not None else None


def innermost_holding(
    calls: list[ForwardCall],
    regions: dict[int, tuple[Any, set[int]]],
    node: Any,
    limit: int = 4096,
) -> ForwardCall | None:
    """The innermost module call whose part of the graph holds ``node``.

    ``calls`` in the order they ended (a module's calls before its parent's);
    ``regions``: per call, its output's node and its inputs' nodes (where its
    part of the graph stops). A parent's part holds its children's, so the
    first call that holds the node is the innermost.
    """
    for call in calls:
        region = regions.get(id(call))
        if region is not None and _reaches(region[0], region[1], node, limit):
            return call
    return None


def op_of_node(node: Any) -> str:
    """The forward op an autograd node differentiates (``SqrtBackward0``: ``aten::sqrt``)."""
    return _node_op(type(node).__name__)


def _node_op(name: str) -> str:
    """``SqrtBackward0`` -> ``aten::sqrt``: the forward op a backward node differentiates."""
    return "aten::" + _snake(re.sub(r"Backward\d*$", "", name))


def _module_nodes(grad_fn: Any, stop: set[int], limit: int) -> Iterator[Any]:
    """The backward nodes between a module's output node and its inputs', nearest first."""
    seen: set[int] = set()
    queue = [grad_fn]
    while queue and len(seen) < limit:
        node = queue.pop(0)
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen.add(id(node))
        yield node
        queue.extend(fn for fn, _ in getattr(node, "next_functions", ()))


def _reaches(grad_fn: Any, stop: set[int], target: Any, limit: int) -> bool:
    """Whether ``target`` lies between the module's output node and its inputs'."""
    return any(node is target for node in _module_nodes(grad_fn, stop, limit))


def _edge_op(grad_fn: Any, stop: set[int], limit: int) -> str | None:
    first_name: str | None = None
    for node in _module_nodes(grad_fn, stop, limit):
        name = type(node).__name__
        if name == "AccumulateGrad":
            continue
        if first_name is None:
            first_name = name
        if DOMAIN_EDGE.match(name):
            return _node_op(name)
    return _node_op(first_name) if first_name is not None else None
