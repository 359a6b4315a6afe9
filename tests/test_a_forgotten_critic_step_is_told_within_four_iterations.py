"""An actor-critic loop whose ``critic_opt.step()`` is forgotten from the start.

``critic_opt.zero_grad(); critic_loss.backward()`` and no step (or
``actor_opt.step()`` written twice, a copy-paste slip): the critic's gradient
is reset and written anew at every iteration, each one thrown away before any
step applies it. That was told only once the actor's optimizer had taken 20
steps; the gradients say it by the fourth iteration: three thrown away in a row.

Each planted bug beside its clean control, and the loops that look alike but
train the critic: gradient accumulation, a critic stepped every second or third
iteration, a GradScaler skipping the critic's steps while its scale comes
down, a learning-rate warm-up from 0, TD3's delayed actor with soft-updated
targets, PPO's epochs over a rollout, a frozen critic.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import trainwatch as tw
from trainwatch.collect.idle_optimizer import PATIENCE
from trainwatch.runner import run_script


class CartPole:
    """CartPole's dynamics, made here (no gym): a pole on a cart, pushed left or right."""

    def __init__(self, seed: int = 0) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        self.reset()

    def reset(self) -> torch.Tensor:
        self.state = (torch.rand(4, generator=self._gen) - 0.5) * 0.1
        self.t = 0
        return self.state.clone()

    def step(self, action: int) -> tuple[torch.Tensor, float, bool]:
        x, v, theta, omega = self.state.tolist()
        force = 10.0 if action == 1 else -10.0
        cos, sin = math.cos(theta), math.sin(theta)
        lean = (force + 0.05 * omega * omega * sin) / 1.1
        angular = (9.8 * sin - cos * lean) / (0.5 * (4 / 3 - 0.1 * cos * cos / 1.1))
        accel = lean - 0.05 * angular * cos / 1.1
        x, v, theta, omega = (
            x + 0.02 * v,
            v + 0.02 * accel,
            theta + 0.02 * omega,
            omega + 0.02 * angular,
        )
        self.state = torch.tensor([x, v, theta, omega])
        self.t += 1
        done = abs(x) > 2.4 or abs(theta) > 0.21 or self.t >= 200
        return self.state.clone(), 1.0, done


class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
        self.critic = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(state), self.critic(state).squeeze(-1)


def _a2c(
    critic: str,
    iterations: int = 30,
    reward_scale: float = 1.0,
    scaler_scale: float | None = None,
    warmup: bool = False,
) -> tuple[list, list[int]]:
    """Batch-of-one A2C, the actor's and the critic's losses each with its optimizer.

    ``critic``: ``"steps"``, ``"forgotten"``, ``"actor_twice"`` (``actor_opt.step()``
    where ``critic_opt.step()`` belongs), ``"accumulates"`` (4 backward passes a
    step, reset after it), ``"every_other"`` / ``"every_other_late"`` (reset every
    iteration, stepped at even / odd ones), ``"every_third_late"`` (reset every
    iteration, stepped at the third of each three: ``(it + 1) % 3 == 0``). Returns
    the alerts and the number of alerts told by the end of each iteration.
    """
    torch.manual_seed(0)
    env = CartPole()
    model = ActorCritic()
    actor_opt = torch.optim.Adam(model.actor.parameters(), 1e-3)
    critic_opt = torch.optim.Adam(model.critic.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=scaler_scale) if scaler_scale else None
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 10))
        for opt in (actor_opt, critic_opt)
        if warmup
    ]
    told: list[int] = []
    state = env.reset()
    with tw.watch(model, optimizer=[actor_opt, critic_opt], console=False) as monitor:
        for it in range(iterations):
            logits, value = model(state)
            dist = torch.distributions.Categorical(logits=logits)
            action = dist.sample()
            next_state, reward, done = env.step(action.item())
            with torch.no_grad():
                bootstrap = 0.0 if done else 0.99 * model.critic(next_state).squeeze(-1)
                target = reward * reward_scale + bootstrap
            advantage = (target - value).detach().clamp(-1, 1)
            actor_loss = -dist.log_prob(action) * advantage
            critic_loss = (target - value).pow(2)
            actor_opt.zero_grad()
            if scaler is None:
                actor_loss.backward()
                actor_opt.step()
            else:
                scaler.scale(actor_loss).backward()
                scaler.step(actor_opt)
            if critic != "accumulates":
                critic_opt.zero_grad()
            (critic_loss if scaler is None else scaler.scale(critic_loss)).backward()
            if critic == "actor_twice":
                actor_opt.step()
            elif critic == "steps" and scaler is not None:
                scaler.step(critic_opt)
            elif (
                critic == "steps"
                or (critic == "accumulates" and it % 4 == 3)
                or (critic == "every_other" and it % 2 == 0)
                or (critic == "every_other_late" and it % 2 == 1)
                or (critic == "every_third_late" and (it + 1) % 3 == 0)
            ):
                critic_opt.step()
                if critic == "accumulates":
                    critic_opt.zero_grad()
            if scaler is not None:
                scaler.update()
            for schedule in schedules:
                schedule.step()
            state = env.reset() if done else next_state
            told.append(len(monitor.alerts))
    return [a for a in monitor.alerts if a.severity != "info"], told


