"""A target network held inside the watched model, and a target's still weights.

A LightningModule (or any model) may hold a DQN's Q-network and its target side
by side (``self.q_target = copy.deepcopy(self.q)``), the optimizer over
``self.q`` alone and the target moved by hand. A TD target computed without
``torch.no_grad()`` writes gradients into the target part: no part left out of
the optimizer (``add_param_group()`` would train the target) but a target fed
gradients, told by accumulated_gradient as ``target_receives_gradients``. A head
added after the optimizer was built copies nothing and stays not_optimized's.

A target network watched as a model of its own, synced every few steps, keeps
its weights still between syncs: that is no stalled training.
"""

from __future__ import annotations

import copy
import io
import json

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

# Short stall phases: a re-run every 20 steps, verdicts from step 40.
SHORT = {"stalled_training": {"every": 20, "warmup": 40, "loss_window": 10}}


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))


def _found(alerts) -> list[tuple[str, str | None]]:
    return [(a.rule, a.module) for a in alerts if a.severity in ("warning", "error")]


def _is_part_target(alert: tw.Alert, step: int = 0) -> bool:
    data = alert.data
    return (
        alert.step == step
        and data.get("kind") == "target_receives_gradients"
        and (data["copy"], data["copy_of"]) == ("q_target", "q")
        and "torch.no_grad()" in alert.message
        and "torch.no_grad()" in alert.hint
        and "add_param_group" not in alert.message
    )


# -- under tw.watch ---------------------------------------------------------------------
class Agent(nn.Module):
    """A Q-network and its Polyak target in one module; ``how`` plants the bug."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.q = _mlp()
        # "own-init": a target started from an initialization of its own.
        self.q_target = _mlp() if how == "own-init" else copy.deepcopy(self.q)

    def forward(self, s, a, r, s2) -> torch.Tensor:
        q = self.q(s).gather(1, a[:, None]).squeeze(1)
        with torch.no_grad() if self.how == "no_grad" else torch.enable_grad():
            y = r + 0.99 * self.q_target(s2).max(1).values
        return nn.functional.mse_loss(q, y)


def _agent_loop(how: str, steps: int = 6, config: dict | None = None) -> list[tw.Alert]:
    torch.manual_seed(0)
    agent = Agent(how)
    opt = torch.optim.Adam(agent.q.parameters(), lr=1e-3)
    monitor = tw.watch(agent, opt, console=io.StringIO(), config=config)
    try:
        for _ in range(steps):
            s, s2 = torch.randn(32, 4), torch.randn(32, 4)
            a, r = torch.randint(0, 2, (32,)), torch.randn(32)
            opt.zero_grad()
            agent(s, a, r, s2).backward()
            opt.step()
            with torch.no_grad():
                for pt, po in zip(agent.q_target.parameters(), agent.q.parameters()):
                    pt.lerp_(po, 0.01)
        return list(monitor.alerts)
    finally:
        monitor.close()


@pytest.mark.parametrize("how", ["deepcopy", "own-init"])
def test_a_target_part_fed_gradients_is_told_as_a_target_not_as_left_out(how):
    # A deepcopy lies near the Q-network; one of its own init moves towards it.
    alerts = _agent_loop(how)
    assert _found(alerts) == [("accumulated_gradient", "q_target")]
    assert _is_part_target(alerts[0])
    assert "not_optimized" not in {a.rule for a in alerts}


def test_a_target_part_under_no_grad_is_silent():
    assert _found(_agent_loop("no_grad")) == []


def test_with_accumulated_gradient_off_a_target_part_fed_gradients_is_still_not_optimized():
    # The rule that tells the target's story is off: the parameters that got
    # gradients no optimizer applies are still told, by the rule that is on.
    alerts = _agent_loop("deepcopy", config={"accumulated_gradient": {"enabled": False}})
    assert ("not_optimized", "q_target.0") in _found(alerts)


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


@pytest.mark.parametrize("shape", ["same-as-body", "own"])
def test_a_head_added_after_the_optimizer_is_still_not_optimized(quiet_watch, shape):
    """A fresh head of another part's class and shapes copies nothing: it lies far from
    that part and nothing moves it."""
    torch.manual_seed(0)
    model = Tower()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.head = nn.Linear(8, 8) if shape == "same-as-body" else nn.Linear(8, 3)
    monitor = quiet_watch(model, opt)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
    assert _found(monitor.alerts) == [("not_optimized", "head")]
    assert "add_param_group" in monitor.alerts[0].hint


def test_layers_of_a_stack_left_out_of_the_optimizer_are_not_targets(quiet_watch):
    """nn.TransformerEncoder's layers start as deepcopies of one: those an optimizer
    over the top layers leaves out are near copies of the others, and left out."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, 3, enable_nested_tensor=False))
    opt = torch.optim.Adam(model[0].layers[2].parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 5, 16)).pow(2).mean().backward()
        opt.step()
    rules = {rule for rule, _ in _found(monitor.alerts)}
    assert rules == {"not_optimized"}


