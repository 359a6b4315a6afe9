"""Twin critics' targets fed gradients each name the critic they copy.

Clipped double-Q (SAC, TD3) keeps two critics of one architecture, q1 and q2,
each with a Polyak target (``q1_t = copy.deepcopy(q1)``, ``q2_t =
copy.deepcopy(q2)``). With the TD target computed outside ``torch.no_grad()``
both targets get gradients and are told as targets fed gradients, naming the
model each copies (``data.copy_of``). Both used to name q1, the first model
found with matching shapes. A target starts as an exact copy of its own critic
and follows it by Polyak averaging, so it stays nearest it by weights: where
several models match by shape, the nearest is named. A DQN's single target
still names its Q-network.
"""

from __future__ import annotations

import copy
import io
import json

import torch
from torch import nn

import trainwatch as tw
from trainwatch.runner import run_script

# Twin Sequential critics; argv: bug|clean, and which target the min() calls first.
TWIN_SEQUENTIAL = """
import copy
import sys
import torch
from torch import nn
from torch.nn import functional as F

bug, q2_first = sys.argv[1] == "bug", sys.argv[2] == "q2-first"
torch.manual_seed(0)
actor = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 1), nn.Tanh())
q1 = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 1))
q2 = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 1))
q1_t, q2_t = copy.deepcopy(q1), copy.deepcopy(q2)
actor_opt = torch.optim.Adam(actor.parameters(), lr=3e-4)
q1_opt = torch.optim.Adam(q1.parameters(), lr=3e-4)
q2_opt = torch.optim.Adam(q2.parameters(), lr=3e-4)


def target_q(x):
    if q2_first:
        t2 = q2_t(x)
        return torch.min(q1_t(x), t2)
    return torch.min(q1_t(x), q2_t(x))


for step in range(30):
    s, a, r, s2 = torch.randn(64, 2), torch.rand(64, 1) * 2 - 1, torch.randn(64), torch.randn(64, 2)
    actor_opt.zero_grad(); q1_opt.zero_grad(); q2_opt.zero_grad()
    x2 = torch.cat([s2, actor(s2)], -1)
    if bug:
        y = r + 0.99 * target_q(x2).squeeze(-1)
    else:
        with torch.no_grad():
            y = r + 0.99 * target_q(x2).squeeze(-1)
    x = torch.cat([s, a], -1)
    (F.mse_loss(q1(x).squeeze(-1), y) + F.mse_loss(q2(x).squeeze(-1), y)).backward()
    q1_opt.step(); q2_opt.step()
    xa = torch.cat([s, actor(s)], -1)
    (-torch.min(q1(xa), q2(xa)).mean()).backward()
    actor_opt.step()
    with torch.no_grad():
        for net, tgt in ((q1, q1_t), (q2, q2_t)):
            for p, pt in zip(net.parameters(), tgt.parameters()):
                pt.mul_(0.995).add_(0.005 * p)
"""

# A DQN with one Polyak target, next to no other model of its shapes.
DQN = """
import copy
import sys
import torch
from torch import nn


class QNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x):
        return self.net(x)


torch.manual_seed(0)
net = QNet()
target_net = copy.deepcopy(net)
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
for step in range(12):
    s, s2 = torch.randn(32, 4), torch.randn(32, 4)
    a, r = torch.randint(0, 2, (32,)), torch.randn(32)
    if sys.argv[1] == "bug":
        y = r + 0.99 * target_net(s2).max(1).values
    else:
        with torch.no_grad():
            y = r + 0.99 * target_net(s2).max(1).values
    q = net(s).gather(1, a[:, None]).squeeze(1)
    opt.zero_grad()
    nn.functional.mse_loss(q, y).backward()
    opt.step()
    with torch.no_grad():
        for pt, p in zip(target_net.parameters(), net.parameters()):
            pt.lerp_(p, 0.01)
"""


def _run(tmp_path, source: str, *args: str) -> list[dict]:
    script = tmp_path / "loop.py"
    script.write_text(source)
    assert run_script(script, list(args), log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["severity"] in ("warning", "error")]


def _copies(alerts: list[dict]) -> dict[str, str]:
    """Each target told as fed gradients, with the model it is told to copy."""
    return {
        a["data"]["model"]: a["data"]["copy_of"]
        for a in alerts
        if a["data"].get("kind") == "target_receives_gradients"
    }