def _told_at(told: list[int]) -> int:
    """The iteration by whose end the first alert was told."""
    return next(i for i, count in enumerate(told) if count)


@pytest.mark.parametrize("critic", ["forgotten", "actor_twice"])
def test_a_forgotten_critic_step_is_told_by_the_fourth_iteration(critic):
    alerts, told = _a2c(critic)
    (alert,) = alerts
    assert alert.rule == "not_optimized" and alert.data["kind"] == "optimizer_never_steps"
    assert alert.module == "critic" and _told_at(told) <= 3
    assert alert.step == 0  # dated at the first step it missed
    assert alert.data["optimizer"] == 1 and alert.data["optimizer_name"] == "critic_opt"
    assert alert.data["lost_gradients"] == 3
    assert {name.split(".")[0] for name in alert.data["parameters"]} == {"critic"}
    assert "critic_opt.step()" in alert.hint


@pytest.mark.parametrize(
    "critic", ["steps", "accumulates", "every_other", "every_other_late", "every_third_late"]
)
def test_a_critic_that_steps_accumulates_or_steps_every_few_iterations_is_silent(critic):
    alerts, _ = _a2c(critic, iterations=2 * PATIENCE)
    assert alerts == []


def test_a_learning_rate_warm_up_from_zero_is_silent():
    """LambdaLR's factor is 0 at step 0: the first updates move nothing, yet step."""
    alerts, _ = _a2c("steps", iterations=2 * PATIENCE, warmup=True)
    assert alerts == []


# Returns in the hundreds overflow the critic's scaled gradients at a loss scale of
# 2**126 for the first several iterations, while the actor's (its advantage clipped)
# stay finite: the scaler skips the critic's steps until its scale has come down.
_OVERFLOWING = {"reward_scale": 100.0, "scaler_scale": 2.0**126}


def test_a_grad_scaler_skipping_the_critics_first_steps_is_silent():
    alerts, _ = _a2c("steps", iterations=2 * PATIENCE, **_OVERFLOWING)
    assert alerts == []


def test_a_forgotten_critic_step_under_a_grad_scaler_is_left_to_the_longer_wait():
    """Never handed to ``scaler.step``, the critic's gradients stay scaled past
    overflow (only the actor's steps bring the scale down): gradients thrown
    away with an Inf in them say nothing, and the optimizer idle for PATIENCE
    steps is told as before."""
    alerts, told = _a2c("forgotten", iterations=2 * PATIENCE, **_OVERFLOWING)
    (alert,) = alerts
    assert alert.module == "critic" and "lost_gradients" not in alert.data
    assert _told_at(told) == PATIENCE


def test_gradients_reset_in_place_are_left_to_the_longer_wait():
    """``zero_grad(set_to_none=False)`` keeps the gradient tensor: nothing is seen
    thrown away, and the optimizer idle for PATIENCE steps is told as before."""
    torch.manual_seed(0)
    model = ActorCritic()
    actor_opt = torch.optim.Adam(model.actor.parameters(), 1e-3)
    critic_opt = torch.optim.Adam(model.critic.parameters(), 1e-3)
    with tw.watch(model, optimizer=[actor_opt, critic_opt], console=False) as monitor:
        for _ in range(PATIENCE + 5):
            state = torch.randn(4)
            logits, value = model(state)
            actor_opt.zero_grad(set_to_none=False)
            (-logits.log_softmax(-1)[0]).backward()
            actor_opt.step()
            critic_opt.zero_grad(set_to_none=False)
            (value - 1.0).pow(2).backward()
    (alert,) = monitor.alerts
    assert alert.module == "critic" and alert.step == PATIENCE
    assert "lost_gradients" not in alert.data


