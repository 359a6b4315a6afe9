"""Finds the floating-point tensors inside whatever a module returns.

Real models return tensors, tuples, dicts, dataclasses and named tuples (a
Hugging Face-style output); checks apply to the floating tensors among them
and silently skip the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

_MAX_DEPTH = 4


def floating_tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.layout == torch.strided and value.numel() > 0:
            yield value
        return
    if depth >= _MAX_DEPTH or value is None or isinstance(value, (str, bytes, int, float)):
        return
    if isinstance(value, dict):
        for item in value.values():
            yield from floating_tensors(item, depth + 1)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from floating_tensors(item, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from floating_tensors(getattr(value, field.name, None), depth + 1)
