"""zero_gradient names the cause it can see: a weight of the same layer held at zero
(LoRA's B at a learning rate of 0, frozen, or left out of the optimizer), and a
custom autograd Function whose backward returns None; each beside the healthy
shape, and the usual hints kept where no such cause is there."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
from torch import nn

from tests.conftest import rules_of


class LoRALinear(nn.Module):
    """A frozen Linear plus ``x @ A.T @ B.T``, B initialised to zero (as LoRA does)."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_A.t() @ self.lora_B.t() * 2.0


class Adapted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = LoRALinear(nn.Linear(8, 32))
        self.head = nn.Linear(32, 1).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc1(x)))


def _fit(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=gen)
        loss = nn.functional.mse_loss(model(x), x[:, :1].sin())
        opt.zero_grad()
        loss.backward()
        opt.step()


def _lora_run(quiet_watch, setup: str) -> list:
    torch.manual_seed(0)
    model = Adapted()
    a, b = model.fc1.lora_A, model.fc1.lora_B
    if setup == "lr_zero":  # LoRA+ with its ratio truncated to 0 by int()
        groups = [{"params": [a], "lr": 1e-3}, {"params": [b], "lr": 1e-3 * int(0.5)}]
    elif setup == "frozen":
        b.requires_grad_(False)
        groups = [{"params": [a], "lr": 1e-3}]
    elif setup == "no_optimizer":
        groups = [{"params": [a], "lr": 1e-3}]
    else:  # healthy: B learns at a rate of its own
        groups = [{"params": [a], "lr": 1e-3}, {"params": [b], "lr": 4e-3}]
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    monitor = quiet_watch(model, opt)
    _fit(model, opt, 8)
    return [a for a in monitor.alerts if a.rule == "zero_gradient"]


@pytest.mark.parametrize(
    "setup, said",
    [
        ("lr_zero", "its param group's learning rate is 0, so it never leaves zero"),
        ("frozen", "it is frozen (requires_grad=False), so it never leaves zero"),
    ],
)
def test_a_lora_b_held_at_zero_is_named_as_the_cause_of_a_zero_gradient(quiet_watch, setup, said):
    (alert,) = _lora_run(quiet_watch, setup)
    assert alert.module == "fc1" and alert.data["parameters"] == ["fc1.lora_A"]
    assert alert.data["cause"] == "all_zero_partner"
    assert alert.data["zero_partner"] == "fc1.lora_B"
    assert alert.data["partner_stays_zero"] == setup
    assert "fc1.lora_B is all zeros, and the gradient of fc1.lora_A passes through it" in (
        alert.message
    )
    assert said in alert.message
    assert "dead" not in alert.hint  # no dead ReLU upstream: the old hint misled


def test_a_lora_b_left_out_of_the_optimizer_is_named_too(quiet_watch):
    found = _lora_run(quiet_watch, "no_optimizer")
    zero = [a for a in found if a.data.get("kind") == "zero"]
    assert [a.data["zero_partner"] for a in zero] == ["fc1.lora_B"]
    assert "no watched optimizer holds it" in zero[0].message


def test_control_a_lora_b_that_learns_leaves_no_zero_gradient(quiet_watch):
    assert _lora_run(quiet_watch, "healthy") == []


class DeadAfterFc1(nn.Module):
    """fc1's units all dead (a bias far below zero before the ReLU)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)
        with torch.no_grad():
            self.fc1.bias.fill_(-100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_control_dead_units_keep_the_dead_relu_hint(quiet_watch):
    torch.manual_seed(0)
    model = DeadAfterFc1()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _fit(model, opt, 5)
    zero = {a.module: a for a in monitor.alerts if a.rule == "zero_gradient"}
    assert set(zero) == {"fc1", "fc2"}
    for alert in zero.values():
        assert "cause" not in alert.data
        assert "dead (ReLU stuck at 0)" in alert.hint
        assert "all zeros" not in alert.message


# -- a custom autograd Function --------------------------------------------------------
class FakeQuant(torch.autograd.Function):
    """Fake quantisation with a learned step size; ``ste`` False drops the input's gradient."""

    @staticmethod
    def forward(ctx, x, s, ste):
        ctx.save_for_backward(x, s)
        ctx.ste = ste
        return torch.round(torch.clamp(x / s, 0, 15)) * s

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensors
        v = x / s
        inside = (v >= 0) & (v <= 15)
        gs = (g * torch.where(inside, torch.round(v) - v, torch.zeros_like(v))).sum()
        gx = g * inside if ctx.ste else None
        return gx, gs.reshape(s.shape), None


class QAct(nn.Module):
    def __init__(self, ste: bool) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor(0.2))
        self.ste = ste

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FakeQuant.apply(x, self.s, self.ste)


def _quantised_run(quiet_watch, ste: bool, detach: bool = False) -> list:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 32), QAct(ste), nn.Linear(32, 1)]
    if detach:

        class Detach(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x.detach()

        layers.insert(1, Detach())
    model = nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    monitor = quiet_watch(model, opt)
    _fit(model, opt, 6)
    return [a for a in monitor.alerts if a.rule == "zero_gradient"]


def test_a_custom_function_returning_none_is_named_as_the_cut(quiet_watch):
    (alert,) = _quantised_run(quiet_watch, ste=False)
    assert alert.module == "0" and alert.data["kind"] == "none"
    assert alert.data["cause"] == "custom_function"
    assert alert.data["functions"] == ["FakeQuant"]
    assert "only through the custom autograd Function FakeQuant" in alert.message
    assert "backward returns None" in alert.message
    assert "straight-through" in alert.hint and "backward() returns None" in alert.hint


def test_control_a_custom_function_with_its_straight_through_gradient_is_silent(quiet_watch):
    assert _quantised_run(quiet_watch, ste=True) == []


def test_control_a_detach_before_a_custom_function_keeps_the_detach_hint(quiet_watch):
    (alert,) = _quantised_run(quiet_watch, ste=True, detach=True)
    assert alert.module == "0" and alert.data["kind"] == "none"
    assert "cause" not in alert.data and "FakeQuant" not in alert.message
    assert ".detach()" in alert.hint
    assert "custom torch.autograd.Function whose backward returns None" in alert.hint


QUANTISED_SCRIPT = textwrap.dedent(
    """
    import torch
    from torch import nn

    class FakeQuant(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.round(x * 4) / 4

        @staticmethod
        def backward(ctx, g):
            return None  # "rounding has no derivative anyway"

    class Q(nn.Module):
        def forward(self, x):
            return FakeQuant.apply(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Q(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(6):
        x = torch.randn(16, 8)
        loss = nn.functional.mse_loss(model(x), x[:, :1])
        opt.zero_grad()
        loss.backward()
        opt.step()
    """
)


def test_trainwatch_run_names_the_custom_function_too(tmp_path):
    import json

    from trainwatch.runner import run_script

    script = tmp_path / "quant.py"
    script.write_text(QUANTISED_SCRIPT)
    assert run_script(script, log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [a for a in map(json.loads, lines) if a["rule"] == "zero_gradient"]
    assert [(a["module"], a["data"].get("cause"), a["data"].get("functions")) for a in found] == [
        ("0", "custom_function", ["FakeQuant"])
    ]


def test_healthy_quantised_training_stays_silent_on_every_rule(quiet_watch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), QAct(True), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    monitor = quiet_watch(model, opt)
    _fit(model, opt, 10)
    assert rules_of(monitor) == []
