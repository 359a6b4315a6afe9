"""broadcast in a loss built from many forward passes: policy gradients, their critics, DQN.

A reinforcement-learning loop makes one forward pass per environment step
(often on a batch of one), keeps each ``log_prob`` or value in a list and
builds the loss once per episode with ``torch.stack``/``torch.cat``; one
optimizer step per episode. Stacking ``(1,)`` log-probs gives ``(T, 1)``,
and ``(T, 1) * returns (T,)`` is ``(T, T)``. Each script below is unmodified
user code, run buggy and clean: under ``tw.watch`` (imported and handed a
monitor) and under ``trainwatch run``. A DQN's TD target and an n-step
actor-critic's bootstrap value come from passes under ``no_grad`` between the
online pass and the loss.
"""

from __future__ import annotations

import gc
import importlib.util
import io
import json
import subprocess
import sys
import textwrap
import warnings
import weakref
from pathlib import Path
from types import ModuleType

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.conftest import rules_of
from tests.lightning_models import quiet_trainer
from trainwatch.collect.broadcast import batch_broadcast
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

CORRIDOR = '''
import torch

EPISODE = 8


class Corridor:
    """A few corridors side by side: a step right pays 1, a step left costs 1."""

    def __init__(self, envs=1, seed=0):
        self.envs, self.gen = envs, torch.Generator().manual_seed(seed)

    def reset(self):
        self.t, self.pos = 0, torch.zeros(self.envs)
        return self._obs()

    def _obs(self):
        noise = torch.randn(self.envs, 3, generator=self.gen) * 0.1
        return torch.cat([self.pos[:, None] / EPISODE, noise], dim=1)

    def step(self, action):
        reward = action.reshape(self.envs).float() * 2 - 1
        self.pos, self.t = self.pos + reward, self.t + 1
        return self._obs(), reward, self.t >= EPISODE


def discounted(rewards, gamma=0.9):
    out, running = [], 0.0
    for reward in reversed(rewards):
        running = reward + gamma * running
        out.insert(0, running)
    return out
'''

# Textbook REINFORCE: one pass per step on a (1, 4) observation, one
# optimizer step per episode. Buggy: stack of (1,) log-probs is (T, 1).
REINFORCE = """
import sys
import torch
from torch import nn
from corridor import Corridor, discounted


def make():
    policy = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    return policy, [torch.optim.Adam(policy.parameters(), lr=1e-2)]


def train(policy, opts, episodes, buggy):
    env, (opt,) = Corridor(), opts
    for _ in range(episodes):
        obs, done, saved, rewards = env.reset(), False, [], []
        while not done:
            dist = torch.distributions.Categorical(logits=policy(obs))
            action = dist.sample()
            saved.append(dist.log_prob(action))
            obs, reward, done = env.step(action)
            rewards.append(float(reward))
        returns = torch.tensor(discounted(rewards))
        log_probs = torch.stack(saved) if buggy else torch.cat(saved)
        loss = (-log_probs * returns).sum()  # THE LOSS LINE
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    torch.manual_seed(0)
    policy, opts = make()
    train(policy, opts, 5, sys.argv[1:] == ["bug"])
    print("trained")
"""

# Continuous actions on four corridors at once: a Gaussian policy whose mean
# is (4, 1), so each log-prob is (4, 1); concatenated over the episode it is
# (4T, 1) against the flattened returns (4T,).
GAUSSIAN_VECTORISED = """
import sys
import torch
from torch import nn
from corridor import Corridor, discounted


class GaussianPolicy(nn.Module):
    def __init__(self):
        super().__init__()
        self.mean = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
        self.log_std = nn.Parameter(torch.zeros(1))

    def forward(self, obs):
        return self.mean(obs), self.log_std.exp().expand(obs.shape[0], 1)


def make():
    policy = GaussianPolicy()
    return policy, [torch.optim.Adam(policy.parameters(), lr=1e-2)]


def train(policy, opts, episodes, buggy):
    env, (opt,) = Corridor(envs=4), opts
    for _ in range(episodes):
        obs, done, saved, rewards = env.reset(), False, [], []
        while not done:
            mean, std = policy(obs)
            dist = torch.distributions.Normal(mean, std)
            action = dist.sample()
            saved.append(dist.log_prob(action))
            obs, reward, done = env.step(action > 0)
            rewards.append(reward)
        returns = torch.stack(discounted(rewards)).flatten()
        log_probs = torch.cat(saved)
        if not buggy:
            log_probs = log_probs.squeeze(-1)
        loss = -(log_probs * returns).mean()  # THE LOSS LINE
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    torch.manual_seed(0)
    policy, opts = make()
    train(policy, opts, 5, sys.argv[1:] == ["bug"])
    print("trained")
"""

