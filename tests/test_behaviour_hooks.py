"""The behaviour collectors: nothing installed when their rules are off, failures contained."""

from __future__ import annotations

import torch
from torch import nn

from tests.conftest import TinyNet, batches
from tests.test_modes import DropNet
from trainwatch.collect.modes import ModeWatch

BEHAVIOUR_OFF = {
    "constant_output": False,
    "dead_units": False,
    "eval_in_train_mode": False,
    "train_in_eval_mode": False,
    "broadcast": False,
    "loss_input": False,
}


def _module_hooks(model: nn.Module) -> int:
    """Hooks on the modules (only the model's own pass hooks, left out of any copy)
    plus global module hooks (none between passes: they cost every module call)."""
    from torch.nn.modules import module as module_globals

    inner = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    inner -= len(model._forward_hooks) + len(model._forward_pre_hooks)
    assert inner == 0
    assert len(model._forward_hooks) + len(model._forward_pre_hooks) <= 2
    return (
        len(model._forward_hooks)
        + len(model._forward_pre_hooks)
        + len(module_globals._global_forward_hooks)
        + len(module_globals._global_forward_pre_hooks)
    )


def test_behaviour_rules_add_no_hook_of_their_own(quiet_watch):
    """They share the model's two pass hooks; the sampling hook exists only in sampled passes."""
    model = TinyNet()
    baseline = quiet_watch(model, **BEHAVIOUR_OFF)
    hooks_without = _module_hooks(model)
    assert baseline._pipeline.behaviour is None
    baseline.close()
    assert _module_hooks(model) == 0
    monitor = quiet_watch(model)
    assert monitor._pipeline.behaviour is not None
    assert _module_hooks(model) == hooks_without == 2


def test_modes_add_no_hook_of_their_own(quiet_watch):
    model = TinyNet()
    off = dict(BEHAVIOUR_OFF)
    baseline = quiet_watch(model, **off)
    hooks_without = _module_hooks(model)
    baseline.close()
    del off["eval_in_train_mode"]
    quiet_watch(model, **off)
    assert _module_hooks(model) == hooks_without


def test_a_failing_check_is_reported_once_and_training_goes_on(quiet_watch, monkeypatch):
    def broken(self, training, skip_dropout=False):
        raise RuntimeError("boom")

    monkeypatch.setattr(ModeWatch, "in_mode", broken)
    torch.manual_seed(0)
    model = DropNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for x, y in batches(4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        model(torch.randn(4, 8))
    errors = [a for a in monitor.alerts if a.rule == "internal_error"]
    assert len(errors) == 1 and errors[0].data["component"] == "behaviour checks"
    assert monitor.step_count == 4


def test_a_failing_step_hand_over_leaves_the_other_checks_running(quiet_watch, monkeypatch):
    from trainwatch.collect.behaviour import BehaviourWatch

    def broken(self, record, pieces):
        raise RuntimeError("boom")

    monkeypatch.setattr(BehaviourWatch, "gather", broken)
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for x, y in batches(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    errors = [a for a in monitor.alerts if a.rule == "internal_error"]
    assert [e.data["component"] for e in errors] == ["behaviour checks"]
    assert set(monitor.grad_norms()) == {"fc1", "fc2", "head"}  # gradient checks go on
