"""A layer's weight swapped for a new parameter after the optimizer was built.

``model.fc.weight = nn.Parameter(pretrained)`` right after building the
optimizer, or ``parametrize.remove_parametrizations(layer, "weight",
leave_parametrized=True)`` on a weight-normed layer mid-run, registers a new
weight no optimizer holds, while the layer's bias stays in it: the weight gets
gradients and never moves. That is not_optimized's finding, at the step it
shows, on that layer, though the layer is not wholly out of the optimizer (a
target network held inside the model is, and is told apart as a target fed
gradients). The same swap done before the optimizer is built, or the weights
loaded in place, is silent.
"""

from __future__ import annotations

import copy
import json

import lightning as L
import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.data import DataLoader, TensorDataset

from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script


def _found(alerts) -> list[tuple[str, str | None, int]]:
    return [(a.rule, a.module, a.step) for a in alerts if a.severity in ("warning", "error")]


def _mlp(normed: bool = False) -> nn.Sequential:
    middle = nn.Linear(16, 16)
    return nn.Sequential(
        nn.Linear(4, 16),
        nn.SiLU(),
        weight_norm(middle) if normed else middle,
        nn.SiLU(),
        nn.Linear(16, 1),
    )


def _train(model: nn.Module, opt, monitor, steps: int, at=None) -> list:
    """A regression loop; ``at(step)`` runs before each step's forward."""
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        if at is not None:
            at(step)
        x = torch.randn(32, 4, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :1].sin()).backward()
        opt.step()
    return list(monitor.alerts)


# -- a head's weight loaded as a new parameter, under tw.watch ------------------------------
@pytest.mark.parametrize("when", ["after", "before"])
def test_a_weight_assigned_after_the_optimizer_is_not_optimized(quiet_watch, when):
    torch.manual_seed(0)
    model = _mlp()
    pretrained = torch.randn(1, 16) * 0.1
    if when == "before":
        model[4].weight = nn.Parameter(pretrained)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if when == "after":
        model[4].weight = nn.Parameter(pretrained)
    alerts = _train(model, opt, quiet_watch(model, opt), 6)
    if when == "before":
        assert _found(alerts) == []
        return
    assert _found(alerts) == [("not_optimized", "4", 0)]
    (alert,) = alerts
    assert alert.data["parameters"] == ["4.weight"]
    assert "nn.Parameter(pretrained)" in alert.hint


# -- remove_parametrizations mid-run, under tw.watch ------------------------------------
def _bake(model: nn.Sequential) -> None:
    parametrize.remove_parametrizations(model[2], "weight", leave_parametrized=True)


@pytest.mark.parametrize("when", ["mid-run", "before"])
def test_weight_norm_removed_mid_run_is_not_optimized_from_that_step(quiet_watch, when):
    torch.manual_seed(0)
    model = _mlp(normed=True)
    if when == "before":
        _bake(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)

    def bake_at_step_5(step: int) -> None:
        if step == 5 and when == "mid-run":
            _bake(model)

    alerts = _train(model, opt, monitor, 12, at=bake_at_step_5)
    if when == "before":
        assert _found(alerts) == []
        return
    assert _found(alerts) == [("not_optimized", "2", 5)]
    assert alerts[0].data["parameters"] == ["2.weight"]


# -- a conv weight swapped mid-run in a CNN, under tw.watch ----------------------------
class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("how", ["new-parameter", "copied-in-place"])
def test_a_conv_weight_swapped_mid_run_is_not_optimized(quiet_watch, how):
    torch.manual_seed(0)
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(2)
    for step in range(10):
        if step == 4:
            restored = model.conv2.weight.detach().clone()
            if how == "new-parameter":
                model.conv2.weight = nn.Parameter(restored)
            else:  # the healthy twin: the held parameter loaded in place
                with torch.no_grad():
                    model.conv2.weight.copy_(restored)
        x = torch.randn(16, 3, 8, 8, generator=gen)
        y = torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    found = _found(monitor.alerts)
    assert found == ([("not_optimized", "conv2", 4)] if how == "new-parameter" else [])


