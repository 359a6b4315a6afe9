"""A model converted in overwrite mode after its optimizer was built.

With ``torch.__future__.set_overwrite_module_params_on_conversion(True)``,
``model.to()``, ``.double()``, ``.half()``, ``.cuda()`` put new Parameter
objects in the model's modules (PyTorch's default keeps each Parameter and
replaces its ``.data``). An optimizer built before the conversion still holds
the old ones, which no module holds any more: it steps tensors nothing uses,
and the model never trains. ``trainwatch run`` meets the model only after the
conversion, so no optimizer holds its parameters there; told apart from a
model replaced by a copy or a new instance (whose fix differs) by what the
optimizer holds: the same tensors as the model's, converted, each held by no
module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Elements of each parameter compared, old (converted) against new: a conversion
# copies every value, a new instance of the model draws its own.
_COMPARED = 16


@dataclass(frozen=True)
class Conversion:
    """What the model's parameters were converted from and to: ``torch.float32 on cpu``."""

    source: str
    target: str


def overwrite_mode() -> bool:
    """Whether conversions put new Parameter objects in modules now."""
    return bool(torch.__future__.get_overwrite_module_params_on_conversion())


def conversion_between(
    held: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> Conversion | None:
    """The conversion that made ``params`` (the model's, in its order) out of ``held``
    (an optimizer's, in its order), or None where they are no such pair.

    Paired by shape, in order (an optimizer built over ``model.parameters()``
    keeps the model's order, its groups split by a filter too), every held
    tensor must be its counterpart converted: its first elements, cast to the
    counterpart's dtype and device, equal the counterpart's, and it differs
    from it in dtype or device or shares its storage (``.float()`` of a float
    model still makes new Parameters, over the same memory). A deep copy
    (equal values, same dtype and device, memory of its own) is none, nor a
    new instance (values of its own).
    """
    waiting: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for param in params:
        waiting.setdefault(tuple(param.shape), []).append(param)
    pairs = []
    for old in held:
        same_shape = waiting.get(tuple(old.shape))
        if not same_shape:
            return None
        pairs.append((old, same_shape.pop(0)))
    if not pairs:
        return None
    try:
        for old, new in pairs:
            if not _converted(old, new):
                return None
    except (RuntimeError, NotImplementedError):
        # Values or memory that cannot be read (the meta device, a sparse tensor).
        return None
    old, new = pairs[0]
    return Conversion(_placed(old), _placed(new))


def _converted(old: torch.Tensor, new: torch.Tensor) -> bool:
    moved = old.dtype != new.dtype or old.device != new.device
    if not moved and old.untyped_storage().data_ptr() != new.untyped_storage().data_ptr():
        return False  # a copy in its own memory: a deep copy, not a conversion
    with torch.no_grad():
        first = old.detach().reshape(-1)[:_COMPARED].to(device=new.device, dtype=new.dtype)
        return torch.equal(first, new.detach().reshape(-1)[:_COMPARED])


def _placed(tensor: torch.Tensor) -> str:
    return f"{tensor.dtype} on {tensor.device}"
