"""A pass with grad that no loss uses does not stand in for the pass backward reached.

People log a metric on another batch without ``no_grad``, or look at the next
state's value before the update: the model then runs with grad after the pass
whose loss is backpropagated. A NaN born in that backward is still located at
its module (the replay runs the pass backward reached, with what entered it).
The plain-loop and GradScaler cases are in ``test_nonfinite.py`` and
``test_amp_scaler_warmup.py``; here, Lightning, a batch-of-one loop and an
unmodified script under ``trainwatch run``.
"""

from __future__ import annotations

import io
import json

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from tests.test_nonfinite import Net, ZeroNorm, nonfinite
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script


class LoggingNet(pl.LightningModule):
    """Logs the output's mean on the batch's first rows, with grad on, before its loss."""

    def __init__(self, fault: nn.Module | None, armed_from: int) -> None:
        super().__init__()
        self.net = Net(fault, "middle")
        self.armed_from = armed_from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if isinstance(self.net.fault, ZeroNorm):
            self.net.fault.armed = batch_idx >= self.armed_from
        loss = nn.functional.mse_loss(self(x), y)
        self.log("first_rows", self(x[:3]).mean())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(48, 8, generator=gen)
        return DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=8)


def _lightning_alerts(tmp_path, fault: nn.Module | None) -> list[tw.Alert]:
    torch.manual_seed(0)
    callback = TrainWatchCallback(console=io.StringIO(), log_dir=str(tmp_path / "tw"))
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=1)
    trainer.fit(LoggingNet(fault, armed_from=3))
    return [a for a in callback.monitor.alerts if a.rule.startswith("nonfinite")]


def test_lightning_step_logging_a_grad_pass_locates_the_backward_fault(tmp_path):
    first = _lightning_alerts(tmp_path, ZeroNorm())[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_backward", 3, "net.fault")
    assert first.data["op"] == "aten::pow"


def test_lightning_step_logging_a_grad_pass_is_clean(tmp_path):
    assert _lightning_alerts(tmp_path, None) == []


def _batch_of_one_loop(model: Net, steps: int = 6) -> tw.Monitor:
    """A value-based loop on one state at a time: the next state's value is looked at
    with grad on (to pick an action), after the prediction the update uses."""
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        state = torch.randn(1, 8, generator=gen)
        for step in range(steps):
            if isinstance(model.fault, ZeroNorm):
                model.fault.armed = step >= 3
            value = model(state)
            following = torch.randn(1, 8, generator=gen)
            looked_at = model(following).item()  # grad on: never backpropagated
            target = torch.tensor([[0.5 + 0.9 * looked_at]])
            opt.zero_grad()
            nn.functional.mse_loss(value, target).backward()
            opt.step()
            state = following
    return monitor


def test_batch_of_one_loop_looking_ahead_with_grad_locates_the_backward_fault():
    torch.manual_seed(0)
    first = nonfinite(_batch_of_one_loop(Net(ZeroNorm(), "middle")))[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_backward", 3, "fault")
    assert first.data["op"] == "aten::pow"


def test_batch_of_one_loop_looking_ahead_with_grad_is_clean():
    torch.manual_seed(0)
    assert nonfinite(_batch_of_one_loop(Net())) == []


SCRIPT = """
import sys
import torch
from torch import nn


class ZeroNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        v = x - x if self.armed else x
        return x * (v * v).sum(dim=1, keepdim=True).pow(0.5)


class Net(nn.Module):
    def __init__(self, faulty):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fault = ZeroNorm() if faulty else nn.Identity()
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.fault(torch.tanh(self.fc1(x)))))


torch.manual_seed(0)
model = Net(sys.argv[1] == "faulty")
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(6):
    if sys.argv[1] == "faulty":
        model.fault.armed = step >= 3
    x, x_val = torch.randn(32, 8), torch.randn(8, 8)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), x[:, :1].sin())
    val_loss = nn.functional.mse_loss(model(x_val), x_val[:, :1].sin())  # no no_grad
    loss.backward()
    opt.step()
    print(step, loss.item(), val_loss.item())
"""


def _run_alerts(tmp_path, faulty: bool) -> list[dict]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    log_dir = tmp_path / "log"
    run_script(script, ["faulty" if faulty else "clean"], log_dir=log_dir, console=False)
    lines = (log_dir / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["rule"].startswith("nonfinite")]


def test_unmodified_script_with_a_validation_pass_under_grad_locates_the_backward_fault(
    tmp_path,
):
    first = _run_alerts(tmp_path, faulty=True)[0]
    assert (first["rule"], first["step"], first["module"]) == ("nonfinite_backward", 3, "fault")
    assert first["data"]["op"] == "aten::pow"


def test_unmodified_script_with_a_validation_pass_under_grad_is_clean(tmp_path):
    assert _run_alerts(tmp_path, faulty=False) == []
