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


def _reference(values: torch.Tensor, inp: torch.Tensor | None) -> list[float]:
    """One row's FIELDS, taken from its own tensors alone, the plain way."""
    spread = values.std(dim=0, unbiased=False).mean()
    in_spread = inp.std(dim=0, unbiased=False).mean() if inp is not None else float("nan")
    zero = values == 0
    return [
        float(spread),
        float(in_spread),
        float(values.square().mean().sqrt()),
        float(values.mean()),
        float(zero.float().mean()),
        float(zero.all(dim=0).float().mean()),
    ]


def test_each_row_holds_its_own_tensors_statistics_whatever_the_other_widths():
    pending = _pass({}, 3, (784, 512, 10, 512))
    found = pending.reduce()
    for stats, entry in zip(found, pending.rows):
        inp = pending.tensors[entry.input] if entry.input is not None else None
        expected = torch.tensor(_reference(pending.tensors[entry.output], inp))
        torch.testing.assert_close(stats, expected, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_a_nan_in_one_modules_output_stays_in_that_modules_row():
    clean = _pass({}, 4, (64, 32, 64)).reduce()
    poisoned = _pass({}, 4, (64, 32, 64))
    poisoned.tensors[1][3, 5] = float("nan")
    found = poisoned.reduce()
    assert found[1, [0, 2, 3]].isnan().all()  # its own spread, rms and mean
    _same(found[0], clean[0])
    # The next row reads the poisoned tensor as its input: that field only.
    assert found[2, 1].isnan()
    _same(found[2, [0, 2, 3, 4, 5]], clean[2, [0, 2, 3, 4, 5]])


def test_an_output_of_zeros_reads_exactly_all_dead():
    pending = _pass({}, 5, (64, 48))
    pending.tensors[1].zero_()
    found = pending.reduce()
    assert found[1, 4].item() == 1.0 and found[1, 5].item() == 1.0
    assert found[0, 5].item() < 1.0


def test_outputs_with_fewer_rows_are_reduced_apart_from_the_others():
    plans: dict = {}
    pending = _PendingRows(plans)
    generator = torch.Generator().manual_seed(6)
    for rows, width in ((16, 64), (3, 64), (16, 10)):
        measured = pending.add(torch.randn(rows, width, generator=generator))
        pending.rows.append(_Row(measured, None, True, True))
    found = pending.reduce()
    for stats, entry in zip(found, pending.rows):
        expected = torch.tensor(_reference(pending.tensors[entry.output], None))
        torch.testing.assert_close(stats, expected, rtol=1e-5, atol=1e-6, equal_nan=True)
