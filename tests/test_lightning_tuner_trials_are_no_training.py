"""Lightning's tuners run trial steps that are no part of the fit, and are not judged.

The learning-rate finder (``Tuner.lr_find``, or the ``LearningRateFinder``
callback run inside the fit at chosen epochs, the Lightning docs' recipe) and
the batch-size scaler save a checkpoint, train a few trial steps, and load the
checkpoint back: weights, optimizer state and ``global_step`` return to where
they were. The range test raises the learning rate until the loss diverges, on
purpose. Judged as training, its steps gave exploding_gradient warnings to
healthy scripts, made a corrupt batch's NaN later read as "after
exploding_gradient, lower the learning rate", and under ``trainwatch run``
dated every fit step after the trials' (a NaN planted at step 20 told at 40). A
second ``Trainer`` fitting the same model was dated after the first's steps.

Each shape runs healthy (silent) and with a bug planted at a known step of the
fit, which must be told at that global_step.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

import trainwatch as tw
from trainwatch.runner import run_script

SCRIPT = r'''
import json
import sys
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateFinder
from lightning.pytorch.tuner import Tuner
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

kind, bug, watch, log_dir, config = sys.argv[1:6]
torch.manual_seed(0)
torch.set_num_threads(1)
X = torch.randn(256, 12)
Y = (X[:, :4] + 0.1 * torch.randn(256, 4)).argmax(1)
PLANTED = 20  # the fit's global_step a corrupt sample comes at (8 steps an epoch)


class Classifier(pl.LightningModule):
    """A small MLP: the learning-rate range test's divergence shows in its gradients."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
        )
        self.lr, self.batch_size, self.fitting = 0.05, 32, False

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if bug == "nan_input" and self.fitting and self.global_step == PLANTED:
            x = x.clone()
            x[0, 0] = float("inf")  # a corrupt sample
        out = self(x)
        if bug == "broadcast" and self.fitting:
            # (N, 1) against (N,): every pair, not each sample's own target
            gap = ((out.gather(1, y[:, None]) - out.max(1).values) ** 2).mean()
            return gap + F.cross_entropy(out, y)
        return F.cross_entropy(out, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(X, Y), batch_size=self.batch_size, shuffle=True)


class RangeTestAtEpochs(LearningRateFinder):
    """The Lightning docs' FineTuneLearningRateFinder: the range test inside the fit."""

    def on_fit_start(self, *args, **kwargs):
        return

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch in (0, 2):
            pl_module.fitting = False
            self.lr_find(trainer, pl_module)
            pl_module.fitting = True


def trainer(epochs, *extra):
    callbacks = list(extra)
    if watch == "callback":
        from trainwatch.lightning import TrainWatchCallback

        config_ = json.loads(config)
        callbacks.append(TrainWatchCallback(log_dir=log_dir, console=False, config=config_))
    return pl.Trainer(
        max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        num_sanity_val_steps=0, default_root_dir=log_dir,
    )


model = Classifier()
if kind == "lr_find":
    fit = trainer(3)
    Tuner(fit).lr_find(model, min_lr=1e-5, max_lr=100.0, num_training=20, update_attr=False)
    model.fitting = True
    fit.fit(model)
elif kind == "lr_find_in_fit":
    # No early stop: the loss runs away, as a range test let run to its end does.
    finder = RangeTestAtEpochs(
        min_lr=1e-5, max_lr=100.0, num_training_steps=20, early_stop_threshold=None
    )
    trainer(4, finder).fit(model)
elif kind == "scale_batch_size":
    fit = trainer(3)
    Tuner(fit).scale_batch_size(model, mode="power", steps_per_trial=3, init_val=8, max_trials=3)
    model.batch_size = 32
    model.fitting = True
    fit.fit(model)
elif kind == "second_trainer":
    trainer(2).fit(model)  # a first stage
    model.lr, model.fitting = 0.01, True
    trainer(3).fit(model)  # fine-tuned by a Trainer of its own
'''

# Short warm-ups, so the range test's divergence is judged within its 20 steps.
CONFIG = {"exploding_gradient": {"warmup": 5}}


def _alerts(log_dir: Path) -> list[dict]:
    path = log_dir / "alerts.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.open()]


def _run(tmp_path: Path, kind: str, bug: str, watch: str) -> tuple[int, list[dict]]:
    script = tmp_path / "tuned.py"
    script.write_text(SCRIPT)
    log_dir = tmp_path / "log"
    args = [kind, bug, watch, str(log_dir), json.dumps(CONFIG)]
    if watch == "run":
        code = run_script(script, args, log_dir=log_dir, config=CONFIG, console=False,
                          fail_on="warning")  # fmt: skip
    else:
        saved = sys.argv
        sys.argv = [str(script), *args]
        try:
            runpy.run_path(str(script), run_name="__main__")
        finally:
            sys.argv = saved
        code = 0
    return code, [a for a in _alerts(log_dir) if a["severity"] != "info"]


SHAPES = [
    ("lr_find", "run"),
    ("lr_find", "callback"),
    ("lr_find_in_fit", "callback"),
    ("lr_find_in_fit", "run"),
    ("scale_batch_size", "run"),
    ("second_trainer", "run"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "watch"), SHAPES)
def test_a_healthy_tuned_fit_is_silent(tmp_path, kind, watch):
    code, alerts = _run(tmp_path, kind, "healthy", watch)
    assert [(a["rule"], a["step"]) for a in alerts] == []
    assert code == 0


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "watch"), SHAPES)
def test_a_corrupt_sample_after_tuning_is_told_at_its_global_step(tmp_path, kind, watch):
    _, alerts = _run(tmp_path, kind, "nan_input", watch)
    assert [(a["rule"], a["step"]) for a in alerts] == [("nonfinite_forward", 20)]
    (alert,) = alerts
    assert alert["data"]["cause"] == "input"
    assert "after_exploding" not in alert["data"]
    assert alert["hint"].startswith("the data is bad")


@pytest.mark.slow
@pytest.mark.parametrize("watch", ["run", "callback"])
def test_a_bug_from_the_fits_first_step_is_told_there_after_the_batch_size_search(tmp_path, watch):
    _, alerts = _run(tmp_path, "scale_batch_size", "broadcast", watch)
    assert [(a["rule"], a["step"]) for a in alerts] == [("broadcast", 0)]


def test_a_corrupt_batch_after_exploding_gradients_keeps_the_data_hint():
    """Plain loop: exploding_gradient told first (a loss scaled up 1e4 times), then
    a NaN already in the model's input. No update grew the batch: the hint is the
    data's, not "lower the learning rate"."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    config = {"exploding_gradient": {"warmup": 5}}
    with tw.watch(model, opt, config=config, console=False) as monitor:
        for step in range(30):
            x, y = torch.randn(16, 8), torch.randn(16, 1)
            if step == 25:
                x[3, 2] = float("nan")
            loss = torch.nn.functional.mse_loss(model(x), y) * (1e4 if step == 20 else 1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
        alerts = monitor.alerts
    told = {(a.rule, a.step) for a in alerts if a.severity != "info"}
    assert ("exploding_gradient", 20) in told
    (nan,) = [a for a in alerts if a.rule == "nonfinite_forward"]
    assert nan.step == 25 and nan.data["cause"] == "input"
    assert "after_exploding" not in nan.data
    assert nan.hint.startswith("the data is bad")
