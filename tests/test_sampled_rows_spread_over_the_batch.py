"""The sampled output statistics look at rows spread over the batch, not its first rows.

A full-batch fit on ``linspace`` inputs (a curve fit, a PINN, a time series
in order) holds neighbours in its first rows: a model that follows its input
well still varies little there, and ``constant_output`` took that for a
collapse. A very sparse code (a few active units in a thousand) shows about
one row per unit that fired in a sample of 16 rows, which is a code, not a
dead layer.
"""

from __future__ import annotations

import torch
from torch import nn

import trainwatch as tw
from trainwatch.rules.activations import _sparse_code


def _curve_fit(collapse_at: int | None) -> list[tw.Alert]:
    torch.manual_seed(0)
    x = torch.linspace(-3, 3, 256)[:, None]
    y = torch.sin(2 * x) + 0.5
    model = nn.Sequential(
        nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(160):
            if step == collapse_at:
                with torch.no_grad():  # the last layer ignores its input from here on
                    model[4].weight.zero_()
                model[4].weight.requires_grad_(False)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
    return [a for a in monitor.alerts if a.rule == "constant_output"]


def test_a_full_batch_curve_fit_on_sorted_inputs_is_no_constant_output():
    assert _curve_fit(None) == []


def test_a_full_batch_curve_fit_whose_output_collapses_is_told():
    found = _curve_fit(collapse_at=60)
    assert found and found[0].module == "" and found[0].step >= 60


def test_a_code_whose_few_live_units_fire_once_each_is_sparse():
    # 1024 units, 16 rows, 9 active entries on 9 different units.
    zero = 1 - 9 / (16 * 1024)
    dead = 1 - 9 / 1024
    assert _sparse_code(zero, dead, 16)


def test_a_layer_whose_few_survivors_fire_on_every_row_is_dead():
    # 9 live units out of 1024, each active on all 16 rows.
    zero = 1 - 9 * 16 / (16 * 1024)
    dead = 1 - 9 / 1024
    assert not _sparse_code(zero, dead, 16)
    assert not _sparse_code(1.0, 1.0, 16)  # nothing fires at all
