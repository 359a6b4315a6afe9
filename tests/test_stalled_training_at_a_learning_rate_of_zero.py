"""stalled_training over learning rates of exactly 0: a freeze, a hold, a stall.

A fine-tune that freezes its backbone by giving its param group lr=0 while
the head trains in the same optimizer, the backbone and head called apart
(so ``trainwatch run`` watches the backbone as a model of its own), was told
"training changes nothing" at step 199 and failed ``--fail-on warning``: a
part frozen by its learning rate on purpose is a freeze, as with
``requires_grad=False``, and is silent now. A run whose every learning rate a
schedule holds at exactly 0 for a stretch (Adam's second moments gathered at
lr 0 first, a per-epoch warm-up whose epoch 0 runs at 0) was told the same
and the warning stood after training started: it is told now as what it is
(every learning rate exactly 0 since step N, held there by the scheduler),
and withdrawn by an info note once the model moves again, so the gate passes.
A stall that lasts (a schedule returning 0 for the whole run, every group at
lr 0, a per-epoch scheduler stepped every batch) is told and stands. Each
under ``tw.watch``, ``trainwatch run`` of an unmodified script and the
Lightning callback.
"""

from __future__ import annotations

import io
import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import trainwatch as tw
from trainwatch.alert import Alert, standing_worst
from trainwatch.runner import EXIT_ALERTS, run_script

# A re-run every 20 steps, verdicts from step 40.
SHORT = {"every": 20, "warmup": 40, "loss_window": 10}


def _stalls(alerts: list[dict]) -> list[dict]:
    return [a for a in alerts if a["rule"] == "stalled_training"]


def _standing(alerts: list[dict]) -> str | None:
    """The worst severity still standing at the end (what ``--fail-on`` judges)."""
    told = [Alert.from_dict(a) for a in alerts]
    return standing_worst((alert, alert.step) for alert in told)


def _data(n: int = 2000, features: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=gen)
    return x, (x[:, :5] @ torch.randn(5, 4, generator=gen)).argmax(1)


