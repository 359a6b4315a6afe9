"""Every optimizer a loop steps over a model watched without one is watched.

``monitor = tw.watch(model)`` over a GAN, an actor-critic agent or a model
fine-tuned in phases, with the loop's optimizers never passed and no
``monitor.step()``: the look for optimizers not given watched only those
that stepped before the first one's second step, and came off. A WGAN's
critic steps five times before the generator's first step, so only ``opt_d``
was watched; the generator's steps went unchecked (a note said an optimizer
not given trains it), a forgotten ``opt_g.zero_grad()`` was never told, and
its steps were not counted. A DCGAN, whose ``opt_g`` is watched from
``opt_d``'s second step, told the same bug two steps late; an actor started
after the critic's warm-up went unwatched too, and a critic whose step the
main loop forgot was taken for an optimizer training the model unwatched.

Now each optimizer stepping the model is watched at its own second step, its
first counted (those seen before the loop shows its second iteration, all at
once from there: a WGAN's two from the critic's step after the generator's
first): the findings, their steps and the step count are those of the
same loop with every optimizer passed (``tw.watch(model, [opt_g, opt_d])``,
or ``monitor.add_optimizer`` for one built mid-run), the twin each test runs
beside. Another model's optimizer in the same process is not taken, a loop
calling ``monitor.step()`` keeps its own marks, the global hook comes off once
every parameter of the model is in a watched optimizer, and ``trainwatch run``
of the unmodified script finds what it found before. Real torch, no mocks.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_pre_hooks

import trainwatch as tw
from trainwatch.runner import run_script

Z, X = 8, 16
NOT_GIVEN = "not passed to tw.watch"
TRAINED_ELSEWHERE = "an optimizer not passed to tw.watch: their gradients"


def _found(monitor: tw.Monitor) -> list[tuple[str, int, str | None, str]]:
    """What a run told: rule, step, module, severity (info lines left out)."""
    return [(a.rule, a.step, a.module, a.severity) for a in monitor.alerts if a.severity != "info"]


def _messages(monitor: tw.Monitor) -> list[str]:
    return [a.message for a in monitor.alerts if a.severity != "info"]


# -- GANs: a WGAN (five critic steps to one generator step) and a DCGAN -------


def _gan() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "G": nn.Sequential(nn.Linear(Z, 32), nn.ReLU(), nn.Linear(32, X)),
            "D": nn.Sequential(nn.Linear(X, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1)),
        }
    )


def _gan_optimizers(model: nn.Module, loop: str) -> tuple[torch.optim.Optimizer, ...]:
    if loop == "wgan":
        return (
            torch.optim.RMSprop(model["G"].parameters(), lr=5e-5),
            torch.optim.RMSprop(model["D"].parameters(), lr=5e-5),
        )
    return (
        torch.optim.Adam(model["G"].parameters(), 2e-4, betas=(0.5, 0.999)),
        torch.optim.Adam(model["D"].parameters(), 2e-4, betas=(0.5, 0.999)),
    )


def _train_gan(
    model, opt_g, opt_d, loop: str, *, g_reset: bool = True, monitor=None, beside=None
) -> None:
    """``g_reset=False``: ``opt_g.zero_grad()`` forgotten. ``monitor``: its step() is
    called after each iteration (the loop marks its own steps). ``beside``: called
    before each critic step (another model trained in the same loop)."""
    gen, disc = model["G"], model["D"]
    bce = nn.BCEWithLogitsLoss()
    data = torch.Generator().manual_seed(1)
    ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
    for _ in range(12):
        real = torch.randn(32, X, generator=data) * 0.5 + 1.0
        for _ in range(5 if loop == "wgan" else 1):
            if beside is not None:
                beside()
            fake = gen(torch.randn(32, Z, generator=data))
            opt_d.zero_grad()
            if loop == "wgan":
                loss_d = disc(fake.detach()).mean() - disc(real).mean()
            else:
                loss_d = bce(disc(real), ones) + bce(disc(fake.detach()), zeros)
            loss_d.backward()
            opt_d.step()
            if loop == "wgan":
                for p in disc.parameters():
                    p.data.clamp_(-0.01, 0.01)
        if g_reset:
            opt_g.zero_grad()
        if loop == "wgan":
            fake = gen(torch.randn(32, Z, generator=data))
            loss_g = -disc(fake).mean()
        else:
            loss_g = bce(disc(fake), ones)
        loss_g.backward()
        opt_g.step()
        if monitor is not None:
            monitor.step(loss_g)


def _gan_run(loop: str, given: bool, *, g_reset: bool = True):
    model = _gan()
    opt_g, opt_d = _gan_optimizers(model, loop)
    console = io.StringIO()
    hooks = len(_global_optimizer_pre_hooks)
    monitor = tw.watch(model, [opt_g, opt_d] if given else None, console=console)
    _train_gan(model, opt_g, opt_d, loop, g_reset=g_reset)
    held = len(_global_optimizer_pre_hooks) - hooks
    monitor.close()
    watched = {id(opt) for opt in monitor.optimizers}
    return monitor, console.getvalue(), held, watched == {id(opt_g), id(opt_d)}


@pytest.mark.parametrize(("loop", "step", "used"), [("wgan", 11, 5), ("dcgan", 3, 1)])
def test_a_forgotten_generator_reset_is_told_at_its_step(loop, step, used):
    monitor, text, _, both = _gan_run(loop, given=False, g_reset=False)
    twin, _, _, _ = _gan_run(loop, given=True, g_reset=False)
    assert both
    assert _found(monitor) == _found(twin) == [("accumulated_gradient", step, None, "error")]
    assert _messages(monitor) == _messages(twin)
    message = _messages(monitor)[0]
    assert f"the gradients step {used} had already used" in message
    assert "(G.0.weight, G.0.bias, G.2.weight" in message
    assert monitor.step_count == twin.step_count
    assert TRAINED_ELSEWHERE not in text


@pytest.mark.parametrize("loop", ["wgan", "dcgan"])
def test_the_healthy_gan_stays_silent_both_halves_watched(loop):
    monitor, text, held, both = _gan_run(loop, given=False)
    twin, _, _, _ = _gan_run(loop, given=True)
    assert both
    assert _found(monitor) == _found(twin) == []
    assert monitor.step_count == twin.step_count == (72 if loop == "wgan" else 24)
    assert TRAINED_ELSEWHERE not in text
    if loop == "wgan":
        # The critic's optimizer at its second step, the generator's at its own.
        # Both at the critic's step after the generator's first: the loop's second
        # iteration, with no monitor.step() in the first.
        notes = [line for line in text.splitlines() if NOT_GIVEN in line]
        assert len(notes) == 1, text
        assert "RMSprop over D and RMSprop over G step the watched ModuleDict's" in notes[0]
        assert "watching them from step 6 on" in notes[0]
        assert "steps 0-5 went unchecked" in notes[0]
    assert held == 0  # the look's hook came off once both halves were watched


@pytest.mark.parametrize("loop", ["wgan", "dcgan"])
def test_a_loop_marking_its_own_steps_keeps_them(loop):
    """monitor.step() once an iteration: no optimizer taken over, no note, each
    iteration one step, and the look's hook gone. (A WGAN's critic steps five
    times before the first monitor.step(), after the generator's first step: no
    second iteration shows before it.)"""
    model = _gan()
    opt_g, opt_d = _gan_optimizers(model, loop)
    console = io.StringIO()
    hooks = len(_global_optimizer_pre_hooks)
    monitor = tw.watch(model, console=console)
    _train_gan(model, opt_g, opt_d, loop, monitor=monitor)
    held = len(_global_optimizer_pre_hooks) - hooks
    monitor.close()
    assert monitor.optimizers == []
    assert monitor.step_count == 12
    assert NOT_GIVEN not in console.getvalue()
    assert held == 0


def test_training_is_the_same_with_and_without_the_monitor():
    def final(watched: bool) -> list[torch.Tensor]:
        model = _gan()
        opt_g, opt_d = _gan_optimizers(model, "wgan")
        monitor = tw.watch(model, console=False) if watched else None
        _train_gan(model, opt_g, opt_d, "wgan", g_reset=False)
        if monitor is not None:
            monitor.close()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(final(False), final(True)))


def test_another_models_optimizer_is_not_taken():
    """A probe classifier trained beside the GAN, its optimizer stepping first and
    twice an iteration: never watched, its steps never counted."""

    def run(given: bool) -> tuple[tw.Monitor, torch.optim.Optimizer, str]:
        model = _gan()
        opt_g, opt_d = _gan_optimizers(model, "wgan")
        probe = nn.Linear(X, 2)
        probe_opt = torch.optim.SGD(probe.parameters(), 1e-2)
        console = io.StringIO()
        monitor = tw.watch(model, [opt_g, opt_d] if given else None, console=console)
        data = torch.Generator().manual_seed(2)

        def train_probe() -> None:
            for _ in range(2):
                probe_opt.zero_grad()
                x = torch.randn(16, X, generator=data)
                y = torch.randint(0, 2, (16,), generator=data)
                nn.functional.cross_entropy(probe(x), y).backward()
                probe_opt.step()

        _train_gan(model, opt_g, opt_d, "wgan", beside=train_probe)
        monitor.close()
        return monitor, probe_opt, console.getvalue()

    monitor, probe_opt, text = run(False)
    twin, _, _ = run(True)
    assert all(opt is not probe_opt for opt in monitor.optimizers)
    assert len(monitor.optimizers) == 2
    assert monitor.step_count == twin.step_count == 72
    assert _found(monitor) == _found(twin) == []
    assert "SGD" not in text


# -- an actor-critic agent whose actor starts after the critic's warm-up -------


class ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
        self.critic = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))


def _actor_critic_run(given: bool, bug: str | None, iterations: int = 20):
    """The critic alone for three iterations (the actor frozen while the value
    estimate warms up), then both. ``bug``: "actor_reset" forgets
    ``actor_opt.zero_grad()``; "critic_step" forgets ``critic_opt.step()`` in the
    main loop."""
    torch.manual_seed(0)
    agent = ActorCritic()
    actor_opt = torch.optim.Adam(agent.actor.parameters(), 3e-4)
    critic_opt = torch.optim.Adam(agent.critic.parameters(), 1e-3)
    console = io.StringIO()
    monitor = tw.watch(agent, [actor_opt, critic_opt] if given else None, console=console)
    data = torch.Generator().manual_seed(1)
    warmup = 3
    for it in range(iterations):
        obs, returns = torch.randn(64, 4, generator=data), torch.randn(64, generator=data)
        critic_opt.zero_grad()
        (returns - agent.critic(obs).squeeze(-1)).pow(2).mean().backward()
        if it < warmup or bug != "critic_step":
            critic_opt.step()
        if it >= warmup:
            dist = torch.distributions.Categorical(logits=agent.actor(obs))
            action = dist.sample()
            advantage = (returns - agent.critic(obs).squeeze(-1)).detach()
            if bug != "actor_reset":
                actor_opt.zero_grad()
            (-(dist.log_prob(action) * advantage).mean()).backward()
            actor_opt.step()
    monitor.close()
    return monitor, console.getvalue()


def test_the_healthy_actor_critic_has_both_watched():
    monitor, text = _actor_critic_run(False, None)
    twin, _ = _actor_critic_run(True, None)
    assert len(monitor.optimizers) == 2
    assert monitor.step_count == twin.step_count == 37
    assert _found(monitor) == _found(twin) == []
    # Both at the critic's step after the actor's first (the critic alone before it).
    assert "Adam over critic and Adam over actor step the watched ActorCritic's" in text
    assert TRAINED_ELSEWHERE not in text


def test_a_forgotten_actor_reset_is_told_at_its_step():
    monitor, _ = _actor_critic_run(False, "actor_reset")
    twin, _ = _actor_critic_run(True, "actor_reset")
    assert _found(monitor) == _found(twin) == [("accumulated_gradient", 6, None, "error")]
    assert _messages(monitor) == _messages(twin)
    assert "(actor.0.weight, actor.0.bias" in _messages(monitor)[0]


def test_a_forgotten_critic_step_is_told_as_with_the_optimizers_passed():
    """The critic's optimizer stops after the warm-up: told as an optimizer that
    stopped, at the twin's step, not as one training the model unwatched."""
    monitor, _ = _actor_critic_run(False, "critic_step", iterations=130)
    twin, _ = _actor_critic_run(True, "critic_step", iterations=130)
    # Told at the module holding the critic's parameters.
    assert _found(monitor) == _found(twin) == [("not_optimized", 125, "critic", "warning")]
    message = _messages(monitor)[0]
    assert "last stepped at step 2, 123 steps ago" in message
    assert "(critic.0.weight, critic.0.bias" in message
    assert monitor.step_count == twin.step_count == 130


