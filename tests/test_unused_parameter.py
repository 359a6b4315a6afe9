"""unused_parameter: a branch that gets gradients on some steps only (hangs DDP)."""

from __future__ import annotations

import torch
from torch import nn

from tests.conftest import batches, rules_of


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.aux = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.use_aux = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        if self.use_aux:
            h = h + torch.tanh(self.aux(h))
        return self.head(h)


def _train(model: Branchy, opt, steps: int, use_aux) -> None:
    for step, (x, y) in enumerate(batches(steps)):
        model.use_aux = use_aux(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_branch_skipped_on_a_later_step_is_named_at_that_step(quiet_watch):
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _train(model, opt, 8, lambda step: step != 3)
    (alert,) = [a for a in monitor.alerts if a.rule == "unused_parameter"]
    assert (alert.step, alert.module) == (3, "aux")
    assert alert.data["parameters"] == ["aux.weight", "aux.bias"]
    assert "find_unused_parameters=True" in alert.message
    assert "DDP" in alert.message or "DistributedDataParallel" in alert.hint


def test_branch_that_joins_late_is_named_when_it_first_gets_a_gradient(quiet_watch):
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, zero_gradient=False)
    _train(model, opt, 8, lambda step: step >= 5)
    (alert,) = [a for a in monitor.alerts if a.rule == "unused_parameter"]
    assert (alert.step, alert.module) == (5, "aux")
    assert alert.data["unused_step"] == 0


def test_branch_used_every_step_is_silent(quiet_watch):
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _train(model, opt, 8, lambda step: True)
    assert "unused_parameter" not in rules_of(monitor)


def test_frozen_parameters_are_not_unused(quiet_watch):
    torch.manual_seed(0)
    model = Branchy()
    model.aux.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    monitor = quiet_watch(model, opt)
    _train(model, opt, 6, lambda step: step % 2 == 0)
    assert "unused_parameter" not in rules_of(monitor)


def _skipped_at_step_3(quiet_watch, **config):
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, **config)
    _train(model, opt, 6, lambda step: step != 3)
    return [a for a in monitor.alerts if a.rule == "unused_parameter"]


def test_a_branch_used_on_some_steps_is_a_note_on_one_device(quiet_watch):
    """Harmless without DDP (stochastic depth, experts, a head trained every k steps):
    a healthy single-device run does not fail ``--fail-on warning`` for it."""
    (alert,) = _skipped_at_step_3(quiet_watch)
    assert alert.severity == "info" and alert.module == "aux"


def test_a_branch_used_on_some_steps_is_a_warning_under_a_process_group(quiet_watch):
    from tests.test_never_called_in_optimizer import one_process_group

    with one_process_group():
        (alert,) = _skipped_at_step_3(quiet_watch)
    assert alert.severity == "warning" and alert.module == "aux"


def test_a_configured_severity_holds_on_one_device(quiet_watch):
    (alert,) = _skipped_at_step_3(quiet_watch, config={"unused_parameter": {"severity": "error"}})
    assert alert.severity == "error"


def test_a_branch_used_on_some_steps_asks_for_nothing_on_one_process(quiet_watch):
    """A mixture of experts on one process is right as it is: the hint says so, and
    keeps find_unused_parameters=True for DistributedDataParallel only."""
    (alert,) = _skipped_at_step_3(quiet_watch)
    assert "On one process nothing needs doing" in alert.hint
    assert "Only under DistributedDataParallel" in alert.hint
    assert "find_unused_parameters=True" in alert.hint
    assert "Better:" not in alert.hint and "run the branch unconditionally" not in alert.hint
    assert alert.data["distributed"] is False


def test_control_under_a_process_group_the_hint_keeps_the_ddp_fixes(quiet_watch):
    from tests.test_never_called_in_optimizer import one_process_group

    with one_process_group():
        (alert,) = _skipped_at_step_3(quiet_watch)
    assert "nothing needs doing" not in alert.hint
    assert "Better: make every branch reach the loss each step" in alert.hint
    assert alert.data["distributed"] is True


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class _TwoExperts(nn.Module):
    """A hard router in miniature: expert 1 runs only on the steps it is picked,
    and its gate (a layer of its own beside it) runs always."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.experts = nn.ModuleList([_Expert(), _Expert()])
        self.gate = nn.Linear(16, 1)
        self.head = nn.Linear(16, 1)
        self.pick_second = True
        self.skip_fc2_only = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        out = self.experts[0](h)
        if self.skip_fc2_only:  # the control: only the expert's first layer runs
            out = out + self.experts[1].fc1(h)[:, :16]
        elif self.pick_second:
            out = out + self.experts[1](h)
        return self.head(out) * torch.sigmoid(self.gate(h))


def test_an_expert_the_router_skipped_is_one_finding_named_after_the_expert(quiet_watch):
    torch.manual_seed(0)
    model = _TwoExperts()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for step, (x, y) in enumerate(batches(8)):
        model.pick_second = step != 3
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    (alert,) = [a for a in monitor.alerts if a.rule == "unused_parameter"]
    assert (alert.step, alert.module) == (3, "experts.1")
    assert alert.data["parameters"] == [
        "experts.1.fc1.weight",
        "experts.1.fc1.bias",
        "experts.1.fc2.weight",
        "experts.1.fc2.bias",
    ]


def test_control_a_layer_skipped_beside_a_sibling_that_ran_keeps_its_own_name(quiet_watch):
    torch.manual_seed(0)
    model = _TwoExperts()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for step, (x, y) in enumerate(batches(8)):
        model.skip_fc2_only = step == 3  # fc1 of expert 1 still reaches the loss
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    (alert,) = [a for a in monitor.alerts if a.rule == "unused_parameter"]
    assert (alert.step, alert.module) == (3, "experts.1.fc2")
