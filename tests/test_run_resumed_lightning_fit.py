"""``trainwatch run`` on a Lightning fit resumed from a checkpoint: steps go on from it.

The callback dates alerts by Lightning's ``global_step``, which a resumed fit
takes from its checkpoint; under ``trainwatch run`` the model's monitor, new in
the second process, counted from 0, so a bug planted at global step 40 was
told at step 10.
"""

from __future__ import annotations

import pytest

from tests.resumed_runs import warnings_of_both_runs

SCRIPT = """
import sys
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

phase, bug, folder = sys.argv[1], sys.argv[2], sys.argv[3]


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(F.relu(self.fc1(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        if bug == "no_zero_grad" and self.global_step >= 40:
            return
        optimizer.zero_grad()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


torch.manual_seed(0)
x = torch.randn(512, 16)
data = DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=32, shuffle=True)
checkpoints = ModelCheckpoint(dirpath=folder, save_last=True, every_n_train_steps=10)
trainer = pl.Trainer(
    max_steps=30 if phase == "first" else 60, accelerator="cpu", logger=False,
    callbacks=[checkpoints], enable_progress_bar=False, enable_model_summary=False,
    num_sanity_val_steps=0,
)
trainer.fit(Net(), data, ckpt_path=None if phase == "first" else f"{folder}/last.ckpt")
"""


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["no_zero_grad", "healthy"])
def test_a_resumed_fit_dates_its_alerts_by_the_checkpoints_global_step(tmp_path, bug):
    first, resumed = warnings_of_both_runs(tmp_path, SCRIPT, bug)
    assert first == []
    assert resumed == ([("accumulated_gradient", 40)] if bug == "no_zero_grad" else [])
