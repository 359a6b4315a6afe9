"""A target network fed gradients by a target computed outside ``torch.no_grad()``.

SAC, DQN, TD3 and DDPG keep a copy of a trained model that no optimizer holds
and that the loop moves by hand (Polyak averaging, a sync every few steps) or
not at all. A TD target built with gradients makes backward write into that
copy, where nothing resets them, and into whatever the target was computed
from (SAC's actor and temperature). That is no hand-written update missing its
``zero_grad()``: the finding names the copy's model and points at
``torch.no_grad()`` (``data.kind: target_receives_gradients``). A model with
its own optimizer missing its reset keeps the usual message.
"""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
from torch import nn

import trainwatch as tw
from trainwatch.runner import run_script

SAC = """
import copy
import sys
import torch
from torch import nn
from torch.nn import functional as F

bug = sys.argv[1] == "bug"


def mlp(i, o):
    return nn.Sequential(nn.Linear(i, 16), nn.ReLU(), nn.Linear(16, o))


class Actor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp(3, 2)

    def forward(self, obs):
        mu, log_std = self.body(obs).chunk(2, -1)
        u = mu + log_std.clamp(-5, 2).exp() * torch.randn_like(mu)
        return torch.tanh(u), (-0.5 * u.pow(2) - log_std).sum(-1)


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.q1, self.q2 = mlp(4, 1), mlp(4, 1)

    def forward(self, obs, act):
        x = torch.cat([obs, act], -1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


torch.manual_seed(0)
actor, critic = Actor(), Critic()
critic_target = copy.deepcopy(critic)
log_alpha = torch.zeros((), requires_grad=True)
actor_opt = torch.optim.Adam(actor.parameters(), lr=3e-4)
critic_opt = torch.optim.Adam(critic.parameters(), lr=3e-4)
alpha_opt = torch.optim.Adam([log_alpha], lr=3e-4)


def td_target(r, d, s2):
    a2, logp2 = actor(s2)
    q1_t, q2_t = critic_target(s2, a2)
    return r + 0.99 * (1 - d) * (torch.min(q1_t, q2_t) - log_alpha.exp() * logp2)


for t in range(8):
    s, a, s2 = torch.randn(32, 3), torch.rand(32, 1) * 2 - 1, torch.randn(32, 3)
    r, d = torch.randn(32), (torch.rand(32) < 0.05).float()
    actor_opt.zero_grad(); critic_opt.zero_grad(); alpha_opt.zero_grad()
    if bug:
        y = td_target(r, d, s2)
    else:
        with torch.no_grad():
            y = td_target(r, d, s2)
    q1, q2 = critic(s, a)
    (F.mse_loss(q1, y) + F.mse_loss(q2, y)).backward()
    critic_opt.step()
    critic.requires_grad_(False)
    a_pi, logp = actor(s)
    q1_pi, q2_pi = critic(s, a_pi)
    (log_alpha.exp().detach() * logp - torch.min(q1_pi, q2_pi)).mean().backward()
    actor_opt.step()
    critic.requires_grad_(True)
    (-(log_alpha * (logp.detach() - 1.0)).mean()).backward()
    alpha_opt.step()
    with torch.no_grad():
        for pt, pc in zip(critic_target.parameters(), critic.parameters()):
            pt.mul_(0.995).add_(0.005 * pc)
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
    if how == "bug":
        y = r + 0.99 * target_net(s2).max(1).values
    else:
        with torch.no_grad():
            y = r + 0.99 * target_net(s2).max(1).values
    q = net(s).gather(1, a[:, None]).squeeze(1)
    if how != "no-reset" or step < 2:
        opt.zero_grad()
    nn.functional.mse_loss(q, y).backward()
    opt.step()
    if step % sync == sync - 1:
        target_net.load_state_dict(net.state_dict())
"""


def _run(tmp_path, source: str, *args: str) -> list[dict]:
    script = tmp_path / "loop.py"
    script.write_text(source)
    assert run_script(script, list(args), log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["severity"] in ("warning", "error")]


def _is_target_finding(alert: dict, copy_of: str) -> bool:
    return (
        alert["data"].get("kind") == "target_receives_gradients"
        and alert["data"]["copy_of"] == copy_of
        and "torch.no_grad()" in alert["message"]
        and "torch.no_grad()" in alert["hint"]
        and "zero_grad() is missing" not in alert["message"]
    )


