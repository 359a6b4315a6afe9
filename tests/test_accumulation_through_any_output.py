"""accumulated_gradient when the loss leaves the model's first output out.

The look for stale gradients runs as backward reaches the model: one hook on
one output of the pass, one on the last-declared parameter. It sat on the
first output, so a loss using only another (an actor-critic's value warm-up,
a metric head left out of the loss) whose last-declared parameter was left
out too went unseen: a missing ``zero_grad()`` was never told, or told when
the first output joined the loss. And where backward reached another output
first, the heads behind it accumulated before the look and passed for reset:
the finding named only some of the parameters. Now the output backward
reaches first is learned at the first step and hooked from then on; a step
whose backward reached no hook but added onto used gradients starts the
learning again.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conftest import calls_from_trainwatch


def accumulation_alerts(monitor):
    return [a for a in monitor.alerts if a.rule == "accumulated_gradient"]


class ActorCritic(nn.Module):
    """The actor is declared last and comes first in the output."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.actor = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x):
        return self.actor(x), self.critic(x)


class MetricHeadNet(nn.Module):
    """Output 0 is a metric head, declared last, that no loss uses."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.main = nn.Linear(32, 1)
        self.metric = nn.Linear(32, 3)

    def forward(self, x):
        h = self.trunk(x)
        return self.metric(h), self.main(h)


class AuxMainNet(nn.Module):
    """A tuple (aux, main), the main head made after the auxiliary one."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.main = nn.Linear(32, 1)
        self.aux = nn.Linear(32, 1)

    def forward(self, x):
        h = self.trunk(x)
        return self.aux(h), self.main(h)


class SplitAgent(nn.Module):
    """PPO's Agent: actor and critic called through methods, never forward."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.actor = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))

    def action_and_value(self, x):
        return self.actor(x), self.critic(x)


def critic_loss(out, x):
    return out[1].pow(2).mean()


def main_loss(out, x):
    return nn.functional.mse_loss(out[1].squeeze(-1), x[:, 0].sin())


def main_and_aux_loss(out, x):
    return main_loss(out, x) + 0.1 * out[0].pow(2).mean()


def both_heads_loss(out, x):
    return out[0].logsumexp(-1).mean() + out[1].pow(2).mean()


# (model, how it is called, its input width, the loss, the parameters that accumulate)
SHAPES = {
    "actor_critic_value_only": (
        ActorCritic,
        None,
        4,
        critic_loss,
        ["critic.0.weight", "critic.0.bias", "critic.2.weight", "critic.2.bias"],
    ),
    "metric_head_left_out": (
        MetricHeadNet,
        None,
        8,
        main_loss,
        ["trunk.0.weight", "trunk.0.bias", "main.weight", "main.bias"],
    ),
    "aux_main_main_only": (
        AuxMainNet,
        None,
        8,
        main_loss,
        ["trunk.0.weight", "trunk.0.bias", "main.weight", "main.bias"],
    ),
    "aux_main_both": (
        AuxMainNet,
        None,
        8,
        main_and_aux_loss,
        ["trunk.0.weight", "trunk.0.bias", "main.weight", "main.bias", "aux.weight", "aux.bias"],
    ),
    "agent_through_methods": (
        SplitAgent,
        "action_and_value",
        4,
        both_heads_loss,
        [
            f"{part}.{i}.{kind}"
            for part in ("critic", "actor")
            for i in (0, 2)
            for kind in ("weight", "bias")
        ],
    ),
}


def _loop(shape: str, quiet_watch, steps: int, *, zero_grad: bool, accumulate: int = 1):
    make, method, width, loss_of, _ = SHAPES[shape]
    torch.manual_seed(0)
    model = make()
    call = model if method is None else getattr(model, method)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(steps):
        if zero_grad:
            opt.zero_grad()
        for _ in range(accumulate):
            x = torch.randn(32, width)
            (loss_of(call(x), x) / accumulate).backward()
        opt.step()
    return monitor


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_missing_zero_grad_is_told_at_step_one_whichever_output_the_loss_uses(shape, quiet_watch):
    monitor = _loop(shape, quiet_watch, 6, zero_grad=False)
    (alert,) = accumulation_alerts(monitor)
    assert alert.step == 1
    assert alert.severity == "error"
    accumulated = SHAPES[shape][4]
    # Every parameter the loss reaches is named, not only those behind the hooked output.
    assert alert.data["parameters"] == len(accumulated)
    assert f"in {len(accumulated)} parameters" in alert.message
    assert set(alert.data["modules"]) == {name.rsplit(".", 1)[0] for name in accumulated}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_same_loops_with_zero_grad_are_silent(shape, quiet_watch):
    monitor = _loop(shape, quiet_watch, 6, zero_grad=True)
    assert accumulation_alerts(monitor) == []


@pytest.mark.parametrize("shape", ["actor_critic_value_only", "metric_head_left_out"])
def test_accumulation_over_micro_batches_with_the_first_output_unused_is_silent(shape, quiet_watch):
    monitor = _loop(shape, quiet_watch, 6, zero_grad=True, accumulate=4)
    assert accumulation_alerts(monitor) == []


@pytest.mark.parametrize("shape", ["actor_critic_value_only", "metric_head_left_out"])
def test_micro_batches_without_zero_grad_and_the_first_output_unused_are_told(shape, quiet_watch):
    monitor = _loop(shape, quiet_watch, 6, zero_grad=False, accumulate=4)
    assert [a.step for a in accumulation_alerts(monitor)] == [1]


class ThreeHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.a = nn.Linear(32, 1)
        self.b = nn.Linear(32, 1)
        self.c = nn.Linear(32, 1)

    def forward(self, x):
        h = self.trunk(x)
        return self.a(h), self.b(h), self.c(h)


def _switching_loop(quiet_watch, *, zero_grad_from_switch: bool):
    """Output a is the loss until step 5, then output b alone: neither the output
    hooked so far nor the last-declared parameter (c's) is reached."""
    torch.manual_seed(0)
    model = ThreeHeads()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt)
    for step in range(10):
        if step < 5 or zero_grad_from_switch:
            opt.zero_grad(set_to_none=False)
        x = torch.randn(32, 8)
        a, b, _ = model(x)
        (a if step < 5 else b).pow(2).mean().backward()
        opt.step()
    return monitor


