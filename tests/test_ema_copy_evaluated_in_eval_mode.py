"""An EMA copy kept inside the model and only ever evaluated in eval mode: nothing told.

The copy (a frozen deepcopy of the network, moved by ``lerp_`` after each step)
is run only as ``model.eval(); with torch.no_grad(): model.ema(x); model.train()``
in a plain loop, or in a LightningModule's ``validation_step``. ``model.train()``
puts its dropout back in training mode between evaluations, yet it never runs
there: the frozen-part note ("a frozen part of the model runs in training mode
while the rest trains") was told all the same, since the copy had been seen
called, in eval mode. Beside it, the same copy made to run in training mode
while the rest trains stays told: as a teacher called under ``no_grad`` in
training mode to make the targets, and as a frozen backbone whose features
feed the trained network.
"""

from __future__ import annotations

import copy
import json

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

FINDING = "frozen part in training mode"


def _network() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4))


class _WithEma(nn.Module):
    """A network and its frozen EMA copy. ``forward`` is the training pass of the
    ``through_forward`` loops; the others call the parts."""

    def __init__(self, use: str) -> None:
        super().__init__()
        self.net = _network()
        self.ema = copy.deepcopy(self.net).requires_grad_(False)
        self.use = use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use == "backbone":
            return self.net(self.ema(x))
        return self.net(x)


def _plain_loop(shape: str, use: str, steps: int = 30) -> list[tuple[int, str | None]]:
    """``use``: "evaluated" (the copy evaluated every 10 steps, in eval mode), "teacher"
    (called by the loop under no_grad, in training mode, to make the targets),
    "backbone" (its features, with gradients on, feed the network)."""
    torch.manual_seed(0)
    model = _WithEma(use)
    opt = torch.optim.Adam(model.net.parameters(), 1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(steps):
            x = torch.randn(32, 4)
            target = x
            if use == "teacher":
                with torch.no_grad():
                    target = model.ema(x)
            if shape == "through_forward":
                out = model(x)
            elif use == "backbone":
                out = model.net(model.ema(x))
            else:
                out = model.net(x)
            loss = F.mse_loss(out, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for ema, param in zip(model.ema.parameters(), model.net.parameters()):
                    ema.lerp_(param, 0.01)
            if use == "evaluated" and step % 10 == 0:
                model.eval()
                with torch.no_grad():
                    F.mse_loss(model.ema(x), x)
                model.train()
    return [(a.step, a.module) for a in monitor.alerts if a.data.get("finding") == FINDING]


def _told(told: bool, through_forward: bool) -> list[tuple[int, str]]:
    """A model called through its parts has its parts' calls seen as its passes from
    its second step (its first step's gradients came without a pass of the whole)."""
    return [(0 if through_forward else 1, "ema.2")] if told else []


@pytest.mark.parametrize("shape", ["through_parts", "through_forward"])
@pytest.mark.parametrize(
    ("use", "told"), [("evaluated", False), ("teacher", True), ("backbone", True)]
)
def test_plain_loop_tells_the_copy_only_where_it_runs_in_training_mode(shape, use, told):
    assert _plain_loop(shape, use) == _told(told, shape == "through_forward")


class _LitWithEma(L.LightningModule):
    """``through_forward``: training_step calls ``self(x)``, else ``self.net(x)``.
    ``teacher``: the copy makes the targets in training_step, in training mode;
    else it is used in validation_step only (Lightning puts the module in eval)."""

    def __init__(self, through_forward: bool, teacher: bool) -> None:
        super().__init__()
        self.net = _network()
        self.ema = copy.deepcopy(self.net).requires_grad_(False)
        self.through_forward = through_forward
        self.teacher = teacher

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, index):
        (x,) = batch
        target = x
        if self.teacher:
            with torch.no_grad():
                target = self.ema(x)
        out = self(x) if self.through_forward else self.net(x)
        return F.mse_loss(out, target)

    def on_train_batch_end(self, outputs, batch, index):
        with torch.no_grad():
            for ema, param in zip(self.ema.parameters(), self.net.parameters()):
                ema.mul_(0.99).add_(param, alpha=0.01)

    def validation_step(self, batch, index):
        (x,) = batch
        self.log("val", F.mse_loss(self.ema(x), x))

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), 1e-3)


@pytest.mark.parametrize("through_forward", [False, True], ids=["through_parts", "forward"])
@pytest.mark.parametrize("teacher", [False, True], ids=["evaluated", "teacher"])
def test_lightning_tells_the_copy_only_where_it_runs_in_training_mode(
    tmp_path, through_forward, teacher
):
    torch.manual_seed(0)
    train = DataLoader(TensorDataset(torch.randn(256, 4)), batch_size=32)
    val = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=32)
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=2)
    trainer.fit(_LitWithEma(through_forward, teacher), train, val)
    found = [(a.step, a.module) for a in callback.alerts if a.data.get("finding") == FINDING]
    assert found == _told(teacher, through_forward)


LIGHTNING_SCRIPT = """
import copy
import sys

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

teacher = sys.argv[1] == "teacher"
torch.manual_seed(0)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4))
        self.ema = copy.deepcopy(self.net).requires_grad_(False)

    def training_step(self, batch, index):
        (x,) = batch
        target = x
        if teacher:
            with torch.no_grad():
                target = self.ema(x)
        return F.mse_loss(self.net(x), target)

    def on_train_batch_end(self, outputs, batch, index):
        with torch.no_grad():
            for ema, param in zip(self.ema.parameters(), self.net.parameters()):
                ema.lerp_(param, 0.01)

    def validation_step(self, batch, index):
        (x,) = batch
        self.log("val", F.mse_loss(self.ema(x), x))

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), 1e-3)


train = DataLoader(TensorDataset(torch.randn(256, 4)), batch_size=32)
val = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=32)
trainer = L.Trainer(
    max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, default_root_dir=sys.argv[2],
)
trainer.fit(Model(), train, val)
"""

PLAIN_SCRIPT = """
import copy
import sys

import torch
from torch import nn
from torch.nn import functional as F

teacher = sys.argv[1] == "teacher"
torch.manual_seed(0)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4))
        self.ema = copy.deepcopy(self.net).requires_grad_(False)

    def forward(self, x):
        return self.net(x)


model = Model()
opt = torch.optim.Adam(model.net.parameters(), 1e-3)
for step in range(30):
    x = torch.randn(32, 4)
    target = x
    if teacher:
        with torch.no_grad():
            target = model.ema(x)
    loss = F.mse_loss(model(x), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        for ema, param in zip(model.ema.parameters(), model.net.parameters()):
            ema.lerp_(param, 0.01)
    if step % 10 == 0:
        model.eval()
        with torch.no_grad():
            F.mse_loss(model.ema(x), x)
        model.train()
"""


@pytest.mark.parametrize("script", ["lightning", "plain"])
@pytest.mark.parametrize(("how", "told"), [("evaluated", []), ("teacher", [(0, "ema.2")])])
def test_trainwatch_run_tells_the_copy_only_where_it_runs_in_training_mode(
    tmp_path, script, how, told
):
    path = tmp_path / "train.py"
    path.write_text(LIGHTNING_SCRIPT if script == "lightning" else PLAIN_SCRIPT)
    run_script(path, [how, str(tmp_path / "root")], log_dir=tmp_path / "log", console=False)
    log = tmp_path / "log" / "alerts.jsonl"
    lines = log.read_text().splitlines() if log.exists() else []
    found = [
        (a["step"], a["module"])
        for a in map(json.loads, lines)
        if a["data"].get("finding") == FINDING
    ]
    assert found == told
