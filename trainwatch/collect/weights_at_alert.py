"""The model's parameters and the optimizers holding them, looked at as an alert is built.

A rule judges records, which name parameters but hold no tensor. A few findings
are only worth their words with a look at the weights themselves: a gradient
exactly zero because another weight of the same layer is all zeros (a LoRA
``B`` initialised to zero) says where to look only once that weight is found
zero and its learning rate read; a gradient jump is no explosion where a copy
of the model was just set to its weights (a DQN's target network, found by
``copies``). That look is taken here, when the alert is made, never on a
healthy step.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from trainwatch.collect.model_copies import ModelCopies
from trainwatch.collect.model_kind import explosion_kind, regression_loss
from trainwatch.collect.tensors import local_part
from trainwatch.layers import LayerMap

# Why an all-zero weight stays zero: its param group's learning rate is 0, it is
# frozen, or no watched optimizer holds it; or its own gradient is exactly zero
# through a weight told of that is all zeros too (both halves of a LoRA adapter
# initialised to zero: each holds the other at zero). None: none of these (it may
# move yet).
LR_ZERO = "lr_zero"
FROZEN = "frozen"
NO_OPTIMIZER = "no_optimizer"
BOTH_ZERO = "both_zero"
# The halves of a low-rank adapter, by module name (PEFT's layout).
_PAIRS = {
    "lora_A": "lora_B",
    "lora_B": "lora_A",
    "lora_embedding_A": "lora_embedding_B",
    "lora_embedding_B": "lora_embedding_A",
}


class HeldParameters:
    """Reads the weights of one module and their optimizers' settings, on request."""

    def __init__(
        self,
        layers: Callable[[], LayerMap | None],
        optimizers: list[Optimizer],
        model: Callable[[], nn.Module | None] = lambda: None,
    ) -> None:
        self._layers = layers  # the pipeline's map, rebuilt when the model changes
        self._optimizers = optimizers  # the Monitor's own list: it adds to it
        # Copies of the model kept beside it (a DQN's target network).
        self.copies = ModelCopies(model)
        self._model = model
        # The loss functions the loss audit saw take the model's outputs (set by
        # the pipeline where the audit runs), and the max_norm of the loop's
        # latest clip_grad_norm_ (set by its clip gathering; None: no clip seen).
        self.losses: Callable[[], Collection[str]] = tuple
        self.clip_max_norm: Callable[[], Any] = _none
        # The source line of an nll_loss the loss audit found given raw logits (a loss
        # unbounded below, whose fall grows weights and gradients), else None.
        self.unbounded_loss: Callable[[], str | None] = _none
        # A step's batch through batch norm in training mode, where much smaller than
        # the usual one: (its size, the usual size, the layer), else None (set by
        # the pipeline where the model has batch norm: see collect.batch_norm_batches).
        self.small_batch: Callable[[int], tuple[int, int, str] | None] = _none_at

    def explosion_kind(self) -> tuple[str, str] | None:
        """Whether the model's gradients explode from its weights rather than from
        an outlier in the data: see trainwatch.collect.model_kind."""
        return explosion_kind(self._model(), self.losses())

    def regression_loss(self) -> str | None:
        """A regression loss the loss audit saw take the model's outputs, None where
        it saw none (or did not run)."""
        return regression_loss(self.losses())

    def all_zero_partners(
        self, owner: str, told: Collection[str], silent: Collection[str]
    ) -> list[tuple[str, str | None]]:
        """The weights of ``owner`` (and of the other half of a low-rank adapter it is
        one half of) that are exactly zero everywhere and that a told weight is
        multiplied by, each with why it stays so; biases are left out (a zero shift
        multiplies nothing).

        ``told`` are the weights whose exactly zero gradient is the finding, ``silent``
        every weight whose gradient is silent now (``told`` among them). A silent
        weight is no cause by itself: its gradient is silent for a reason of its own
        (dead units upstream), and it may merely not have moved yet. Unless a told
        weight is all zeros too: two all-zero weights multiplying each other's path
        (LoRA's A and B both initialised to zero) each make the other's gradient
        exactly zero, so neither ever moves; then each of them, told ones included,
        is returned as ``BOTH_ZERO``.

        Only factors of one product are partners: two all-zero weights of one module
        may have nothing to do with each other's gradient (a learned prior's ``mu``
        and ``logvar``, both N(0, I) at init and silent while the KL term is weighed
        by 0). See :func:`_factors`."""
        layers = self._layers()
        if layers is None:
            return []
        owners = {owner, *_pair_owners(owner)}
        zero, told_weights = [], []
        for param in layers.parameters():
            info = layers.info(param)
            if info.owner not in owners or not info.in_model:
                continue
            if info.name in told:
                told_weights.append(param)
            if info.name.rsplit(".", 1)[-1] == "bias" or not _all_zero(param):
                continue
            zero.append((info.name, param))
        held_zero = [(name, param) for name, param in zero if name in silent]
        mutual = [
            name
            for name, param in held_zero
            if any(_factors(param, other) for _, other in held_zero if other is not param)
        ]
        if any(name in told for name in mutual):
            return [(name, BOTH_ZERO) for name in mutual]
        return [
            (name, self._why_still(param))
            for name, param in zero
            if name not in silent and any(_factors(param, mine) for mine in told_weights)
        ]

    def owners_beside(self, told: Collection[str]) -> set[str] | None:
        """The modules owning a parameter of the model other than ``told`` that trains
        (requires_grad) or that a watched optimizer holds: a frozen part told as one
        (a backbone frozen inside the optimizer) ends short of each of them, so that
        frozen embeddings and a frozen head, the encoder trained between them, stay
        two parts. Parameters frozen and held by no optimizer (left out of it, as
        they should be) end no part. None: the model is not known."""
        layers = self._layers()
        if layers is None:
            return None
        held = {id(p) for opt in self._optimizers for g in opt.param_groups for p in g["params"]}
        beside = set()
        for param in layers.parameters():
            info = layers.info(param)
            if info.name not in told and (param.requires_grad or id(param) in held):
                beside.add(info.owner)
        return beside

    def sizes(self) -> dict[str, tuple[str, int, bool]] | None:
        """Each parameter of the model by name: its owner, its element count and
        whether it trains (requires_grad). What a frozen model's small trainable
        additions weigh beside the frozen weights around them (a LoRA pair beside
        its base layer). None: the model is not known."""
        layers = self._layers()
        if layers is None:
            return None
        found = {}
        for param in layers.parameters():
            info = layers.info(param)
            found[info.name] = (info.owner, param.numel(), param.requires_grad)
        return found

    def layer_order(self) -> list[str] | None:
        """The model's layers in the order it registered them (as named_modules()
        gives them), None where the model is not known.

        The stand-in for their order in the forward pass, which nothing keeps:
        a model's layers are as a rule registered in the order it calls them, so
        a later one lies nearer the output, and the loss."""
        layers = self._layers()
        return layers.layers if layers is not None else None

    def _why_still(self, param: torch.Tensor) -> str | None:
        if not param.requires_grad:
            return FROZEN
        rates = [
            _rate(group.get("lr"))
            for opt in self._optimizers
            for group in opt.param_groups
            if any(p is param for p in group["params"])
        ]
        if not rates:
            return NO_OPTIMIZER
        return LR_ZERO if all(rate == 0.0 for rate in rates) else None


