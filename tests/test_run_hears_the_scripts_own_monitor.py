"""``trainwatch run`` counts the alerts of a script's own ``tw.watch`` or callback.

A script that watches its model itself keeps its monitor: the run's own
gives way to it. Its alerts used to stay with it, so ``--fail-on warning``
exited 0 over a frozen layer the script's callback had reported, and the
run's ``alerts.jsonl`` and counts said nothing. They are the run's findings
too: the gate, the run's files and its summary hear them (its console does
not: the script's own monitor printed them already).
"""

from __future__ import annotations

import json

import pytest

from trainwatch.runner import EXIT_ALERTS, run_script

WATCHED = """
import sys
import torch
from torch import nn
import trainwatch as tw

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
if sys.argv[1] == "frozen":
    model[0].requires_grad_(False)
opt = torch.optim.Adam(model.parameters(), 1e-3)
with tw.watch(model, opt, console=False):
    for _ in range(10):
        x = torch.randn(32, 8)
        loss = nn.functional.mse_loss(model(x), x[:, :1])
        if sys.argv[1] != "noreset":
            opt.zero_grad()
        loss.backward()
        opt.step()
"""

CALLBACK = """
import sys
import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainwatch.lightning import TrainWatchCallback


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        if sys.argv[1] == "frozen":
            self.net[0].requires_grad_(False)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), 1e-3)


torch.manual_seed(0)
x = torch.randn(128, 8)
pl.Trainer(
    max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
    callbacks=[TrainWatchCallback(console=False, log_dir=sys.argv[2])],
).fit(Regressor(), DataLoader(TensorDataset(x, x[:, :1]), batch_size=32))
"""


@pytest.mark.parametrize("script", ["watched", "callback"])
@pytest.mark.parametrize("variant", ["frozen", "clean"])
def test_the_gate_and_the_runs_files_hear_the_scripts_own_alerts(tmp_path, script, variant):
    path = tmp_path / f"{script}.py"
    path.write_text(WATCHED if script == "watched" else CALLBACK)
    code = run_script(
        path,
        [variant, str(tmp_path / "own")],
        log_dir=tmp_path / "run",
        console=False,
        fail_on="warning",
    )
    lines = (tmp_path / "run" / "alerts.jsonl").read_text().splitlines()
    found = [(a["rule"], a["module"]) for a in map(json.loads, lines)]
    counts = json.loads((tmp_path / "run" / "alert_counts.json").read_text())["counts"]
    if variant == "frozen":
        assert code == EXIT_ALERTS
        assert found == [("frozen_in_optimizer", "0" if script == "watched" else "net.0")]
        assert [c["count"] for c in counts] == [1]  # relayed twice by a callback, told once
    else:
        assert code == 0
        assert found == [] and counts == []


def test_the_runs_counts_and_steps_follow_the_scripts_own_monitor(tmp_path):
    """A missing zero_grad fires at every step from step 1: the run's counts say how
    often, over the script's own monitor's 10 steps."""
    path = tmp_path / "watched.py"
    path.write_text(WATCHED)
    code = run_script(path, ["noreset"], log_dir=tmp_path / "run", console=False)
    assert code == 0  # no --fail-on: the script's own status
    counts = json.loads((tmp_path / "run" / "alert_counts.json").read_text())
    assert counts["steps"] == 10
    assert [(c["rule"], c["first_step"], c["last_step"], c["count"]) for c in counts["counts"]] == [
        ("accumulated_gradient", 1, 9, 9)
    ]