# Actor-critic with a shared body and two heads on an unbatched (4,)
# observation: each value is (1,), their stack (T, 1) against returns (T,).
ACTOR_CRITIC = """
import sys
import torch
import torch.nn.functional as F
from torch import nn
from corridor import Corridor, discounted


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 32), nn.ReLU())
        self.policy = nn.Linear(32, 2)
        self.value = nn.Linear(32, 1)

    def forward(self, obs):
        h = self.body(obs)
        return F.softmax(self.policy(h), dim=-1), self.value(h)


def make():
    model = ActorCritic()
    return model, [torch.optim.Adam(model.parameters(), lr=1e-2)]


def train(model, opts, episodes, buggy):
    env, (opt,) = Corridor(), opts
    for _ in range(episodes):
        obs, done, log_probs, values, rewards = env.reset()[0], False, [], [], []
        while not done:
            probs, value = model(obs)
            dist = torch.distributions.Categorical(probs)
            action = dist.sample()
            log_probs.append(dist.log_prob(action))
            values.append(value)
            obs, reward, done = env.step(action)
            obs = obs[0]
            rewards.append(reward.item())
        returns = torch.tensor(discounted(rewards))
        stacked = torch.stack(values)
        if not buggy:
            stacked = stacked.squeeze(-1)
        advantage = returns - stacked.detach().view(-1)
        policy_loss = -(torch.stack(log_probs) * advantage).sum()
        value_loss = F.smooth_l1_loss(stacked, returns)  # THE LOSS LINE
        opt.zero_grad()
        (policy_loss + value_loss).backward()
        opt.step()


if __name__ == "__main__":
    torch.manual_seed(0)
    model, opts = make()
    train(model, opts, 5, sys.argv[1:] == ["bug"])
    print("trained")
"""

# Advantage actor-critic on four corridors with a separate actor and critic,
# each with its own optimizer: each value is (4, 1), concatenated (4T, 1)
# against the concatenated returns (4T,).
A2C_SEPARATE = """
import sys
import torch
import torch.nn.functional as F
from torch import nn
from corridor import Corridor, discounted


def make():
    actor = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
    critic = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
    opts = [
        torch.optim.Adam(actor.parameters(), lr=1e-2),
        torch.optim.Adam(critic.parameters(), lr=1e-2),
    ]
    return (actor, critic), opts


def train(models, opts, episodes, buggy):
    (actor, critic), env = models, Corridor(envs=4)
    for _ in range(episodes):
        obs, done, log_probs, values, rewards = env.reset(), False, [], [], []
        while not done:
            dist = torch.distributions.Categorical(logits=actor(obs))
            action = dist.sample()
            log_probs.append(dist.log_prob(action))
            values.append(critic(obs))
            obs, reward, done = env.step(action)
            rewards.append(reward)
        returns = torch.cat(discounted(rewards))
        values = torch.cat(values)
        if not buggy:
            values = values.squeeze(-1)
        advantage = returns - values.detach().reshape(-1)
        actor_loss = -(torch.cat(log_probs) * advantage).mean()
        critic_loss = F.mse_loss(values, returns)  # THE LOSS LINE
        for opt in opts:
            opt.zero_grad()
        (actor_loss + critic_loss).backward()
        for opt in opts:
            opt.step()


if __name__ == "__main__":
    torch.manual_seed(0)
    models, opts = make()
    train(models, opts, 5, sys.argv[1:] == ["bug"])
    print("trained")
"""

