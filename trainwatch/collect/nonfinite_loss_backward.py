"""The loss's own backward, looked at once the gradient entering the model came out non-finite.

A loss can be finite while its backward is not: ``torch.where(n > 0, s / n, 0)``
picks 0 when ``n == 0``, yet backward still runs through ``s / n``, and its
0 * inf = NaN reaches every gradient. Whether the loss itself was finite tells
``nonfinite_loss`` from ``nonfinite_backward``, and a plain loop under
``tw.watch`` or ``trainwatch run`` hands no loss over. The step boundary comes
right after ``loss.backward()``, so the training code still holds it: a scalar
tensor in a caller's frame whose graph reaches the model's parameters. Its
graph outlives the backward (the values it saved are freed, its nodes are
not), so it also names the op whose derivative blows up at the edge of its
domain, one under a ``torch.where`` first (the masked branch's trap), and the
line that assigned the nearest variable above it.

Only on that rare path: a healthy step never comes here, and a look that
fails only means the loss stays unknown.
"""

from __future__ import annotations

import dis
import math
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any

import torch

from trainwatch.collect.nonfinite_locate import DOMAIN_EDGE, op_of_node
from trainwatch.collect.op_trace import _SKIP_DIRS

if TYPE_CHECKING:
    from trainwatch.collect.nonfinite import NonfiniteProbe
    from trainwatch.collect.nonfinite_locate import NonfiniteFinding

# Frames looked through from the step boundary outwards, and nodes of the
# loss's graph walked, at most.
_MAX_FRAMES = 64
_MAX_NODES = 100_000
# The instructions that assign a variable.
_STORES = frozenset({"STORE_FAST", "STORE_NAME", "STORE_GLOBAL", "STORE_DEREF"})
# Ops whose derivative is finite wherever their value is.
_FINITE_WHERE_VALUE_IS = ("Div", "Reciprocal", "Rsqrt", "Log", "Exp")
# How the op is known: from the graph's shape, its values having been freed.
LOSS_GRAPH = "the loss's autograd graph (not re-run)"


@dataclass
class _Part:
    """A loss's part of the graph: its nodes, nearest first, down to (and with)
    those that take a parameter of the model, each with its parent on the way
    from the loss. The nodes are held, so their ids stay theirs."""

    nodes: list[Any]
    ids: set[int]
    parents: dict[int, Any]
    model: list[Any]  # the nodes that take a parameter of the model


@dataclass
class _Named:
    """A tensor with a graph the training code holds, and the variable holding it
    (none for a loss handed over); its node is kept, so its id stays its own."""

    node: Any
    tensor: torch.Tensor
    frame: FrameType | None = None
    name: str = ""


@dataclass
class _Held:
    """What the training code holds: the losses backward may have run from, and
    the tensors with a graph, by their node's id."""

    losses: list[tuple[torch.Tensor, _Part]] = field(default_factory=list)
    named: dict[int, _Named] = field(default_factory=dict)


def look_at_loss(probe: NonfiniteProbe, finding: NonfiniteFinding) -> None:
    """Fill in, on ``finding`` (the gradient non-finite where it entered the model),
    the value of the loss the training code still holds and, when it is finite,
    the op of its backward that made the NaN/Inf."""
    root = probe._modules[0]() if probe._modules else None
    if root is None:
        return
    try:
        params = {id(p) for p in root.parameters()}
        handed = probe.handed_loss() if probe.handed_loss is not None else None
        held = _held(sys._getframe(1), params, handed)
        _judge(finding, held, params)
    except Exception:  # a look that fails leaves the loss unknown
        return


def _user_frames(frame: FrameType | None) -> Iterator[FrameType]:
    """The frames above the step boundary that are neither PyTorch's nor trainwatch's."""
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return
        if not frame.f_code.co_filename.startswith(_SKIP_DIRS):
            yield frame
        frame = frame.f_back


def _held(frame: FrameType | None, params: set[int], handed: torch.Tensor | None) -> _Held:
    held = _Held()
    scalars: list[torch.Tensor] = []
    if handed is not None and handed.grad_fn is not None and handed.numel() == 1:
        scalars.append(handed)
    for user in _user_frames(frame):
        for name, value in list(user.f_locals.items()):
            if not isinstance(value, torch.Tensor) or value.grad_fn is None:
                continue
            node = value.grad_fn
            held.named.setdefault(id(node), _Named(node, value, user, name))
            if value.numel() == 1 and value.is_floating_point():
                scalars.append(value)
    # The loss backward ran from: a scalar whose graph reaches the model, and
    # no other's part (``loss_u`` is inside ``loss = loss + loss_u``).
    parts: dict[int, tuple[torch.Tensor, _Part]] = {}
    for tensor in scalars:
        node = tensor.grad_fn
        held.named.setdefault(id(node), _Named(node, tensor))
        if id(node) not in parts:
            part = _loss_part(node, params)
            if part.model:
                parts[id(node)] = (tensor, part)
    held.losses = [
        (tensor, part)
        for key, (tensor, part) in parts.items()
        if not any(other != key and key in found.ids for other, (_, found) in parts.items())
    ]
    return held


