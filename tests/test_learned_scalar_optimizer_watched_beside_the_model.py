"""An optimizer of learned scalars, passed beside the model's, is watched, not refused.

SAC learns its entropy temperature as ``log_alpha = torch.zeros(1,
requires_grad=True)`` (or a module-less ``nn.Parameter``) stepped by an Adam
of its own, and the user naturally hands every optimizer of the training to
``tw.watch(actor, [actor_opt, alpha_opt])``. That was refused, ``WatchError:
optimizer 1 (Adam) holds 1 parameters and none of them belongs to the watched
model: was it built for another model?``, though a temperature's optimizer (or
a Lagrange multiplier's, or learned loss weights') is built for no model.

Now an optimizer all of whose tensors are learned scalars (plain tensors, which
no module can hold, or ``nn.Parameter``s of 16 elements at most in all) is one
more optimizer, its tensors outside the model. A healthy SAC loop (twin critics
with an optimizer of their own, not passed) and a constrained loop with a
Lagrange multiplier and learned loss weights stay silent for 100+ iterations;
the actor's missing ``zero_grad()`` beside them is still told. An optimizer
over another network (a critic's) is still refused.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import trainwatch as tw

ITERATIONS = 120


def _mlp(i: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, 32), nn.ReLU(), nn.Linear(32, o))


class Actor(nn.Module):
    """A squashed-Gaussian policy: actions in (-1, 1) and their log-probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp(2, 2)

    def forward(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, log_std = self.net(s).chunk(2, dim=-1)
        log_std = log_std.clamp(-5, 2)
        u = mu + log_std.exp() * torch.randn_like(mu)
        a = torch.tanh(u)
        logp = -0.5 * ((u - mu) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi)
        return a, (logp - torch.log(1 - a.pow(2) + 1e-6)).sum(-1)


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = _mlp(3, 1)

    def forward(self, s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return self.q(torch.cat([s, a], -1)).squeeze(-1)


def _temperature(kind: str) -> torch.Tensor:
    if kind == "parameter":
        return nn.Parameter(torch.zeros(1))  # a Parameter, but no module's
    return torch.zeros(1, requires_grad=True)


def _sac(temperature: str, *, actor_zero_grad: bool = True) -> list[tw.Alert]:
    """SAC with twin critics and their Polyak targets: the actor watched with its
    optimizer and the temperature's, the critics' optimizer not handed over."""
    torch.manual_seed(0)
    actor, q1, q2 = Actor(), Critic(), Critic()
    q1_t, q2_t = copy.deepcopy(q1), copy.deepcopy(q2)
    log_alpha = _temperature(temperature)
    actor_opt = torch.optim.Adam(actor.parameters(), lr=3e-4)
    q_opt = torch.optim.Adam([*q1.parameters(), *q2.parameters()], lr=3e-4)
    alpha_opt = torch.optim.Adam([log_alpha], lr=3e-4)
    with tw.watch(actor, [actor_opt, alpha_opt], console=False) as monitor:
        for _ in range(ITERATIONS):
            s, r, s2 = torch.randn(64, 2), torch.randn(64), torch.randn(64, 2)
            a = torch.rand(64, 1) * 2 - 1
            alpha = log_alpha.exp().detach()
            with torch.no_grad():
                a2, logp2 = actor(s2)
                y = r + 0.99 * (torch.min(q1_t(s2, a2), q2_t(s2, a2)) - alpha * logp2)
            q_opt.zero_grad()
            (F.mse_loss(q1(s, a), y) + F.mse_loss(q2(s, a), y)).backward()
            q_opt.step()
            if actor_zero_grad:
                actor_opt.zero_grad()
            a_new, logp = actor(s)
            (alpha * logp - torch.min(q1(s, a_new), q2(s, a_new))).mean().backward()
            actor_opt.step()
            alpha_opt.zero_grad()
            (-(log_alpha * (logp.detach() - 1.0)).mean()).backward()
            alpha_opt.step()
            with torch.no_grad():
                for net, target in ((q1, q1_t), (q2, q2_t)):
                    for p, pt in zip(net.parameters(), target.parameters()):
                        pt.mul_(0.995).add_(0.005 * p)
        assert monitor.step_count == 2 * ITERATIONS  # the temperature's steps counted too
        return list(monitor.alerts)


def _constrained(*, model_zero_grad: bool = True) -> list[tw.Alert]:
    """Two tasks weighted by learned log-variances (an ``nn.Parameter`` of two
    elements) under a constraint kept by a Lagrange multiplier (a 0-d tensor,
    ascended), each with an optimizer of its own, every optimizer reset at the top."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    log_vars = nn.Parameter(torch.zeros(2))
    multiplier = torch.zeros((), requires_grad=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    weights_opt = torch.optim.Adam([log_vars], lr=1e-2)
    multiplier_opt = torch.optim.SGD([multiplier], lr=1e-2, maximize=True)
    optimizers = [opt, weights_opt, multiplier_opt]
    with tw.watch(model, optimizers, console=False) as monitor:
        for _ in range(ITERATIONS):
            x = torch.randn(32, 8)
            if model_zero_grad:
                opt.zero_grad()
            weights_opt.zero_grad()
            multiplier_opt.zero_grad()
            out = model(x)
            losses = torch.stack([F.mse_loss(out[:, 0], x[:, 0]), F.mse_loss(out[:, 1], x[:, 1])])
            task_loss = (losses * (-log_vars).exp() + log_vars).sum()
            violation = out.pow(2).mean() - 1.0
            (task_loss + F.softplus(multiplier) * violation).backward()
            for o in optimizers:
                o.step()
        return list(monitor.alerts)


def _told(alerts: list[tw.Alert]) -> list[tuple[str, str]]:
    return [(a.rule, a.severity) for a in alerts if a.severity in ("warning", "error")]


@pytest.mark.parametrize("temperature", ["tensor", "parameter"])
def test_a_healthy_sac_loop_watched_with_its_temperature_optimizer_is_silent(temperature):
    assert _told(_sac(temperature)) == []


@pytest.mark.parametrize("temperature", ["tensor", "parameter"])
def test_the_actors_missing_zero_grad_beside_a_temperature_optimizer_is_told(temperature):
    alerts = [a for a in _sac(temperature, actor_zero_grad=False) if a.severity == "error"]
    (told,) = alerts
    assert told.rule == "accumulated_gradient"
    assert told.data["optimizer"] == 0
    assert told.data["modules"] == ["net.0", "net.2"]


def test_learned_loss_weights_and_a_lagrange_multiplier_with_optimizers_of_their_own_are_silent():
    assert _told(_constrained()) == []


def test_the_models_missing_zero_grad_beside_scalar_optimizers_is_told():
    told = [a for a in _constrained(model_zero_grad=False) if a.rule == "accumulated_gradient"]
    assert len(told) == 1 and told[0].severity == "error"
    assert told[0].data["optimizer"] == 0


def test_an_optimizer_over_another_network_is_still_refused():
    torch.manual_seed(0)
    actor, critic = Actor(), Critic()
    actor_opt = torch.optim.Adam(actor.parameters(), lr=3e-4)
    critic_opt = torch.optim.Adam(critic.parameters(), lr=3e-4)
    with pytest.raises(tw.WatchError, match="none of them belongs to the watched model"):
        tw.watch(actor, [actor_opt, critic_opt], console=False)
    with pytest.raises(tw.WatchError, match="another model"):
        tw.watch(actor, critic_opt, console=False)
    with tw.watch(actor, actor_opt, console=False) as monitor:
        with pytest.raises(tw.WatchError, match="another model"):
            monitor.add_optimizer(critic_opt)


def test_a_temperature_optimizer_added_later_is_taken():
    torch.manual_seed(0)
    actor = Actor()
    log_alpha = torch.zeros(1, requires_grad=True)
    actor_opt = torch.optim.Adam(actor.parameters(), lr=3e-4)
    with tw.watch(actor, actor_opt, console=False) as monitor:
        monitor.add_optimizer(torch.optim.Adam([log_alpha], lr=3e-4))
