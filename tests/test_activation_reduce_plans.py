"""The activation statistics' reduction, planned once per layout of measured tensors."""

from __future__ import annotations

import torch

from trainwatch.collect.activations import _PendingRows, _Row


def _pass(plans: dict, seed: int, widths: tuple[int, ...]) -> _PendingRows:
    """A sampled pass's measured tensors: one output per width, each fed by the one before."""
    generator = torch.Generator().manual_seed(seed)
    pending = _PendingRows(plans)
    previous = None
    for width in widths:
        values = torch.randn(16, width, generator=generator).clamp_min(0.0)
        measured = pending.add(values)
        pending.rows.append(_Row(measured, previous, True, True))
        previous = measured
    return pending


def _same(found: torch.Tensor, expected: torch.Tensor) -> None:
    # Bit for bit, NaN (a field the row does not have) included.
    torch.testing.assert_close(found, expected, rtol=0, atol=0, equal_nan=True)


def test_a_layout_seen_before_reuses_its_plan_and_gives_the_same_statistics():
    plans: dict = {}
    first = _pass(plans, 0, (64, 32, 64, 10)).reduce()
    assert len(plans) == 1
    again = _pass(plans, 1, (64, 32, 64, 10)).reduce()  # other values, same layout
    assert len(plans) == 1
    planned_afresh = _pass({}, 1, (64, 32, 64, 10)).reduce()
    _same(again, planned_afresh)
    assert not torch.allclose(first.nan_to_num(), again.nan_to_num())


def test_another_layout_gets_a_plan_of_its_own():
    plans: dict = {}
    _pass(plans, 0, (64, 32)).reduce()
    other = _pass(plans, 0, (32, 64, 64)).reduce()
    assert len(plans) == 2
    _same(other, _pass({}, 0, (32, 64, 64)).reduce())
