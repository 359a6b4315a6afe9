"""stalled_training of a model called through its parts: one part trains, another not.

A LightningModule with manual optimization and no ``forward`` of its own
calls ``self.head(self.backbone(x))``; a ``zero_grad()`` planted between the
head's backward and its step (after ``self.clip_gradients``) keeps the head
from training, which zero_gradient tells at step 0. A second alert followed,
"training changes nothing" at step 199, judged on the head's pass alone while
the backbone trained and the model's output moved; and only when the loop
clipped, as the step gathered again after the reset lost the loss the loop
had handed over. Each part's pass is measured now (the model moves as far as
its part that moved most), and the regathered step keeps the loss: no stall
while a part trains. A model whose every part stands still (the backbone at
lr 0 too) is still told. Under the Lightning callback, ``trainwatch run`` (the
loss out of reach) and a plain loop under ``tw.watch``.
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
from trainwatch.runner import run_script

SHORT = {"every": 20, "warmup": 40, "loss_window": 10}


def _rules(alerts: list[dict]) -> list[tuple[str, str]]:
    return sorted({(a["rule"], a["module"]) for a in alerts})


def _stalls(alerts: list[dict]) -> list[dict]:
    return [a for a in alerts if a["rule"] == "stalled_training"]


LIGHTNING = """
import sys
import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

backbone_lr = float(sys.argv[1])
pl.seed_everything(31, verbose=False)
X = torch.randn(3200, 24); Y = (X[:, :6] @ torch.randn(6, 4)).argmax(1)


class Lit(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.backbone = nn.Sequential(nn.Linear(24, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU())
        self.head = nn.Linear(96, 4)

    def training_step(self, batch, i):
        opt_head, opt_bb = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.head(self.backbone(x)), y)
        opt_head.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt_head, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt_head.zero_grad()                     # the bug: the head never trains
        opt_head.step()
        if (i + 1) % 4 == 0:
            opt_bb.step(); opt_bb.zero_grad()

    def configure_optimizers(self):
        return [torch.optim.SGD(self.head.parameters(), lr=0.05),
                torch.optim.Adam(self.backbone.parameters(), lr=backbone_lr)]


callbacks = []
if len(sys.argv) > 2:  # the callback instead of trainwatch run
    from trainwatch.lightning import TrainWatchCallback
    callbacks.append(TrainWatchCallback(log_dir=sys.argv[2], console=False, stalled_training=SHORT))
trainer = pl.Trainer(max_epochs=3, accelerator="cpu", callbacks=callbacks, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(Lit(), DataLoader(TensorDataset(X, Y), batch_size=64, shuffle=True))
"""


def _callback(tmp_path: Path, backbone_lr: float) -> list[dict]:
    script = tmp_path / "lit.py"
    script.write_text(f"SHORT = {SHORT!r}\n" + LIGHTNING)
    log_dir = tmp_path / "log"
    saved = sys.argv
    sys.argv = [str(script), str(backbone_lr), str(log_dir)]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved
    return [json.loads(line) for line in (log_dir / "alerts.jsonl").open() if line.strip()]


def _run(tmp_path: Path, backbone_lr: float) -> list[dict]:
    script = tmp_path / "lit.py"
    script.write_text(f"SHORT = {SHORT!r}\n" + LIGHTNING)
    log_dir = tmp_path / "log"
    config = {"stalled_training": SHORT}
    assert (
        run_script(script, [str(backbone_lr)], log_dir=log_dir, console=False, config=config) == 0
    )
    return [json.loads(line) for line in (log_dir / "alerts.jsonl").open() if line.strip()]


@pytest.mark.slow
def test_the_callback_tells_the_wiped_head_and_no_stall_while_the_backbone_trains(tmp_path):
    alerts = _callback(tmp_path, 5e-4)
    assert _rules(alerts) == [("zero_gradient", "head")]


@pytest.mark.slow
def test_the_callback_tells_a_stall_where_the_backbone_stands_still_too(tmp_path):
    """Control: the backbone at lr 0, nothing moves; the loss the loop handed over
    reaches the rule although the step was gathered again after the clip."""
    alerts = _callback(tmp_path, 0.0)
    (stall,) = _stalls(alerts)
    assert stall["step"] == 39 and stall["data"]["criterion"] == "output_change"
    assert "the loss flat (" in stall["message"]
    assert ("zero_gradient", "head") in _rules(alerts)


@pytest.mark.slow
def test_trainwatch_run_measures_every_part_where_the_loss_is_out_of_reach(tmp_path):
    alerts = _run(tmp_path, 5e-4)
    assert _stalls(alerts) == []
    assert ("zero_gradient", "head") in _rules(alerts)


@pytest.mark.slow
def test_trainwatch_run_tells_a_stall_where_no_part_moves(tmp_path):
    """Control: the same under trainwatch run, the backbone at lr 0."""
    (stall,) = _stalls(_run(tmp_path, 0.0))
    assert stall["step"] == 39 and stall["data"]["criterion"] == "output_change"


# -- a plain loop under tw.watch ---------------------------------------------------------------
def _parts_loop(backbone_lr: float, wipe_head: bool) -> list[dict]:
    """A model of two parts called one after the other, each with its optimizer;
    the head clipped, then (the bug) its gradients wiped before its step."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 24, generator=gen)
    y = (x[:, :6] @ torch.randn(6, 4, generator=gen)).argmax(1)
    model = nn.ModuleDict(
        {
            "backbone": nn.Sequential(nn.Linear(24, 96), nn.ReLU(), nn.Linear(96, 96), nn.ReLU()),
            "head": nn.Linear(96, 4),
        }
    )
    opt_head = torch.optim.SGD(model["head"].parameters(), lr=0.05)
    opt_bb = torch.optim.Adam(model["backbone"].parameters(), lr=backbone_lr)
    with tw.watch(
        model, [opt_head, opt_bb], console=io.StringIO(), stalled_training=SHORT
    ) as monitor:
        for _ in range(100):
            idx = torch.randint(0, len(x), (64,), generator=gen)
            opt_head.zero_grad()
            opt_bb.zero_grad()
            loss = F.cross_entropy(model["head"](model["backbone"](x[idx])), y[idx])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model["head"].parameters(), 1.0)
            if wipe_head:
                opt_head.zero_grad()
            opt_head.step()
            opt_bb.step()
    return [a.to_dict() for a in monitor.alerts]


def test_a_plain_loop_whose_backbone_trains_beside_a_wiped_head_tells_no_stall():
    alerts = _parts_loop(5e-4, wipe_head=True)
    assert ("zero_gradient", "head") in _rules(alerts)
    assert _stalls(alerts) == []


def test_a_plain_loop_whose_parts_both_stand_still_is_a_stall():
    """Control: the backbone at lr 0 beside the wiped head."""
    alerts = _parts_loop(0.0, wipe_head=True)
    (stall,) = _stalls(alerts)
    assert stall["data"]["criterion"] == "output_change"


def test_a_plain_loop_of_two_healthy_parts_is_silent():
    """Control: no bug at all."""
    alerts = _parts_loop(5e-4, wipe_head=False)
    assert _stalls(alerts) == [] and ("zero_gradient", "head") not in _rules(alerts)
