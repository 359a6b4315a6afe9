"""The step's gradients, each parameter sorted: present (with its gradient), frozen, missing.

Run at every step boundary over every parameter the step uses, so the usual
step (every parameter trainable, each with a plain gradient, each known by
name) is read in C loops (``map`` over attribute getters), with no Python
work per parameter; anything else is read one parameter at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter, is_
from typing import Protocol

import torch

from trainwatch.collect.tensors import all_plain, local_part
from trainwatch.layers import LayerMap
from trainwatch.record import StepRecord, new_step_record

_GRAD = attrgetter("grad")
_REQUIRES_GRAD = attrgetter("requires_grad")


class Reach(Protocol):
    """What backward reached since the last step boundary (``GradResetTracker``)."""

    def reached(self, param: torch.Tensor) -> bool: ...

    def all_reached(self, params: Sequence[torch.Tensor]) -> bool: ...


def read_gradients(
    params: Sequence[torch.Tensor],
    optimizer: int | None,
    layers: LayerMap,
    tracker: Reach,
) -> tuple[StepRecord, list[torch.Tensor]]:
    """A new record of the step and the present parameters' gradients, in its order.

    ``optimizer`` None: a step without an optimizer (``monitor.step()``), where
    frozen parameters are only counted, and a gradient reset before the step
    still counts as present when backward reached it (the ``tracker`` tells, for
    every one at once where it can: a loop that resets its gradients to None
    before ``monitor.step()`` reads none, in C loops too).
    """
    manual = optimizer is None
    record = new_step_record(-1)
    if manual:
        record.source = "manual"  # the default: "optimizer"
    record.optimizer = optimizer
    known = layers.known()
    grads: list[torch.Tensor] = list(map(_GRAD, params))
    # Every gradient a plain tensor (so none is None) and every parameter trainable.
    if all_plain(grads) and all(map(_REQUIRES_GRAD, params)):
        present = list(map(known.get, map(id, params)))
        if not any(map(is_, present, repeat(None))):
            record.present = present
            return record, grads
    elif (
        manual
        and all(map(is_, grads, repeat(None)))
        and all(map(_REQUIRES_GRAD, params))
        and tracker.all_reached(params)
    ):
        return record, []  # every gradient reset to None after backward reached it
    info = layers.info
    present = record.present
    grads = []
    plain = torch.Tensor
    for param in params:
        grad = param.grad
        if grad is not None and param.requires_grad:  # the usual case, without a call
            if type(grad) is not plain and _empty_shard(grad):
                continue  # FSDP2 put all of this small tensor on other ranks
            found = known.get(id(param))
            present.append(found if found is not None else info(param))
            grads.append(grad)
        elif not param.requires_grad:
            if manual:
                record.frozen_count += 1
            else:
                record.frozen.append(info(param))
        elif not (manual and tracker.reached(param)):
            record.missing.append(info(param))
    return record, grads


def _empty_shard(grad: torch.Tensor) -> bool:
    """A DTensor whose shard on this rank has no elements (its norm, 0, means nothing)."""
    return hasattr(grad, "to_local") and local_part(grad).numel() == 0
