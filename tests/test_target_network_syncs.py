"""A DQN's target network synced to the Q-network every N steps: its gradient jump is no explosion.

The step after a hard sync the TD targets jump, and the gradients 50-250x with
them: healthy. ``exploding_gradient`` finds the copy of the model that was just
set to its weights (whatever the style of the sync, under ``tw.watch`` where
the target is not watched and under ``trainwatch run`` where it is a model of
its own) and says nothing. A learning rate raised 100x between syncs, jumps that
go on long after a sync, and a broadcast in the loss are still told.
"""

from __future__ import annotations

import copy
import json
import runpy
import sys

import pytest
import torch
from torch import nn

from trainwatch.runner import run_script

# A replay buffer of a fixed environment whose every reward is 1, as in
# CartPole: the Q-network fits its targets closely before the first sync at
# step 200, whose targets then jump by about 1 (the old code's alert there: 57x).
SCRIPT = """
import copy
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

style, fault, how = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)


class QNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)
        )

    def forward(self, x):
        return self.net(x)


n = 4096
states, actions = torch.randn(n, 4), torch.randint(0, 2, (n,))
next_states = 0.9 * states + 0.3 * torch.randn(n, 4)
q_net = QNet()
target_net = copy.deepcopy(q_net)
optimizer = torch.optim.Adam(q_net.parameters(), lr=1e-3)
if how.startswith("watch"):
    import trainwatch as tw

    # watch_lagged: each step read back a step late, as on CUDA.
    readback = "lagged" if how == "watch_lagged" else "auto"
    monitor = tw.watch(
        q_net, optimizer, console=False, log_dir=os.environ["LOG_DIR"], readback=readback
    )


def sync():
    global target_net
    if style == "load_state_dict":
        target_net.load_state_dict(q_net.state_dict())
    elif style == "data_copy":
        for tp, p in zip(target_net.parameters(), q_net.parameters()):
            tp.data.copy_(p.data)
    elif style == "polyak_tau_1":  # stable-baselines3's polyak_update(tau=1.0)
        with torch.no_grad():
            for tp, p in zip(target_net.parameters(), q_net.parameters()):
                tp.data.mul_(1 - 1.0)
                torch.add(tp.data, p.data, alpha=1.0, out=tp.data)
    elif style == "deepcopy":
        target_net = copy.deepcopy(q_net)


for step in range(430):
    if fault == "lr_100x" and step == 330:
        for group in optimizer.param_groups:
            group["lr"] *= 100
    rewards = 100.0 if fault == "rewards_100x_from_the_sync" and step >= 200 else 1.0
    i = torch.randint(0, n, (64,))
    q_values = q_net(states[i]).gather(1, actions[i].unsqueeze(1))
    if fault != "broadcast":
        q_values = q_values.squeeze(1)  # (N,): kept (N, 1) it broadcasts against (N,)
    with torch.no_grad():
        targets = rewards + 0.99 * target_net(next_states[i]).max(1).values
    loss = F.smooth_l1_loss(q_values, targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if (step + 1) % 200 == 0:
        sync()
if how.startswith("watch"):
    monitor.close()
"""

STYLES = ["load_state_dict", "data_copy", "polyak_tau_1", "deepcopy"]


def _dqn(tmp_path, monkeypatch, style: str, fault: str, how: str) -> tuple[list, list]:
    """The alerts told first (rule, step, message) and the counts (rule, first, last)."""
    script, log = tmp_path / "dqn.py", tmp_path / "log"
    script.write_text(SCRIPT)
    args = [style, fault, how]
    if how == "run":
        run_script(script, args, log_dir=log, console=False)
    else:
        monkeypatch.setenv("LOG_DIR", str(log))
        monkeypatch.setattr(sys, "argv", [str(script), *args])
        runpy.run_path(str(script), run_name="__main__")
    alerts = [json.loads(line) for line in (log / "alerts.jsonl").read_text().splitlines()]
    counts = json.loads((log / "alert_counts.json").read_text())["counts"]
    return (
        [(a["rule"], a["step"], a["message"]) for a in alerts],
        [(c["rule"], c["first_step"], c["last_step"]) for c in counts],
    )


