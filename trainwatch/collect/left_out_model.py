"""A whole model left out of every optimizer, told apart from a loss module's weights.

Under ``trainwatch run`` a module with parameters that no optimizer holds is
watched as a model trained by hand, its backward ends its steps. When its
gradients are never reset and its weights never move while other models'
optimizers step, nothing trains it. Two shapes of that differ in cause and fix:

- learned loss weights, a temperature, a criterion with parameters: a few
  learned scalars, or a module that is the loss, meant to train with the
  model's optimizer (``Adam([*model.parameters(), *criterion.parameters()])``);
- a model with a forward of its own that the loop calls, whose output feeds
  the loss (a seq2seq tutorial's decoder whose ``decoder_optimizer`` was built
  over ``encoder.parameters()`` by a copy-paste slip): its own optimizer was
  meant, ``torch.optim.Adam(decoder.parameters())``.

The second is known at the model's second step: its gradients were not reset
and its weights did not move, while other optimizers stepped between the two
(a hand-written update would have moved them; a hand-written accumulation
beside them would not have let the others step). Read only as the finding is
due, with the training code's names for the model and its optimizers (its
frames are on the stack: the step ends inside its ``backward()``).
"""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

from trainwatch.callers import values_in_caller
from trainwatch.compiled import unwrap
from trainwatch.record import LeftOutModel

# Trainable elements up to which a model is taken for learned scalars (loss
# weights, a temperature) rather than a model of its own.
LEARNED_SCALARS = 16


def a_loss_module(model: nn.Module) -> bool:
    """Whether ``model`` is a criterion or learned loss weights rather than a model:
    a torch loss, a class named as one, or a few learned scalars in all."""
    inner = unwrap(model)
    if isinstance(inner, nn.modules.loss._Loss):
        return True
    name = type(inner).__name__.lower()
    if "loss" in name or "criterion" in name:
        return True
    trainable = sum(p.numel() for p in inner.parameters() if p.requires_grad)
    return trainable <= LEARNED_SCALARS


def left_out_model(model: nn.Module) -> LeftOutModel:
    """What the training code calls the model and the optimizers it holds: the
    optimizer named after the model (``decoder_optimizer`` for ``decoder``), where
    one holds none of its parameters, and what that one holds instead."""
    optimizers = values_in_caller(Optimizer)
    name = next((key for key, value in values_in_caller(nn.Module) if value is model), None)
    ours = {id(p) for p in model.parameters()}
    meant: str | None = None
    holds_instead: str | None = None
    kind = type(optimizers[0][1]).__name__ if optimizers else "Adam"
    if name is not None:
        for key, optimizer in optimizers:
            held = _held(optimizer)
            if name.lower() in key.lower() and not held & ours:
                meant, kind = key, type(optimizer).__name__
                twin = next(
                    (
                        k
                        for k, other in optimizers
                        if other is not optimizer and _held(other) == held
                    ),
                    None,
                )
                if twin is not None:
                    holds_instead = f"the same parameters as {twin}"
                break
    return LeftOutModel(
        model_class=type(unwrap(model)).__name__,
        model_name=name,
        optimizer_class=kind,
        meant=meant,
        holds_instead=holds_instead,
    )


def _held(optimizer: Optimizer) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}