def test_a_frozen_critic_in_no_optimizer_is_silent():
    """The actor trained against a fixed, pretrained critic."""
    torch.manual_seed(0)
    model = ActorCritic()
    model.critic.requires_grad_(False)
    actor_opt = torch.optim.Adam(model.actor.parameters(), 1e-3)
    with tw.watch(model, optimizer=actor_opt, console=False) as monitor:
        for _ in range(2 * PATIENCE):
            logits, value = model(torch.randn(4))
            dist = torch.distributions.Categorical(logits=logits)
            action = dist.sample()
            actor_opt.zero_grad()
            (-dist.log_prob(action) * value.detach()).backward()
            actor_opt.step()
    assert [a for a in monitor.alerts if a.severity != "info"] == []


def test_ppo_epochs_over_a_rollout_are_silent():
    torch.manual_seed(0)
    env = CartPole()
    model = ActorCritic()
    actor_opt = torch.optim.Adam(model.actor.parameters(), 3e-4)
    critic_opt = torch.optim.Adam(model.critic.parameters(), 1e-3)
    with tw.watch(model, optimizer=[actor_opt, critic_opt], console=False) as monitor:
        state = env.reset()
        for _ in range(4):
            states, actions, rewards, old_logp = [], [], [], []
            with torch.no_grad():
                for _ in range(16):
                    dist = torch.distributions.Categorical(logits=model.actor(state))
                    action = dist.sample()
                    states.append(state)
                    actions.append(action)
                    old_logp.append(dist.log_prob(action))
                    state, reward, done = env.step(action.item())
                    rewards.append(reward)
                    if done:
                        state = env.reset()
            states, actions, old_logp = (
                torch.stack(states),
                torch.stack(actions),
                torch.stack(old_logp),
            )
            returns = torch.tensor(rewards).flip(0).cumsum(0).flip(0)
            for _ in range(4):  # epochs over the rollout
                logits, values = model(states)
                dist = torch.distributions.Categorical(logits=logits)
                advantage = (returns - values).detach()
                ratio = (dist.log_prob(actions) - old_logp).exp()
                clipped = torch.min(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage)
                actor_opt.zero_grad()
                (-clipped.mean()).backward()
                actor_opt.step()
                critic_opt.zero_grad()
                F.mse_loss(values, returns).backward()
                critic_opt.step()
    assert [a for a in monitor.alerts if a.severity != "info"] == []


# -- the actor and the critic as two models ----------------------------------------------


def _two_models(forget: bool) -> tuple[list, list[int]]:
    torch.manual_seed(0)
    env = CartPole()
    actor = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
    critic = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
    actor_opt = torch.optim.Adam(actor.parameters(), 1e-3)
    critic_opt = torch.optim.Adam(critic.parameters(), 1e-3)
    told: list[int] = []
    with (
        tw.watch(actor, actor_opt, console=False),
        tw.watch(critic, critic_opt, console=False) as watched,
    ):
        state = env.reset()
        for _ in range(2 * PATIENCE):
            dist = torch.distributions.Categorical(logits=actor(state))
            action = dist.sample()
            value = critic(state).squeeze(-1)
            next_state, reward, done = env.step(action.item())
            with torch.no_grad():
                target = reward + (0.0 if done else 0.99 * critic(next_state).squeeze(-1))
            actor_opt.zero_grad()
            (-dist.log_prob(action) * (target - value).detach()).backward()
            actor_opt.step()
            critic_opt.zero_grad()
            (target - value).pow(2).backward()
            if not forget:
                critic_opt.step()
            state = env.reset() if done else next_state
            told.append(len(watched.alerts))
    return [a for a in watched.alerts if a.severity != "info"], told