def test_sac_target_critic_fed_gradients_by_the_td_target_is_told_as_a_target(tmp_path):
    found = _run(tmp_path, SAC, "bug")
    (alert,) = found
    # The target copy is called first, so it has the plain name; the message says
    # which model it copies.
    where = (alert["rule"], alert["data"]["model"], alert["step"])
    assert where == ("accumulated_gradient", "Critic", 1)
    assert _is_target_finding(alert, "Critic#2")
    assert "the copy of Critic#2" in alert["message"]


def test_sac_with_the_td_target_under_no_grad_is_silent(tmp_path):
    assert _run(tmp_path, SAC, "clean") == []


def test_dqn_target_synced_every_few_steps_fed_gradients_is_told_as_a_target(tmp_path):
    # Told at its second step, before the first sync moves it; not again after.
    found = _run(tmp_path, DQN, "bug", "3", "12")
    (alert,) = found
    assert (alert["rule"], alert["data"]["model"], alert["step"]) == ("not_optimized", "QNet", 1)
    assert _is_target_finding(alert, "QNet#2")


def test_dqn_target_never_synced_yet_fed_gradients_is_told_once_as_a_target(tmp_path):
    # Not moved yet at its second step: told then; not again once the sync moves it.
    found = _run(tmp_path, DQN, "bug", "55", "70")
    (alert,) = found
    assert alert["step"] == 1
    where = (alert["rule"], alert["data"]["model"], alert["severity"])
    assert where == ("not_optimized", "QNet", "warning")
    assert _is_target_finding(alert, "QNet#2")


@pytest.mark.parametrize("sync", ["3", "55"])
def test_dqn_target_under_no_grad_is_silent(tmp_path, sync):
    assert _run(tmp_path, DQN, "clean", sync, "70") == []


def test_online_network_missing_its_reset_beside_a_target_keeps_the_usual_message(tmp_path):
    found = _run(tmp_path, DQN, "no-reset", "3", "8")
    (alert,) = found
    assert (alert["rule"], alert["data"]["model"]) == ("accumulated_gradient", "QNet#2")
    assert "zero_grad() is missing" in alert["message"]
    assert "kind" not in alert["data"]


class QNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _watched_polyak_loop(no_grad: bool) -> list[tw.Alert]:
    """An online network watched with its optimizer, its Polyak target watched on its
    own and stepped by hand after each update."""
    torch.manual_seed(0)
    net = QNet()
    target_net = copy.deepcopy(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    online = tw.watch(net, opt, console=io.StringIO())
    target = tw.watch(target_net, console=io.StringIO())
    try:
        for _ in range(6):
            s, s2 = torch.randn(32, 4), torch.randn(32, 4)
            a, r = torch.randint(0, 2, (32,)), torch.randn(32)
            with torch.no_grad() if no_grad else torch.enable_grad():
                y = r + 0.99 * target_net(s2).max(1).values
            q = net(s).gather(1, a[:, None]).squeeze(1)
            opt.zero_grad()
            nn.functional.mse_loss(q, y).backward()
            opt.step()
            with torch.no_grad():
                for pt, po in zip(target_net.parameters(), net.parameters()):
                    pt.lerp_(po, 0.01)
            target.step()
        return [a for a in [*online.alerts, *target.alerts] if a.severity in ("warning", "error")]
    finally:
        target.close()
        online.close()


def test_polyak_target_watched_on_its_own_fed_gradients_is_told_as_a_target():
    (alert,) = _watched_polyak_loop(no_grad=False)
    assert alert.rule == "accumulated_gradient" and alert.step == 1
    assert _is_target_finding(
        {"data": alert.data, "message": alert.message, "hint": alert.hint}, "QNet"
    )


def test_polyak_target_watched_on_its_own_under_no_grad_is_silent():
    assert _watched_polyak_loop(no_grad=True) == []


def test_hand_written_sgd_missing_its_reset_keeps_the_usual_message(quiet_watch):
    torch.manual_seed(0)
    model = QNet()
    monitor = quiet_watch(model)
    for _ in range(4):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
        monitor.step()
    (alert,) = [a for a in monitor.alerts if a.rule == "accumulated_gradient"]
    assert "zero_grad() is missing" in alert.message and "kind" not in alert.data