# -- a second optimizer built mid-run for a head unfrozen then ------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _fine_tune_run(given: bool, *, head_reset: bool = True):
    """The body trained with the head frozen for ten iterations, then the head
    unfrozen and given an optimizer of its own; ``head_reset=False`` forgets that
    optimizer's ``zero_grad()``."""
    torch.manual_seed(0)
    model = Net()
    model.head.requires_grad_(False)
    body_opt = torch.optim.Adam(model.body.parameters(), 1e-3)
    console = io.StringIO()
    hooks = len(_global_optimizer_pre_hooks)
    monitor = tw.watch(model, body_opt if given else None, console=console)
    data = torch.Generator().manual_seed(1)
    head_opt = None
    for it in range(20):
        if it == 10:
            model.head.requires_grad_(True)
            head_opt = torch.optim.SGD(model.head.parameters(), 1e-2)
            if given:
                monitor.add_optimizer(head_opt)
        x, y = torch.randn(32, 8, generator=data), torch.randint(0, 3, (32,), generator=data)
        body_opt.zero_grad()
        if head_opt is not None and head_reset:
            head_opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        body_opt.step()
        if head_opt is not None:
            head_opt.step()
    held = len(_global_optimizer_pre_hooks) - hooks
    monitor.close()
    return monitor, console.getvalue(), held, head_opt