# -- beside a target network held inside the model -------------------------------------
class Agent(nn.Module):
    """A Q-network and its Polyak target, the target fed gradients (no no_grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        self.q_target = copy.deepcopy(self.q)

    def forward(self, s, a, r, s2) -> torch.Tensor:
        q = self.q(s).gather(1, a[:, None]).squeeze(1)
        y = r + 0.99 * self.q_target(s2).max(1).values
        return nn.functional.mse_loss(q, y)


@pytest.mark.parametrize("swap", [False, True])
def test_a_target_part_stays_a_target_beside_a_swapped_weight(quiet_watch, swap):
    torch.manual_seed(0)
    agent = Agent()
    opt = torch.optim.Adam(agent.q.parameters(), lr=1e-3)
    if swap:
        agent.q[2].weight = nn.Parameter(agent.q[2].weight.detach().clone())
    monitor = quiet_watch(agent, opt)
    for _ in range(6):
        s, s2 = torch.randn(32, 4), torch.randn(32, 4)
        a, r = torch.randint(0, 2, (32,)), torch.randn(32)
        opt.zero_grad()
        agent(s, a, r, s2).backward()
        opt.step()
        with torch.no_grad():
            for pt, po in zip(agent.q_target.parameters(), agent.q.parameters()):
                pt.lerp_(po, 0.01)
    found = sorted(_found(monitor.alerts))
    target = ("accumulated_gradient", "q_target", 0)
    assert found == ([target, ("not_optimized", "q.2", 0)] if swap else [target])
    (told,) = [a for a in monitor.alerts if a.rule == "accumulated_gradient"]
    assert told.data["kind"] == "target_receives_gradients"


# -- under Lightning: weights loaded in on_fit_start, after configure_optimizers -------
class LitRegressor(L.LightningModule):
    def __init__(self, load: str) -> None:
        super().__init__()
        self.load = load
        self.body = nn.Linear(8, 16)
        self.fc = nn.Linear(16, 1)

    def on_fit_start(self) -> None:
        pretrained = torch.full((1, 16), 0.05)
        if self.load == "new-parameter":
            self.fc.weight = nn.Parameter(pretrained)
        else:  # the healthy twin: loaded into the parameter the optimizer holds
            with torch.no_grad():
                self.fc.weight.copy_(pretrained)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.body(x)))

    def training_step(self, batch, index):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("load", ["new-parameter", "in-place"])
def test_lightning_weight_assigned_in_on_fit_start_is_not_optimized(tmp_path, load):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=gen)
    data = DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=16)
    callback = TrainWatchCallback(console=False)
    quiet_trainer(tmp_path, [callback], max_epochs=1).fit(LitRegressor(load), data)
    found = _found(callback.monitor.alerts)
    assert found == ([("not_optimized", "fc", 0)] if load == "new-parameter" else [])


# -- under trainwatch run ----------------------------------------------------------------
SCRIPT = """
import sys
import torch
from torch import nn

when = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
pretrained = torch.randn(2, 16) * 0.1
if when == "before":
    model[2].weight = nn.Parameter(pretrained)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
if when == "after":
    model[2].weight = nn.Parameter(pretrained)
for step in range(10):
    x = torch.randn(32, 4)
    y = (x[:, 0] > 0).long()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""


@pytest.mark.parametrize("when", ["after", "before"])
def test_run_tells_a_weight_assigned_after_the_optimizer(tmp_path, when):
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    log = tmp_path / "log"
    assert run_script(script, [when], log_dir=log, console=False) == 0
    lines = (
        (log / "alerts.jsonl").read_text().splitlines() if (log / "alerts.jsonl").exists() else []
    )
    alerts = [a for a in map(json.loads, lines) if a["severity"] in ("warning", "error")]
    found = [(a["rule"], a["module"], a["step"]) for a in alerts]
    assert found == ([("not_optimized", "2", 0)] if when == "after" else [])
