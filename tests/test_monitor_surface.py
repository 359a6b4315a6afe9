"""The Monitor's public surface: reading it never halts; its state survives a resume."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainwatch as tw
from tests.conftest import TinyNet, batches


def _step(model, opt, x, y, zero_grad=True):
    if zero_grad:
        opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _lagged_missing_zero_grad(quiet_watch):
    """Step 1's finding lands one step late (lagged readback), with halt_on set."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, readback="lagged", halt_on=["accumulated_gradient"])
    data = list(batches(3))
    _step(model, opt, *data[0])
    _step(model, opt, *data[1], zero_grad=False)  # the bug, at step 1
    return model, opt, monitor, data


def test_reading_alerts_and_norms_never_raises_the_halt(quiet_watch):
    model, opt, monitor, data = _lagged_missing_zero_grad(quiet_watch)
    found = [a.rule for a in monitor.alerts]  # lands step 1: no raise here
    assert "accumulated_gradient" in found
    assert monitor.alert_counts[("accumulated_gradient", None)] == 1
    assert set(monitor.grad_norms()) == {"fc1", "fc2", "head"}
    assert monitor.total_grad_norm is not None
    with pytest.raises(tw.TrainingHealthError) as raised:
        _step(model, opt, *data[2])  # the halt comes at the next step boundary
    assert raised.value.alert.step == 1


def test_flush_lands_the_step_and_applies_halt_on(quiet_watch):
    _, _, monitor, _ = _lagged_missing_zero_grad(quiet_watch)
    with pytest.raises(tw.TrainingHealthError):
        monitor.flush()
    monitor.flush()  # once raised, not again


def test_flush_on_a_healthy_run_raises_nothing(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, readback="lagged", halt_on=["accumulated_gradient"])
    for x, y in batches(3):
        _step(model, opt, x, y)
    monitor.flush()
    assert monitor.alerts == []


def _resumed_after_two_cut_steps(quiet_watch, keep_rule_state: bool):
    """fc1 cut off (.detach()) for two steps, a checkpoint, a resume, one more step."""
    torch.manual_seed(0)
    model = TinyNet()
    model.detach_fc1 = True
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = list(batches(3))
    first = quiet_watch(model, opt)
    for x, y in data[:2]:
        _step(model, opt, x, y)
    state = first.state_dict()
    first.close()
    assert first.alerts == []
    if not keep_rule_state:
        state = {k: v for k, v in state.items() if k != "rules"}
    resumed = quiet_watch(model, opt)
    resumed.load_state_dict(state)
    _step(model, opt, *data[2])
    return resumed


def test_rule_state_survives_a_resume(quiet_watch):
    """A zero-gradient streak two steps long at the checkpoint ends in an alert one
    step after the resume (patience 3), not three."""
    resumed = _resumed_after_two_cut_steps(quiet_watch, keep_rule_state=True)
    # Reported at the step the streak began, before the checkpoint.
    assert [(a.rule, a.step, a.module) for a in resumed.alerts] == [("zero_gradient", 0, "fc1")]


def test_without_the_rule_state_the_streak_starts_again(quiet_watch):
    resumed = _resumed_after_two_cut_steps(quiet_watch, keep_rule_state=False)
    assert resumed.alerts == []


def test_rule_state_is_plain_data_that_loads_with_weights_only(quiet_watch, tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    model.detach_fc1 = True
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, exploding_gradient={"warmup": 1})
    for x, y in batches(3):
        _step(model, opt, x, y)
    path = tmp_path / "state.pt"
    torch.save(monitor.state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    assert loaded["rules"].keys() == monitor.state_dict()["rules"].keys()
