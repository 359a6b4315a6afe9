"""The live optimizers holding given parameters: one scan of the heap.

An optimizer the training code never handed over is found only among the live
objects. A scan costs milliseconds on a large process, so callers make one
where a finding or a decision is due, never at every step.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Sequence

import torch
from torch.optim import Optimizer

from trainwatch.optimizer_wrappers import inner_optimizer, takes_step_hooks


def optimizers_holding(
    params: Iterable[torch.Tensor],
    excluded: Sequence[Optimizer] = (),
    *,
    wrappers: bool = True,
) -> dict[int, list[Optimizer]]:
    """Per id of ``params``, the live optimizers (but ``excluded``) holding it.
    ``wrappers=False`` leaves out a wrapper (its inner optimizer holds the same
    parameters, and takes the step hooks)."""
    wanted = {id(p) for p in params}
    found: dict[int, list[Optimizer]] = {}
    if not wanted:
        return found
    for obj in gc.get_objects():
        # By type: isinstance asks a dead weak proxy among the live objects and raises.
        if not issubclass(type(obj), Optimizer) or any(obj is opt for opt in excluded):
            continue
        if not wrappers and (inner_optimizer(obj) is not obj or not takes_step_hooks(obj)):
            continue
        for group in obj.param_groups:
            for param in group["params"]:
                if id(param) in wanted:
                    found.setdefault(id(param), []).append(obj)
    return found
