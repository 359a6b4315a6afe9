"""accumulated_gradient: a missing zero_grad, exact at its first step; silent on
legitimate accumulation and every way of resetting gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainwatch as tw
from tests.conftest import TinyNet, batches, rules_of, train


def accumulation_alerts(monitor):
    return [a for a in monitor.alerts if a.rule == "accumulated_gradient"]


@pytest.mark.parametrize("missing_from", [0, 1, 5])
def test_missing_zero_grad_fires_at_the_first_step_that_reuses_gradients(
    model, quiet_watch, missing_from
):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    train(model, opt, 10, zero_grad_until=missing_from)
    (alert,) = accumulation_alerts(monitor)
    # Step 0 has nothing stale to add onto: zero_grad missing from the start
    # shows at step 1.
    assert alert.step == max(missing_from, 1)
    assert alert.module is None and alert.severity == "error"
    assert alert.data["method"] == "optimizer_step"
    assert alert.data["modules"] == ["fc1", "fc2", "head"]
    assert "zero_grad" in alert.message


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_reset_of_only_some_layers_names_the_others_at_the_step_it_stops(
    model, quiet_watch, set_to_none
):
    """From step 5 only the head's gradients are reset: after healthy steps, some
    gradients fresh and some stale is told apart parameter by parameter."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for step, (x, y) in enumerate(batches(10)):
        if step < 5:
            opt.zero_grad(set_to_none=set_to_none)
        else:
            model.head.zero_grad(set_to_none=set_to_none)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    (alert,) = accumulation_alerts(monitor)
    assert alert.step == 5
    assert alert.data["modules"] == ["fc1", "fc2"]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_every_step_is_clean(model, quiet_watch, set_to_none):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    train(model, opt, 10, set_to_none=set_to_none)
    assert rules_of(monitor) == []


