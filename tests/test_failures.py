"""halt_on stops training at the cause; trainwatch's own failures never do."""

from __future__ import annotations

import io
import json

import pytest
import torch

import trainwatch as tw
from tests.conftest import train
from trainwatch.rules.zero_gradient import ZeroGradientRule


def test_halt_on_raises_after_every_sink_has_the_alert(model, tmp_path):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = io.StringIO()
    with pytest.raises(tw.TrainingHealthError) as caught:
        with tw.watch(
            model, opt, log_dir=tmp_path, console=out, halt_on=["accumulated_gradient"]
        ) as monitor:
            train(model, opt, 10, zero_grad_until=4)
    alert = caught.value.alert
    assert (alert.rule, alert.step) == ("accumulated_gradient", 4)
    assert "accumulated_gradient at step 4" in str(caught.value)
    assert monitor.step_count == 5  # stopped inside the step where it happened
    assert json.loads((tmp_path / "alerts.jsonl").read_text())["step"] == 4
    assert "ERROR accumulated_gradient" in out.getvalue()
    assert monitor.closed


def test_no_halt_by_default(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        train(model, opt, 6, zero_grad_until=1)
    assert monitor.step_count == 6


def test_failing_rule_is_reported_once_and_training_goes_on(model, monkeypatch):
    def broken(self, record):
        raise RuntimeError("boom")

    monkeypatch.setattr(ZeroGradientRule, "evaluate", broken)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        train(model, opt, 5, zero_grad_until=2)
    internal = [a for a in monitor.alerts if a.rule == "internal_error"]
    assert len(internal) == 1
    assert internal[0].data["component"] == "rule zero_gradient"
    assert "boom" in internal[0].message and "RuntimeError" in internal[0].data["traceback"]
    assert monitor.step_count == 5
    # The other rules kept working.
    assert [a.rule for a in monitor.alerts if a.rule != "internal_error"] == [
        "accumulated_gradient"
    ]


def test_two_different_parts_failing_are_each_told_once(model, monkeypatch):
    """A second part's different failure is its own finding, not a repeat of the first's."""
    from trainwatch.rules.gradient_scale import ExplodingGradientRule

    def broken(self, record):
        raise RuntimeError("boom")

    def broken_otherwise(self, record):
        raise TypeError("bang")

    monkeypatch.setattr(ZeroGradientRule, "evaluate", broken)
    monkeypatch.setattr(ExplodingGradientRule, "evaluate", broken_otherwise)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        train(model, opt, 5)
    told = sorted(a.data["component"] for a in monitor.alerts if a.rule == "internal_error")
    assert told == ["rule exploding_gradient", "rule zero_gradient"]


def test_failing_hook_inside_backward_does_not_break_backward(model, monkeypatch):
    from trainwatch.collect.accumulation import GradResetTracker

    def broken(self):
        raise ValueError("hook failure")

    monkeypatch.setattr(GradResetTracker, "backward_starts", broken, raising=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses_plain = None
    with tw.watch(model, opt, console=False) as monitor:
        losses = train(model, opt, 3)
    assert len(losses) == 3 and losses_plain is None
    assert monitor.step_count == 3


def test_failing_sink_is_switched_off_and_reported_through_the_others(model):
    from trainwatch.sinks import Sink

    class Broken(Sink):
        name = "broken"

        def emit(self, alert):
            raise OSError("disk full")

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = tw.Monitor(model, [opt], sinks=[Broken()])
    train(model, opt, 4, zero_grad_until=1)
    monitor.close()
    rules = [a.rule for a in monitor.alerts]
    assert rules == ["accumulated_gradient", "internal_error"]
    assert monitor.alerts[1].data["component"] == "broken sink (emit)"


def test_a_failure_building_the_monitor_leaves_training_running_unwatched(model, monkeypatch):
    """A model of a kind trainwatch mishandles must not kill the script at tw.watch:
    every check goes off, the failure is told once, the loop trains on."""
    from trainwatch.collect.nonfinite import NonfiniteProbe

    def broken(self, model):
        raise RuntimeError("cannot hook this parameter")

    monkeypatch.setattr(NonfiniteProbe, "attach", broken)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        losses = train(model, opt, 5, zero_grad_until=2)
    assert [(a.rule, a.data["component"]) for a in monitor.alerts] == [
        ("internal_error", "monitor setup (every check is off)")
    ]
    assert "cannot hook this parameter" in monitor.alerts[0].message
    assert monitor.step_count == 5 and len(losses) == 5


def test_control_a_bad_argument_is_still_refused_at_once(model):
    with pytest.raises(tw.WatchError, match="optimizer"):
        tw.watch(model, "sgd", console=False)


def test_a_monitor_that_fails_to_attach_leaves_no_hook_behind(model, monkeypatch):
    """Whatever part of the build failed, the switched-off monitor is the only one
    on the model: the failed one's module, parameter, global and optimizer hooks
    are all off (a global module hook left behind would run at every module call
    of the process, long after)."""
    from tests.test_lifecycle import NO_HOOKS, hook_counts
    from trainwatch.collect.nonfinite import NonfiniteProbe

    def broken(self, model):
        raise RuntimeError("cannot hook this parameter")

    monkeypatch.setattr(NonfiniteProbe, "attach", broken)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        train(model, opt, 3)
    assert monitor.alerts[0].rule == "internal_error"
    assert hook_counts(model, [opt]) == NO_HOOKS


def test_a_monitor_failing_at_its_second_optimizer_takes_the_first_ones_hooks_off(
    model, monkeypatch
):
    from tests.test_lifecycle import NO_HOOKS, hook_counts
    from trainwatch.monitor import Monitor

    original = Monitor.add_optimizer
    added: list[int] = []

    def second_fails(self, optimizer):
        original(self, optimizer)
        added.append(1)
        if len(added) == 2 and self.config.zero_gradient.enabled:  # the full monitor only
            raise RuntimeError("cannot audit this optimizer")

    monkeypatch.setattr(Monitor, "add_optimizer", second_fails)
    body = [p for name, p in model.named_parameters() if not name.startswith("head")]
    head = [p for name, p in model.named_parameters() if name.startswith("head")]
    opts = [torch.optim.SGD(body, lr=0.01), torch.optim.SGD(head, lr=0.01)]
    with tw.watch(model, opts, console=False) as monitor:
        # Only the switched-off monitor's hooks: one pre- and one post-step hook each.
        assert [len(o._optimizer_step_pre_hooks) for o in opts] == [1, 1]
    assert monitor.alerts[0].rule == "internal_error"
    assert hook_counts(model, opts) == NO_HOOKS


def test_control_a_monitor_built_whole_takes_its_hooks_off_at_close(model):
    from tests.test_lifecycle import NO_HOOKS, hook_counts

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        train(model, opt, 3)
    assert not [a for a in monitor.alerts if a.rule == "internal_error"]
    assert hook_counts(model, [opt]) == NO_HOOKS