@pytest.mark.parametrize("forget", [True, False], ids=["forgotten", "steps"])
def test_a_critic_watched_as_a_model_of_its_own(forget):
    alerts, told = _two_models(forget)
    if not forget:
        assert alerts == []
        return
    (alert,) = alerts
    assert alert.rule == "not_optimized" and alert.data["kind"] == "optimizer_never_steps"
    assert _told_at(told) <= 3 and alert.step == 0
    assert alert.data["model_name"] == "critic" and alert.data["optimizer_name"] == "critic_opt"
    assert alert.message.startswith("critic_opt (Adam) has not stepped once")


# -- DDPG / TD3: soft-updated targets, the actor updated every other iteration -----------


class TD3(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 1), nn.Tanh())
        self.critic = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
        self.actor_target = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 1), nn.Tanh())
        self.critic_target = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
        self.actor_target.load_state_dict(self.actor.state_dict())
        self.critic_target.load_state_dict(self.critic.state_dict())
        for target in (self.actor_target, self.critic_target):
            target.requires_grad_(False)

    def q(self, state: torch.Tensor, action: torch.Tensor, target: bool = False) -> torch.Tensor:
        critic = self.critic_target if target else self.critic
        return critic(torch.cat([state, action], -1))

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return self.actor(state)


def _td3(forget_critic: bool, actor_loss_every_iteration: bool) -> tuple[list, list[int]]:
    """The actor stepped at odd iterations only (TD3's policy delay), its loss
    computed only then or at every iteration and thrown away at even ones."""
    torch.manual_seed(0)
    model = TD3()
    actor_opt = torch.optim.Adam(model.actor.parameters(), 1e-3)
    critic_opt = torch.optim.Adam(model.critic.parameters(), 1e-3)
    told: list[int] = []
    with tw.watch(model, optimizer=[actor_opt, critic_opt], console=False) as monitor:
        for it in range(2 * PATIENCE):
            state = torch.randn(64, 3)
            action = torch.randn(64, 1).clamp(-1, 1)
            reward, next_state = -state.pow(2).sum(1, keepdim=True), torch.randn(64, 3)
            with torch.no_grad():
                noise = (0.2 * torch.randn(64, 1)).clamp(-0.5, 0.5)
                next_action = (model.actor_target(next_state) + noise).clamp(-1, 1)
                target = reward + 0.99 * model.q(next_state, next_action, target=True)
            critic_opt.zero_grad()
            F.mse_loss(model.q(state, action), target).backward()
            if not forget_critic:
                critic_opt.step()
            if actor_loss_every_iteration or it % 2 == 1:
                actor_opt.zero_grad()
                (-model.q(state, model(state)).mean()).backward()
                if it % 2 == 1:
                    actor_opt.step()
                    with torch.no_grad():  # the targets' soft update
                        for net, target_net in (
                            (model.actor, model.actor_target),
                            (model.critic, model.critic_target),
                        ):
                            for p, t in zip(net.parameters(), target_net.parameters()):
                                t.lerp_(p, 0.005)
            told.append(len(monitor.alerts))
    return [a for a in monitor.alerts if a.severity != "info"], told


@pytest.mark.parametrize("every_iteration", [False, True], ids=["delayed_loss", "loss_each_time"])
def test_td3_with_a_delayed_actor_and_soft_updated_targets_is_silent(every_iteration):
    alerts, _ = _td3(forget_critic=False, actor_loss_every_iteration=every_iteration)
    assert alerts == []


def test_td3_whose_critic_step_is_forgotten_is_told_early():
    alerts, told = _td3(forget_critic=True, actor_loss_every_iteration=False)
    (alert,) = alerts
    assert alert.rule == "not_optimized" and alert.module == "critic"
    assert alert.data["optimizer_name"] == "critic_opt" and alert.data["lost_gradients"] == 3
    # The actor steps at odd iterations only: the critic, seen idle at its first step
    # (iteration 1), is told three iterations later.
    assert _told_at(told) <= 4


# -- Lightning's manual optimization -----------------------------------------------------


