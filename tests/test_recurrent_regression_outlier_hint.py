"""A recurrent model trained with a regression loss whose gradients jump at one
corrupt batch is told of that batch's outlier, not of its recurrent weights.

The planted bug: a sliding-window LSTM/GRU forecaster trained with MSE on a
standardised series, one of whose windows holds a stuck-sensor reading of 4000
at step 60. Its loss is 1e7x the usual one for that step, its gradient norms
jump 1e3-1e5x and are back to usual the next step: the hint names the batch,
the outlier and a robust loss, as a feed-forward regression's does, not "the
recurrent weights blew up, not an outlier". Watched by ``tw.watch``, by
``trainwatch run`` and by the Lightning callback.

Beside it: the same forecasters on clean data stay silent; a feed-forward
forecaster with the same corrupt batch keeps its advice on the batch; and a
recurrent regression whose learning rate blows its weights up, whose norms climb
into the jump (within its warm-up) or go on jumping at the next step (after it),
keeps the learning-rate and small-clip advice, as the RNN language model at lr 20
does (tests/test_gradient_explosion_in_one_step.py).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

STUCK_AT, STUCK_VALUE = 60, 4000.0


def _series() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    t = torch.arange(5000.0)
    return torch.sin(2 * torch.pi * t / 24) + 0.1 * torch.randn(5000, generator=gen)


def _windows(z: torch.Tensor, step: int, gen: torch.Generator, stuck: bool) -> torch.Tensor:
    """32 windows of 49 readings; at ``STUCK_AT`` one sensor stuck for half a window."""
    starts = torch.randint(0, 4900, (32,), generator=gen)
    seq = torch.stack([z[i : i + 49] for i in starts]).unsqueeze(-1)
    if stuck and step == STUCK_AT:
        seq[5, 20:, 0] = STUCK_VALUE
    return seq


class _Forecaster(nn.Module):
    def __init__(self, cell: str) -> None:
        super().__init__()
        if cell == "mlp":  # the feed-forward twin: each reading from the 8 before it
            self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        else:
            self.body = getattr(nn, cell)(1, 32, batch_first=True)
        self.cell = cell
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cell == "mlp":
            return self.head(self.body(x.squeeze(-1).unfold(1, 8, 1)))
        return self.head(self.body(x)[0])


def _target(model: _Forecaster, seq: torch.Tensor) -> torch.Tensor:
    return seq[:, 8:] if model.cell == "mlp" else seq[:, 1:]


def _fit(
    cell: str,
    *,
    stuck: bool,
    steps: int = 70,
    sgd_raised: tuple[int, float] | None = None,
) -> list[tw.Alert]:
    """Adam at 3e-3, or SGD at 0.05 whose learning rate becomes ``sgd_raised[1]`` from
    step ``sgd_raised[0]`` on (a schedule multiplying where it meant to divide)."""
    torch.manual_seed(0)
    z, gen = _series(), torch.Generator().manual_seed(1)
    model = _Forecaster(cell)
    if sgd_raised is None:
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(steps):
            if sgd_raised is not None and step == sgd_raised[0]:
                for group in opt.param_groups:
                    group["lr"] = sgd_raised[1]
            seq = _windows(z, step, gen, stuck)
            loss = F.mse_loss(model(seq[:, :-1]), _target(model, seq))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return [a for a in monitor.alerts if a.severity != "info"]


def _names_the_outlier(hint: str) -> None:
    assert "this batch" in hint and "mse_loss" in hint
    assert "huber_loss" in hint and "drop or clamp" in hint
    assert "not an outlier" not in hint and "robust loss would not help" not in hint


def _names_the_weights(hint: str) -> None:
    assert "recurrent" in hint and "learning rate" in hint and "0.25 to 1.0" in hint
    assert "huber" not in hint and "clamp" not in hint


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_one_stuck_sensor_reading_in_a_recurrent_forecaster_is_told_as_that_batch(cell):
    (alert,) = _fit(cell, stuck=True)
    assert (alert.rule, alert.step) == ("exploding_gradient", STUCK_AT)
    assert alert.data["ratio"] > 1e3
    _names_the_outlier(alert.hint)
    # What the jumps going on would mean instead, named second.
    assert "If the norms stay high over the next steps instead" in alert.hint


@pytest.mark.parametrize("cell", ["LSTM", "GRU", "mlp"])
def test_the_same_forecasters_on_clean_data_stay_silent(cell):
    assert _fit(cell, stuck=False, steps=100) == []


def test_a_feed_forward_forecaster_keeps_its_advice_on_the_batch():
    (alert, *_) = _fit("mlp", stuck=True)
    assert (alert.rule, alert.step) == ("exploding_gradient", STUCK_AT)
    assert "bad data in this batch" in alert.hint and "check the batch" in alert.hint
    assert "recurrent" not in alert.hint


def test_a_recurrent_regression_whose_learning_rate_blows_up_keeps_the_weights_advice():
    # lr 0.05 -> 50 at step 70, past the warm-up: a 75x jump at 71, held back a
    # step, goes on (2e5x) at 72: no single batch.
    (first, *rest) = _fit("GRU", stuck=False, steps=80, sgd_raised=(70, 50.0))
    assert (first.rule, first.step) == ("exploding_gradient", 71)
    _names_the_weights(first.hint)
    assert all("huber" not in a.hint for a in rest)


def test_a_recurrent_regression_blowing_up_in_its_warm_up_keeps_the_weights_advice():
    # lr 0.05 -> 50 at step 40: its norms climb 400x at 41 (inside the warm-up, so
    # no jump yet) and 1e7x at 42, told at once.
    (first, *_) = _fit("GRU", stuck=False, steps=45, sgd_raised=(40, 50.0))
    assert (first.rule, first.step, first.data["kind"]) == (
        "exploding_gradient",
        42,
        "enormous_jump",
    )
    _names_the_weights(first.hint)


FORECASTER_SCRIPT = """
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

