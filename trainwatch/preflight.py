"""The checks that can refuse a watch, made before anything is created or attached.

``tw.watch`` runs them before it opens any file, the Monitor again when it is
built, and ``Monitor.add_optimizer`` for each optimizer it is handed: a
refused watch leaves no hook, no alerts file and no event file behind. They
read the model and the optimizers only, so they sit apart from the Monitor
(and from ``watch``, which builds one) without an import cycle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from trainwatch import registry
from trainwatch.compiled import unwrap
from trainwatch.errors import WatchError
from trainwatch.layers import LayerMap
from trainwatch.optimizer_wrappers import inner_optimizer, takes_step_hooks


def preflight(model: nn.Module, optimizers: Sequence[Optimizer]) -> LayerMap:
    """Refuse a model or optimizers that cannot be watched; returns the model's layers."""
    if not isinstance(model, nn.Module):
        raise WatchError(f"tw.watch expects a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):
        raise WatchError(
            f"{type(model).__name__} is a TorchScript module, which takes no hooks: watch "
            "the eager module before torch.jit.script (or use torch.compile)"
        )
    for opt in optimizers:
        check_optimizer(opt)
    layers = LayerMap(unwrap(model))
    if len(layers) == 0:
        raise WatchError(
            f"{type(model).__name__} has no parameters: there is nothing to train or "
            "watch (pass the model that holds the weights)"
        )
    for index, opt in enumerate(optimizers):
        check_optimizer_matches(inner_optimizer(opt), layers, index)
    for param in layers.parameters():
        owner = registry.owner_of(param)
        if owner is not None and not owner.yields_to_explicit_watch:
            raise WatchError(
                f"{type(model).__name__} (parameter {layers.info(param).name!r}) is "
                "already watched by an open trainwatch monitor; close that one first "
                "(monitor.close()) or keep using it"
            )
    return layers


def check_optimizer(optimizer: Any) -> None:
    """Anything but a torch optimizer is refused, naming what it was, and so is
    one whose steps no hook can see (a wrapper's inner optimizer is watched instead).

    A wrapper written as a plain class (a Lookahead holding ``self.optimizer``
    and sharing its ``param_groups``) is no ``Optimizer`` itself; the one it
    steps is, and that is what gets watched.
    """
    inner = inner_optimizer(optimizer)
    if not isinstance(inner, Optimizer):
        raise WatchError(_not_an_optimizer(optimizer))
    if not takes_step_hooks(inner):
        raise WatchError(
            f"optimizer {type(optimizer).__name__} never ran torch.optim.Optimizer.__init__, "
            "so its steps run no hooks, and it holds no optimizer of its parameters to watch "
            "instead: call super().__init__ in its __init__, or pass the optimizer it steps"
        )


def _not_an_optimizer(optimizer: Any) -> str:
    """The refusal of something that is not a torch optimizer, naming the one it
    holds where it holds one: a wrapper with no ``param_groups`` of its own (a
    PCGrad holding ``._optim``) cannot be told to train the same parameters, one
    with others of its own does not."""
    message = f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}"
    own = vars(optimizer) if hasattr(optimizer, "__dict__") else {}
    held = [name for name, value in own.items() if isinstance(value, Optimizer)]
    if not held:
        return message
    name = held[0]
    if getattr(optimizer, "param_groups", None) is None:
        return (
            f"{message}, which holds an optimizer as .{name} and exposes no param_groups "
            f"of its own: pass that optimizer (.{name}) instead"
        )
    return (
        f"{message}, which holds one as .{name} but does not train the same parameters "
        f"(its param_groups are not the held optimizer's): pass that optimizer (.{name}) "
        "instead"
    )


# The most elements an optimizer's ``nn.Parameter``s may hold in all, none of them
# the model's, and still be taken for learned scalars rather than another model:
# a temperature, a Lagrange multiplier or a few per-task loss weights take one
# element each, while a network's weights hold more (a Linear(4, 4) alone: 20).
LEARNED_SCALARS_MAX_ELEMENTS = 16


def check_optimizer_matches(optimizer: Optimizer, layers: LayerMap, index: int) -> None:
    """An optimizer none of whose parameters the model holds is the wrong optimizer,
    unless all it holds are learned scalars (see ``_holds_learned_scalars_only``).

    A few extra parameters (learnable loss weights) are fine: they are named
    as outside the model.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if params and not any(p in layers for p in params) and not _holds_learned_scalars_only(params):
        raise WatchError(
            f"optimizer {index} ({type(optimizer).__name__}) holds {len(params)} parameters "
            "and none of them belongs to the watched model: was it built for another model?"
        )


def _holds_learned_scalars_only(params: list[torch.Tensor]) -> bool:
    """Every tensor is a learned scalar of the training outside any module: SAC's
    temperature (``log_alpha``), a Lagrange multiplier, learned loss weights.

    Their optimizer is passed beside the model's because the loop steps it, not
    because it was built for another model. A module holds only ``nn.Parameter``s,
    so a plain tensor is no module's; ``nn.Parameter``s count as scalars only while
    they hold a few elements in all (``LEARNED_SCALARS_MAX_ELEMENTS``), fewer than a
    real network holds, so an optimizer over another model's weights is still refused.
    """
    parameters = [p for p in params if isinstance(p, nn.Parameter)]
    return sum(p.numel() for p in parameters) <= LEARNED_SCALARS_MAX_ELEMENTS