def test_model_zero_grad_is_clean(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for x, y in batches(8):
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert rules_of(monitor) == []


def test_legacy_data_zero_is_clean(model, quiet_watch):
    """``p.grad.data.zero_()`` leaves no version trace; the content check covers it."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for x, y in batches(8):
        for p in model.parameters():
            if p.grad is not None:
                p.grad.data.zero_()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert rules_of(monitor) == []


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_legitimate_gradient_accumulation_is_clean(model, quiet_watch, micro_batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    train(model, opt, 8, accumulate=micro_batches)
    assert rules_of(monitor) == []


def test_missing_zero_grad_with_accumulation_still_fires(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    train(model, opt, 6, accumulate=4, zero_grad_until=3)
    assert [a.step for a in accumulation_alerts(monitor)] == [3]


def test_missing_zero_grad_is_caught_through_gradient_clipping(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    train(model, opt, 6, clip=0.5, zero_grad_until=2)
    assert [a.step for a in accumulation_alerts(monitor)] == [2]


def test_clipping_with_zero_grad_is_clean(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    train(model, opt, 6, clip=0.5)
    assert rules_of(monitor) == []


def test_grad_scaler_with_skipped_steps_is_clean(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    monitor = quiet_watch(model, opt)
    for i, (x, y) in enumerate(batches(8)):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if i in (2, 3):
            loss = loss * float("inf")  # the scaler skips these steps
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert monitor.step_count == 6
    assert rules_of(monitor) == []


def _lbfgs_run(model, monitor_factory, zero_grad_in_closure: bool):
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    monitor = monitor_factory(model, opt)
    for x, y in batches(4):

        def closure(x=x, y=y):
            if zero_grad_in_closure:
                opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)
    return monitor


def test_lbfgs_with_closure_is_clean(model, quiet_watch):
    monitor = _lbfgs_run(model, quiet_watch, zero_grad_in_closure=True)
    assert monitor.step_count == 4
    assert rules_of(monitor) == []
    assert set(monitor.grad_norms()) == {"fc1", "fc2", "head"}


def test_lbfgs_closure_without_zero_grad_fires(model, quiet_watch):
    monitor = _lbfgs_run(model, quiet_watch, zero_grad_in_closure=False)
    # LBFGS uses each closure call's gradients inside one step(): the second
    # call of the first step() adds onto the first call's.
    assert [a.step for a in accumulation_alerts(monitor)] == [0]


class _Gan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))


def _gan_run(quiet_watch, zero_d: bool = True, zero_g: bool = True):
    torch.manual_seed(0)
    gan = _Gan()
    opt_g = torch.optim.Adam(gan.generator.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(gan.discriminator.parameters(), lr=1e-3)
    monitor = quiet_watch(gan, [opt_d, opt_g])
    bce = nn.BCEWithLogitsLoss()
    for it in range(6):
        real = torch.randn(16, 8) + 2.0
        fake = gan.generator(torch.randn(16, 4))
        if zero_d or it == 0:
            opt_d.zero_grad()
        d_loss = bce(gan.discriminator(real), torch.ones(16, 1)) + bce(
            gan.discriminator(fake.detach()), torch.zeros(16, 1)
        )
        d_loss.backward()
        opt_d.step()
        if zero_g or it == 0:
            opt_g.zero_grad()
        # This backward also adds onto the discriminator's used gradients:
        # harmless, because they are reset before the discriminator's next step.
        bce(gan.discriminator(fake), torch.ones(16, 1)).backward()
        opt_g.step()
    return monitor


def test_gan_with_two_optimizers_is_clean(quiet_watch):
    monitor = _gan_run(quiet_watch)
    assert monitor.step_count == 12
    assert rules_of(monitor) == []


def test_gan_discriminator_missing_zero_grad_fires(quiet_watch):
    monitor = _gan_run(quiet_watch, zero_d=False)
    (alert,) = accumulation_alerts(monitor)
    assert alert.step == 2  # the discriminator's second step (opt_d steps at 0, 2, 4...)
    assert alert.data["optimizer"] == 0
    assert alert.data["modules"] == ["discriminator.0", "discriminator.2"]


def test_gan_generator_missing_zero_grad_fires_though_its_optimizer_steps_second(quiet_watch):
    """The generator's optimizer steps after the discriminator's: the discriminator's
    reset and step in between must not hide the generator's stale gradients."""
    (alert,) = accumulation_alerts(_gan_run(quiet_watch, zero_g=False))
    assert alert.step == 3  # the generator's second step (opt_g steps at 1, 3, 5...)
    assert alert.data["optimizer"] == 1
    assert alert.data["modules"] == ["generator.0", "generator.2"]
    assert "step 1 had already used" in alert.message  # its own last step, not step 2


def _two_optimizers_over_one_model(quiet_watch, zeroed: tuple[bool, bool], iterations: int = 6):
    """One network, its trunk and its head each with an optimizer, both stepped each
    iteration; from iteration 3 on, only the optimizers ``zeroed`` says are reset."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizers = [
        torch.optim.Adam(model[0].parameters(), lr=1e-3),
        torch.optim.Adam(model[2].parameters(), lr=1e-3),
    ]
    monitor = quiet_watch(model, optimizers)
    for iteration in range(iterations):
        x = torch.randn(64, 8)
        for opt, reset in zip(optimizers, zeroed):
            if reset or iteration < 3:
                opt.zero_grad()
        nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        for opt in optimizers:
            opt.step()
    return monitor


@pytest.mark.parametrize(
    ("zeroed", "step", "optimizer", "modules", "used_at"),
    [
        ((False, True), 6, 0, ["0"], 4),  # the trunk's: iteration 3's first step
        ((True, False), 7, 1, ["2"], 5),  # the head's: iteration 3's second step
    ],
    ids=["first optimizer's reset missing", "second optimizer's reset missing"],
)
def test_two_optimizers_of_one_model_each_missing_its_reset_fires_at_its_own_step(
    quiet_watch, zeroed, step, optimizer, modules, used_at
):
    (alert,) = accumulation_alerts(_two_optimizers_over_one_model(quiet_watch, zeroed))
    assert alert.step == step
    assert alert.data["optimizer"] == optimizer
    assert alert.data["modules"] == modules
    assert f"step {used_at} had already used" in alert.message


def test_two_optimizers_of_one_model_both_reset_every_iteration_are_clean(quiet_watch):
    monitor = _two_optimizers_over_one_model(quiet_watch, (True, True))
    assert monitor.step_count == 12
    assert rules_of(monitor) == []


def _manual_sgd(model, monitor, steps, reset: bool):
    for x, y in batches(steps):
        nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
                if reset:
                    p.grad = None
        monitor.step()


def test_without_optimizer_monitor_step_marks_the_use(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    monitor = quiet_watch(model)
    _manual_sgd(model, monitor, 5, reset=False)
    (alert,) = accumulation_alerts(monitor)
    assert alert.step == 1
    assert alert.data["method"] == "monitor.step"


def test_without_optimizer_resetting_gradients_is_clean(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    monitor = quiet_watch(model)
    _manual_sgd(model, monitor, 5, reset=True)
    assert rules_of(monitor) == []


TWO_OPTIMIZER_SCRIPT = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
trunk = torch.optim.Adam(model[0].parameters(), lr=1e-3)
head = torch.optim.Adam(model[2].parameters(), lr=1e-3)
forget_head = sys.argv[1] == "forget-head"
for iteration in range(8):
    x = torch.randn(64, 8)
    trunk.zero_grad()
    if not forget_head or iteration < 3:
        head.zero_grad()
    nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
    trunk.step()
    head.step()
"""


@pytest.mark.parametrize("mode", ["forget-head", "reset-both"])
def test_trainwatch_run_finds_the_second_optimizers_missing_reset_in_an_unmodified_script(
    tmp_path, mode
):
    import json

    from trainwatch.runner import run_script

    script = tmp_path / "two_optimizers.py"
    script.write_text(TWO_OPTIMIZER_SCRIPT)
    assert run_script(script, [mode], log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [a for a in map(json.loads, lines) if a["rule"] == "accumulated_gradient"]
    if mode == "reset-both":
        assert found == []
        return
    (alert,) = found
    assert alert["step"] == 7 and alert["data"]["modules"] == ["2"]


def _assigned_gradients(reset: bool, per_example: bool = False, steps: int = 8) -> list:
    """Gradients assigned to ``p.grad`` before each update (DP-SGD written by hand:
    per-example gradients clipped, summed, noised, then assigned)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(steps):
            x = torch.randn(8, 4)
            if reset:
                opt.zero_grad()
            if per_example:
                summed = [torch.zeros_like(p) for p in model.parameters()]
                for row in x:
                    if reset:
                        for p in model.parameters():
                            p.grad = None
                    model(row[None]).pow(2).mean().backward()
                    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
                    for total, p in zip(summed, model.parameters()):
                        total += p.grad * torch.clamp(1.0 / (norm + 1e-6), max=1.0)
                for total, p in zip(summed, model.parameters()):
                    p.grad = total / len(x) + 0.01 * torch.randn_like(total)
            else:
                model(x).pow(2).mean().backward()
                for p in model.parameters():
                    p.grad = p.grad.clone() * 0.5  # clipped or noised: a new tensor
            opt.step()
    return [(a.rule, a.step) for a in monitor.alerts if a.severity != "info"]


@pytest.mark.parametrize("per_example", [False, True], ids=["batch", "per_example"])
def test_gradients_assigned_before_the_update_still_show_a_missing_reset(per_example):
    found = _assigned_gradients(reset=False, per_example=per_example)
    assert found[:1] == [("accumulated_gradient", 1)]


@pytest.mark.parametrize("per_example", [False, True], ids=["batch", "per_example"])
def test_gradients_assigned_before_the_update_with_a_reset_are_silent(per_example):
    assert _assigned_gradients(reset=True, per_example=per_example) == []


def _autograd_grad_assigned(quiet_watch, how: str):
    """Gradients from torch.autograd.grad assigned to p.grad before each step: no
    backward writes .grad, so no zero_grad is needed (meta-learning, custom
    gradients). ``how`` "backward": the same loop with loss.backward() and no reset."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params = list(model.parameters())
    monitor = quiet_watch(model, opt)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    for _ in range(6):
        loss = nn.functional.cross_entropy(model(x), y)
        if how == "backward":
            loss.backward()
        else:
            for p, g in zip(params, torch.autograd.grad(loss, params)):
                if how == "none_first":
                    p.grad = None
                p.grad = g.clone() if how == "clone" else g
        opt.step()
    monitor.close()
    return [(a.rule, a.step) for a in monitor.alerts if a.severity != "info"]


@pytest.mark.parametrize("how", ["assign", "clone", "none_first"])
def test_gradients_from_autograd_grad_assigned_each_step_are_no_missing_reset(quiet_watch, how):
    assert _autograd_grad_assigned(quiet_watch, how) == []


def test_control_the_same_loop_with_backward_and_no_reset_fires(quiet_watch):
    assert _autograd_grad_assigned(quiet_watch, "backward") == [("accumulated_gradient", 1)]
