"""Bugs that begin mid-run, after hundreds of healthy steps, under a Lightning Trainer.

The Lightning side of test_bugs_that_begin_mid_run.py: a classifier with batch
norm and dropout trains 420 steps, healthy until step ``S`` = 350 (the first
step of its sixth epoch), where a bug written into its hooks begins. The same
fit without the bug says nothing.
"""

from __future__ import annotations

import io

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.lightning_models import quiet_trainer
from trainwatch.alert import Alert
from trainwatch.lightning import TrainWatchCallback

S = 350  # the first step the bug touches: 5 epochs of 70 batches
BATCHES = 70
STEPS = 420

pytestmark = pytest.mark.filterwarnings(
    "ignore:The '(train|val)_dataloader' does not have many workers"
)


class Classifier(pl.LightningModule):
    def __init__(self, bug: str | None) -> None:
        super().__init__()
        self.bug = bug
        self.fc1 = nn.Linear(16, 64)
        self.bn = nn.BatchNorm1d(64)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.act(self.bn(self.fc1(x)))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer) -> None:
        # The reset put under the warm-up epochs' check: none from epoch 5 on.
        if self.bug != "zero_grad_in_warmup_epochs" or epoch < S // BATCHES:
            optimizer.zero_grad()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)
        # A decay at step S, its factor typed as 1e3 where 1e-3 was meant.
        gamma = 1e3 if self.bug == "scheduler_factor_typo" else 1e-3
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[S], gamma=gamma)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(BATCHES * 16, 16, generator=gen)
        y = (x @ torch.randn(16, 4, generator=gen)).argmax(1)
        return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=gen)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        # Every 25 updates, the batch's accuracy in eval mode (a quick probe).
        if self.global_step % 25 == 0:
            self.eval()
            with torch.no_grad():
                (self(batch[0]).argmax(1) == batch[1]).float().mean()
            if not (self.bug == "probe_left_in_eval" and self.global_step >= S):
                self.train()


def fit(bug: str | None, tmp_path) -> list[Alert]:
    torch.manual_seed(0)
    callback = TrainWatchCallback(console=io.StringIO())
    trainer = quiet_trainer(
        tmp_path, [callback], max_steps=STEPS, limit_val_batches=0, num_sanity_val_steps=0
    )
    trainer.fit(Classifier(bug))
    return callback.alerts


def told(alerts: list[Alert]) -> list[tuple[str, int, str | None]]:
    return [(a.rule, a.step, a.module) for a in alerts]


@pytest.mark.slow
def test_the_clean_fit_says_nothing(tmp_path):
    assert fit(None, tmp_path) == []


@pytest.mark.slow
def test_zero_grad_kept_to_the_warm_up_epochs_is_told_at_the_first_step_after(tmp_path):
    alerts = fit("zero_grad_in_warmup_epochs", tmp_path)
    assert told(alerts) == [("accumulated_gradient", S, None)]
    assert alerts[0].data["modules"] == ["fc1", "bn", "head"]


@pytest.mark.slow
def test_a_scheduler_factor_typo_is_an_exploding_gradient_the_next_step(tmp_path):
    """Step S's update is the first at 1000x the rate; the next step's gradients jump."""
    alerts = fit("scheduler_factor_typo", tmp_path)
    assert min(a.step for a in alerts) == S + 1
    assert (alerts[0].rule, alerts[0].step) == ("exploding_gradient", S + 1)
    assert alerts[0].module in {"fc1", "bn", "head"}


@pytest.mark.slow
def test_a_probe_that_leaves_the_module_in_eval_is_told_at_the_next_step(tmp_path):
    """The probe after update S (``global_step`` S) forgets ``train()``: step S,
    counted from 0, is the first trained in eval mode."""
    alerts = fit("probe_left_in_eval", tmp_path)
    assert told(alerts) == [("train_in_eval_mode", S, "bn")]
