"""A part of a model replaced after its optimizer was built: a new head.

Transfer learning freezes the backbone, builds the optimizer over the head,
and swaps the head for one with the task's classes (``model.fc =
nn.Linear(512, 2)``). Done in that order, the optimizer holds only the old
head, which no module holds any more: it steps tensors nothing uses, and
nothing of the model trains. ``trainwatch run`` finds the model with no
optimizer holding it. The optimizer's parameters are told for the old head by
their shapes: the same tensors as a part of the model, in order, each of the
same rank and the same shape but for its first dimension (the outputs, which
a new head for other classes changes). A weight of rank two or more must be
among them (a learned temperature of shape (1,) matches any bias).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def replaced_part(held: Sequence[torch.Tensor], model: nn.Module) -> str | None:
    """The name, in ``model``, of the module whose trainable parameters ``held`` (an
    optimizer's module parameters, held by no module of the model) are the old
    counterparts of: the smallest such module whose trainable parameters all got a
    gradient (it trains). None where no part of the model matches."""
    if not held or all(p.dim() < 2 for p in held):
        return None
    found, size = None, 0
    for name, module in model.named_modules():
        if not name:
            continue  # the whole model: a model replaced, not a part
        params = [p for p in module.parameters() if p.requires_grad]
        if len(params) != len(held) or any(p.grad is None for p in params):
            continue
        if not all(map(_counterparts, held, params)):
            continue
        total = sum(p.numel() for p in module.parameters())
        if found is None or total <= size:  # the innermost of those alike
            found, size = name, total
    return found


def _counterparts(old: torch.Tensor, new: torch.Tensor) -> bool:
    return old.dim() == new.dim() and old.shape[1:] == new.shape[1:]
