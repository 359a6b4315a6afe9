"""Weights made non-finite by the training code, not by the optimizer's update.

A NaN/Inf met in a module's own weights during a forward was taken to be the
last update's doing, and reported at the step before with "lower the learning
rate", even with ``check_every: 1`` (which saw the weights finite after that
update) or a learning rate of zero. A weight written in place since the update
(a clamp, a checkpoint loaded, a copy from another model) moved its version
counter past where the update left it: that write is named, at the step whose
forward met it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

CHECKS = ["auto", "step"]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
    return x, (x[:, 0] > 0).long()


def _found(monitor) -> list[tuple[str, int, str | None, str | None]]:
    return [
        (a.rule, a.step, a.module, (a.data or {}).get("cause"))
        for a in monitor.alerts
        if a.severity != "info"
    ]


def _train(model, opt, before_forward=None, before_step=None, steps: int = 36) -> None:
    for step in range(steps):
        if before_forward is not None:
            before_forward(step)
        x, y = _batch(step)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if before_step is not None:
            before_step(step)
        opt.step()


def _poison_at(model: nn.Module, at: int):
    def write(step: int) -> None:
        if step == at:
            with torch.no_grad():
                model[2].weight[0, 0] = float("inf")

    return write


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("lr", [1e-2, 0.0])
def test_an_inf_written_into_a_weight_before_a_forward_is_named_at_that_step(
    quiet_watch, check, lr
):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    monitor = quiet_watch(model, opt, config={"nonfinite_forward": {"check": check}})
    _train(model, opt, before_forward=_poison_at(model, 30))
    assert _found(monitor)[0] == ("nonfinite_parameter", 30, "2", "written")
    assert "2.weight" in monitor.alerts[0].message and "2.bias" not in monitor.alerts[0].message


def test_the_weight_check_after_every_update_agrees(quiet_watch):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    config = {"nonfinite_parameter": {"check_every": 1}}
    monitor = quiet_watch(model, opt, config=config)
    _train(model, opt, before_forward=_poison_at(model, 30))
    assert _found(monitor)[0] == ("nonfinite_parameter", 30, "2", "written")


@pytest.mark.parametrize("check", CHECKS)
def test_control_an_update_that_blows_a_weight_up_is_still_the_update(quiet_watch, check):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt, config={"nonfinite_forward": {"check": check}})

    def huge_step(step: int) -> None:
        for group in opt.param_groups:
            group["lr"] = 1e37 if step == 29 else 1e-2
        if step == 29:
            model[2].weight.grad.mul_(1e3)

    _train(model, opt, before_step=huge_step)
    assert _found(monitor)[0] == ("nonfinite_parameter", 29, "2", None)
    assert "in the optimizer step 29" in monitor.alerts[0].message


def test_a_corrupt_checkpoint_loaded_mid_run_is_the_load(quiet_watch):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved["4.weight"][1, 3] = float("nan")

    def load(step: int) -> None:
        if step == 20:
            model.load_state_dict(saved)

    _train(model, opt, before_forward=load, steps=24)
    assert _found(monitor)[0] == ("nonfinite_parameter", 20, "4", "written")


def test_a_hand_written_update_then_a_write_is_the_write(quiet_watch):
    """No optimizer: the loop updates the weights itself and calls monitor.step()."""
    model = _model()
    monitor = quiet_watch(model)
    poison = _poison_at(model, 30)
    for step in range(36):
        poison(step)
        x, y = _batch(step)
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
        monitor.step()
    assert _found(monitor)[0] == ("nonfinite_parameter", 30, "2", "written")


def test_lbfgs_blowing_its_weights_up_inside_its_step_is_the_update(quiet_watch):
    """LBFGS updates and re-runs the model inside step(): the counters move there by
    the optimizer's own doing."""
    torch.manual_seed(0)
    x = torch.linspace(-3, 3, 256).unsqueeze(1)
    y = torch.sin(2 * x) + 0.3 * x
    model = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=50.0, max_iter=5, history_size=10)
    monitor = quiet_watch(model, opt)

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(6):
        opt.step(closure)
    found = [a for a in monitor.alerts if a.rule == "nonfinite_parameter"]
    assert found and all((a.data or {}).get("cause") != "written" for a in found)
    assert "optimizer step" in found[0].message


@pytest.mark.parametrize("write", ["assign", "data_in_place"])
def test_a_weight_clamp_through_data_after_the_step(quiet_watch, write):
    """WGAN's clamp, written the old way: ``p.data = ...`` gives a new storage (told as
    written); ``p.data.clamp_()`` moves no counter, and the alert says it may be that."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt)

    def clamp(step: int) -> None:
        if step == 30:
            w = model[2].weight
            if write == "assign":
                w.data = w.data.clamp(min=float("inf"))
            else:
                w.data.clamp_(min=float("inf"))

    _train(model, opt, before_forward=clamp)
    found = _found(monitor)[0]
    if write == "assign":
        assert found == ("nonfinite_parameter", 30, "2", "written")
    else:
        assert found == ("nonfinite_parameter", 29, "2", None)
        assert "written through .data" in monitor.alerts[0].message
