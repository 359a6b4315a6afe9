"""What real modules return: tensors inside tuples, dicts, dataclasses, named tuples.

``ModelOutput`` is a small lookalike of Hugging Face's: an ``OrderedDict``
subclass whose subclasses are dataclasses, holding only the fields that are
not None, indexable by name and by position.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple
from typing import Any

import torch


class ModelOutput(OrderedDict):
    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return super().__getitem__(key)
        return self.to_tuple()[key]

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(self.values())


@dataclasses.dataclass
class LMOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclasses.dataclass
class Features:
    hidden: torch.Tensor
    meta: Any = None


Pair = namedtuple("Pair", ["value", "index"])

# Every structure `wrap` builds around a module's floating output.
KINDS = (
    "tensor",
    "tuple",
    "list",
    "dict",
    "namedtuple",
    "dataclass",
    "model_output",
    "nested",
    "dtypes",
    "empty",
    "scalars",
)


def wrap(kind: str, h: torch.Tensor) -> Any:
    """``h`` (float32, batch first) inside the structure ``kind``, beside values of other kinds.

    The first floating tensor that carries gradient is always ``h`` itself;
    ``unwrap`` reads it back.
    """
    if kind == "tensor":
        return h
    if kind == "tuple":
        return (h, h.argmax(-1))
    if kind == "list":
        return [h, None, 3, "label"]
    if kind == "dict":
        return {"h": h, "mask": h > 0, "count": 3, "name": "x", "spectrum": torch.complex(h, h)}
    if kind == "namedtuple":
        return Pair(h, (h * 4).long())
    if kind == "dataclass":
        return Features(h, meta={"source": "encoder"})
    if kind == "model_output":
        return LMOutput(logits=h, hidden_states=(h, h.half()))
    if kind == "nested":  # a dict of a tuple of a dataclass, and deeper
        return {"out": (Features(h, 1), [h.bfloat16(), {"deep": h.double()}]), "n": 2.5}
    if kind == "dtypes":
        return (h, h.half(), h.bfloat16(), h.double(), h.int(), h.bool(), h.to(torch.complex64))
    if kind == "empty":
        return (h, h[:0], torch.empty(0), h.new_zeros(h.shape[0], 0))
    if kind == "scalars":
        return (h, h.sum(), torch.tensor(3), 1.5)
    raise ValueError(kind)


def unwrap(kind: str, value: Any) -> torch.Tensor:
    """The ``h`` that ``wrap(kind, h)`` holds, the way user code reads it back."""
    if kind == "tensor":
        return value
    if kind == "dict":
        return value["h"]
    if kind == "dataclass":
        return value.hidden
    if kind == "model_output":
        return value["logits"]
    if kind == "nested":
        return value["out"][0].hidden
    return value[0]


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor inside ``value``, found without trainwatch's own walker."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (tuple, list)):
        items = list(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, field.name) for field in dataclasses.fields(value)]
    else:
        return []
    return [tensor for item in items for tensor in tensors_in(item)]
