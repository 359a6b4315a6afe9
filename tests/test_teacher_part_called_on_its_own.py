"""A frozen teacher held inside the trained module, called on its own by the loop.

A distillation wrapper holds the frozen teacher and the student; the loop (or a
LightningModule's ``training_step``) calls ``model.teacher(x)`` itself under
``no_grad``, then the model for the student. With ``teacher.eval()`` forgotten
its dropout makes the soft targets noisy. The frozen-part check saw only the
model's own passes, and the call tracker, seeing the teacher never run inside
them, took it for a part that never runs (an EMA copy only copied from):
nothing was said. Under ``trainwatch run`` the teacher, called before the model,
was first watched as a model of its own, and its one pass was told at step 0 as
an evaluation (``model.eval()`` advice) when its monitor gave way to the
model's. Now each shape tells the one info line of a frozen part in training
mode, at step 0, with the teacher advice; a teacher kept in eval stays silent.
"""

from __future__ import annotations

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


def _net(width: int, norm: bool = False) -> nn.Sequential:
    middle = nn.BatchNorm1d(width) if norm else nn.Dropout(0.3)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), middle, nn.Linear(width, 4))


class Distiller(nn.Module):
    """``frozen``: the teacher's parameters have requires_grad=False; else only the
    optimizer (over the student) and ``no_grad`` leave it untrained."""

    def __init__(self, frozen: bool = True, norm: bool = False) -> None:
        super().__init__()
        self.teacher = _net(128, norm)
        self.student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        if frozen:
            self.teacher.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x)


def _distil(model: Distiller, teacher_in_eval: bool, steps: int = 10) -> list:
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.student.parameters(), 1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(steps):
            model.train()
            if teacher_in_eval:
                model.teacher.eval()
            x = torch.randn(32, 16)
            with torch.no_grad():
                target = model.teacher(x).softmax(-1)
            loss = F.kl_div(model(x).log_softmax(-1), target, reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
    return monitor.alerts


def _told(alerts: list) -> list[tuple[int, str | None, str]]:
    return [(a.step, a.module, a.severity) for a in alerts if a.data.get("finding") == FINDING]


@pytest.mark.parametrize("norm", [False, True], ids=["dropout", "batch_norm"])
def test_a_teacher_called_by_the_loop_in_training_mode_is_the_frozen_part_line(norm):
    alerts = _distil(Distiller(norm=norm), teacher_in_eval=False)
    assert _told(alerts) == [(0, "teacher.2", "info")]
    (alert,) = alerts
    assert alert.rule == "eval_in_train_mode"
    assert ("batch norm" if norm else "dropout is on") in alert.message
    assert "call teacher.eval()" in alert.hint
    assert "model.eval() before evaluating" not in alert.hint


def test_a_teacher_called_by_the_loop_kept_in_eval_says_nothing():
    alerts = _distil(Distiller(), teacher_in_eval=True)
    assert _told(alerts) == []
    assert all(a.severity == "info" for a in alerts)


def test_a_teacher_never_frozen_called_by_the_loop_is_told_as_held_by_no_optimizer():
    alerts = _distil(Distiller(frozen=False), teacher_in_eval=False)
    assert _told(alerts) == [(0, "teacher.2", "info")]
    assert alerts[0].data["held_by_no_optimizer"] is True


class LitDistiller(L.LightningModule):
    """The teacher called in ``training_step``, never in ``forward``."""

    def __init__(self, teacher_in_eval: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.teacher = _net(128).requires_grad_(False)
        self.student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        if teacher_in_eval:
            self.teacher.eval()  # Lightning keeps submodule modes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x)

    def training_step(self, batch, index):
        x, _ = batch
        with torch.no_grad():
            target = self.teacher(x).softmax(-1)
        return F.kl_div(self(x).log_softmax(-1), target, reduction="batchmean")

    def configure_optimizers(self):
        return torch.optim.Adam(self.student.parameters(), lr=1e-3)


@pytest.mark.parametrize("teacher_in_eval", [False, True], ids=["forgotten", "in_eval"])
def test_lightning_teacher_called_in_training_step(tmp_path, teacher_in_eval):
    x = torch.randn(256, 16)
    loader = DataLoader(TensorDataset(x, torch.zeros(256)), batch_size=32)
    callback = TrainWatchCallback(console=False)
    quiet_trainer(tmp_path, [callback], max_steps=12).fit(LitDistiller(teacher_in_eval), loader)
    assert _told(callback.alerts) == ([] if teacher_in_eval else [(0, "teacher.2", "info")])
    assert [a.severity for a in callback.alerts if a.severity != "info"] == []


SCRIPT = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)


def net(width):
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Dropout(0.3), nn.Linear(width, 4))


class Distiller(nn.Module):
    def __init__(self):
        super().__init__()
        self.teacher, self.student = net(128), net(32)
        self.teacher.requires_grad_(False)

    def forward(self, x):
        return self.student(x)


model = Distiller()
if sys.argv[1] == "eval":
    model.teacher.eval()
opt = torch.optim.Adam(model.student.parameters(), 1e-3)
for step in range(10):
    x = torch.randn(32, 16)
    with torch.no_grad():
        target = model.teacher(x).softmax(-1)
    loss = F.kl_div(model(x).log_softmax(-1), target, reduction="batchmean")
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _run(tmp_path, source: str, how: str) -> list[dict]:
    script = tmp_path / "train.py"
    script.write_text(source)
    run_script(script, [how], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return list(map(json.loads, lines))


@pytest.mark.parametrize("how", ["train", "eval"])
def test_trainwatch_run_tells_the_teacher_the_loop_calls_as_the_models_frozen_part(tmp_path, how):
    """The teacher, called before the model, is watched alone until the model's first
    call: its pass is the model's, no evaluation of a model of its own."""
    alerts = _run(tmp_path, SCRIPT, how)
    told = [
        (a["step"], a["module"], a["severity"], a["data"].get("model"))
        for a in alerts
        if a["data"].get("finding") == FINDING
    ]
    assert told == ([(0, "teacher.2", "info", "Distiller")] if how == "train" else [])
    assert [a["severity"] for a in alerts] == ["info"]  # kept in eval: the usual idiom line


SHAPE_CHECK = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 16)
        )
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.encoder(x))


model = Net()
with torch.no_grad():
    for _ in range(int(sys.argv[1])):
        assert model.encoder(torch.zeros(2, 8)).shape == (2, 16)
opt = torch.optim.Adam(model.parameters(), 1e-3)
for step in range(12):
    x = torch.randn(32, 8)
    loss = F.cross_entropy(model(x), (x[:, 0] > 0).long())
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("passes", ["1", "4"])
def test_trainwatch_run_lets_a_shape_check_of_a_part_go_and_tells_a_longer_run(tmp_path, passes):
    """The same hand-over: one pass of the encoder before the model's first call is
    a shape check, as one before a first training pass is; four are still a
    (baseline) evaluation in training mode."""
    alerts = _run(tmp_path, SHAPE_CHECK, passes)
    told = [(a["rule"], a["severity"]) for a in alerts]
    assert told == ([] if passes == "1" else [("eval_in_train_mode", "warning")])