# -- under Lightning ----------------------------------------------------------------------
class LitDQN(L.LightningModule):
    """Manual optimization, the target held in the module and Polyak-updated by hand."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.how = how
        self.q = _mlp()
        self.q_target = copy.deepcopy(self.q)

    def training_step(self, batch, index):
        s, a, r, s2 = batch
        q = self.q(s).gather(1, a[:, None]).squeeze(1)
        with torch.no_grad() if self.how == "no_grad" else torch.enable_grad():
            y = r + 0.99 * self.q_target(s2).max(1).values
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(nn.functional.mse_loss(q, y))
        opt.step()
        with torch.no_grad():
            for pt, po in zip(self.q_target.parameters(), self.q.parameters()):
                pt.lerp_(po, 0.005)

    def configure_optimizers(self):
        return torch.optim.Adam(self.q.parameters(), lr=1e-3)


class LitTower(L.LightningModule):
    """The optimizer built over the body alone: the head is left out."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)

    def training_step(self, batch, index):
        s = batch[0]
        return self.head(torch.relu(self.body(s))).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.body.parameters(), lr=1e-3)


def _transitions() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    n = 192
    data = TensorDataset(
        torch.randn(n, 4, generator=gen),
        torch.randint(0, 2, (n,), generator=gen),
        torch.randn(n, generator=gen),
        torch.randn(n, 4, generator=gen),
    )
    return DataLoader(data, batch_size=32)


def _fit(tmp_path, module: L.LightningModule) -> list[tw.Alert]:
    torch.manual_seed(0)
    callback = TrainWatchCallback(console=False)
    quiet_trainer(tmp_path, [callback], max_epochs=1).fit(module, _transitions())
    return list(callback.monitor.alerts)


def test_lightning_target_held_in_the_module_fed_gradients_is_told_as_a_target(tmp_path):
    alerts = _fit(tmp_path, LitDQN("bug"))
    assert _found(alerts) == [("accumulated_gradient", "q_target")]
    assert _is_part_target(alerts[0])


def test_lightning_target_held_in_the_module_under_no_grad_is_silent(tmp_path):
    assert _found(_fit(tmp_path, LitDQN("no_grad"))) == []


def test_lightning_head_left_out_of_the_optimizer_is_still_not_optimized(tmp_path):
    assert _found(_fit(tmp_path, LitTower())) == [("not_optimized", "head")]


# -- under trainwatch run ------------------------------------------------------------------
AGENT = """
import copy
import sys
import torch
from torch import nn

how = sys.argv[1]


def mlp():
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))


class Agent(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = mlp()
        self.q_target = copy.deepcopy(self.q)
        self.head = nn.Linear(2, 2)

    def forward(self, s, a, r, s2):
        q = self.q(s)
        if how == "head":
            q = self.head(q)
        q = q.gather(1, a[:, None]).squeeze(1)
        with torch.no_grad() if how != "bug" else torch.enable_grad():
            y = r + 0.99 * self.q_target(s2).max(1).values
        return nn.functional.mse_loss(q, y)


torch.manual_seed(0)
agent = Agent()
opt = torch.optim.Adam(agent.q.parameters(), lr=1e-3)
for step in range(12):
    s, s2 = torch.randn(32, 4), torch.randn(32, 4)
    a, r = torch.randint(0, 2, (32,)), torch.randn(32)
    opt.zero_grad()
    agent(s, a, r, s2).backward()
    opt.step()
    with torch.no_grad():
        for pt, po in zip(agent.q_target.parameters(), agent.q.parameters()):
            pt.lerp_(po, 0.01)
"""

