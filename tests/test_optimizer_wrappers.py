"""Optimizers that wrap the one updating the weights are watched through it.

SAM (the common implementation: ``base_optimizer`` built inside over its own
groups, stepped once after two forward/backward passes, by
``first_step``/``second_step`` or ``step(closure)``) and Lookahead (an old
timm copy holding ``_base_optimizer`` that never runs ``Optimizer.__init__``)
count the inner optimizer's steps; SAM's zero_grad between its two backward
passes is its design, not a reset before the step. A Lookahead written as a
plain class (no ``Optimizer`` at all) that holds ``optimizer`` and shares its
groups is watched through it too, by ``tw.watch`` and ``add_optimizer``.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tests.optimizer_wrappers import (
    SAM,
    WRAPPERS,
    Holder,
    Lookahead,
    PCGrad,
    PlainLookahead,
    PlainLookaheadOptimizer,
    Unhooked,
)
from trainwatch.errors import WatchError
from trainwatch.runner import run_script

STEPS = 20


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
    return x, (x[:, 0] > 0).long()


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    return nn.functional.cross_entropy(model(x), y)


def _warnings(monitor) -> list[tuple[str, int]]:
    return [(a.rule, a.step) for a in monitor.alerts if a.severity != "info"]


def _sam_two_steps(model, opt, reset_before_step: bool) -> None:
    for step in range(STEPS):
        _loss(model, step).backward()
        opt.first_step(zero_grad=True)
        _loss(model, step).backward()
        if reset_before_step:
            opt.zero_grad()
        opt.second_step(zero_grad=True)


def _sam_closure(model, opt, reset_before_step: bool) -> None:
    for step in range(STEPS):

        def closure(step=step):
            loss = _loss(model, step)
            loss.backward()
            if reset_before_step:
                opt.zero_grad()
            return loss

        _loss(model, step).backward()
        opt.step(closure)
        opt.zero_grad()


@pytest.mark.parametrize("loop", [_sam_two_steps, _sam_closure], ids=["first_second", "closure"])
@pytest.mark.parametrize("reset_before_step", [False, True], ids=["healthy", "zero_grad_misplaced"])
def test_sam_counts_its_base_optimizer_steps(quiet_watch, loop, reset_before_step):
    model = _model()
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    monitor = quiet_watch(model, opt)
    loop(model, opt, reset_before_step)
    assert monitor.optimizers == [opt.base_optimizer]
    assert monitor.step_count == STEPS
    assert _warnings(monitor) == ([("zero_gradient", 0)] if reset_before_step else [])


@pytest.mark.parametrize("zero_grad_until", [None, 10], ids=["healthy", "zero_grad_dropped"])
def test_lookahead_without_optimizer_init_is_watched_through_its_base(quiet_watch, zero_grad_until):
    model = _model()
    opt = Lookahead(torch.optim.Adam(model.parameters(), 1e-3))
    monitor = quiet_watch(model, opt)
    for step in range(STEPS):
        if zero_grad_until is None or step < zero_grad_until:
            opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
    assert monitor.optimizers == [opt._base_optimizer]
    assert monitor.step_count == STEPS
    assert _warnings(monitor) == ([] if zero_grad_until is None else [("accumulated_gradient", 10)])


@pytest.mark.parametrize("form", ["plain_class", "optimizer_subclass"])
@pytest.mark.parametrize("zero_grad_until", [None, 10], ids=["healthy", "zero_grad_dropped"])
@pytest.mark.parametrize("given", ["to_watch", "to_add_optimizer"])
def test_a_lookahead_holding_its_optimizer_is_watched_through_it(
    quiet_watch, form, zero_grad_until, given
):
    model = _model()
    wrapper = PlainLookahead if form == "plain_class" else PlainLookaheadOptimizer
    opt = wrapper(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    if given == "to_watch":
        monitor = quiet_watch(model, opt)
    else:
        monitor = quiet_watch(model)
        monitor.add_optimizer(opt)
    for step in range(STEPS):
        if zero_grad_until is None or step < zero_grad_until:
            opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
    assert monitor.optimizers == [opt.optimizer]
    assert monitor.step_count == STEPS
    assert _warnings(monitor) == ([] if zero_grad_until is None else [("accumulated_gradient", 10)])


def test_a_plain_class_holding_an_optimizer_of_other_parameters_is_refused_naming_it(
    quiet_watch,
):
    model = _model()
    holder = Holder(torch.optim.SGD(model.parameters(), lr=0.1), [nn.Parameter(torch.zeros(3))])
    with pytest.raises(WatchError, match=r"got Holder, which holds one as \.optimizer .*pass") as e:
        quiet_watch(model, holder)
    assert "does not train the same parameters" in str(e.value)
    monitor = quiet_watch(model)
    with pytest.raises(WatchError, match=r"pass that optimizer \(\.optimizer\) instead"):
        monitor.add_optimizer(holder)


def test_a_wrapper_with_no_param_groups_of_its_own_is_refused_for_that_not_other_parameters(
    quiet_watch,
):
    model = _model()
    pcgrad = PCGrad(torch.optim.Adam(model.parameters(), lr=1e-3))
    with pytest.raises(WatchError) as refused:
        quiet_watch(model, pcgrad)
    message = str(refused.value)
    assert "holds an optimizer as ._optim and exposes no param_groups of its own" in message
    assert "pass that optimizer (._optim) instead" in message
    assert "does not train the same parameters" not in message
    # The advice taken: the wrapper's steps are its optimizer's, all counted.
    monitor = quiet_watch(model, pcgrad._optim)
    for step in range(STEPS):
        pcgrad.zero_grad()
        _loss(model, step).backward()
        pcgrad.step()
    assert monitor.step_count == STEPS and _warnings(monitor) == []


def test_an_optimizer_no_hook_can_see_is_refused_by_name(quiet_watch):
    model = _model()
    with pytest.raises(WatchError, match=r"Unhooked never ran torch\.optim\.Optimizer\.__init__"):
        quiet_watch(model, Unhooked(model.parameters()))


SCRIPT = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
{build}
for step in range(20):
    x = torch.randn(32, 8)
    y = (x[:, 0] > 0).long()
{loop}
"""

