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

Where no model matches in full, a copy of a run of one's parameters lying near
them (BYOL's target: the online network's backbone and projector, less its
predictor; see :mod:`trainwatch.collect.copied_runs`) is its target too.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trainwatch import registry
from trainwatch.collect.copied_runs import (
    Named,
    copied_runs,
    covered_parts,
    named_parameters,
    nearest_run,
)
from trainwatch.collect.model_copies import is_copy, sample_weights, weight_distance
from trainwatch.compiled import unwrap, user_name
from trainwatch.record import CopiedFrom


def copied_model(root: nn.Module) -> CopiedFrom | None:
    """The open monitor's model, stepped by an optimizer, whose parameters match
    ``root``'s shape for shape and in order, the nearest by weights where several
    do; failing that, the one a run of whose parameters ``root`` copies, with the
    parts it copies (None: no such model)."""
    own = list(root.parameters())
    if not own:
        return None
    trained = [owner for owner in registry.owners() if owner.optimizers]
    matches = [owner for owner in trained if is_copy(own, list(owner.model.parameters()))]
    if matches:
        return CopiedFrom(_name(matches[0] if len(matches) == 1 else _nearest(own, matches)))
    return _copied_part(named_parameters(root), trained)


def _copied_part(own: Named, trained: list[Any]) -> CopiedFrom | None:
    """The model a run of whose parameters ``own`` copies, the nearest where several
    do, named with the parts it copies."""
    best = None
    for owner in trained:
        run = nearest_run(copied_runs(own, named_parameters(owner.model)))
        if run is not None and (best is None or run.far < best[1].far):
            best = (owner, run)
    if best is None:
        return None
    owner, run = best
    modules = {user_name(name): module for name, module in owner.model.named_modules()}
    return CopiedFrom(_name(owner), covered_parts(modules, run.params))


def _name(owner: Any) -> str:
    return owner.model_name or type(unwrap(owner.model)).__name__


def _nearest(own: list[nn.Parameter], owners: list[Any]) -> Any:
    """The monitor whose model's weights lie nearest ``own`` (the first, on a tie)."""
    weights = sample_weights(own)
    return min(
        owners, key=lambda owner: weight_distance(sample_weights(owner.model.parameters()), weights)
    )


# How far, relative to its source's weights, a copy may lie and still be one at its
# second step: a deepcopy or a synced target is one or two updates from its source
# (far below this); an instance of the same architecture initialised on its own (a
# k-fold's fresh model, which a stale optimizer leaves untrained) lies about sqrt(2)
# away, as two independent draws of the same norm do.
_NEAR = 0.5


def near_copy(root: nn.Module) -> bool:
    """Whether ``root`` lies near, by weights, the model an optimizer trains that it
    copies shape for shape (a reference or target still one or two updates from
    its source). A copy of a run of parameters counts as near (BYOL's target)."""
    own = list(root.parameters())
    trained = [owner for owner in registry.owners() if owner.optimizers]
    matches = [owner for owner in trained if is_copy(own, list(owner.model.parameters()))]
    if not matches:
        return True
    weights = sample_weights(own)
    for owner in matches:
        source = sample_weights(owner.model.parameters())
        scale = float(source.norm())
        if scale > 0.0 and weight_distance(source, weights) <= _NEAR * scale:
            return True
    return False