def _holds_parameter(node: Any, params: set[int]) -> bool:
    """Whether ``node`` takes one of the model's parameters directly (a ``Linear``'s
    ``addmm``): part of the model, whose backward the gradient reached finite."""
    for fn, _ in node.next_functions:
        if type(fn).__name__ == "AccumulateGrad" and id(fn.variable) in params:
            return True
    return False


def _loss_part(root: Any, params: set[int]) -> _Part:
    part = _Part([], {id(root)}, {id(root): None}, [])
    queue = deque([root])
    while queue and len(part.nodes) < _MAX_NODES:
        node = queue.popleft()
        part.nodes.append(node)
        if _holds_parameter(node, params):
            part.model.append(node)
            continue
        for fn, _ in node.next_functions:
            if fn is None or id(fn) in part.ids or type(fn).__name__ == "AccumulateGrad":
                continue
            part.ids.add(id(fn))
            part.parents[id(fn)] = node
            queue.append(fn)
    return part


def _feeding_model(part: _Part) -> set[int]:
    """The nodes from which backward goes on into the model: only those can have
    sent it the NaN/Inf (a branch into weights outside the model cannot)."""
    feeding = {id(node) for node in part.model}
    changed = True
    while changed:
        changed = False
        for node in part.nodes:
            if id(node) in feeding:
                continue
            if any(fn is not None and id(fn) in feeding for fn, _ in node.next_functions):
                feeding.add(id(node))
                changed = True
    return feeding


def _judge(finding: NonfiniteFinding, held: _Held, params: set[int]) -> None:
    if not held.losses:
        return
    values = [float(tensor.detach().reshape(-1)[0]) for tensor, _ in held.losses]
    bad = [value for value in values if not math.isfinite(value)]
    finding.loss = bad[0] if bad else values[0]
    if bad:
        return  # the loss itself: its backward only carried the NaN/Inf on
    edges: list[tuple[Any, bool, _Part]] = []
    for _, part in held.losses:
        feeding = _feeding_model(part)
        # Below a torch.where: computed whichever branch it picked.
        masked: set[int] = set()
        wheres = [n for n in part.nodes if type(n).__name__.startswith("WhereBackward")]
        below = [_loss_part(where, params) for where in wheres]  # held while ids are compared
        for where, under in zip(wheres, below):
            masked |= under.ids - {id(where)}
        edges.extend(
            (node, id(node) in masked, part)
            for node in part.nodes
            if id(node) in feeding and _can_blow_up(node, held.named.get(id(node)))
        )
    under_where = [edge for edge in edges if edge[1]]
    # The classic trap first: an op under a torch.where. Else an op named only
    # where it is the only one that can blow up (``loss / accumulation`` is a
    # division too).
    chosen = under_where[0] if under_where else (edges[0] if len(edges) == 1 else None)
    if chosen is None:
        return
    node, finding.under_where, part = chosen
    finding.op, finding.op_basis = op_of_node(node), LOSS_GRAPH
    finding.source = _source(node, part.parents, held.named)


def _can_blow_up(node: Any, held: _Named | None) -> bool:
    """Whether the op's derivative can be infinite at the edge of its domain.

    A power's exponent outlives the backward: x ** 2 has a finite derivative
    everywhere (a squared error), x ** 0.5 not at 0. An op whose output the
    training code holds finite (the loss itself, ``loss / accumulation``) had
    a finite derivative too, if its derivative is finite wherever its value
    is: a division, a log, an exp (not sqrt: sqrt(0) is 0).
    """
    name = type(node).__name__
    if not DOMAIN_EDGE.match(name):
        return False
    if (
        held is not None
        and name.startswith(_FINITE_WHERE_VALUE_IS)
        and bool(torch.isfinite(held.tensor.detach()).all())
    ):
        return False
    exponent = (
        getattr(node, "_saved_exponent", None) if type(node).__name__ == "PowBackward0" else None
    )
    return not (isinstance(exponent, (int, float)) and (exponent >= 1 or exponent == 0))


def _source(node: Any, parents: dict[int, Any], named: dict[int, _Named]) -> str | None:
    """The line that assigned the variable nearest above ``node`` (the op's own
    output, or what its expression was part of), where it is assigned once."""
    while node is not None:
        held = named.get(id(node))
        if held is not None and held.frame is not None:
            lines = _assigned_lines(held.frame.f_code, held.name)
            if len(lines) == 1:
                return f"{held.frame.f_code.co_filename}:{lines[0]}"
            return None  # assigned on several lines: which one is not known
        node = parents.get(id(node))
    return None


def _assigned_lines(code: CodeType, name: str) -> list[int]:
    starts = sorted((offset, line) for offset, line in dis.findlinestarts(code) if line)
    lines: set[int] = set()
    for instruction in dis.get_instructions(code):
        if instruction.opname in _STORES and instruction.argval == name:
            line = next(
                (line for offset, line in reversed(starts) if offset <= instruction.offset), None
            )
            if line is not None:
                lines.add(line)
    return sorted(lines)