# The forms of PyTorch's own examples: a loss term per environment step,
# concatenated or stacked from matching shapes. Clean whichever way it runs.
PER_STEP_TERMS = """
import sys
import torch
import torch.nn.functional as F
from torch import nn
from corridor import Corridor, discounted


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine = nn.Linear(4, 32)
        self.action_head = nn.Linear(32, 2)
        self.value_head = nn.Linear(32, 1)

    def forward(self, x):
        h = F.relu(self.affine(x))
        return F.softmax(self.action_head(h), dim=-1), self.value_head(h)


def make():
    model = Policy()
    return model, [torch.optim.Adam(model.parameters(), lr=1e-2)]


def train(model, opts, episodes, buggy):
    env, (opt,) = Corridor(), opts
    for _ in range(episodes):
        obs, done, saved, rewards = env.reset(), False, [], []
        while not done:
            probs, value = model(obs)
            dist = torch.distributions.Categorical(probs)
            action = dist.sample()
            saved.append((dist.log_prob(action), value))
            obs, reward, done = env.step(action)
            rewards.append(reward.item())
        returns = torch.tensor(discounted(rewards))
        returns = (returns - returns.mean()) / (returns.std() + 1e-6)
        policy_losses, value_losses = [], []
        for (log_prob, value), R in zip(saved, returns):
            advantage = R - value.item()
            policy_losses.append(-log_prob * advantage)
            value_losses.append(F.smooth_l1_loss(value, torch.tensor([[R]])))
        loss = torch.cat(policy_losses).sum() + torch.stack(value_losses).sum()  # THE LOSS LINE
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    torch.manual_seed(0)
    model, opts = make()
    train(model, opts, 5, False)
    print("trained")
"""

# Deep Q-learning from a replay buffer: actions chosen by a no-grad pass, then
# per update the online pass q(s, a) and, under no_grad after it, the TD target
# from next_q. Buggy: the gathered q is (N, 1) against the (N,) target. NEXT_Q
# is the target: the same network's max, a target network's, or Double DQN's
# (the online network's argmax, the target network's value).
DQN = """
import copy
import sys
import torch
import torch.nn.functional as F
from torch import nn
from corridor import Corridor

BATCH = 8


def make():
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
    return model, [torch.optim.Adam(model.parameters(), lr=1e-3)]


def act(model, obs, explore):
    if torch.rand(()) < explore:
        return torch.randint(0, 2, (1,))
    with torch.no_grad():
        return model(obs).argmax(1)


def train(model, opts, episodes, buggy):
    env, (opt,), buffer = Corridor(), opts, []
    target_net = copy.deepcopy(model)
    updates = 0
    for _ in range(episodes):
        obs, done = env.reset(), False
        while not done:
            action = act(model, obs, 0.3)
            next_obs, reward, done = env.step(action)
            buffer.append((obs[0], action[0], reward[0], next_obs[0], float(done)))
            obs = next_obs
            if len(buffer) < BATCH:
                continue
            picked = [buffer[int(i)] for i in torch.randint(len(buffer), (BATCH,))]
            s, a, r, s2, d = (torch.stack([torch.as_tensor(x) for x in f]) for f in zip(*picked))
            q = model(s).gather(1, a[:, None])
            if not buggy:
                q = q.squeeze(1)
            with torch.no_grad():
                next_q = NEXT_Q
            target = r + 0.9 * next_q * (1 - d)
            loss = F.mse_loss(q, target)  # THE LOSS LINE
            opt.zero_grad()
            loss.backward()
            opt.step()
            updates += 1
            if updates % 8 == 0:
                target_net.load_state_dict(model.state_dict())


if __name__ == "__main__":
    torch.manual_seed(0)
    model, opts = make()
    train(model, opts, 5, sys.argv[1:] == ["bug"])
    print("trained")
"""
NEXT_Q = {
    "dqn": "model(s2).max(1).values",
    "dqn_target_net": "target_net(s2).max(1).values",
    "double_dqn": "target_net(s2).gather(1, model(s2).argmax(1, keepdim=True)).squeeze(1)",
}

# n-step advantage actor-critic: a rollout of one pass per step, then the
# bootstrap value V(s_n) from a pass under no_grad, then the loss; a greedy
# evaluation episode under no_grad after each training episode. Buggy: the
# concatenated values are (n, 1) against the (n,) returns.
A2C_BOOTSTRAP = """
import sys
import torch
import torch.nn.functional as F
from torch import nn
from corridor import Corridor

ROLLOUT = 4


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 32), nn.Tanh())
        self.policy = nn.Linear(32, 2)
        self.value = nn.Linear(32, 1)

    def forward(self, obs):
        h = self.body(obs)
        return self.policy(h), self.value(h)


def make():
    model = ActorCritic()
    return model, [torch.optim.Adam(model.parameters(), lr=1e-2)]


def evaluate(model):
    env, score = Corridor(seed=1), 0.0
    obs, done = env.reset(), False
    with torch.no_grad():
        while not done:
            obs, reward, done = env.step(model(obs)[0].argmax(1))
            score += float(reward)
    return score


def train(model, opts, episodes, buggy):
    env, (opt,) = Corridor(), opts
    for _ in range(episodes):
        obs, done = env.reset(), False
        while not done:
            log_probs, values, rewards = [], [], []
            for _ in range(ROLLOUT):
                logits, value = model(obs)
                dist = torch.distributions.Categorical(logits=logits)
                action = dist.sample()
                log_probs.append(dist.log_prob(action))
                values.append(value)
                obs, reward, done = env.step(action)
                rewards.append(float(reward))
            with torch.no_grad():
                running = 0.0 if done else float(model(obs)[1])
            returns = []
            for reward in reversed(rewards):
                running = reward + 0.9 * running
                returns.insert(0, running)
            returns = torch.tensor(returns)
            values = torch.cat(values)
            if not buggy:
                values = values.squeeze(1)
            advantage = returns - values.detach().view(-1)
            policy_loss = -(torch.cat(log_probs) * advantage).mean()
            value_loss = F.mse_loss(values, returns)  # THE LOSS LINE
            opt.zero_grad()
            (policy_loss + value_loss).backward()
            opt.step()
        evaluate(model)


if __name__ == "__main__":
    torch.manual_seed(0)
    model, opts = make()
    train(model, opts, 5, sys.argv[1:] == ["bug"])
    print("trained")
"""

