"""Training started over with the same optimizer: its state emptied or loaded back.

A k-fold loop or a hyperparameter search that re-initialises one model and
one optimizer in place between folds or trials (``model.load_state_dict`` of
the initial weights with ``optimizer.load_state_dict`` of the initial state,
or ``reset_parameters()`` on each layer with ``optimizer.state.clear()``)
starts training over: the gradients go back to their first steps' level, a
thousand times above where a run trained to a near-zero loss ended. Judged
against that run's history it is an explosion; it is a new phase, with its
own warm-up, as when a new optimizer is built for each fold.

An optimizer built anew says so by being new. One reused says so through its
state, in ways a healthy run never shows:

- loaded back: ``Optimizer.load_state_dict`` after it stepped under the
  monitor, of a state that is empty where the one replaced was not, or whose
  per-parameter ``step`` counts are below those it replaces. Where the counts
  say nothing (SGD keeps none; or they are the very tensors it holds: a
  checkpoint's dict loaded for every fold, whose step and moment tensors
  torch's load keeps, so that the next fold's steps move them), a load with
  every weight it trains rewritten since its last update (the model's
  ``load_state_dict`` first, as usual). Seen from the optimizer's own load
  hooks: nothing on any step.
- emptied in place (``state.clear()``, a new ``state`` dict): at a step
  boundary an optimizer that kept state after its previous step keeps none.
  The usual step reads one attribute for it (``Optimizer.state`` is not
  empty); an optimizer that keeps no state at all (plain SGD) is known as such
  from its second step on and pays a set lookup.

A run resumed from a checkpoint loads its state before its first step, or a
later one (step counts past those it replaces, or the same counts in tensors
of its own: a copy of where it is); an LR scheduler's restart and an EMA/SWA
weight swap leave the optimizer's state as it was: none of them is a restart.
Not seen: a stateless optimizer's restart without a load (``reset_parameters()``
under plain SGD: weights rewritten wholesale are no sign on their own, an EMA
swap rewrites them too), or a load made before the model's own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer


class Progress:
    """How far an optimizer's state has come, read at a load only (a step count
    held on a device is waited for there)."""

    __slots__ = ("entries", "count", "steps")

    def __init__(self, optimizer: Optimizer) -> None:
        entries = [entry for entry in optimizer.state.values() if isinstance(entry, dict)]
        self.entries = len(optimizer.state)
        # Each entry's ``step`` object, and the largest count (None: none kept, as
        # SGD keeps none).
        self.steps = [entry.get("step") for entry in entries]
        counts = [count for count in map(_count, self.steps) if count is not None]
        self.count = max(counts) if counts else None

    def same_objects(self, other: Progress) -> bool:
        """Every ``step`` the other holds is this one's very object: the state
        handed in was the optimizer's own (nothing in it changed)."""
        kept = [step for step in other.steps if step is not None]
        held = {id(step) for step in self.steps if step is not None}
        return bool(kept) and all(id(step) in held for step in kept)


def _count(step: Any) -> float | None:
    if isinstance(step, torch.Tensor):
        if step.numel() != 1:
            return None
        step = step.item()
    if isinstance(step, (int, float)) and math.isfinite(step):
        return float(step)
    return None


class OptimizerRestarts:
    """Whether an optimizer the monitor watched step has started over (see the module)."""

    __slots__ = ("stateless", "_empty_at", "_before_load")

    def __init__(self) -> None:
        # Optimizers found to keep no state: empty at two of their boundaries in a row.
        self.stateless: set[int] = set()
        # Per optimizer, the latest step whose boundary found its state empty.
        self._empty_at: dict[int, int] = {}
        # Per optimizer being loaded, its state's progress before the load.
        self._before_load: dict[int, Progress] = {}

    def emptied(self, index: int, now: int, stepped_at: int | None) -> bool:
        """The optimizer's state is empty at step ``now``'s boundary: True when it kept
        state at its previous step (``stepped_at``, None: it never stepped here),
        so the state was emptied since."""
        before = self._empty_at.get(index)
        self._empty_at[index] = now
        if stepped_at is None or before == now:
            return False  # its first step here, or this step gathered again
        if before == stepped_at:
            # Empty after its previous step too: it keeps none (plain SGD), or
            # none yet (no parameter of its has had a gradient).
            self.stateless.add(index)
            return False
        return True

    def loading(self, index: int, optimizer: Optimizer) -> None:
        """``load_state_dict`` begins: the state it replaces, noted."""
        self._before_load[index] = Progress(optimizer)

    def loaded(
        self,
        index: int,
        optimizer: Optimizer,
        stepped: bool,
        weights_rewritten: Callable[[], bool],
    ) -> bool:
        """``load_state_dict`` is over: True when it took an optimizer that has
        stepped here back to an earlier state (an empty one where it had state,
        or lower per-parameter step counts), or, where the counts say nothing,
        when every weight it trains was rewritten since its last update
        (``weights_rewritten``)."""
        before = self._before_load.pop(index, None)
        if before is None or not stepped:
            return False  # loaded before any step here: a resumed run goes on
        now = Progress(optimizer)
        if before.entries and not now.entries:
            return True
        if before.count is not None and now.count is not None:
            if now.count != before.count:
                return now.count < before.count  # later: a resume goes on
            if not before.same_objects(now):
                return False  # the same counts in tensors of its own: a copy of where it is
        return weights_rewritten()
