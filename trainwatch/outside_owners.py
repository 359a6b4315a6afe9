"""Which monitor tells a parameter that an optimizer holds outside the monitor's model.

One optimizer often trains several modules called one after the other: a
backbone and a margin head (ArcFace, CosFace), a model and its loss module's
learned temperature. ``trainwatch run`` watches each such module as a model of
its own (and a script may call ``tw.watch`` once for each): every monitor then
sees the others' parameters in the shared optimizer, outside its own model.
Each parameter is told once:

- one that another monitor holding the optimizer watches in its own model is
  that monitor's (it names it by its place in that model);
- one that no monitor watches (a bare tensor, a loss module's parameter under
  ``tw.watch`` of the model alone) is told by one monitor of those holding the
  optimizer, the one whose model holds the first parameter of the optimizer
  that some such monitor watches, under ``<outside the model>``.

Asked off the healthy step: as a frozen parameter's verdict falls due, and as a
new set of parameters with gradients is first met (then again only once
``registry.changes`` moved).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from trainwatch import registry
from trainwatch.layers import LayerMap


def holds(monitor: Any, optimizer: Optimizer) -> bool:
    """Whether an open monitor watches ``optimizer`` (its steps are its to judge)."""
    return any(opt is optimizer for opt in monitor.optimizers)


def watched_by_another(param: torch.Tensor, optimizer: Optimizer) -> bool:
    """Whether another open monitor holding ``optimizer`` watches ``param`` in its own
    model. A parameter the asking monitor's model held before (a replaced head's,
    still claimed by that monitor) is no other monitor's."""
    owner = registry.owner_of(param)
    return owner is not None and holds(owner, optimizer) and owner.model_holds(param)


def tells_loose(layers: LayerMap, optimizer: Optimizer) -> bool:
    """Whether the monitor whose model is ``layers`` tells the optimizer's tensors no
    monitor watches: the one whose model holds the first of the optimizer's
    parameters that some monitor holding it watches."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param in layers:
                return True
            if watched_by_another(param, optimizer):
                return False
    return True


def told_elsewhere(layers: LayerMap, optimizer: Optimizer) -> frozenset[str]:
    """The names (as ``layers`` gives them) of the optimizer's parameters outside the
    model of ``layers`` that another monitor tells: those it watches in its own
    model, and those no monitor watches where that monitor tells them."""
    elsewhere: list[torch.Tensor] = []
    loose: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param in layers:
                continue
            if watched_by_another(param, optimizer):
                elsewhere.append(param)
            else:
                loose.append(param)
    if loose and not tells_loose(layers, optimizer):
        elsewhere.extend(loose)
    return frozenset(layers.info(param).name for param in elsewhere)
