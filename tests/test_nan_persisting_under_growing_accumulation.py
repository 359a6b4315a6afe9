"""A NaN that persists in the weights while gradient accumulation grows: updated, not skipped.

Accumulation that grows mid-run (Lightning's ``GradientAccumulationScheduler``,
or the same written by hand) takes more backward passes per optimizer step
than at the start. Once a NaN born before the growth sits in the weights,
every pass's gradient is non-finite, yet the optimizer steps after each group
of micro-batches and applies them all: the weights are updated (to NaN), no
step is skipped. The NaN's origin is told once; ``amp_skipped_steps`` stays
silent. A GradScaler or a loop's own guard that does skip steps is still told.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _rules(alerts: list[tw.Alert]) -> list[str]:
    return [a.rule for a in alerts]


def _classifier() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))


def _growing_loop(
    *, corrupt: int | None, before: int = 30, after: int = 40, grow_to: int = 4
) -> tuple[tw.Monitor, nn.Module]:
    """Accumulation 1 for ``before`` batches, then ``grow_to``; a NaN input at
    batch ``corrupt`` (None: none) makes every weight NaN from then on."""
    model = _classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = 0
    with tw.watch(model, opt, console=False) as monitor:
        for i in range(before + grow_to * after):
            acc = 1 if i < before else grow_to
            x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
            if i == corrupt:
                x[0, 0] = float("nan")
            (F.cross_entropy(model(x), y) / acc).backward()
            micro += 1
            if micro == acc:
                opt.step()
                opt.zero_grad()
                micro = 0
    return monitor, model


def _weights_finite(model: nn.Module) -> bool:
    return all(torch.isfinite(p).all().item() for p in model.parameters())


def test_a_nan_persisting_while_accumulation_grows_is_told_once_and_never_as_skipped_steps():
    monitor, model = _growing_loop(corrupt=10)
    assert not _weights_finite(model)  # updated to NaN, not left alone
    (alert,) = monitor.alerts
    assert (alert.rule, alert.step) == ("nonfinite_forward", 10)


def test_the_growing_accumulation_without_a_nan_is_silent():
    monitor, model = _growing_loop(corrupt=None)
    assert _weights_finite(model)
    assert monitor.alerts == []


def test_a_nan_persisting_under_accumulation_grown_eightfold_is_not_skipped_steps():
    monitor, _ = _growing_loop(corrupt=10, after=30, grow_to=8)
    assert "amp_skipped_steps" not in _rules(monitor.alerts)


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 8, 3, padding=1)
        self.head = nn.Linear(8 * 6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x)).flatten(1))


def _epoch_schedule_loop(*, corrupt_target: bool) -> tw.Monitor:
    """A regression over a DataLoader, Adam, accumulation 2 in epoch 0 and 6 after;
    a NaN target in epoch 0 (a corrupt label) that the update carries into the weights."""
    x = torch.randn(96, 2, 6)
    y = x.mean((1, 2)).unsqueeze(1)
    if corrupt_target:
        y[13, 0] = float("nan")
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    model = Regressor()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        for epoch in range(6):
            acc = 2 if epoch == 0 else 6
            for i, (xb, yb) in enumerate(loader):
                (F.mse_loss(model(xb), yb) / acc).backward()
                if (i + 1) % acc == 0:
                    opt.step()
                    opt.zero_grad()
    return monitor


def test_a_nan_target_persisting_through_an_epoch_schedule_of_accumulation_is_told_once():
    monitor = _epoch_schedule_loop(corrupt_target=True)
    assert "amp_skipped_steps" not in _rules(monitor.alerts)
    (alert,) = monitor.alerts
    assert alert.rule.startswith("nonfinite") and alert.severity == "error"


def test_the_epoch_schedule_of_accumulation_without_a_nan_is_silent():
    assert _epoch_schedule_loop(corrupt_target=False).alerts == []


class CorruptBatchNet(pl.LightningModule):
    """A classifier whose batch ``corrupt`` of epoch 0 (None: none) holds a NaN."""

    def __init__(self, corrupt: int | None) -> None:
        super().__init__()
        self.net = _classifier()
        self.corrupt = corrupt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.current_epoch == 0 and batch_idx == self.corrupt:
            x = x.clone()
            x[0, 0] = float("nan")
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=gen)
        data = TensorDataset(x, torch.randint(0, 3, (256,), generator=gen))
        return DataLoader(data, batch_size=8, shuffle=True, generator=gen)


def _lightning_fit(tmp_path, corrupt: int | None) -> tuple[TrainWatchCallback, pl.LightningModule]:
    callback = TrainWatchCallback(console=False)
    module = CorruptBatchNet(corrupt)
    trainer = quiet_trainer(
        tmp_path,
        [callback, GradientAccumulationScheduler({0: 1, 2: 4})],
        max_epochs=6,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(module)
    assert trainer.global_step == 2 * 32 + 4 * 8
    return callback, module


def test_lightning_accumulation_scheduler_with_a_persisting_nan_tells_no_skipped_steps(tmp_path):
    callback, module = _lightning_fit(tmp_path, corrupt=5)
    assert not _weights_finite(module)
    (alert,) = callback.alerts
    assert (alert.rule, alert.step) == ("nonfinite_forward", 5)


def test_lightning_accumulation_scheduler_without_a_nan_is_silent(tmp_path):
    callback, module = _lightning_fit(tmp_path, corrupt=None)
    assert _weights_finite(module)
    assert callback.alerts == []


# Steps that are skipped are still told.


class BreaksAt(nn.Module):
    """A layer that computes NaN from ``broken`` on: a NaN born anew every pass."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 32)
        self.broken = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        return out * float("nan") if self.broken else out


