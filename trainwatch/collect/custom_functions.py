"""Which custom autograd Functions stand between a layer and the model's output.

A layer that ran, is connected to the output in the autograd graph, and still
got no gradient was given ``None`` on the way: a custom
``torch.autograd.Function`` whose ``backward`` returns ``None`` for an input
(a fake-quantiser written without its straight-through estimator) does that,
where a ``.detach()`` would have cut the layer out of the graph altogether.
The graph's structure outlives its backward (only saved tensors are freed),
so the nodes a pass's output hangs from are walked once, for the layers seen
running without a gradient, and never on a healthy step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

# Nodes walked at most: a graph larger than this is left unexplained.
_MOST_NODES = 200_000


def functions_through(
    roots: Sequence[Any], targets: dict[str, list[torch.Tensor]]
) -> tuple[dict[str, list[str]], frozenset[str]]:
    """Per layer of ``targets`` (its parameters), the custom Functions nearest it on
    every path from ``roots`` to its parameters, by class name; a layer with a
    path free of custom Functions, or none at all (detached), is left out.

    Second, the layers none of whose parameters the graph holds at all: cut off
    inside the model, which no output of it explains, left out of the loss or
    not. Both come of the one walk; a graph too large to walk claims neither,
    and one holding any autograd Function claims no layer cut off.
    """
    order = postorder(roots)
    if order is None:
        return {}, frozenset()
    custom = {id(node): _custom(node) for node in order}
    owners = {id(p): owner for owner, params in targets.items() for p in params}
    target_owner: dict[int, str] = {}
    for node in order:
        variable = None if custom[id(node)] else getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor) and id(variable) in owners:
            target_owner[id(node)] = owners[id(variable)]
    found: dict[str, list[str]] = {}
    for owner in targets:
        names = _names(nearest(order, roots, custom, target_owner, owner))
        if names:
            found[owner] = names
    if any(isinstance(node, BackwardCFunction) for node in order):
        # A Function may run parameters its graph does not show (a reentrant
        # checkpoint re-runs its block in backward): no layer is claimed cut off.
        return found, frozenset()
    return found, frozenset(targets.keys() - target_owner.values())


def nearest(
    order: list[Any],
    roots: Sequence[Any],
    blocking: dict[int, bool],
    target_owner: dict[int, str],
    owner: str,
) -> list[Any]:
    """The ``blocking`` nodes from which ``owner``'s parameters are reached without
    passing another; none where some root reaches them without any (or where
    the graph does not hold them). ``order``: the graph's nodes, children first
    (``postorder``); ``target_owner``: the parameters' AccumulateGrad nodes, by id,
    with the layer owning each."""
    plain: dict[int, bool] = {}  # reaches the parameters through plain nodes only
    for node in order:  # children first
        plain[id(node)] = target_owner.get(id(node)) == owner or any(
            child is not None and plain[id(child)] and not blocking[id(child)]
            for child, _ in node.next_functions
        )
    if any(plain[id(root)] and not blocking[id(root)] for root in roots):
        return []  # a path with no blocking node: something else explains it
    return [node for node in order if blocking[id(node)] and plain[id(node)]]


def _names(nodes: list[Any]) -> list[str]:
    names: list[str] = []
    for node in nodes:
        name = _name(node)
        if name not in names:
            names.append(name)
    return names


def postorder(roots: Sequence[Any]) -> list[Any] | None:
    """Every node reachable from ``roots``, each after the nodes it leads to."""
    order: list[Any] = []
    seen: set[int] = set()
    for root in roots:
        if id(root) in seen:
            continue
        seen.add(id(root))
        stack = [(root, iter(root.next_functions))]
        while stack:
            node, children = stack[-1]
            for child, _ in children:
                if child is not None and id(child) not in seen:
                    seen.add(id(child))
                    stack.append((child, iter(child.next_functions)))
                    break
            else:
                stack.pop()
                order.append(node)
                if len(order) > _MOST_NODES:
                    return None
    return order


def _custom(node: Any) -> bool:
    """A custom Function of the user's or a library's; torch's own (a reentrant
    checkpoint, DDP's output sink) pass on what they are given, and count as plain."""
    if not isinstance(node, BackwardCFunction):
        return False
    forward = getattr(node, "_forward_cls", None)
    module = getattr(forward, "__module__", "") or ""
    return not module.startswith("torch.")


def _name(node: Any) -> str:
    forward = getattr(node, "_forward_cls", None)
    if forward is not None:
        return forward.__name__
    return type(node).__name__.removesuffix("Backward")
