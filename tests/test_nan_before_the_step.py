"""A NaN that stops training before the optimizer steps is still reported, at close.

Loops guard themselves (``if not torch.isfinite(loss): raise``), skip the
batch (``continue``), or a NaN makes torch itself raise (a ``Categorical``
refusing NaN logits): the step whose forward met the NaN never reaches its
boundary. What its passes found is judged when the monitor closes, with the
module, op and line of the origin, and the step it happened at. A script that
stops for another reason reports nothing of the kind.
"""

from __future__ import annotations

import io
import json

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

CHECKS = ["auto", "step", "deferred"]


class Broken(nn.Module):
    """x / (x - x) once ``on``: a forward NaN born here."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x - x) if self.on else x


class Net(nn.Module):
    def __init__(self, outputs: int = 1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.broken = Broken()
        self.head = nn.Linear(16, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.broken(torch.tanh(self.fc1(x))))


def nonfinite(alerts) -> list[tuple[str, int, str | None]]:
    return [(a.rule, a.step, a.module) for a in alerts if a.rule.startswith("nonfinite")]


def _guarded_loop(nan_from: int | None, check: str, on_nan: str) -> tw.Monitor:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(RuntimeError) if on_nan == "raise" else _nothing():
        with tw.watch(model, opt, console=False, nonfinite_forward={"check": check}) as monitor:
            for step in range(12):
                model.broken.on = nan_from is not None and step >= nan_from
                x = torch.randn(16, 8)
                loss = nn.functional.mse_loss(model(x), x[:, :1])
                if not torch.isfinite(loss):
                    if on_nan == "raise":
                        raise RuntimeError(f"loss {loss.item()} at step {step}")
                    continue  # skip the batch
                opt.zero_grad()
                loss.backward()
                opt.step()
            if on_nan == "raise":
                raise RuntimeError("stopped for another reason")
    return monitor


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("on_nan", ["raise", "skip"])
def test_a_loop_that_stops_or_skips_on_a_nan_loss_reports_its_origin(check, on_nan):
    monitor = _guarded_loop(6, check, on_nan)
    assert nonfinite(monitor.alerts) == [("nonfinite_forward", 6, "broken")]
    (alert,) = monitor.alerts
    if check != "deferred":
        assert alert.data["op"] == "aten::div"
        assert alert.data["source"].endswith("test_nan_before_the_step.py:38")


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("on_nan", ["raise", "skip"])
def test_a_loop_that_stops_for_another_reason_reports_nothing(check, on_nan):
    assert _guarded_loop(None, check, on_nan).alerts == []


def test_a_policy_whose_logits_turn_nan_reports_the_origin_though_torch_raises():
    """REINFORCE, one observation at a time: ``Categorical`` refuses the NaN logits."""
    torch.manual_seed(0)
    policy = Net(outputs=4)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    # ValueError when distributions validate their arguments, else the sampler's error
    with pytest.raises((ValueError, RuntimeError)):
        with tw.watch(policy, opt, console=False) as monitor:
            for episode in range(8):
                policy.broken.on = episode >= 5
                log_probs = []
                for _ in range(4):
                    dist = torch.distributions.Categorical(logits=policy(torch.randn(1, 8)))
                    log_probs.append(dist.log_prob(dist.sample()))
                opt.zero_grad()
                (-torch.stack(log_probs).sum()).backward()
                opt.step()
    assert nonfinite(monitor.alerts) == [("nonfinite_forward", 5, "broken")]


class GuardedNet(pl.LightningModule):
    def __init__(self, nan_from: int | None) -> None:
        super().__init__()
        self.net = Net()
        self.nan_from = nan_from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.net.broken.on = self.nan_from is not None and batch_idx >= self.nan_from
        loss = nn.functional.mse_loss(self(x), y)
        if not torch.isfinite(loss):
            raise RuntimeError("non-finite loss")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x[:, :1]), batch_size=8)


@pytest.mark.parametrize("nan_from", [4, None])
def test_lightning_step_raising_on_a_nan_loss_reports_its_origin(tmp_path, nan_from):
    torch.manual_seed(0)
    callback = TrainWatchCallback(console=io.StringIO(), log_dir=str(tmp_path / "tw"))
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=1)
    if nan_from is None:
        trainer.fit(GuardedNet(nan_from))
        assert nonfinite(callback.monitor.alerts) == []
        return
    with pytest.raises(RuntimeError, match="non-finite loss"):
        trainer.fit(GuardedNet(nan_from))
    assert nonfinite(callback.monitor.alerts) == [("nonfinite_forward", 4, "net.broken")]


SCRIPT = """
import sys
import torch
from torch import nn


class Broken(nn.Module):
    def forward(self, x):
        return x / (x - x) if NAN else x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.broken = Broken()
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.broken(torch.tanh(self.fc1(x))))


torch.manual_seed(0)
model = Net()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
NAN = False
for step in range(10):
    NAN = sys.argv[1] == "nan" and step >= 3
    x = torch.randn(16, 8)
    loss = nn.functional.mse_loss(model(x), x[:, :1])
    if torch.isnan(loss):
        raise SystemExit(f"NaN loss at step {step}")
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("case", ["nan", "clean"])
def test_unmodified_script_exiting_on_a_nan_loss_reports_its_origin(tmp_path, case):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    log_dir = tmp_path / "log"
    run_script(script, [case], log_dir=log_dir, console=False)
    lines = (log_dir / "alerts.jsonl").read_text().splitlines()
    found = [(a["rule"], a["step"], a["module"]) for a in map(json.loads, lines)]
    assert found == ([("nonfinite_forward", 3, "broken")] if case == "nan" else [])
