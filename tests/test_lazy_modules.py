"""A model with lazy modules (``nn.LazyLinear``) is watched like any other.

A lazy module's parameters are ``UninitializedParameter`` until its first
call: any op on one (a tensor hook, ``numel()``) raises. Watched before that
first call, the model crashed ``tw.watch`` and turned the Lightning callback
and ``trainwatch run`` off for the run, so a missing ``zero_grad`` went
unreported. Nothing is asked of such a parameter before its module has run:
the setup table waits for the first step.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import batches, rules_of
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script


def lazy_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LazyLinear(1))


def _loop(model: nn.Module, opt: torch.optim.Optimizer, steps: int, reset: bool) -> None:
    for x, y in batches(steps):
        if reset:
            opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("reset", [True, False], ids=["healthy", "zero_grad_missing"])
def test_a_lazy_model_watched_before_its_first_call(quiet_watch, reset):
    model = lazy_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _loop(model, opt, 20, reset)
    assert rules_of(monitor) == ([] if reset else ["accumulated_gradient"])
    if not reset:
        assert monitor.alerts[0].step == 1
    audit = monitor.setup_audit
    assert audit is not None and audit.trainable == 8 * 16 + 16 + 16 + 1  # sized once run
    assert set(monitor.grad_norms()) == {"0", "2"}


class _LazyModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = lazy_net()

    def training_step(self, batch, index):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_lazy_lightning_module_is_watched(tmp_path):
    x = torch.randn(640, 8)
    data = DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=32)
    callback = TrainWatchCallback(console=False)
    trainer = L.Trainer(
        max_steps=20,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        default_root_dir=tmp_path,
    )
    trainer.fit(_LazyModule(), data)
    monitor = callback.monitor
    assert monitor is not None and monitor.step_count == 20
    assert rules_of(monitor) == []
    assert set(monitor.grad_norms()) == {"net.0", "net.2"}


SCRIPT = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LazyLinear(1))
model(torch.zeros(2, 8))  # the dry run that sizes the lazy layer
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(20):
    x = torch.randn(32, 8)
    if sys.argv[1] == "reset":
        opt.zero_grad()
    nn.functional.mse_loss(model(x), x[:, :1].sin()).backward()
    opt.step()
"""


@pytest.mark.parametrize("how", ["reset", "forgot"])
def test_trainwatch_run_watches_a_lazy_model_sized_by_a_dry_run(tmp_path, how):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_script(script, [how], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = {(a["rule"], a["step"]) for a in map(json.loads, lines) if a["severity"] != "info"}
    assert found == (set() if how == "reset" else {("accumulated_gradient", 1)})
    counts = json.loads((tmp_path / "log" / "alert_counts.json").read_text())
    assert counts["steps"] == 20
