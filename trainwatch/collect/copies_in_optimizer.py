"""A copy of a model handed to that model's own optimizer: an EMA or averaged copy.

``SGD([*model.parameters(), *ema.parameters()])`` holds an EMA copy
(``torch.optim.swa_utils.AveragedModel``, a ``copy.deepcopy`` moved by
``lerp_``) beside the model it averages. The copy runs under ``no_grad`` in
eval mode on purpose and is moved by its own update, so its parameters never
get a gradient: the slip is that they are in the optimizer at all, not a
``.detach()`` cutting a layer off nor a forgotten ``model.train()``.

Told from the optimizer's parameters, on a step where some got no gradient,
never on the healthy step: the parameters without one are, shape for shape and
in order, a copy of the parameters of another model the same optimizer holds
whose gradients came (none shared), and lie near them as an average of them
does, either way round: under ``trainwatch run``
the copy is a model of its own and its whole parameters go without one; under
``tw.watch`` they lie outside the watched model, which is the one copied.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

from trainwatch import registry
from trainwatch.collect.model_copies import WITHIN_NORM, is_copy, sample_weights, weight_distance
from trainwatch.compiled import unwrap
from trainwatch.record import CopiedFrom


def _trainable(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [p for p in params if p.requires_grad]


def copy_of_another(root: nn.Module, held: Sequence[torch.Tensor]) -> CopiedFrom | None:
    """``root`` is a copy of another watched model whose parameters ``held`` (an
    optimizer's) holds too, and none of ``root``'s got a gradient while that
    model's did (None: not so)."""
    own = _trainable(list(root.parameters()))
    ids = {id(p) for p in held}
    if not own or any(id(p) not in ids or p.grad is not None for p in own):
        return None
    for owner in registry.owners():
        model = unwrap(owner.model)
        if model is unwrap(root):
            continue
        theirs = _trainable(list(model.parameters()))
        if (
            theirs
            and all(id(p) in ids for p in theirs)
            and any(p.grad is not None for p in theirs)
            and is_copy(own, theirs)
            and _near(own, theirs)
        ):
            return CopiedFrom(owner.model_name or type(model).__name__)
    return None


def copy_outside(root: nn.Module, held: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters of ``held`` outside ``root`` that make a copy of ``root``'s own
    and got no gradient, while some of ``root``'s did (empty: none such)."""
    own = _trainable(list(root.parameters()))
    mine = {id(p) for p in own}
    outside = [p for p in _trainable(held) if id(p) not in mine]
    if not outside or any(p.grad is not None for p in outside):
        return []
    if not any(p.grad is not None for p in own) or not is_copy(outside, own):
        return []
    return outside if _near(outside, own) else []


def _near(copy: Sequence[torch.Tensor], of: Sequence[torch.Tensor]) -> bool:
    """The copy lies near the model's weights, as an EMA of them does (within
    ``WITHIN_NORM`` of their norm): a second network of the same architecture
    initialised on its own (a twin critic whose loss was forgotten) lies about
    its own norm away, and its missing gradients stay zero_gradient's warning."""
    mine, theirs = sample_weights(copy), sample_weights(of)
    return weight_distance(mine, theirs) <= WITHIN_NORM * float(torch.linalg.vector_norm(theirs))


class CopiesTold:
    """The copies told in this process, by their parameters (weakly): the model
    copied tells a copy outside it, and the copy's own monitor (``trainwatch run``
    watches it as a model of its own once it is called) finds the same one."""

    def __init__(self) -> None:
        self._told: dict[int, weakref.ref[torch.Tensor]] = {}

    def first_telling(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether these parameters were not told of yet (then they are, from now)."""
        for key, ref in list(self._told.items()):
            if ref() is None:
                del self._told[key]
        if any((ref := self._told.get(id(p))) is not None and ref() is p for p in params):
            return False
        self._told.update((id(p), weakref.ref(p)) for p in params)
        return True

    def clear(self) -> None:
        """The last open monitor closed: a new run tells its copies anew."""
        self._told.clear()


COPIES_TOLD = CopiesTold()