STUCK = sys.argv[1] == "stuck"
torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)
t = torch.arange(5000.0)
z = torch.sin(2 * torch.pi * t / 24) + 0.1 * torch.randn(5000, generator=gen)


class Forecaster(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(1, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.gru(x)[0][:, -1])


model = Forecaster()
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
for step in range(70):
    starts = torch.randint(0, 4900, (32,), generator=gen)
    seq = torch.stack([z[i:i + 49] for i in starts]).unsqueeze(-1)
    if STUCK and step == 60:
        seq[5, -1, 0] = 4000.0  # the target the window forecasts: a stuck reading
    loss = F.mse_loss(model(seq[:, :-1]), seq[:, -1])
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _run(tmp_path: Path, stuck: bool) -> list[tw.Alert]:
    script = tmp_path / "forecast.py"
    script.write_text(textwrap.dedent(FORECASTER_SCRIPT))
    log = tmp_path / ("stuck" if stuck else "clean")
    arg = "stuck" if stuck else "clean"
    assert run_script(script, [arg], log_dir=log, console=False) == 0
    found = []
    for line in (log / "alerts.jsonl").read_text().splitlines():
        fields = json.loads(line)
        fields.pop("time", None)
        found.append(tw.Alert(**fields))
    return [a for a in found if a.severity != "info"]


def test_a_stuck_target_under_trainwatch_run_is_told_as_that_batch(tmp_path):
    # A 2-layer GRU forecasting the window's last reading: the outlier is the target.
    (alert,) = _run(tmp_path, stuck=True)
    assert (alert.rule, alert.step, alert.module) == ("exploding_gradient", 60, "head")
    _names_the_outlier(alert.hint)


def test_the_same_script_on_clean_data_stays_silent_under_trainwatch_run(tmp_path):
    assert _run(tmp_path, stuck=False) == []


class _Windows(Dataset):
    """Step ``i``'s batch of windows, one per item: the loader does not shuffle."""

    def __init__(self, stuck: bool) -> None:
        z, gen = _series(), torch.Generator().manual_seed(1)
        self.batches = [_windows(z, step, gen, stuck) for step in range(70)]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.batches[index]


class _LitForecaster(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(1, 32, batch_first=True)
        self.head = nn.Linear(32, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        seq = batch[0]
        return F.mse_loss(self.head(self.lstm(seq[:, :-1])[0]), seq[:, 1:])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def _lightning(tmp_path: Path, stuck: bool) -> list[tw.Alert]:
    callback = TrainWatchCallback(console=False)
    loader = DataLoader(_Windows(stuck), batch_size=1, shuffle=False)
    quiet_trainer(tmp_path, [callback], max_epochs=1).fit(_LitForecaster(), loader)
    return [a for a in callback.alerts if a.severity != "info"]


def test_a_stuck_reading_in_a_lightning_forecaster_is_told_as_that_batch(tmp_path):
    (alert,) = _lightning(tmp_path, stuck=True)
    assert (alert.rule, alert.step) == ("exploding_gradient", STUCK_AT)
    _names_the_outlier(alert.hint)


def test_the_same_lightning_forecaster_on_clean_data_stays_silent(tmp_path):
    assert _lightning(tmp_path, stuck=False) == []