def _none_at(step: int) -> None:
    return None


def _none() -> None:
    return None


def _pair_owners(owner: str) -> list[str]:
    """The other half of a low-rank adapter held in modules of its own: PEFT's
    ``q.lora_A.default`` beside ``q.lora_B.default`` (loralib keeps both in ``q``)."""
    parts = owner.split(".")
    return [
        ".".join([*parts[:i], _PAIRS[part], *parts[i + 1 :]])
        for i, part in enumerate(parts)
        if part in _PAIRS
    ]


def _factors(one: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether two weights chain as the factors of a low-rank product, so that the
    gradient of each passes through the other: LoRA's ``B (out, r)`` after ``A (r,
    in)``, in loralib's layout (bare parameters of one layer) or PEFT's (two Linear
    or Conv layers, ``(out, in, ...)`` each), the rank shared and smaller than the
    dimensions it joins. Weights of one dimension (a learned prior's ``mu`` and
    ``logvar``) or of shapes that do not chain are no such pair; neither are two
    square matrices of one size (a recurrent cell's input and hidden weights),
    whose shapes chain whether they multiply or not."""
    if one.dim() < 2 or other.dim() < 2:
        return False
    return _after(one.shape, other.shape) or _after(other.shape, one.shape)


def _after(first: torch.Size, second: torch.Size) -> bool:
    """``second (out, r, ...)`` takes what ``first (r, in, ...)`` gives, r the smaller."""
    rank = first[0]
    return second[1] == rank and (rank < first[1] or rank < second[0])


def _all_zero(param: torch.Tensor) -> bool:
    """This rank's part only: a reduction over a whole DTensor would be a collective."""
    part = local_part(param.detach())
    if part.numel() == 0 or part.is_meta:
        return False
    with torch.no_grad():
        return not bool(part.any())


def _rate(lr: Any) -> float | None:
    if isinstance(lr, torch.Tensor):
        return float(lr.detach().reshape(-1)[0]) if lr.numel() else None
    return float(lr) if isinstance(lr, (int, float)) else None