DQN = """
import sys
import torch
from torch import nn

how, sync, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


class QNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x):
        return self.net(x)


torch.manual_seed(0)
net, target_net = QNet(), QNet()
target_net.load_state_dict(net.state_dict())
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
for step in range(steps):
    s, s2 = torch.randn(32, 4), torch.randn(32, 4)
    a, r = torch.randint(0, 2, (32,)), torch.randn(32)
    with torch.no_grad() if how == "clean" else torch.enable_grad():
        y = r + 0.99 * target_net(s2).max(1).values
    q = net(s).gather(1, a[:, None]).squeeze(1)
    opt.zero_grad()
    nn.functional.mse_loss(q, y).backward()
    opt.step()
    if step % sync == sync - 1:
        target_net.load_state_dict(net.state_dict())
"""


def _run(tmp_path, source: str, *args: str, config=None) -> list[dict]:
    script = tmp_path / "loop.py"
    script.write_text(source)
    log = tmp_path / "log"
    assert run_script(script, list(args), log_dir=log, config=config, console=False) == 0
    lines = (log / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["severity"] in ("warning", "error")]


def test_run_tells_a_target_part_fed_gradients_as_a_target(tmp_path):
    (alert,) = _run(tmp_path, AGENT, "bug")
    assert (alert["rule"], alert["module"], alert["step"]) == (
        "accumulated_gradient",
        "q_target",
        0,
    )
    assert alert["data"]["kind"] == "target_receives_gradients"
    assert alert["data"]["copy_of"] == "q"


def test_run_with_the_target_part_under_no_grad_is_silent(tmp_path):
    assert _run(tmp_path, AGENT, "clean") == []


def test_run_still_tells_a_head_left_out_of_the_optimizer(tmp_path):
    found = [(a["rule"], a["module"]) for a in _run(tmp_path, AGENT, "head")]
    assert found == [("not_optimized", "head")]


@pytest.mark.parametrize("sync", ["25", "50"])
def test_run_tells_a_synced_target_fed_gradients_once_and_no_stall(tmp_path, sync):
    """Between syncs the target's weights stay still: a target, not a training that
    stopped (before the first sync, nor one that changes nothing). Told at its
    second step, before the first sync: its gradients never reset, its weights
    not moved, while the online network's optimizer stepped."""
    found = _run(tmp_path, DQN, "bug", sync, "200", config=SHORT)
    assert [(a["rule"], a["data"]["model"], a["step"]) for a in found] == [
        ("not_optimized", "QNet", 1)
    ]
    assert found[0]["data"]["kind"] == "target_receives_gradients"


def test_run_with_a_synced_target_under_no_grad_is_silent(tmp_path):
    assert _run(tmp_path, DQN, "clean", "25", "200", config=SHORT) == []


def _watched_synced_target(no_grad: bool, steps: int = 150) -> list[tw.Alert]:
    """An online network watched with its optimizer, its target watched on its own,
    synced every 25 steps and stepped by hand after each update."""
    torch.manual_seed(0)
    net = _mlp()
    target_net = copy.deepcopy(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    online = tw.watch(net, opt, console=io.StringIO(), **SHORT)
    target = tw.watch(target_net, console=io.StringIO(), **SHORT)
    try:
        for step in range(steps):
            s, s2 = torch.randn(32, 4), torch.randn(32, 4)
            a, r = torch.randint(0, 2, (32,)), torch.randn(32)
            with torch.no_grad() if no_grad else torch.enable_grad():
                y = r + 0.99 * target_net(s2).max(1).values
            q = net(s).gather(1, a[:, None]).squeeze(1)
            opt.zero_grad()
            nn.functional.mse_loss(q, y).backward()
            opt.step()
            if step % 25 == 24:
                target_net.load_state_dict(net.state_dict())
            target.step()
        return [*online.alerts, *target.alerts]
    finally:
        target.close()
        online.close()


def test_a_synced_target_watched_on_its_own_fed_gradients_tells_no_stall():
    found = _found(_watched_synced_target(no_grad=False))
    assert "stalled_training" not in {rule for rule, _ in found}
    # Told as a target at its second step, before the first sync moved it.
    assert found and {rule for rule, _ in found} == {"not_optimized"}


def test_a_synced_target_watched_on_its_own_under_no_grad_tells_no_stall():
    # Stepped by hand without gradients, it is told only as such (zero_gradient).
    rules = {rule for rule, _ in _found(_watched_synced_target(no_grad=True))}
    assert rules <= {"zero_gradient"}