T = 8  # corridor.EPISODE
SCRIPTS = {
    "reinforce": (REINFORCE, "mul", [[T, 1], [T]], [T, T]),
    "gaussian_vectorised": (GAUSSIAN_VECTORISED, "mul", [[4 * T, 1], [4 * T]], [4 * T, 4 * T]),
    "actor_critic": (ACTOR_CRITIC, "smooth_l1_loss", [[T, 1], [T]], [T, T]),
    "a2c_separate": (A2C_SEPARATE, "mse_loss", [[4 * T, 1], [4 * T]], [4 * T, 4 * T]),
    # The target comes from passes under no_grad after the online pass.
    **{
        name: (DQN.replace("NEXT_Q", next_q), "mse_loss", [[8, 1], [8]], [8, 8])
        for name, next_q in NEXT_Q.items()
    },
    "a2c_bootstrap": (A2C_BOOTSTRAP, "mse_loss", [[4, 1], [4]], [4, 4]),
}
BUGGY = list(SCRIPTS)
SCRIPTS["per_step_terms"] = (PER_STEP_TERMS, "", [], [])


def write(tmp_path: Path, name: str) -> Path:
    (tmp_path / "corridor.py").write_text(textwrap.dedent(CORRIDOR))
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(SCRIPTS[name][0]))
    return path