def test_a_new_optimizer_for_an_unfrozen_head_is_watched():
    monitor, text, held, head_opt = _fine_tune_run(False)
    twin, _, _, _ = _fine_tune_run(True)
    assert any(opt is head_opt for opt in monitor.optimizers)
    assert monitor.step_count == twin.step_count == 30
    assert _found(monitor) == _found(twin) == []
    assert "SGD over head steps the watched Net's parameters too" in text
    assert "watching it from step 13 on" in text and "its step 11 went unchecked" in text
    assert TRAINED_ELSEWHERE not in text
    assert held == 0  # every parameter in a watched optimizer: the hook is off


def test_a_forgotten_reset_of_the_new_head_optimizer_is_told():
    monitor, _, _, _ = _fine_tune_run(False, head_reset=False)
    twin, _, _, _ = _fine_tune_run(True, head_reset=False)
    assert _found(monitor) == _found(twin) == [("accumulated_gradient", 13, None, "error")]
    assert _messages(monitor) == _messages(twin)
    assert "(head.weight, head.bias)" in _messages(monitor)[0]


def test_the_look_stays_while_a_part_is_in_no_optimizer_and_goes_at_close():
    """A head frozen for the whole run: the hook stays (a later optimizer may train
    it), and close takes it off."""
    torch.manual_seed(0)
    model = Net()
    model.head.requires_grad_(False)
    opt = torch.optim.Adam(model.body.parameters(), 1e-3)
    hooks = len(_global_optimizer_pre_hooks)
    monitor = tw.watch(model, console=False)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(8, 8)).sum().backward()
        opt.step()
    assert len(_global_optimizer_pre_hooks) == hooks + 1
    assert monitor.step_count == 5
    monitor.close()
    assert len(_global_optimizer_pre_hooks) == hooks