# -- a plain loop under tw.watch ---------------------------------------------------------------
def _backbone_and_head(backbone_lr: float, head_lr: float, raise_at: int | None) -> list[dict]:
    """The backbone watched on its own, its optimizer holding the head too (lr 0 for
    the backbone until ``raise_at``, then 2e-4); the two called one after the other."""
    torch.manual_seed(0)
    x, y = _data()
    backbone = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
    head = nn.Linear(64, 4)
    opt = torch.optim.AdamW(
        [
            {"params": backbone.parameters(), "lr": backbone_lr},
            {"params": head.parameters(), "lr": head_lr},
        ]
    )
    gen = torch.Generator().manual_seed(1)
    with tw.watch(backbone, opt, console=io.StringIO(), stalled_training=SHORT) as monitor:
        for step in range(120):
            if step == raise_at:
                opt.param_groups[0]["lr"] = 2e-4
            idx = torch.randint(0, len(x), (64,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(head(backbone(x[idx])), y[idx]).backward()
            opt.step()
    return [a.to_dict() for a in monitor.alerts]


def test_a_backbone_frozen_by_its_learning_rate_while_the_head_trains_is_no_stall():
    alerts = _backbone_and_head(0.0, 1e-3, raise_at=80)
    assert _stalls(alerts) == []
    # and frozen by it for the whole run
    assert _stalls(_backbone_and_head(0.0, 1e-3, raise_at=None)) == []


def test_a_backbone_whose_every_group_sits_at_0_with_its_head_is_a_stall():
    """Control: nothing in the optimizer trains, the head at lr 0 too."""
    alerts = _backbone_and_head(0.0, 0.0, raise_at=None)
    (stall,) = _stalls(alerts)
    assert stall["step"] == 39 and stall["severity"] == "warning"
    assert stall["data"]["cause"] == "learning_rate_zero"
    assert "every learning rate has been exactly 0 since step 0" in stall["message"]
    assert "as set in the optimizer's param groups" in stall["message"]
    assert _standing(alerts) == "warning"


def _held_at_zero(hold: int | None, steps: int = 140, optimizer: str = "adam") -> list[dict]:
    """LambdaLR returning 0 for the first ``hold`` steps (None: for ever), then 1."""
    torch.manual_seed(0)
    x, y = _data()
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.0 if hold is None or s < hold else 1.0
    )
    gen = torch.Generator().manual_seed(1)
    with tw.watch(model, opt, console=io.StringIO(), stalled_training=SHORT) as monitor:
        for _ in range(steps):
            idx = torch.randint(0, len(x), (64,), generator=gen)
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            sched.step()
            monitor.step(loss=loss.item())
    return [a.to_dict() for a in monitor.alerts]


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_hold_at_lr_0_is_told_plainly_and_withdrawn_once_the_model_moves(optimizer):
    alerts = _held_at_zero(60, optimizer=optimizer)
    warning, note = _stalls(alerts)
    assert warning["step"] == 39 and warning["severity"] == "warning"
    assert warning["data"]["cause"] == "learning_rate_zero"
    assert warning["data"]["zero_since"] == 0
    assert "every learning rate has been exactly 0 since step 0" in warning["message"]
    assert "held there by its scheduler (initial lr" in warning["message"]
    assert "every learning rate is exactly 0" in warning["hint"]
    # the first re-run after the rate rose at step 60 sees the model moving
    assert note["step"] == 79 and note["severity"] == "info"
    assert note["module"] == warning["module"] == ""
    assert note["data"]["kind"] == "resumed" and note["data"]["withdraws"] is True
    assert note["data"]["told_at"] == 39
    assert (note["data"]["zero_from"], note["data"]["zero_to"]) == (0, 60)
    assert note["data"]["change"] > 1e-3
    assert "no longer stands" in note["message"]
    assert _standing(alerts) == "info"


def test_a_schedule_returning_0_for_the_whole_run_stays_told():
    """Control: the same loop, held at 0 to the end: told, never withdrawn."""
    alerts = _held_at_zero(None)
    (warning,) = _stalls(alerts)
    assert warning["step"] == 39 and warning["data"]["cause"] == "learning_rate_zero"
    assert _standing(alerts) == "warning"


def test_a_per_epoch_scheduler_stepped_every_batch_stays_told():
    """Control: a real collapse (ExponentialLR(0.5) stepped every batch) is told
    and, the rate never rising again, stands to the end."""
    torch.manual_seed(0)
    x, y = _data()
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    gen = torch.Generator().manual_seed(1)
    with tw.watch(model, opt, console=io.StringIO(), stalled_training=SHORT) as monitor:
        for _ in range(200):
            idx = torch.randint(0, len(x), (64,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            sched.step()
    alerts = [a.to_dict() for a in monitor.alerts]
    stalls = _stalls(alerts)
    assert [a["data"].get("kind") for a in stalls] == ["learning_rate_collapsed"]
    assert _standing(alerts) == "warning"


@pytest.mark.parametrize(
    "collapse_steps, kind",
    [(20, "learning_rate_collapsed"), (10**6, None)],  # None: updates_stopped's
)
def test_updates_stopped_then_restarted_are_withdrawn_whichever_told_them(collapse_steps, kind):
    """The rate at 0 from step 30 to step 100 after real training: told by the look
    at the rates (a collapse) or, that look put off, by the updates that stopped;
    either is withdrawn once the rate is back and the weights move."""
    torch.manual_seed(0)
    x, y = _data()
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0 if 30 <= s < 100 else 1.0)
    config = {**SHORT, "lr_collapse_steps": collapse_steps}
    gen = torch.Generator().manual_seed(1)
    with tw.watch(model, opt, console=io.StringIO(), stalled_training=config) as monitor:
        for _ in range(160):
            idx = torch.randint(0, len(x), (64,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            sched.step()
    alerts = [a.to_dict() for a in monitor.alerts]
    warning, note = _stalls(alerts)
    assert warning["severity"] == "warning" and warning["data"].get("kind") == kind
    if kind is None:
        assert warning["data"]["criterion"] == "updates_stopped"
        assert "every learning rate is 0 since step 30" in warning["message"]
    assert note["step"] == 119 and note["data"]["kind"] == "resumed"
    assert note["data"]["told_at"] == warning["step"] and note["data"]["withdraws"] is True
    assert (note["data"]["zero_from"], note["data"]["zero_to"]) == (30, 100)
    assert _standing(alerts) == "info"


# -- trainwatch run of an unmodified script ----------------------------------------------------
SCRIPT = """
import sys
import torch, torch.nn as nn, torch.nn.functional as F

variant = sys.argv[1]
torch.manual_seed(0)
X = torch.randn(2000, 32); Y = (X[:, :8] @ torch.randn(8, 4)).argmax(1)
if variant.startswith("parts"):
    backbone = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
    head = nn.Linear(128, 4)
    head_lr = 0.0 if variant == "parts-all-0" else 1e-3
    opt = torch.optim.AdamW([{"params": backbone.parameters(), "lr": 0.0},
                             {"params": head.parameters(), "lr": head_lr}])
    for step in range(140):
        if step == 80 and variant == "parts":
            opt.param_groups[0]["lr"] = 2e-4   # the freeze by lr over
        idx = torch.randint(0, 2000, (64,))
        opt.zero_grad()
        F.cross_entropy(head(backbone(X[idx])), Y[idx]).backward()
        opt.step()
else:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    hold = {"hold": 60, "hold-for-ever": 10**9}[variant]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0 if s < hold else 1.0)
    for step in range(140):
        idx = torch.randint(0, 2000, (64,))
        opt.zero_grad()
        F.cross_entropy(model(X[idx]), Y[idx]).backward()
        opt.step(); sched.step()
"""


def _run(tmp_path: Path, variant: str) -> tuple[int, list[dict]]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    log_dir = tmp_path / variant
    status = run_script(
        script,
        [variant],
        log_dir=log_dir,
        console=False,
        config={"stalled_training": SHORT},
        fail_on="warning",
    )
    lines = (log_dir / "alerts.jsonl").read_text().splitlines() if log_dir.exists() else []
    return status, [json.loads(line) for line in lines if line.strip()]


@pytest.mark.slow
def test_trainwatch_run_of_a_backbone_frozen_by_lr_beside_its_head_passes(tmp_path):
    status, alerts = _run(tmp_path, "parts")
    assert _stalls(alerts) == []
    assert status == 0


@pytest.mark.slow
def test_trainwatch_run_of_a_backbone_and_head_both_at_lr_0_fails(tmp_path):
    """Control: the head at lr 0 as well, nothing trains."""
    status, alerts = _run(tmp_path, "parts-all-0")
    stalls = _stalls(alerts)
    assert stalls and all(a["severity"] == "warning" for a in stalls)
    assert stalls[0]["data"]["cause"] == "learning_rate_zero"
    assert status == EXIT_ALERTS


@pytest.mark.slow
def test_trainwatch_run_of_an_adam_warm_start_at_lr_0_passes_once_it_trains(tmp_path):
    status, alerts = _run(tmp_path, "hold")
    warning, note = _stalls(alerts)
    assert warning["step"] == 39 and warning["data"]["cause"] == "learning_rate_zero"
    assert note["step"] == 79 and note["data"]["withdraws"] is True
    assert status == 0


@pytest.mark.slow
def test_trainwatch_run_of_a_hold_at_lr_0_for_the_whole_run_fails(tmp_path):
    status, alerts = _run(tmp_path, "hold-for-ever")
    (warning,) = _stalls(alerts)
    assert warning["data"]["cause"] == "learning_rate_zero"
    assert status == EXIT_ALERTS


# -- the Lightning callback ------------------------------------------------------------------
LIGHTNING = """
import sys
import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from trainwatch.lightning import TrainWatchCallback

hold, log_dir = int(sys.argv[1]), sys.argv[2]
pl.seed_everything(0, verbose=False)
X = torch.randn(640, 20); Y = (X[:, :5] @ torch.randn(5, 4)).argmax(1)


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0 if s < hold else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


trainer = pl.Trainer(
    max_epochs=14, accelerator="cpu", logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
    callbacks=[TrainWatchCallback(log_dir=log_dir, console=False, stalled_training=SHORT)],
)
trainer.fit(Classifier(), DataLoader(TensorDataset(X, Y), batch_size=64, shuffle=True))
"""


def _lightning(tmp_path: Path, hold: int) -> list[dict]:
    script = tmp_path / "lit.py"
    script.write_text(f"SHORT = {SHORT!r}\n" + LIGHTNING)
    log_dir = tmp_path / "log"
    saved = sys.argv
    sys.argv = [str(script), str(hold), str(log_dir)]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved
    return [json.loads(line) for line in (log_dir / "alerts.jsonl").open() if line.strip()]


@pytest.mark.slow
def test_the_callback_withdraws_the_stall_of_a_hold_at_lr_0_once_the_model_moves(tmp_path):
    alerts = _lightning(tmp_path, hold=60)
    warning, note = _stalls(alerts)
    assert warning["step"] == 39 and warning["data"]["cause"] == "learning_rate_zero"
    assert "held there by its scheduler" in warning["message"]
    assert note["step"] == 79 and note["data"]["kind"] == "resumed"
    assert _standing(alerts) == "info"


@pytest.mark.slow
def test_the_callback_keeps_the_stall_of_a_schedule_at_0_for_the_whole_run(tmp_path):
    alerts = _lightning(tmp_path, hold=10**9)
    (warning,) = _stalls(alerts)
    assert warning["data"]["cause"] == "learning_rate_zero"
    assert _standing(alerts) == "warning"
