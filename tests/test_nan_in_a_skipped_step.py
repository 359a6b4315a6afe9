"""A NaN/Inf born in the forward of a step GradScaler then skips is still named.

Lightning (and a loop that clips) gathers a step before the scaler decides:
the forward's origin, already located, went into that gathering, and when
the scaler skipped the step only the skip was carried over. A corrupt batch
overflowing fp16 was reported by a plain loop and by nothing else.

A loop's own guard (``if not torch.isfinite(norm): continue`` after clipping)
skips the step the same way: a NaN in the batch itself, which no module made,
and a NaN born in a backward are named there too, and the message says no
optimizer step followed.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from tests.test_nonfinite_messages import regress
from trainwatch.lightning import TrainWatchCallback

CORRUPT_AT = 30


class _Classifier(L.LightningModule):
    def __init__(self, corrupt: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 64)
        self.head = nn.Linear(64, 4)
        self.corrupt = corrupt

    def forward(self, x):
        return self.head(F.gelu(self.inp(x)))

    def training_step(self, batch, index):
        x, y = batch
        if self.corrupt and self.global_step == CORRUPT_AT:
            x = x.clone()
            x[:, 0] = 1e30  # a corrupt sample: inf in fp16
        return F.cross_entropy(self(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), 3e-3)


@pytest.mark.parametrize("corrupt", [True, False], ids=["corrupt_batch", "healthy"])
def test_lightning_fp16_names_the_origin_of_a_step_the_scaler_skipped(tmp_path, corrupt):
    data = TensorDataset(torch.randn(1024, 16), torch.randint(0, 4, (1024,)))
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(
        tmp_path, [callback], max_steps=40, plugins=[MixedPrecision("16-mixed", "cpu")]
    )
    trainer.fit(_Classifier(corrupt), DataLoader(data, batch_size=32, shuffle=True))
    found = [(a.rule, a.module, a.step) for a in callback.alerts if a.severity != "info"]
    assert found == ([("nonfinite_forward", "inp", CORRUPT_AT)] if corrupt else [])


@pytest.mark.parametrize("corrupt", [True, False], ids=["corrupt_batch", "healthy"])
def test_a_clipping_fp16_loop_names_the_origin_of_a_step_the_scaler_skipped(corrupt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), 3e-3)
    scaler = torch.amp.GradScaler("cpu")
    with tw.watch(model, opt, scaler=scaler, console=False) as monitor:
        for step in range(40):
            x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
            if corrupt and step == CORRUPT_AT:
                x[:, 0] = 1e30
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scaler.scale(F.cross_entropy(out.float(), y)).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    found = [(a.rule, a.module, a.step) for a in monitor.alerts if a.severity != "info"]
    assert found == ([("nonfinite_forward", "0", CORRUPT_AT)] if corrupt else [])


def test_a_nan_input_batch_the_loop_skips_is_told_as_bad_data():
    alerts = regress(where="input", value=float("nan"), guard=True)
    assert [(a.rule, a.step, a.data["cause"]) for a in alerts] == [
        ("nonfinite_forward", 5, "input")
    ]
    assert "already non-finite" in alerts[0].message


@pytest.mark.parametrize("value", [float("inf"), 1e3])
def test_an_infinite_input_batch_the_loop_skips_is_told_and_a_merely_odd_one_is_not(value):
    alerts = regress(where="input", value=value, guard=True)
    expected = [("nonfinite_forward", 5)] if value == float("inf") else []
    assert [(a.rule, a.step) for a in alerts] == expected


@pytest.mark.parametrize("armed", [True, False], ids=["sqrt_at_zero", "healthy"])
def test_a_backward_nan_the_loop_skips_says_no_step_applied_it(armed):
    class SqrtAtZero(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(10, 10)
            self.armed = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return h + torch.sqrt(h * 0.0) if self.armed else h

    torch.manual_seed(0)
    fault = SqrtAtZero()
    model = nn.Sequential(fault, nn.Linear(10, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(8):
            fault.armed = armed and step == 4
            opt.zero_grad()
            model(torch.randn(16, 10)).pow(2).mean().backward()
            norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if torch.isfinite(norm):
                opt.step()
    if not armed:
        assert monitor.alerts == []
        return
    (alert,) = monitor.alerts
    assert (alert.rule, alert.step, alert.module) == ("nonfinite_backward", 4, "0")
    assert "no optimizer step followed it" in alert.message
    assert "applied it" not in alert.message