def _lightning_a2c(tmp_path, forget: bool) -> list:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, IterableDataset

    from tests.lightning_models import quiet_trainer
    from trainwatch.lightning import TrainWatchCallback

    class Ticks(IterableDataset):
        """One tick per environment step: the module keeps the environment."""

        def __iter__(self):
            return iter([torch.zeros(1)] * 2 * PATIENCE)

    class A2C(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.actor = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
            self.critic = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
            self.env = CartPole()
            self.state = self.env.reset()

        def training_step(self, batch, batch_idx):
            actor_opt, critic_opt = self.optimizers()
            dist = torch.distributions.Categorical(logits=self.actor(self.state))
            action = dist.sample()
            value = self.critic(self.state).squeeze(-1)
            next_state, reward, done = self.env.step(action.item())
            with torch.no_grad():
                target = reward + (0.0 if done else 0.99 * self.critic(next_state).squeeze(-1))
            actor_opt.zero_grad()
            self.manual_backward(-dist.log_prob(action) * (target - value).detach())
            actor_opt.step()
            critic_opt.zero_grad()
            self.manual_backward((target - value).pow(2))
            if not forget:
                critic_opt.step()
            self.state = self.env.reset() if done else next_state

        def configure_optimizers(self):
            return [
                torch.optim.Adam(self.actor.parameters(), 1e-3),
                torch.optim.Adam(self.critic.parameters(), 1e-3),
            ]

    torch.manual_seed(0)
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=1)
    trainer.fit(A2C(), DataLoader(Ticks(), batch_size=None))
    return [a for a in callback.alerts if a.severity != "info"]


@pytest.mark.parametrize("forget", [True, False], ids=["forgotten", "steps"])
def test_lightning_manual_optimization_with_a_forgotten_critic_step(tmp_path, forget):
    alerts = _lightning_a2c(tmp_path, forget)
    if not forget:
        assert alerts == []
        return
    (alert,) = alerts
    assert alert.rule == "not_optimized" and alert.module == "critic"
    assert alert.step == 0 and alert.data["steps_elsewhere"] <= 4
    assert alert.data["optimizer"] == 1 and alert.data["optimizer_name"] == "critic_opt"


# -- trainwatch run on the script as written ---------------------------------------------

SCRIPT = """
import math
import sys

import torch
from torch import nn

forget = sys.argv[1] == "forget"
torch.manual_seed(0)


class CartPole:
    def reset(self):
        self.state, self.t = (torch.rand(4) - 0.5) * 0.1, 0
        return self.state.clone()

    def step(self, action):
        x, v, theta, omega = self.state.tolist()
        force = 10.0 if action == 1 else -10.0
        cos, sin = math.cos(theta), math.sin(theta)
        lean = (force + 0.05 * omega * omega * sin) / 1.1
        angular = (9.8 * sin - cos * lean) / (0.5 * (4 / 3 - 0.1 * cos * cos / 1.1))
        accel = lean - 0.05 * angular * cos / 1.1
        x, v = x + 0.02 * v, v + 0.02 * accel
        theta, omega = theta + 0.02 * omega, omega + 0.02 * angular
        self.state, self.t = torch.tensor([x, v, theta, omega]), self.t + 1
        return self.state.clone(), 1.0, abs(x) > 2.4 or abs(theta) > 0.21 or self.t >= 200


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
        self.critic = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, state):
        return self.actor(state), self.critic(state).squeeze(-1)


env = CartPole()
model = ActorCritic()
actor_opt = torch.optim.Adam(model.actor.parameters(), 1e-3)
critic_opt = torch.optim.Adam(model.critic.parameters(), 1e-3)
state = env.reset()
for it in range(30):
    logits, value = model(state)
    dist = torch.distributions.Categorical(logits=logits)
    action = dist.sample()
    next_state, reward, done = env.step(action.item())
    with torch.no_grad():
        target = reward + (0.0 if done else 0.99 * model.critic(next_state).squeeze(-1))
    actor_opt.zero_grad()
    (-dist.log_prob(action) * (target - value).detach()).backward()
    actor_opt.step()
    critic_opt.zero_grad()
    (target - value).pow(2).backward()
    if not forget:
        critic_opt.step()
    state = env.reset() if done else next_state
"""


@pytest.mark.parametrize("how", ["forget", "step"])
def test_trainwatch_run_tells_the_forgotten_critic_step(tmp_path, how):
    script = tmp_path / "a2c.py"
    script.write_text(SCRIPT)
    run_script(script, [how], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [a for a in map(json.loads, lines) if a["severity"] != "info"]
    if how == "step":
        assert found == []
        return
    (alert,) = found
    assert alert["rule"] == "not_optimized" and alert["module"] == "critic"
    assert alert["step"] == 0 and alert["data"]["steps_elsewhere"] <= 4
    assert alert["data"]["optimizer_name"] == "critic_opt"
