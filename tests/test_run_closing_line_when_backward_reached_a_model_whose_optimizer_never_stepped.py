"""``trainwatch run`` on a script whose model ran and was backpropagated through, but
whose optimizer never stepped, closes with a line that says so.

A Lightning script in manual optimisation that forgets ``opt.step()`` (without the
trainwatch callback of its own), or a plain loop that forgets it, ended the run
with "no optimizer stepped and no backward pass reached a model": backward passes
did reach it. The run now says what ``tw.watch`` says of such a loop: the model
ran, backward reached it, its optimizer never stepped. The healthy scripts
(automatic and manual optimisation stepping, the plain loop stepping) close with
their step count, and a script that only ran the model forward keeps the run's
usual line.
"""

from __future__ import annotations

import pytest

from tests.run_script import stderr_under_run

NEVER_STEPPED = (
    "trainwatch: no training step watched: {model} ran 8 forward passes and backward "
    "passes reached it, but its optimizer never stepped"
)
NOTHING_WATCHED = "no training step watched"
NO_BACKWARD = "no backward pass reached a model"

LIGHTNING = """
import sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning.pytorch as pl

torch.set_num_threads(1)
torch.manual_seed(0)


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = "automatic" in sys.argv
        self.fc1 = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.fc1(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        if "step" in sys.argv:
            opt.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


x = torch.randn(64, 8)
trainer = pl.Trainer(
    accelerator="cpu", max_epochs=1, enable_progress_bar=False, logger=False,
    enable_checkpointing=False, enable_model_summary=False,
)
trainer.fit(Net(), DataLoader(TensorDataset(x, x[:, :1]), batch_size=8))
"""

LOOP = """
import sys
import torch
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(8):
    x = torch.randn(8, 8)
    if "forward" in sys.argv:
        with torch.no_grad():
            model(x)
        continue
    loss = nn.functional.mse_loss(model(x), x[:, :1])
    opt.zero_grad()
    loss.backward()
    if "step" in sys.argv:
        opt.step()
"""


@pytest.mark.slow
def test_lightning_manual_optimisation_without_opt_step_closes_with_its_optimizer_never_stepped(
    tmp_path,
):
    err = stderr_under_run(tmp_path, LIGHTNING, "manual")
    assert NEVER_STEPPED.format(model="Net") in err, err
    assert err.count(NOTHING_WATCHED) == 1 and NO_BACKWARD not in err


@pytest.mark.slow
@pytest.mark.parametrize("optimisation", [("manual", "step"), ("automatic",)])
def test_control_lightning_stepping_closes_with_its_steps(tmp_path, optimisation):
    err = stderr_under_run(tmp_path, LIGHTNING, *optimisation)
    assert NOTHING_WATCHED not in err and "8 steps watched" in err, err


@pytest.mark.slow
def test_a_loop_without_opt_step_closes_with_its_optimizer_never_stepped(tmp_path):
    err = stderr_under_run(tmp_path, LOOP)
    assert NEVER_STEPPED.format(model="Sequential") in err, err
    assert err.count(NOTHING_WATCHED) == 1 and NO_BACKWARD not in err


@pytest.mark.slow
def test_control_a_stepping_loop_closes_with_its_steps(tmp_path):
    err = stderr_under_run(tmp_path, LOOP, "step")
    assert NOTHING_WATCHED not in err and "8 steps watched" in err, err


@pytest.mark.slow
def test_control_a_loop_that_only_runs_the_model_forward_keeps_the_runs_line(tmp_path):
    err = stderr_under_run(tmp_path, LOOP, "forward")
    assert err.count(NOTHING_WATCHED) == 1 and NO_BACKWARD in err, err
    assert "never stepped" not in err