def test_a_loss_that_moves_to_another_output_is_followed_there(quiet_watch):
    """The step whose backward no hook saw, adding onto used gradients, starts the
    learning again: the missing reset is told at the next step (a step late: that
    step's own look did not happen)."""
    monitor = _switching_loop(quiet_watch, zero_grad_from_switch=False)
    (alert,) = accumulation_alerts(monitor)
    assert alert.step == 6
    assert "in 4 parameters (trunk.0.weight" in alert.message


def test_a_loss_that_moves_to_another_output_with_zero_grad_is_silent(quiet_watch):
    monitor = _switching_loop(quiet_watch, zero_grad_from_switch=True)
    assert accumulation_alerts(monitor) == []


class CriticFirst(ActorCritic):
    def forward(self, x):
        return self.critic(x), self.actor(x)


def _steady_step_calls(make, used: int, quiet_watch) -> list[str]:
    """trainwatch's calls in a healthy step of a loop whose loss uses output ``used``."""
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    quiet_watch(model, opt)
    data = torch.randn(45, 32, 4)

    def step(i):
        opt.zero_grad()
        model(data[i])[used].pow(2).mean().backward()
        opt.step()

    for i in range(41):
        step(i)
    return calls_from_trainwatch(lambda: step(41))


def test_a_healthy_step_whose_loss_skips_output_zero_costs_what_the_usual_one_does(quiet_watch):
    """Once learned, a pass gets one hook, on the output backward reaches first: the
    same calls as where the loss uses the first output, the pass's method aside."""
    usual = _steady_step_calls(CriticFirst, 0, quiet_watch)
    learned = _steady_step_calls(ActorCritic, 1, quiet_watch)
    assert "_learning_pass_ends" not in learned and "output_reached" not in learned
    assert [name.replace("_targeted_pass_ends", "pass_ends") for name in learned] == usual