@pytest.mark.parametrize("how", ["watch", "run"])
@pytest.mark.parametrize("style", STYLES)
def test_a_target_network_hard_synced_every_n_steps_is_no_explosion(
    tmp_path, monkeypatch, style, how
):
    alerts, _ = _dqn(tmp_path, monkeypatch, style, "none", how)
    assert alerts == []


@pytest.mark.parametrize("style", ["load_state_dict", "deepcopy"])
def test_a_sync_read_back_a_step_late_is_no_explosion_either(tmp_path, monkeypatch, style):
    # The copy is then two of the model's moves behind when the jump is judged.
    alerts, _ = _dqn(tmp_path, monkeypatch, style, "none", "watch_lagged")
    assert alerts == []


@pytest.mark.parametrize("how", ["watch", "watch_lagged", "run"])
def test_a_learning_rate_raised_100x_between_syncs_is_still_exploding(tmp_path, monkeypatch, how):
    _, counts = _dqn(tmp_path, monkeypatch, "load_state_dict", "lr_100x", how)
    told = [(first, last) for rule, first, last in counts if rule == "exploding_gradient"]
    assert any(330 < last <= 340 for _, last in told)


def test_jumps_going_on_long_after_a_sync_are_told_naming_the_sync(tmp_path, monkeypatch):
    alerts, _ = _dqn(tmp_path, monkeypatch, "load_state_dict", "rewards_100x_from_the_sync", "run")
    (told,) = [(step, message) for rule, step, message in alerts if rule == "exploding_gradient"]
    step, message = told
    assert 250 <= step <= 260
    assert "the jumps began at step 200" in message and "target network's sync" in message


def test_a_broadcast_in_a_dqn_s_loss_is_still_told(tmp_path, monkeypatch):
    alerts, _ = _dqn(tmp_path, monkeypatch, "load_state_dict", "broadcast", "run")
    assert [rule for rule, _, _ in alerts] == ["broadcast"]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))


def _moved(model: nn.Module, scale: float = 1e-3) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


def _look(model: nn.Module):
    from trainwatch.collect.model_copies import ModelCopies

    return ModelCopies(lambda: model).look(step=0)


def _synced_after_one_more_move(model: nn.Module) -> bool:
    look = _look(model)
    if look is None:
        return False
    _moved(model)
    return look.synced() is not None


def test_a_copy_set_to_the_model_one_step_back_is_a_sync():
    torch.manual_seed(0)
    model = _Net()
    target = copy.deepcopy(model)  # noqa: F841 (found among live objects)
    _moved(model)
    assert _synced_after_one_more_move(model)


def test_a_copy_many_steps_behind_is_no_sync():
    torch.manual_seed(0)
    model = _Net()
    reference = copy.deepcopy(model)  # noqa: F841
    for _ in range(100):
        _moved(model)
    assert not _synced_after_one_more_move(model)


def test_a_copy_near_the_model_that_moves_every_step_is_no_sync():
    torch.manual_seed(0)
    model = _Net()
    ema = copy.deepcopy(model)
    _moved(model)
    look = _look(model)
    assert look is not None  # near enough to be looked at
    _moved(model)
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p, 0.01)
    assert look.synced() is None


def test_a_jump_held_back_at_the_last_step_is_told_at_close():
    import trainwatch as tw

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    monitor = tw.watch(model, optimizer, console=False)
    for step in range(80):
        if step == 79:
            snapshot = copy.deepcopy(model)  # noqa: F841 (a copy one step behind)
        loss = nn.functional.mse_loss(model(x), y) * (1e4 if step == 79 else 1.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert [a for a in monitor.alerts if a.rule == "exploding_gradient"] == []  # held
    monitor.close()
    assert [a.step for a in monitor.alerts if a.rule == "exploding_gradient"] == [79]
