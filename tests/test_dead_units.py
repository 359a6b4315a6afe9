"""dead_units: a ReLU layer whose outputs are zero for nearly every unit and sample."""

from __future__ import annotations

import torch
from torch import nn

from tests.conftest import batches, rules_of


class ReluNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(32, 32)
        self.act2 = nn.ReLU()
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act2(self.fc2(self.act1(self.fc1(x)))))


def _train(model, opt, steps: int, plant=None) -> None:
    for step, (x, y) in enumerate(batches(steps)):
        if plant is not None:
            plant(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _kill(model: ReluNet) -> None:
    with torch.no_grad():
        model.fc2.bias.fill_(-100.0)  # what one huge update does to a layer


def test_layer_killed_mid_training_is_named_at_the_first_sampled_step(quiet_watch):
    torch.manual_seed(0)
    model = ReluNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, dead_units={"every": 10})
    _train(model, opt, 45, plant=lambda step: step == 12 and _kill(model))
    (alert,) = [a for a in monitor.alerts if a.rule == "dead_units"]
    assert (alert.step, alert.module) == (20, "act2")  # sampled: steps 0-4, 10, 20, 30...
    assert alert.data["zero_fraction"] == 1.0 and alert.data["dead_fraction"] == 1.0
    assert "100.0%" in alert.message


def test_dead_from_the_start_is_caught_at_step_0(quiet_watch):
    torch.manual_seed(0)
    model = ReluNet()
    _kill(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _train(model, opt, 3)
    (alert,) = [a for a in monitor.alerts if a.rule == "dead_units"]
    assert (alert.step, alert.module) == (0, "act2")


def test_healthy_relu_network_is_silent(quiet_watch):
    torch.manual_seed(0)
    model = ReluNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt, dead_units={"every": 5})
    _train(model, opt, 60)
    assert rules_of(monitor) == []


def test_threshold_is_configurable(quiet_watch):
    torch.manual_seed(0)
    model = ReluNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, dead_units={"threshold": 0.3, "every": 1})
    _train(model, opt, 3)  # healthy ReLUs sit near 50% zeros
    assert "dead_units" in rules_of(monitor)