def test_a_guard_skipping_every_step_of_a_growing_accumulation_is_still_told():
    feat = BreaksAt()
    model = nn.Sequential(feat, nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = 0
    with tw.watch(model, opt, console=False) as monitor:
        for i in range(30 + 4 * 20):
            acc = 1 if i < 30 else 4
            feat.broken = i >= 50  # after the growth: every update from then on skipped
            x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
            (F.cross_entropy(model(x), y) / acc).backward()
            micro += 1
            if micro == acc:
                norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if torch.isfinite(norm):
                    opt.step()
                opt.zero_grad()
                micro = 0
    (alert,) = [a for a in monitor.alerts if a.rule == "amp_skipped_steps"]
    assert "guard in the loop" in alert.message and alert.data["skipped"] >= 10
    assert _weights_finite(model)


def test_a_guard_skipping_most_steps_is_still_told():
    model = _classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tw.watch(model, opt, console=False) as monitor:
        for i in range(160):
            x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
            if i >= 10 and i % 3:
                x[0, 0] = float("nan")  # two batches in three corrupt, each skipped
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if torch.isfinite(loss):
                opt.step()
    (alert,) = [a for a in monitor.alerts if a.rule == "amp_skipped_steps"]
    assert "of the last 100 steps were skipped" in alert.message
    assert _weights_finite(model)


def test_a_grad_scaler_that_keeps_skipping_under_a_growing_accumulation_is_still_told():
    model = _classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    micro = 0
    with tw.watch(model, opt, console=False, scaler=scaler) as monitor:
        for i in range(30 + 4 * 20):
            acc = 1 if i < 30 else 4
            x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = F.cross_entropy(out.float(), y) / acc
            if i >= 50:
                loss = loss * float("inf")  # overflows at any scale from here on
            scaler.scale(loss).backward()
            micro += 1
            if micro == acc:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                micro = 0
    (alert,) = [a for a in monitor.alerts if a.rule == "amp_skipped_steps"]
    assert "GradScaler keeps skipping" in alert.message and "scale" in alert.data