def load(tmp_path: Path, name: str) -> ModuleType:
    """The script imported as a module (its ``__main__`` block does not run)."""
    path = write(tmp_path, name)
    sys.path.insert(0, str(tmp_path))
    try:
        spec = importlib.util.spec_from_file_location(f"script_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(tmp_path))
    return module


def loss_line(name: str) -> int:
    lines = textwrap.dedent(SCRIPTS[name][0]).splitlines()
    return next(i + 1 for i, line in enumerate(lines) if "THE LOSS LINE" in line)


@pytest.fixture(autouse=True)
def _forget_script_modules():
    yield
    sys.modules.pop("corridor", None)
    assert torch._C._len_torch_function_stack() == 0


def watched_training(tmp_path, quiet_watch, name: str, buggy: bool, **overrides) -> list:
    """Train the script's own models for five episodes, every model watched."""
    script = load(tmp_path, name)
    torch.manual_seed(0)
    models, opts = script.make()
    if isinstance(models, tuple):  # a separate actor and critic: one monitor each
        monitors = [quiet_watch(m, o, **overrides) for m, o in zip(models, opts)]
    else:
        monitors = [quiet_watch(models, opts, **overrides)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        script.train(models, opts, 5, buggy)
    # torch's own warning for a mismatched loss still names the user's line
    # (the audit calls the loss function from in between), and no other comes.
    where = {(Path(w.filename).name, w.lineno) for w in seen}
    assert where <= {(f"{name}.py", loss_line(name))}, [str(w.message) for w in seen]
    return monitors


@pytest.mark.parametrize("name", BUGGY)
def test_a_loss_stacked_from_one_pass_per_env_step_broadcasting_is_caught_in_the_first_episode(
    tmp_path, quiet_watch, name
):
    _, op, shapes, result = SCRIPTS[name]
    monitors = watched_training(tmp_path, quiet_watch, name, buggy=True)
    found = [a for m in monitors for a in m.alerts if a.rule == "broadcast"]
    assert len(found) == 1, [a.message for m in monitors for a in m.alerts]
    (alert,) = found
    assert alert.step == 0 and alert.module is None and alert.severity == "error"
    assert alert.data["op"] == op
    assert sorted(alert.data["shapes"], key=len) == sorted(shapes, key=len)
    assert alert.data["result"] == result
    assert alert.data["source"].endswith(f"{name}.py:{loss_line(name)}")


def test_torchs_own_warning_for_the_mismatched_critic_loss_points_at_the_users_line(tmp_path):
    script = load(tmp_path, "actor_critic")
    torch.manual_seed(0)
    model, opts = script.make()
    with tw.watch(model, opts, console=io.StringIO()):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            script.train(model, opts, 2, True)
    (found,) = [w for w in seen if "target size" in str(w.message)][:1]
    assert (Path(found.filename).name, found.lineno) == (
        "actor_critic.py",
        loss_line("actor_critic"),
    )
    with tw.watch(model, opts, console=io.StringIO()):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # the user's own filter still applies
            with pytest.raises(UserWarning, match="target size"):
                script.train(model, opts, 1, True)
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_the_same_loop_with_matching_shapes_is_silent(tmp_path, quiet_watch, name):
    monitors = watched_training(tmp_path, quiet_watch, name, buggy=False)
    assert [rules_of(m) for m in monitors] == [[] for _ in monitors]


def test_a_separate_critic_is_named_by_its_own_monitor_and_the_actors_stays_silent(
    tmp_path, quiet_watch
):
    actor_monitor, critic_monitor = watched_training(
        tmp_path, quiet_watch, "a2c_separate", buggy=True
    )
    assert "broadcast" not in rules_of(actor_monitor)
    assert rules_of(critic_monitor) == ["broadcast"]


def test_the_passes_outputs_are_held_only_by_the_users_list(tmp_path, quiet_watch):
    """Followed tensors are held weakly: once the episode's list goes, they go too."""
    script = load(tmp_path, "reinforce")
    torch.manual_seed(0)
    policy, (opt,) = script.make()
    quiet_watch(policy, opt)
    env = script.Corridor()
    obs, saved = env.reset(), []
    for _ in range(6):
        with torch.no_grad():  # no graph of the user's to hold them either
            saved.append(policy(obs))
        saved.append(
            torch.distributions.Categorical(logits=policy(obs)).log_prob(torch.tensor([0]))
        )
    refs = [weakref.ref(t) for t in saved]
    del saved
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def test_past_the_audit_an_episode_runs_with_no_function_mode(tmp_path, quiet_watch):
    script = load(tmp_path, "reinforce")
    torch.manual_seed(0)
    policy, opts = script.make()
    monitor = quiet_watch(policy, opts[0], broadcast={"audit_steps": 2})
    script.train(policy, opts, 2, buggy=False)
    env = script.Corridor()
    policy(env.reset())
    assert torch._C._len_torch_function_stack() == 0  # nothing of the audit runs any more
    script.train(policy, opts, 2, buggy=True)  # too late to be seen
    assert rules_of(monitor) == []


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_under_trainwatch_run_the_unmodified_script_is_caught_and_its_clean_twin_is_silent(
    tmp_path, capsys, name
):
    script = write(tmp_path, name)
    _, op, _, result = SCRIPTS[name]
    for buggy in (True, False) if name in BUGGY else (False,):
        log = tmp_path / f"log-{buggy}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's own, for a mismatched loss
            code = run_script(script, ["bug"] if buggy else [], log_dir=log, console=False)
        assert code == 0
        found = [json.loads(line) for line in (log / "alerts.jsonl").read_text().splitlines()]
        rules = [
            (a["rule"], a["step"], a["data"].get("op"), a["data"].get("result")) for a in found
        ]
        assert rules == ([("broadcast", 0, op, result)] if buggy else []), (buggy, rules)
        sys.modules.pop("corridor", None)
    assert "trained" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["reinforce", "actor_critic"])
def test_the_textbook_bug_fails_the_gate_from_the_console_script(tmp_path, name):
    script = write(tmp_path, name)
    _, op, _, result = SCRIPTS[name]
    log = tmp_path / "log"
    run = subprocess.run(
        [sys.executable, "-m", "trainwatch", "run", "--log-dir", str(log)]
        + ["--fail-on", "error", "--no-console", str(script), "bug"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert "trained" in run.stdout, run.stderr
    assert run.returncode == 3, run.stderr
    assert "Traceback" not in run.stderr
    (alert,) = [json.loads(line) for line in (log / "alerts.jsonl").open()]
    assert (alert["rule"], alert["step"], alert["data"]["op"]) == ("broadcast", 0, op)
    assert alert["data"]["result"] == result
    assert alert["data"]["source"].endswith(f"{name}.py:{loss_line(name)}")


@pytest.mark.parametrize(
    ("first", "second", "result"),
    [
        ((T, 1), (T,), (T, T)),  # a stack of batch-of-one log-probs against the returns
        ((4 * T, 1), (4 * T,), (4 * T, 4 * T)),  # four envs' steps concatenated
        ((T, 4, 1), (4,), (T, 4, 4)),  # stacked (4, 1) values against one step's (4,)
        ((T, 1, 1), (T, 1), (T, T, 1)),  # stacked (1, 1) values against (T, 1) returns
        ((T, 1, 1), (T,), (T, 1, T)),
        ((T, 4), (T, 4), None),  # stacked and squeezed: matching
        ((T, 4, 1), (T, 4, 1), None),
        ((T, 1), (1,), None),  # against one step's scalar return
    ],
)
def test_shapes_alone_decide_whatever_the_models_batch(first, second, result):
    assert batch_broadcast(first, second) == result


def _value_episodes(critic, opt, episodes: int, returns_shape) -> None:
    """A critic on (1, 4) observations: each value is (1, 1), stacked (T, 1, 1)."""
    for _ in range(episodes):
        values = [critic(torch.randn(1, 4)) for _ in range(T)]
        returns = torch.linspace(1.0, 0.0, T).reshape(returns_shape)
        loss = torch.nn.functional.mse_loss(torch.stack(values), returns)
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize(
    ("returns_shape", "result"), [((T, 1), [T, T, 1]), ((T, 1, 1), None), ((T,), [T, 1, T])]
)
def test_stacked_single_values_against_returns_are_judged_past_the_trailing_feature(
    quiet_watch, returns_shape, result
):
    torch.manual_seed(0)
    critic = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(critic.parameters(), lr=1e-2)
    monitor = quiet_watch(critic, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's own, for the mismatched ones
        _value_episodes(critic, opt, 2, returns_shape)
    found = [a.data["result"] for a in monitor.alerts if a.rule == "broadcast"]
    assert found == ([] if result is None else [result])


def test_a_pairwise_ranking_loss_over_one_tensors_rows_is_silent(quiet_watch):
    """``s - s.view(-1)`` compares every score with every other on purpose."""
    torch.manual_seed(0)
    scorer = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(scorer.parameters(), lr=1e-2)
    monitor = quiet_watch(scorer, opt)
    for _ in range(3):
        x = torch.randn(16, 4)
        relevance = x[:, 0]
        scores = scorer(x)  # (16, 1)
        pairs = scores - scores.view(-1)  # (16, 16): score i minus score j
        order = torch.sign(relevance[:, None] - relevance[None, :])
        loss = torch.nn.functional.softplus(-order * pairs).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert rules_of(monitor) == []


class _EpisodeModule(pl.LightningModule):
    """REINFORCE in Lightning: each training step plays one episode of batch-of-one passes."""

    def __init__(self, buggy: bool) -> None:
        super().__init__()
        self.policy = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)
        )
        self.buggy = buggy
        self.gen = torch.Generator().manual_seed(0)

    def training_step(self, batch, batch_idx):
        saved, rewards = [], []
        for _ in range(T):
            obs = torch.randn(1, 4, generator=self.gen)
            dist = torch.distributions.Categorical(logits=self.policy(obs))
            action = dist.sample()
            saved.append(dist.log_prob(action))
            rewards.append(float(action) * 2 - 1)
        returns = torch.tensor(rewards).flip(0).cumsum(0).flip(0)
        log_probs = torch.stack(saved) if self.buggy else torch.cat(saved)
        return (-log_probs * returns).sum()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("buggy", [True, False])
def test_a_lightning_module_playing_an_episode_per_step(tmp_path, buggy):
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(
        tmp_path, [callback], max_steps=4, limit_val_batches=0, num_sanity_val_steps=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's own notes on a tiny run
        trainer.fit(_EpisodeModule(buggy))
    found = [
        (a.rule, a.step, a.data.get("result"))
        for a in callback.alerts
        if a.severity in ("warning", "error")
    ]
    # The module has no forward of its own, only its policy is called: its parts'
    # calls count as passes from the first step.
    assert found == ([("broadcast", 0, [T, T])] if buggy else [])
