"""SAC's temperature optimizer is not taken for one built over a replaced model.

SAC learns its entropy temperature as a bare tensor, ``log_alpha =
torch.zeros(1, requires_grad=True)``, stepped by an Adam of its own. With the
TD target computed outside ``torch.no_grad()``, the target critic gets
gradients, no optimizer holding it: rightly told as a target fed gradients
(``accumulated_gradient``). But ``trainwatch run`` also told it as the model
trained in place of one replaced after its optimizer was built
(``not_optimized``, ``data.kind: replaced_model``), because the temperature's
(1,)-shaped tensor, without a gradient once every optimizer is reset at the top
of the update, matched the shape of the critic's output bias. Its hint, build
the optimizer over the new model, would have trained the target network.

A bare tensor was never a module's parameter, and a shape shared with one
small part of a model is no evidence of a copy: only an optimizer over module
parameters matching most of the model, by count and by size, is taken for the
one built over a model replaced. A real replacement (a new instance loaded over
the model's name, its optimizer holding the old one's parameters, with or
without a learned loss weight beside them) is still told, beside a temperature
optimizer.
"""

from __future__ import annotations

import json

import pytest

from trainwatch.runner import run_script

# One critic and its Polyak target, every optimizer reset at the top of the update.
ONE_CRITIC = """
import copy
import sys
import torch
from torch import nn
from torch.nn import functional as F

bug, temperature = sys.argv[1] == "bug", sys.argv[2]
torch.manual_seed(0)
critic = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 1))
critic_t = copy.deepcopy(critic)
if temperature == "parameter":
    log_alpha = nn.Parameter(torch.zeros(1))  # a Parameter, but no module's
else:
    log_alpha = torch.zeros(1, requires_grad=True)
critic_opt = torch.optim.Adam(critic.parameters(), lr=3e-4)
alpha_opt = torch.optim.Adam([log_alpha], lr=3e-4)
for step in range(30):
    s, r, s2 = torch.randn(64, 3), torch.randn(64), torch.randn(64, 3)
    critic_opt.zero_grad()
    alpha_opt.zero_grad()
    if bug:
        y = r + 0.99 * critic_t(s2).squeeze(-1)
    else:
        with torch.no_grad():
            y = r + 0.99 * critic_t(s2).squeeze(-1)
    F.mse_loss(critic(s).squeeze(-1), y).backward()
    critic_opt.step()
    (-(log_alpha * (torch.randn(64) - 1.0)).mean()).backward()
    alpha_opt.step()
    with torch.no_grad():
        for p, pt in zip(critic.parameters(), critic_t.parameters()):
            pt.mul_(0.995).add_(0.005 * p)
"""

# Full SAC: a squashed-Gaussian actor, twin critics q1/q2 with their own targets
# (classes of their own), a (1,)-shaped temperature.
TWIN_CRITICS = """
import copy
import math
import sys
import torch
from torch import nn
from torch.nn import functional as F

bug, temperature = sys.argv[1] == "bug", sys.argv[2]


def mlp(i, o):
    return nn.Sequential(nn.Linear(i, 32), nn.ReLU(), nn.Linear(32, o))


class Actor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp(2, 2)

    def forward(self, s):
        mu, log_std = self.net(s).chunk(2, dim=-1)
        log_std = log_std.clamp(-5, 2)
        u = mu + log_std.exp() * torch.randn_like(mu)
        a = torch.tanh(u)
        logp = (-0.5 * ((u - mu) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi))
        return a, (logp - torch.log(1 - a.pow(2) + 1e-6)).sum(-1)


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = mlp(3, 1)

    def forward(self, s, a):
        return self.q(torch.cat([s, a], -1)).squeeze(-1)


torch.manual_seed(0)
actor, q1, q2 = Actor(), Critic(), Critic()
q1_t, q2_t = copy.deepcopy(q1), copy.deepcopy(q2)
if temperature == "parameter":
    log_alpha = nn.Parameter(torch.zeros(1))
else:
    log_alpha = torch.zeros(1, requires_grad=True)
actor_opt = torch.optim.Adam(actor.parameters(), lr=3e-4)
q_opt = torch.optim.Adam([*q1.parameters(), *q2.parameters()], lr=3e-4)
alpha_opt = torch.optim.Adam([log_alpha], lr=3e-4)
for step in range(25):
    s, a, r, s2 = torch.randn(64, 2), torch.rand(64, 1) * 2 - 1, torch.randn(64), torch.randn(64, 2)
    alpha = log_alpha.exp().detach()
    actor_opt.zero_grad()
    q_opt.zero_grad()
    alpha_opt.zero_grad()
    if bug:
        a2, logp2 = actor(s2)
        y = r + 0.99 * (torch.min(q1_t(s2, a2), q2_t(s2, a2)) - alpha * logp2)
    else:
        with torch.no_grad():
            a2, logp2 = actor(s2)
            y = r + 0.99 * (torch.min(q1_t(s2, a2), q2_t(s2, a2)) - alpha * logp2)
    (F.mse_loss(q1(s, a), y) + F.mse_loss(q2(s, a), y)).backward()
    q_opt.step()
    a_new, logp = actor(s)
    (alpha * logp - torch.min(q1(s, a_new), q2(s, a_new))).mean().backward()
    actor_opt.step()
    (-(log_alpha * (logp.detach() - 1.0)).mean()).backward()
    alpha_opt.step()
    with torch.no_grad():
        for net, tgt in ((q1, q1_t), (q2, q2_t)):
            for p, pt in zip(net.parameters(), tgt.parameters()):
                pt.mul_(0.995).add_(0.005 * p)
"""

