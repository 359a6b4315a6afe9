"""The pass output check: the same verdict whether a tensor is small enough to be read
as Python floats or large enough to be summed first."""

from __future__ import annotations

import pytest
import torch

from trainwatch.collect.tensors import finite_exact

NAN, INF = float("nan"), float("inf")


def _both_sizes(shape_small, shape_large, fill_at, value, requires_grad=False):
    """A small and a large tensor, each finite but for ``value`` at one place."""
    made = []
    for shape in (shape_small, shape_large):
        t = torch.randn(shape)
        if fill_at is not None:
            t.view(-1)[fill_at] = value
        made.append(t.requires_grad_(requires_grad))
    return made


@pytest.mark.parametrize(
    ("value", "requires_grad", "finite"),
    [
        (None, False, True),
        (None, True, True),
        (NAN, False, False),
        (INF, True, False),
        (-INF, True, False),  # training made it: not a mask
        (-INF, False, True),  # outside autograd: a deliberate mask
    ],
    ids=["finite", "finite-requires-grad", "nan", "inf", "neg-inf-trained", "neg-inf-mask"],
)
@pytest.mark.parametrize(
    ("small", "large"),
    [((1, 4), (64, 4)), ((4,), (300,)), ((2, 2, 2), (8, 8, 8)), ((16,), (17,))],
    ids=["policy-logits", "vector", "3d", "at-the-bound"],
)
def test_small_and_large_outputs_get_the_same_verdict(small, large, value, requires_grad, finite):
    fill_at = None if value is None else 1
    for tensor in _both_sizes(small, large, fill_at, value, requires_grad):
        assert finite_exact(tensor) is finite


def test_a_zero_dim_output_is_checked_too():
    assert finite_exact(torch.tensor(0.5)) is True
    assert finite_exact(torch.tensor(NAN)) is False


def test_a_half_precision_output_is_checked_like_a_float_one():
    assert finite_exact(torch.ones(1, 4, dtype=torch.bfloat16)) is True
    assert finite_exact(torch.tensor([[1.0, INF]], dtype=torch.float16)) is False


def test_a_small_output_is_checked_without_any_op():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    small = torch.nn.Linear(3, 4)(torch.randn(1, 3))
    with Ops() as ops:
        assert finite_exact(small)
    assert ops.seen == []