# -- `trainwatch run` of the same WGAN script ------------------------------------

SCRIPT = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.ModuleDict({
    "G": nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16)),
    "D": nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1)),
})
opt_g = torch.optim.RMSprop(model["G"].parameters(), lr=5e-5)
opt_d = torch.optim.RMSprop(model["D"].parameters(), lr=5e-5)
WATCH, BUG = {watch}, {bug}
if WATCH:
    import trainwatch as tw
    monitor = tw.watch(model)
for it in range(12):
    real = torch.randn(32, 16) * 0.5 + 1.0
    for _ in range(5):
        opt_d.zero_grad()
        fake = model["G"](torch.randn(32, 8)).detach()
        (model["D"](fake).mean() - model["D"](real).mean()).backward()
        opt_d.step()
        for p in model["D"].parameters():
            p.data.clamp_(-0.01, 0.01)
    if not BUG:
        opt_g.zero_grad()
    (-model["D"](model["G"](torch.randn(32, 8))).mean()).backward()
    opt_g.step()
if WATCH:
    monitor.close()
"""


def _run_counts(tmp_path: Path, *, watch: bool, bug: bool) -> dict:
    script = tmp_path / "wgan.py"
    script.write_text(SCRIPT.replace("{watch}", str(watch)).replace("{bug}", str(bug)))
    log = tmp_path / "log"
    assert run_script(script, log_dir=log, console=False) == 0
    return json.loads((log / "alert_counts.json").read_text())


def _told_counts(counts: dict) -> list[tuple[str, int]]:
    return [(c["rule"], c["first_step"]) for c in counts["counts"]]


@pytest.mark.slow
@pytest.mark.parametrize("bug", [False, True], ids=["healthy", "g_reset_forgotten"])
def test_trainwatch_run_of_the_unmodified_script_is_unchanged(tmp_path, bug):
    """The run finds both optimizers itself (G and D watched as models of their own,
    the container never being called): as before this change."""
    counts = _run_counts(tmp_path, watch=False, bug=bug)
    assert counts["steps"] == 60
    assert _told_counts(counts) == ([("accumulated_gradient", 1)] if bug else [])


@pytest.mark.slow
@pytest.mark.parametrize("bug", [False, True], ids=["healthy", "g_reset_forgotten"])
def test_trainwatch_run_of_the_script_watching_without_optimizers(tmp_path, bug):
    """The script's own tw.watch(model) holds the model: both halves' optimizers are
    watched, the forgotten reset told at the generator's second step."""
    counts = _run_counts(tmp_path, watch=True, bug=bug)
    assert counts["steps"] == 72
    assert _told_counts(counts) == ([("accumulated_gradient", 11)] if bug else [])
