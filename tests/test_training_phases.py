"""exploding_gradient across training phases: a new phase starts a new warm-up, a resume does not.

Pre-training then fine-tuning changes every layer's gradient scale at once:
the new head's first gradients are not a jump against the old head's
history, nor the body's against its converged past. A real spike after the
new warm-up is still caught, and a run resumed from a checkpoint keeps its
history, so its first steps are judged.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

PHASES = Path(__file__).parent / "scripts" / "fine_tune_phases.py"


def _exploding(alerts) -> list[tuple[int, str | None]]:
    return [(a.step, a.module) for a in alerts if a.rule == "exploding_gradient"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


X = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
LABELS = (X[:, 0] > 0).long() + 2 * (X[:, 1] > 0).long()


def _pretrain(model: nn.Module, optimizer, steps: int = 120) -> None:
    for step in range(steps):
        x = X[(step * 32) % 512 :][:32]
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :1].sin() * 0.1).backward()
        optimizer.step()


def _fine_tune(model: nn.Module, optimizer, steps: int = 80, spike_at: int | None = None) -> None:
    for step in range(steps):
        x, y = X[(step * 32) % 512 :][:32], LABELS[(step * 32) % 512 :][:32]
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x) * 10.0, y)
        if step == spike_at:
            loss = loss * 1e4  # one batch whose loss blows up
        loss.backward()
        optimizer.step()


def _two_phases(*, new_optimizer: bool, spike_at: int | None = None) -> list:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    with tw.watch(model, optimizer, console=False) as monitor:
        _pretrain(model, optimizer)
        model.head = nn.Linear(32, 5)  # a new task's head, under the old name
        if new_optimizer:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            monitor.add_optimizer(optimizer)
        else:
            optimizer.add_param_group({"params": model.head.parameters()})
        _fine_tune(model, optimizer, spike_at=spike_at)
    return monitor.alerts


@pytest.mark.parametrize("new_optimizer", [True, False], ids=["new-optimizer", "param-group"])
def test_a_replaced_head_starts_a_new_warm_up_for_every_layer(new_optimizer):
    assert _exploding(_two_phases(new_optimizer=new_optimizer)) == []


def test_a_spike_after_the_new_warm_up_is_still_exploding():
    found = _exploding(_two_phases(new_optimizer=True, spike_at=60))
    assert found and found[0][0] == 120 + 60


def test_a_new_optimizer_over_the_same_layers_starts_a_new_phase():
    """A second phase on new data at another scale, with its own optimizer: silent.

    At lr 3e-5 its loss falls from 5e4 to 150 in 60 steps. (At 1e-4 it diverges:
    at its 33rd step the loss reaches 3e12 and the gradient norm jumps 5e6x in
    one step, after which the first layer's units are dead for good: that jump
    is an explosion, told whatever the phase's warm-up.)"""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    with tw.watch(model, optimizer, console=False) as monitor:
        _pretrain(model, optimizer)
        optimizer = torch.optim.SGD(model.parameters(), lr=3e-5)
        monitor.add_optimizer(optimizer)
        for step in range(60):
            x = X[(step * 32) % 512 :][:32] * 30.0
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1] * 10.0).backward()
            optimizer.step()
    assert _exploding(monitor.alerts) == []


def test_the_same_change_without_a_new_phase_is_exploding():
    """Control: the batches change scale by 1000x mid-run with the same optimizer."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    with tw.watch(model, optimizer, console=False) as monitor:
        _pretrain(model, optimizer)
        x = X[:32] * 30.0
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :1] * 10.0).backward()
        optimizer.step()
    assert [step for step, _ in _exploding(monitor.alerts)][:1] == [120]


def test_a_resumed_run_keeps_its_history_and_judges_its_first_steps():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    with tw.watch(model, optimizer, console=False) as monitor:
        _pretrain(model, optimizer)
        saved = {"model": model.state_dict(), "trainwatch": monitor.state_dict()}
    resumed = Net()
    resumed.load_state_dict(saved["model"])
    optimizer = torch.optim.Adam(resumed.parameters(), lr=3e-3)
    with tw.watch(resumed, optimizer, console=False) as monitor:
        monitor.load_state_dict(saved["trainwatch"])
        for step in range(5):
            x = X[(step * 32) % 512 :][:32]
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(resumed(x), x[:, :1].sin() * 0.1)
            (loss * (1e4 if step == 3 else 1.0)).backward()
            optimizer.step()
    assert [step for step, _ in _exploding(monitor.alerts)][:1] == [120 + 3]


def _deep_relu(depth: int = 10, width: int = 64) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(8, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_deep_plain_relu_stack_waking_up_is_not_exploding(seed):
    """Near-dead at init, its first layer's norm rises 10,000x in ~45 steps: steady, no jump."""
    torch.manual_seed(seed)
    model = _deep_relu()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    with tw.watch(model, optimizer, console=False) as monitor:
        for step in range(90):
            x = torch.randn(32, 8, generator=gen)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), x[:, :1].sin())
            (loss * (1e4 if step == 85 else 1.0)).backward()
            optimizer.step()
    found = _exploding(monitor.alerts)
    assert [step for step, _ in found] == [85]  # the planted spike only


class FineTuner(pl.LightningModule):
    """Lightning's usual fine-tuning: a frozen body unfrozen at epoch 2, joining the optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.net.body.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 2:
            self.net.body.requires_grad_(True)
            self.optimizers().optimizer.add_param_group(
                {"params": self.net.body.parameters(), "lr": 1e-2}
            )

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.head.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(TensorDataset(X, X[:, :1].sin() * 3.0), batch_size=16, shuffle=True)


def test_lightning_unfreezing_the_body_mid_fit_is_not_exploding(tmp_path):
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=4)
    trainer.fit(FineTuner())
    assert trainer.global_step == 128
    assert [a for a in callback.alerts if a.severity != "info"] == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variant", "first_exploding"),
    [("replace", None), ("same-optimizer", None), ("spike", 150 + 60)],
)
def test_trainwatch_run_starts_a_new_warm_up_for_the_fine_tuning_phase(
    tmp_path, variant, first_exploding
):
    assert run_script(PHASES, [variant], log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    rules = [json.loads(line)["rule"] for line in lines]
    exploding = [s for s, r in zip(steps, rules) if r == "exploding_gradient"]
    assert exploding[:1] == ([first_exploding] if first_exploding is not None else [])


@pytest.mark.parametrize("forward_first", [False, True], ids=["at_once", "after_a_pass"])
def test_an_optimizer_over_a_head_put_in_after_steps_is_accepted(forward_first):
    """A new task head assigned into the model, and an optimizer over it handed to
    add_optimizer before any step names the head: the head is the model's own."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.body = nn.Linear(8, 16)
    model.head = nn.Linear(16, 8)
    first = torch.optim.Adam(model.parameters(), 1e-3)
    x = torch.randn(32, 8)
    with tw.watch(model, first, console=False) as monitor:
        for _ in range(5):
            first.zero_grad()
            (model(x) - x).pow(2).mean().backward()
            first.step()
        model.body.requires_grad_(False)
        model.head = nn.Linear(16, 2)
        second = torch.optim.Adam(model.head.parameters(), 1e-3)
        if forward_first:
            with torch.no_grad():
                model(x)
        monitor.add_optimizer(second)
        y = torch.randint(0, 2, (32,))
        for _ in range(10):
            second.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            second.step()
    assert [a.rule for a in monitor.alerts if a.severity != "info"] == []
    assert monitor.step_count == 15
