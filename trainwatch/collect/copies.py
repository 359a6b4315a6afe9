"""Which model an optimizer trains that this model, which none holds, is a copy of.

A model no optimizer holds whose gradients pile up unreset while the loop
moves its weights by hand looks like a hand-written update missing its
``zero_grad()``. When it has the very parameters, shape for shape and in
order, of a model an optimizer trains (a ``copy.deepcopy``, a second
instance loaded from its state dict), it is that model's target network (a
Polyak/EMA target, a DQN target synced every few hundred steps, a frozen
reference): its weights come from the other model, not from its gradients,
and those gradients say its output was used with gradients (a TD target
built outside ``torch.no_grad()``), which also sends gradients into
whatever fed it.

Asked only once a finding is due, never on the healthy step, of the open
monitors: their names are those the alerts use (``Critic#2`` under
``trainwatch run``). A model no monitor watches is not looked for: a scan of
live objects would meet models and optimizers the script has dropped but the
collector not yet freed.

Several models may match by shape (clipped double-Q: two critics of one
architecture, each with its own target): the copy is then told as the copy of
the one nearest by weights. A target starts as an exact copy of its own model
and follows it by Polyak averaging or periodic syncs, so it stays nearest it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trainwatch import registry
from trainwatch.collect.model_copies import is_copy, sample_weights, weight_distance
from trainwatch.compiled import unwrap


def copied_model(root: nn.Module) -> str | None:
    """The name of an open monitor's model, stepped by an optimizer, whose parameters
    match ``root``'s shape for shape and in order, the nearest by weights where
    several do (None: no such model)."""
    own = list(root.parameters())
    if not own:
        return None
    matches = [
        owner
        for owner in registry.owners()
        if owner.optimizers and is_copy(own, list(owner.model.parameters()))
    ]
    if not matches:
        return None
    owner = matches[0] if len(matches) == 1 else _nearest(own, matches)
    return owner.model_name or type(unwrap(owner.model)).__name__


def _nearest(own: list[nn.Parameter], owners: list[Any]) -> Any:
    """The monitor whose model's weights lie nearest ``own`` (the first, on a tie)."""
    weights = sample_weights(own)
    return min(
        owners, key=lambda owner: weight_distance(sample_weights(owner.model.parameters()), weights)
    )