SAM_SCRIPT = SCRIPT.format(
    build="opt = SAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)",
    loop="""    nn.functional.cross_entropy(model(x), y).backward()
    opt.first_step(zero_grad=True)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.second_step(zero_grad=True)""",
)

SAM_CLOSURE_SCRIPT = SCRIPT.format(
    build="opt = SAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)",
    loop="""    def closure():
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    nn.functional.cross_entropy(model(x), y).backward()
    opt.step(closure)
    opt.zero_grad()""",
)

UNHOOKED_SCRIPT = SCRIPT.format(
    build="opt = Unhooked(model.parameters())",
    loop="""    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()""",
)

LOOKAHEAD_SCRIPT = SCRIPT.format(
    build="opt = Lookahead(torch.optim.Adam(model.parameters(), 1e-3))",
    loop="""    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()""",
)


def _planted(body: str, line: str, bug: str) -> str:
    assert line in body
    return body.replace(line, bug)


SAM_MISPLACED_ZERO_GRAD = _planted(
    SAM_SCRIPT,
    "    opt.second_step(zero_grad=True)",
    "    opt.zero_grad()\n    opt.second_step(zero_grad=True)",
)
LOOKAHEAD_NO_ZERO_GRAD = _planted(
    LOOKAHEAD_SCRIPT, "    opt.zero_grad()", "    if step < 10:\n        opt.zero_grad()"
)


@pytest.mark.parametrize(
    ("body", "told"),
    [
        (SAM_SCRIPT, []),
        (SAM_CLOSURE_SCRIPT, []),
        (LOOKAHEAD_SCRIPT, []),
        (SAM_MISPLACED_ZERO_GRAD, [("zero_gradient", 0)]),
        (LOOKAHEAD_NO_ZERO_GRAD, [("accumulated_gradient", 10)]),
    ],
    ids=[
        "sam_first_second",
        "sam_closure",
        "lookahead",
        "sam_zero_grad_misplaced",
        "lookahead_zero_grad_dropped",
    ],
)
def test_trainwatch_run_watches_a_wrapped_optimizer_once(tmp_path, body, told):
    script = tmp_path / "train.py"
    script.write_text(WRAPPERS + body)
    run_script(script, [], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    assert [(a["rule"], a["step"]) for a in map(json.loads, lines)] == told
    audits = json.loads((tmp_path / "log" / "setup.json").read_text())["audits"]
    assert len(audits[-1]["optimizers"]) == 1
    assert json.loads((tmp_path / "log" / "alert_counts.json").read_text())["steps"] == STEPS


def test_trainwatch_run_counts_backward_ends_for_an_optimizer_no_hook_can_see(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(WRAPPERS + UNHOOKED_SCRIPT)
    run_script(script, [], log_dir=tmp_path / "log", console=False)
    assert (tmp_path / "log" / "alerts.jsonl").read_text().splitlines() == []
    assert json.loads((tmp_path / "log" / "alert_counts.json").read_text())["steps"] == STEPS
