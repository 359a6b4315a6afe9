"""A Lightning loop that clips its own gradients in manual optimization is seen whole.

With ``self.automatic_optimization = False`` the loop clips between
``self.manual_backward(loss)`` and ``opt.step()`` (``self.clip_gradients`` or
``clip_grad_norm_``), and Lightning then steps through
``optimizer.step(closure)``. The step was gathered before the clip, as in a
plain loop, but the closure step dropped that gathering and the step was
gathered again after the clip: with no pass since, the model's pass looked
unseen (as if compiled in place, or run in parts), and what it found was lost.
A broadcast in the loss went untold, and a NaN born in the forward was told as
a gradient no hook saw made. The same happened under ``trainwatch run`` and,
with a GradScaler ("16-mixed"), to every Lightning loop, clipping or not:
Lightning steps there after its hook, without a closure.

Each planted bug has its healthy loop beside it, silent.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

from trainwatch.runner import run_script

NAN_AT = 3

SCRIPT = f"""
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

# BUG: none | broadcast | nan; CLIP: none | clip_gradients | clip_grad_norm_ |
# clip_in_closure; MODE: manual | auto; PRECISION: 32 | 16-mixed;
# LOG_DIR: the callback's, or "-" under trainwatch run.
BUG, CLIP, MODE, PRECISION, LOG_DIR = sys.argv[1:6]


class Features(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.poisoned = False

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return torch.log(h - 0.5) if self.poisoned else h  # NaN where h < 0.5


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = MODE == "auto"
        self.features = Features()
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.features(x))

    def loss(self, batch):
        x, y = batch
        self.features.poisoned = BUG == "nan" and self.global_step == {NAN_AT}
        out = self(x)
        # (N, 1) against (N,): every sample paired with every other's target.
        return F.mse_loss(out.float(), y if BUG == "broadcast" else y.unsqueeze(-1))

    def clip(self, opt):
        if CLIP in ("clip_gradients", "clip_in_closure"):
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        elif CLIP == "clip_grad_norm_":
            torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)

    def training_step(self, batch, batch_idx):
        if MODE == "auto":
            return self.loss(batch)
        opt = self.optimizers()

        def closure():
            opt.zero_grad()
            loss = self.loss(batch)
            self.manual_backward(loss)
            self.clip(opt)
            return loss

        if CLIP == "clip_in_closure":
            opt.step(closure=closure)
            return None
        opt.zero_grad()
        self.manual_backward(self.loss(batch))
        self.clip(opt)
        opt.step()
        return None

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


torch.manual_seed(0)
x = torch.randn(256, 8)
callbacks = []
if LOG_DIR != "-":
    from trainwatch.lightning import TrainWatchCallback

    callbacks.append(TrainWatchCallback(log_dir=LOG_DIR, console=False))
options = dict(
    accelerator="cpu",
    max_steps=8,
    callbacks=callbacks,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
if MODE == "auto" and CLIP != "none":
    options["gradient_clip_val"] = 1.0
if PRECISION == "16-mixed":
    options["plugins"] = [MixedPrecision("16-mixed", "cpu")]
pl.Trainer(**options).fit(Net(), DataLoader(TensorDataset(x, x[:, 0].sin()), batch_size=32))
"""

CLIPS = ["clip_gradients", "clip_grad_norm_", "clip_in_closure"]


def _script(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def _alerts(log_dir: Path) -> list[tuple[str, str | None, int]]:
    lines = (log_dir / "alerts.jsonl").read_text().splitlines()
    return [(a["rule"], a["module"], a["step"]) for a in map(json.loads, lines)]


def _with_callback(tmp_path, monkeypatch, bug, clip, mode="manual", precision="32"):
    log_dir = tmp_path / "log"
    args = [bug, clip, mode, precision, str(log_dir)]
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    runpy.run_path(str(_script(tmp_path)), run_name="__main__")
    return _alerts(log_dir)


def _under_run(tmp_path, bug, clip, fail_on="never"):
    log_dir = tmp_path / "log"
    run_script(
        _script(tmp_path),
        [bug, clip, "manual", "32", "-"],
        log_dir=log_dir,
        console=False,
        fail_on=fail_on,
    )
    return _alerts(log_dir)


@pytest.mark.parametrize("clip", CLIPS)
def test_a_broadcast_loss_is_told_when_the_manual_loop_clips(tmp_path, monkeypatch, clip):
    assert _with_callback(tmp_path, monkeypatch, "broadcast", clip)[:1] == [("broadcast", None, 0)]


@pytest.mark.parametrize("clip", CLIPS)
def test_a_nan_born_in_forward_is_told_where_when_the_manual_loop_clips(
    tmp_path, monkeypatch, clip
):
    found = _with_callback(tmp_path, monkeypatch, "nan", clip)
    assert found[:1] == [("nonfinite_forward", "features", NAN_AT)]
    assert not any(rule == "nonfinite_backward" for rule, _, _ in found)


@pytest.mark.parametrize("clip", [*CLIPS, "none"])
def test_the_healthy_manual_loop_is_silent_with_or_without_its_clip(tmp_path, monkeypatch, clip):
    assert _with_callback(tmp_path, monkeypatch, "none", clip) == []


def test_the_manual_loop_without_a_clip_tells_the_same(tmp_path, monkeypatch):
    """The loop these were measured against: told right before the fix too."""
    assert _with_callback(tmp_path, monkeypatch, "broadcast", "none")[:1] == [
        ("broadcast", None, 0)
    ]


@pytest.mark.parametrize("mode", ["manual", "auto"])
def test_a_broadcast_loss_is_told_under_a_grad_scaler(tmp_path, monkeypatch, mode):
    found = _with_callback(tmp_path, monkeypatch, "broadcast", "clip_gradients", mode, "16-mixed")
    assert found[:1] == [("broadcast", None, 0)]


@pytest.mark.parametrize("mode", ["manual", "auto"])
def test_the_healthy_loop_under_a_grad_scaler_is_silent(tmp_path, monkeypatch, mode):
    assert _with_callback(tmp_path, monkeypatch, "none", "clip_gradients", mode, "16-mixed") == []


def test_trainwatch_run_tells_a_broadcast_and_a_nan_of_a_manual_loop_that_clips(tmp_path):
    assert _under_run(tmp_path / "a", "broadcast", "clip_gradients")[:1] == [("broadcast", None, 0)]
    found = _under_run(tmp_path / "b", "nan", "clip_grad_norm_")
    assert found[:1] == [("nonfinite_forward", "features", NAN_AT)]


def test_trainwatch_run_of_the_healthy_manual_loop_that_clips_is_silent(tmp_path):
    assert _under_run(tmp_path, "none", "clip_gradients", fail_on="warning") == []