def test_twin_targets_fed_gradients_each_name_their_own_critic(tmp_path):
    # Called in order actor, q1_t, q2_t, q1, q2: Sequential, #2, #3, #4, #5.
    alerts = _run(tmp_path, TWIN_SEQUENTIAL, "bug", "q1-first")
    assert _copies(alerts) == {"Sequential#2": "Sequential#4", "Sequential#3": "Sequential#5"}
    assert "the copy of Sequential#5" in next(
        a["message"] for a in alerts if a["data"]["model"] == "Sequential#3"
    )
    assert len(alerts) == 2


def test_twin_targets_called_the_other_way_round_still_name_their_own_critic(tmp_path):
    # q2_t is called first now: actor, q2_t, q1_t, q1, q2.
    alerts = _run(tmp_path, TWIN_SEQUENTIAL, "bug", "q2-first")
    assert _copies(alerts) == {"Sequential#2": "Sequential#5", "Sequential#3": "Sequential#4"}
    assert len(alerts) == 2


def test_twin_targets_under_no_grad_are_silent(tmp_path):
    assert _run(tmp_path, TWIN_SEQUENTIAL, "clean", "q1-first") == []


def test_a_dqn_target_fed_gradients_names_its_q_network(tmp_path):
    (alert,) = _run(tmp_path, DQN, "bug")
    assert alert["data"]["model"] == "QNet" and _copies([alert]) == {"QNet": "QNet#2"}


def test_a_dqn_target_under_no_grad_is_silent(tmp_path):
    assert _run(tmp_path, DQN, "clean") == []


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x).squeeze(-1)


class Q1(Critic):
    """The first critic (a class of its own: tw.watch names a model by its class)."""


class Q2(Critic):
    """The second critic, of the same architecture."""


def _watched_twin_critics(no_grad: bool) -> list[list[tw.Alert]]:
    """Twin critics watched with their optimizers, their Polyak targets watched alone
    and stepped by hand after each update: the warnings and errors of q1, q2, q1_t
    and q2_t."""
    torch.manual_seed(0)
    q1, q2 = Q1(), Q2()
    q1_t, q2_t = copy.deepcopy(q1), copy.deepcopy(q2)
    opt1 = torch.optim.Adam(q1.parameters(), lr=3e-4)
    opt2 = torch.optim.Adam(q2.parameters(), lr=3e-4)
    monitors = [
        tw.watch(q1, opt1, console=io.StringIO()),
        tw.watch(q2, opt2, console=io.StringIO()),
        tw.watch(q1_t, console=io.StringIO()),
        tw.watch(q2_t, console=io.StringIO()),
    ]
    try:
        for _ in range(6):
            x, x2, r = torch.randn(32, 3), torch.randn(32, 3), torch.randn(32)
            with torch.no_grad() if no_grad else torch.enable_grad():
                y = r + 0.99 * torch.min(q1_t(x2), q2_t(x2))
            opt1.zero_grad()
            opt2.zero_grad()
            (nn.functional.mse_loss(q1(x), y) + nn.functional.mse_loss(q2(x), y)).backward()
            opt1.step()
            opt2.step()
            with torch.no_grad():
                for net, tgt in ((q1, q1_t), (q2, q2_t)):
                    for p, pt in zip(net.parameters(), tgt.parameters()):
                        pt.lerp_(p, 0.005)
            monitors[2].step()
            monitors[3].step()
        return [[a for a in m.alerts if a.severity in ("warning", "error")] for m in monitors]
    finally:
        for monitor in reversed(monitors):
            monitor.close()


def test_under_watch_twin_targets_fed_gradients_each_name_their_own_critic():
    q1, q2, q1_t, q2_t = _watched_twin_critics(no_grad=False)
    assert q1 == q2 == []
    for (alert,), critic in ((q1_t, "Q1"), (q2_t, "Q2")):
        assert (alert.rule, alert.step) == ("accumulated_gradient", 1)
        assert alert.data["kind"] == "target_receives_gradients"
        assert alert.data["copy_of"] == critic
        assert f"the copy of {critic} " in alert.message


def test_under_watch_twin_targets_under_no_grad_are_silent():
    assert _watched_twin_critics(no_grad=True) == [[], [], [], []]
