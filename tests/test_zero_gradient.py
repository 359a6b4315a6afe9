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


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


@pytest.mark.parametrize("dead", [False, True])
def test_a_bias_the_loss_cancels_is_silent_but_a_dead_layer_is_not(quiet_watch, dead):
    """A WGAN critic's loss ``D(fake).mean() - D(real).mean()`` cancels its output
    bias exactly (and a linear layer's bias before batch norm is cancelled the same
    way): zero, while the layer's weight learns. A layer fed only zeros is dead."""
    torch.manual_seed(0)
    critic = Critic()
    opt = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.0, 0.9))
    monitor = quiet_watch(critic, opt)
    for _ in range(6):
        real, fake = torch.randn(16, 8) + 1.0, torch.randn(16, 8)
        if dead:
            real, fake = real * 0.0, fake * 0.0
        opt.zero_grad()
        (critic(fake).mean() - critic(real).mean()).backward()
        opt.step()
    found = {a.module: a.data["parameters"] for a in monitor.alerts if a.rule == "zero_gradient"}
    if dead:
        assert found["body.0"] == ["body.0.weight", "body.0.bias"]
        assert found["out"] == ["out.weight", "out.bias"]
    else:
        assert found == {}


def test_a_bias_before_batch_norm_is_silent(quiet_watch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    train(model, opt, 6)
    assert rules_of(monitor) == []
