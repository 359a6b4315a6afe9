"""A model trained on by an optimizer its monitor was never given.

Under ``tw.watch(model, opt)`` a loop that builds a new optimizer for a second
phase (a new task, a new head) and forgets ``monitor.add_optimizer`` trains
on unwatched: the summary said 96 steps watched out of 224, and the second
phase's bugs were never seen. The weights moving while backward passes go by
with no watched step is told once (``not_optimized``), and the optimizer
found at its next step is watched from then on. Gradient accumulation, an
attribution phase, an evaluation, a GAN's less frequent generator step,
L-BFGS and the same phase change handed over stay silent.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_pre_hooks

import trainwatch as tw

PHASE_A = 60
PHASE_B = 90


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
    return x, x[:, :4].argmax(1)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _told(monitor: tw.Monitor) -> list[tuple[str, str | None, str | None]]:
    return [(a.rule, a.module, a.data.get("kind")) for a in monitor.alerts if a.severity != "info"]


@pytest.mark.parametrize("handed_over", [False, True], ids=["forgotten", "add_optimizer"])
def test_a_second_phase_optimizer_never_handed_over_is_told_and_watched(quiet_watch, handed_over):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    monitor = quiet_watch(model, opt)
    _train(model, opt, PHASE_A)
    second = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if handed_over:
        monitor.add_optimizer(second)
    _train(model, second, PHASE_B, start=PHASE_A)
    if handed_over:
        assert _told(monitor) == []
        assert monitor.step_count == PHASE_A + PHASE_B
        return
    (alert,) = monitor.alerts
    assert (alert.rule, alert.severity, alert.step) == ("not_optimized", "warning", PHASE_A)
    assert alert.data["kind"] == "unwatched_optimizer"
    assert alert.data["optimizer_class"] == "AdamW"
    assert alert.data["last_step"] == PHASE_A - 1
    assert "AdamW" in alert.message and "monitor.add_optimizer" in alert.hint
    # Watched from the step it was found at: the rest of the phase is counted.
    assert any(o is second for o in monitor.optimizers)
    assert PHASE_A + PHASE_B - 40 < monitor.step_count < PHASE_A + PHASE_B
    # The hook that found it is gone (taken off at the next pass).
    assert not _global_optimizer_pre_hooks
    assert "unwatched updates" not in monitor._pipeline.passes.listener_names()


def test_a_new_head_left_out_of_the_unwatched_optimizer_is_caught_once_it_is_found(quiet_watch):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    monitor = quiet_watch(model, opt)
    _train(model, opt, PHASE_A)
    second = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model[2] = nn.Linear(32, 4)  # the new head, put on after the optimizer was built
    _train(model, second, PHASE_B, start=PHASE_A)
    assert _told(monitor) == [
        ("not_optimized", "", "unwatched_optimizer"),
        ("not_optimized", "2", None),
    ]


def test_a_watched_optimizer_that_never_steps_while_another_trains_is_told(quiet_watch):
    model = _model()
    given = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, given)
    used = torch.optim.SGD(model.parameters(), lr=0.05)  # the loop builds its own
    _train(model, used, PHASE_B)
    (alert,) = monitor.alerts
    assert alert.data["kind"] == "unwatched_optimizer"
    assert alert.data["last_step"] is None and "since watching began" in alert.message
    assert any(o is used for o in monitor.optimizers)


def _hand_written_steps(model: nn.Module, steps: int, start: int) -> None:
    for step in range(start, start + steps):
        x, y = _batch(step)
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.05 * p.grad)


@pytest.mark.parametrize("through_data", [False, True], ids=["no_grad_update", "data_update"])
def test_weights_written_by_hand_after_the_optimizer_stopped_are_told(quiet_watch, through_data):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    _train(model, opt, PHASE_A)
    if through_data:
        for step in range(PHASE_A, PHASE_A + PHASE_B):
            x, y = _batch(step)
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.05)  # no version counter moves
    else:
        _hand_written_steps(model, PHASE_B, PHASE_A)
    (alert,) = monitor.alerts
    assert alert.data["kind"] == "unwatched_updates"
    assert alert.data["optimizer_class"] is None
    assert "monitor.step()" in alert.hint
    assert monitor.optimizers == [opt]


def test_the_look_for_the_optimizer_ends_when_the_watched_one_steps_again(quiet_watch):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    _train(model, opt, PHASE_A)
    # Long enough to be found moving once (the hook goes on), too short for the
    # second finding that would tell it.
    _hand_written_steps(model, 35, PHASE_A)
    assert _global_optimizer_pre_hooks
    _train(model, opt, 20, start=PHASE_A + 35)
    assert _told(monitor) == []
    assert not _global_optimizer_pre_hooks
    assert monitor.optimizers == [opt] and monitor.step_count == PHASE_A + 20


# -- controls: no watched step for a while, nothing else moving the weights ------


def _evaluation_after_training(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    _train(model, opt, PHASE_A)
    model.eval()
    for step in range(PHASE_B):
        x, _ = _batch(step)
        model(x)  # with gradients on: no backward all the same
        with torch.no_grad():
            model(x)


def _attribution_after_training(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    _train(model, opt, PHASE_A)
    for step in range(PHASE_B):
        x, _ = _batch(step)
        x.requires_grad_(True)
        model.zero_grad()
        model(x).max(1).values.sum().backward()  # a saliency map: no update
        x.grad.abs().amax(0)


def _training_that_stops(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    _train(model, opt, PHASE_A)


def _accumulation(micro: int):
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for step in range(3):
            opt.zero_grad()
            for part in range(micro):
                x, y = _batch(step * micro + part)
                (nn.functional.cross_entropy(model(x), y) / micro).backward()
            opt.step()

    return loop


def _lbfgs(model: nn.Module, lbfgs: torch.optim.Optimizer) -> None:
    for step in range(8):
        x, y = _batch(step)

        def closure(x=x, y=y):
            lbfgs.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss

        lbfgs.step(closure)  # 20 evaluations, the weights moved between them


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _lbfgs_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=20)


LOOPS = {
    "evaluation_after_training": (_sgd, _evaluation_after_training),
    "attribution_after_training": (_sgd, _attribution_after_training),
    "training_that_stops": (_sgd, _training_that_stops),
    "accumulation_of_64": (_sgd, _accumulation(64)),
    "accumulation_of_100": (_sgd, _accumulation(100)),
    "lbfgs": (_lbfgs_optimizer, _lbfgs),
}


@pytest.mark.parametrize("name", list(LOOPS))
def test_backward_passes_without_a_watched_step_that_move_no_weight_stay_silent(quiet_watch, name):
    make, loop = LOOPS[name]
    model = _model()
    opt = make(model)
    monitor = quiet_watch(model, opt)
    loop(model, opt)
    assert [told for told in _told(monitor) if told[0] == "not_optimized"] == []
    assert monitor.optimizers == [opt]


@pytest.mark.parametrize("critic_steps_first", [5, 100])
def test_a_generator_whose_optimizer_steps_less_often_stays_silent(quiet_watch, critic_steps_first):
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 8))
    critic = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt_g = torch.optim.Adam(gen.parameters(), 1e-4, betas=(0.0, 0.9))
    opt_c = torch.optim.Adam(critic.parameters(), 1e-4, betas=(0.0, 0.9))
    g_monitor = quiet_watch(gen, opt_g)
    c_monitor = quiet_watch(critic, opt_c)
    for it in range(40):
        # 5 critic steps per generator step (WGAN's schedule starts with 100); the
        # critic's loss reaches the generator too (its fake is not detached).
        for _ in range(critic_steps_first if it < 2 else 5):
            real = torch.randn(32, 8) + 2
            fake = gen(torch.randn(32, 4))
            opt_c.zero_grad()
            (critic(fake).mean() - critic(real).mean()).backward()
            opt_c.step()
        opt_g.zero_grad()
        (-critic(gen(torch.randn(32, 4))).mean()).backward()
        opt_g.step()
    told = _told(g_monitor) + _told(c_monitor)
    assert [kind for _, _, kind in told if kind and kind.startswith("unwatched")] == []
    if critic_steps_first == 5:
        assert told == []
    assert g_monitor.optimizers == [opt_g] and c_monitor.optimizers == [opt_c]
    assert g_monitor.step_count == 40
