"""zero_gradient: detached layers (None) and dead signal (exact zeros), with controls."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conftest import rules_of, train


@pytest.mark.parametrize("bug_from", [0, 4])
def test_detached_layer_alerts_none_at_the_step_it_started(model, quiet_watch, bug_from):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)

    def plant(step: int) -> None:
        model.detach_fc1 = step + 1 >= bug_from

    model.detach_fc1 = bug_from == 0
    train(model, opt, 10, before_step=plant)
    (alert,) = [a for a in monitor.alerts if a.rule == "zero_gradient"]
    assert alert.module == "fc1"
    assert alert.step == bug_from
    assert alert.data["kind"] == "none"
    assert "None" in alert.message and "detach" in alert.hint
    assert alert.data["parameters"] == ["fc1.weight", "fc1.bias"]


def test_exact_zero_gradient_is_told_apart_from_none(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    model.zero_fc2 = True  # fc1 and fc2 are reached by backward, but with zeros
    train(model, opt, 5)
    zero = {a.module: a for a in monitor.alerts if a.rule == "zero_gradient"}
    assert set(zero) == {"fc1", "fc2", "head"}
    assert all(a.data["kind"] == "zero" and a.step == 0 for a in zero.values())
    assert zero["head"].data["parameters"] == ["head.weight"]  # its bias still learns
    assert "exactly zero" in zero["fc1"].message


def test_healthy_training_raises_no_zero_gradient(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    train(model, opt, 20)
    assert rules_of(monitor) == []


def test_one_step_of_zeros_from_zero_init_is_within_patience(quiet_watch):
    """LoRA-style B=0 init: A's gradient is exactly zero at step 0 only."""

    class LoRA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 2, bias=False)
            self.b = nn.Linear(2, 1, bias=False)
            nn.init.zeros_(self.b.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    torch.manual_seed(0)
    model = LoRA()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = quiet_watch(model, opt)
    train(model, opt, 10)
    assert rules_of(monitor) == []


def test_patience_is_configurable(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, zero_gradient={"patience": 8})
    model.detach_fc1 = True
    train(model, opt, 6)
    assert rules_of(monitor) == []
    train(model, opt, 3)
    assert rules_of(monitor) == ["zero_gradient"]


def test_frozen_parameters_outside_the_optimizer_are_not_zero_gradient(model, quiet_watch):
    for p in model.fc1.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    monitor = quiet_watch(model, opt)
    train(model, opt, 6)
    assert rules_of(monitor) == []


def test_manual_steps_without_optimizer_check_every_trainable_parameter(model, quiet_watch):
    monitor = quiet_watch(model)
    model.detach_fc1 = True
    for _ in range(4):
        model.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.01 * p.grad
        monitor.step()
    assert monitor.step_count == 4
    (alert,) = monitor.alerts
    assert (alert.rule, alert.module, alert.step) == ("zero_gradient", "fc1", 0)
