"""Property: whatever structure a module returns, healthy training raises nothing.

Hypothesis builds random nested outputs (tuples, lists, dicts, named tuples,
dataclasses, ModelOutput-style hybrids) whose tensor leaves have random
dtypes (float32/16, bfloat16, float64, int64/32, bool, complex64) and shapes
(batch-first, 0-d, not batch-first, zero-sized dims), next to None, numbers
and strings. Every floating leaf is computed from the input and carries
gradient. Watched with every rule on, in both NaN check paths, a few training
steps raise no exception, no warning and no alert at all.

What healthy means: the model's prediction (its first floating output) varies
across the batch. Other leaves may be the same for every sample (a statistic
of the batch broadcast to it, like a mask): that is structure, not a
collapse. Only the prediction doing so is what constant_output is for, so
the generator puts a varying prediction first, then the random structure.

Derandomised and without an example database: the same examples on every
run, nothing written next to the tests.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import warnings
from collections import namedtuple
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import trainwatch as tw
from tests.conftest import CHECK_MODES, device_of, every_check
from tests.output_types import ModelOutput, tensors_in

DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.complex64,
)
# How a leaf is cut from the layer's (N, 8) output h.
SHAPES = {
    "batch": lambda h: h[:, :3],
    "batch_3d": lambda h: h.reshape(h.shape[0], 2, 4),
    "scalar": lambda h: h.sum() / 8,
    "per_feature": lambda h: h.sum(0) / 8,  # (8,): not batch-first
    "same_for_all": lambda h: (h.sum(0) / 8).expand(h.shape[0], -1),  # batch-first, constant
    "zero_width": lambda h: h[:, :0],
    "zero_batch": lambda h: h[:0],
}

CONTAINERS = ["tuple", "list", "dict", "namedtuple", "dataclass", "model_output"]

leaves = st.one_of(
    st.tuples(st.just("tensor"), st.sampled_from(DTYPES), st.sampled_from(sorted(SHAPES))),
    st.sampled_from([("none",), ("int",), ("str",), ("float",)]),
)


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    items = st.lists(children, min_size=1, max_size=4)
    return st.tuples(st.sampled_from(CONTAINERS), items)


PREDICTION = ("tensor", torch.float32, "batch")

structures = st.recursive(leaves, _containers, max_leaves=10)
# What the model returns: its prediction first, then anything.
outputs = st.builds(
    lambda kind, rest: (kind, [PREDICTION, rest]), st.sampled_from(CONTAINERS), structures
)


@functools.cache
def _namedtuple(width: int) -> type:
    return namedtuple(f"Fields{width}", [f"f{i}" for i in range(width)])


@functools.cache
def _dataclass(width: int, hybrid: bool) -> type:
    fields = [(f"f{i}", Any, None) for i in range(width)]
    bases = (ModelOutput,) if hybrid else ()
    return dataclasses.make_dataclass(f"Output{width}", fields, bases=bases)


def build(spec: tuple, h: torch.Tensor) -> Any:
    """The structure ``spec`` describes, its tensors computed from ``h``."""
    kind = spec[0]
    if kind == "tensor":
        _, dtype, shape = spec
        leaf = SHAPES[shape](h)
        if dtype.is_floating_point:
            return leaf.to(dtype)
        if dtype == torch.bool:
            return leaf > 0
        if dtype.is_complex:
            return torch.complex(leaf, -leaf)
        return (leaf * 100).to(dtype)
    if kind in ("none", "int", "str", "float"):
        return {"none": None, "int": 7, "str": "label", "float": 0.5}[kind]
    children = [build(child, h) for child in spec[1]]
    if kind == "tuple":
        return tuple(children)
    if kind == "list":
        return children
    if kind == "dict":
        return {f"k{i}": child for i, child in enumerate(children)}
    if kind == "namedtuple":
        return _namedtuple(len(children))(*children)
    return _dataclass(len(children), kind == "model_output")(*children)


class Structured(nn.Module):
    def __init__(self, spec: tuple) -> None:
        super().__init__()
        self.spec = spec
        self.fc = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> Any:
        return build(self.spec, torch.tanh(self.fc(x)))


class Model(nn.Module):
    """The model returns what its submodule returns: both levels see the structure."""

    def __init__(self, spec: tuple) -> None:
        super().__init__()
        self.body = Structured(spec)

    def forward(self, x: torch.Tensor) -> Any:
        return self.body(x)


def trainable_leaves(output: Any) -> list[torch.Tensor]:
    return [
        t for t in tensors_in(output) if t.is_floating_point() and t.requires_grad and t.numel() > 0
    ]


def train(spec: tuple, batch: int, check: str, steps: int = 4) -> tw.Monitor:
    torch.manual_seed(0)
    device = device_of(check)
    model = Model(spec).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    with tw.watch(model, opt, console=io.StringIO(), **every_check(check)) as monitor:
        for _ in range(steps):
            x = torch.randn(batch, 4, generator=gen).to(device)
            opt.zero_grad()
            out = model(x)
            loss = sum(((t.float() - 0.5) ** 2).mean() for t in trainable_leaves(out))
            loss.backward()
            opt.step()
    return monitor


@pytest.mark.parametrize("check", CHECK_MODES)
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(spec=outputs, batch=st.sampled_from([1, 2, 5]))
def test_any_healthy_output_structure_raises_nothing(check, spec, batch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monitor = train(spec, batch, check)
    assert monitor.alerts == [], (spec, [a.message for a in monitor.alerts])