# A real replacement beside a temperature: the model's name bound to a new instance
# loaded after its optimizer was built (which may also hold a learned loss weight).
LOADED_OVER_THE_MODEL = """
import sys
import torch
from torch import nn

how, path = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
torch.save(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)), path)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
log_alpha = torch.zeros(1, requires_grad=True)
log_var = torch.zeros((), requires_grad=True)
if how == "with-loss-weight":
    opt = torch.optim.SGD([*model.parameters(), log_var], lr=1e-2, momentum=0.9)
else:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
alpha_opt = torch.optim.Adam([log_alpha], lr=1e-3)
if how != "fixed":
    model = torch.load(path, weights_only=False)  # a new instance; the old one is freed
for step in range(20):
    x = torch.randn(32, 8)
    opt.zero_grad()
    alpha_opt.zero_grad()
    err = nn.functional.mse_loss(model(x).squeeze(-1), x[:, 0])
    (err * (-log_var).exp() + log_var).backward()
    opt.step()
    (-(log_alpha * (torch.randn(32) - 1.0)).mean()).backward()
    alpha_opt.step()
"""


def _run(tmp_path, source: str, *args: str) -> list[dict]:
    script = tmp_path / "loop.py"
    script.write_text(source)
    assert run_script(script, list(args), log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["severity"] in ("warning", "error")]


def _replaced(alerts: list[dict]) -> list[dict]:
    return [a for a in alerts if a["data"].get("kind") == "replaced_model"]


def _targets_told(alerts: list[dict]) -> list[str]:
    return sorted(
        a["data"]["model"]
        for a in alerts
        if a["rule"] == "accumulated_gradient"
        and a["data"].get("kind") == "target_receives_gradients"
    )


def test_one_critic_target_fed_gradients_beside_a_bare_temperature_is_told_only_as_a_target(
    tmp_path,
):
    alerts = _run(tmp_path, ONE_CRITIC, "bug", "tensor")
    assert _replaced(alerts) == []
    (alert,) = alerts
    assert (alert["rule"], alert["step"]) == ("accumulated_gradient", 1)
    assert alert["data"]["kind"] == "target_receives_gradients"


def test_a_temperature_held_as_a_parameter_of_no_module_is_no_replaced_model_either(tmp_path):
    alerts = _run(tmp_path, ONE_CRITIC, "bug", "parameter")
    assert _replaced(alerts) == []
    assert [a["rule"] for a in alerts] == ["accumulated_gradient"]


def test_one_critic_sac_under_no_grad_is_silent(tmp_path):
    assert _run(tmp_path, ONE_CRITIC, "clean", "tensor") == []


@pytest.mark.parametrize("temperature", ["tensor", "parameter"])
def test_twin_critic_sac_targets_fed_gradients_are_told_only_as_targets(tmp_path, temperature):
    alerts = _run(tmp_path, TWIN_CRITICS, "bug", temperature)
    assert _replaced(alerts) == []
    assert len(_targets_told(alerts)) == 2
    assert {a["rule"] for a in alerts} == {"accumulated_gradient"}


def test_twin_critic_sac_under_no_grad_is_silent(tmp_path):
    assert _run(tmp_path, TWIN_CRITICS, "clean", "tensor") == []


def test_a_model_replaced_beside_a_temperature_optimizer_is_still_told(tmp_path):
    alerts = _run(tmp_path, LOADED_OVER_THE_MODEL, "bug", str(tmp_path / "model.pt"))
    (told,) = _replaced(alerts)
    assert told["step"] <= 3 and told["data"]["stale_class"] is None
    assert told["data"]["optimizer_class"] == "SGD"  # the model's, not the temperature's
    assert told["data"]["parameters"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert [a["rule"] for a in alerts] == ["not_optimized"]


def test_a_model_replaced_while_its_optimizer_also_steps_a_loss_weight_is_told(tmp_path):
    alerts = _run(tmp_path, LOADED_OVER_THE_MODEL, "with-loss-weight", str(tmp_path / "model.pt"))
    (told,) = _replaced(alerts)
    assert told["step"] <= 3 and told["data"]["optimizer_class"] == "SGD"


def test_the_model_its_optimizer_holds_beside_a_temperature_is_silent(tmp_path):
    assert _run(tmp_path, LOADED_OVER_THE_MODEL, "fixed", str(tmp_path / "model.pt")) == []
