"""An optimizer step with a closure (LBFGS) evaluates it several times inside one
``step()``, moving the weights in between: each evaluation needs fresh gradients.

A closure without ``zero_grad()`` adds each evaluation's gradients onto the ones
LBFGS already used: ``accumulated_gradient`` at that very step, under ``tw.watch``
and ``trainwatch run`` alike (whose model is found inside the closure). Its
evaluations, non-finite or not, are no steps a GradScaler skipped.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from trainwatch.runner import run_script


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(128, 2, generator=torch.Generator().manual_seed(0))
    return x, x[:, 0] * 0.7 - x[:, 1] ** 2 * 0.3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))


def _fit(
    quiet_watch,
    *,
    reset: str | None,
    max_iter: int = 20,
    steps: int = 1,
    micro_batches: int = 1,
    line_search: str | None = None,
):
    """LBFGS on a small fit with an L2 penalty; ``reset``: how the closure resets
    the gradients ("none", "zeros") or None (it does not)."""
    model = _model()
    opt = torch.optim.LBFGS(
        model.parameters(), lr=0.5, max_iter=max_iter, line_search_fn=line_search
    )
    monitor = quiet_watch(model, opt)
    x, y = _data()
    evaluations = 0

    def closure() -> torch.Tensor:
        nonlocal evaluations
        evaluations += 1
        if reset is not None:
            opt.zero_grad(set_to_none=reset == "none")
        total = torch.zeros(())
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            loss = nn.functional.mse_loss(model(xs).squeeze(1), ys) / micro_batches
            loss = loss + 1e-4 * sum(p.pow(2).sum() for p in model.parameters())
            loss.backward()
            total = total + loss.detach()
        return total

    for _ in range(steps):
        opt.step(closure)
    assert monitor.step_count == steps
    return monitor, evaluations


def _told(monitor) -> list[tuple[str, int]]:
    return [(a.rule, a.step) for a in monitor.alerts if a.severity != "info"]


@pytest.mark.parametrize("line_search", [None, "strong_wolfe"])
def test_one_lbfgs_step_whose_closure_misses_zero_grad_fires_at_that_step(quiet_watch, line_search):
    monitor, evaluations = _fit(quiet_watch, reset=None, line_search=line_search)
    assert evaluations > 2
    (alert,) = [a for a in monitor.alerts if a.rule == "accumulated_gradient"]
    assert alert.step == 0
    assert alert.data["method"] == "closure"
    assert "an earlier evaluation of step 0's closure" in alert.message
    assert "zero_grad() at the start of the closure" in alert.hint


@pytest.mark.parametrize("reset", ["none", "zeros"], ids=["set_to_none", "zeroed_in_place"])
@pytest.mark.parametrize("line_search", [None, "strong_wolfe"])
def test_control_lbfgs_closure_with_zero_grad_is_silent(quiet_watch, reset, line_search):
    monitor, evaluations = _fit(quiet_watch, reset=reset, steps=3, line_search=line_search)
    assert evaluations > 3
    assert _told(monitor) == []


def test_several_lbfgs_steps_without_zero_grad_fire_at_the_first(quiet_watch):
    monitor, _ = _fit(quiet_watch, reset=None, max_iter=4, steps=5)
    assert [a.step for a in monitor.alerts if a.rule == "accumulated_gradient"] == [0]


def test_lbfgs_with_one_evaluation_per_step_fires_at_the_step_that_reuses(quiet_watch):
    """max_iter=1: one evaluation per step(), so the first reuse is step 1's."""
    monitor, _ = _fit(quiet_watch, reset=None, max_iter=1, steps=4)
    (alert,) = [a for a in monitor.alerts if a.rule == "accumulated_gradient"]
    assert alert.step == 1
    assert "step 0 had already used" in alert.message


def test_control_lbfgs_with_one_evaluation_per_step_and_zero_grad_is_silent(quiet_watch):
    monitor, _ = _fit(quiet_watch, reset="none", max_iter=1, steps=4)
    assert _told(monitor) == []


def test_control_a_closure_summing_micro_batches_after_zero_grad_is_silent(quiet_watch):
    """Backward passes of one evaluation (weights unmoved between them) accumulate
    by design."""
    monitor, _ = _fit(quiet_watch, reset="none", micro_batches=4, steps=2)
    assert _told(monitor) == []


def test_a_closure_summing_micro_batches_without_zero_grad_fires(quiet_watch):
    monitor, _ = _fit(quiet_watch, reset=None, micro_batches=4)
    assert [a.step for a in monitor.alerts if a.rule == "accumulated_gradient"] == [0]


def test_diverging_lbfgs_evaluations_are_no_skipped_scaler_steps(quiet_watch):
    """Without zero_grad the evaluations blow up to non-finite gradients inside
    step(), with no step boundary between them and no GradScaler anywhere."""
    monitor, _ = _fit(quiet_watch, reset=None, max_iter=50, steps=3)
    assert not [a for a in monitor.alerts if a.rule == "amp_skipped_steps"]
    assert ("accumulated_gradient", 0) in _told(monitor)


LBFGS_SCRIPT = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=50)
x = torch.randn(128, 2)
y = x[:, 0] * 0.7 - x[:, 1] ** 2 * 0.3


def closure():
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x).squeeze(1), y)
    loss.backward()
    return loss


opt.step(closure)
"""


@pytest.mark.parametrize(
    ("body", "told"),
    [
        (LBFGS_SCRIPT, []),
        (LBFGS_SCRIPT.replace("    opt.zero_grad()\n", ""), [("accumulated_gradient", 0)]),
    ],
    ids=["zero_grad", "zero_grad_missing"],
)
def test_trainwatch_run_follows_the_lbfgs_step_its_model_was_found_in(tmp_path, body, told):
    """The model's first call is inside the closure, after the step's pre-hook: the
    step under way is followed all the same."""
    script = tmp_path / "train.py"
    script.write_text(body)
    run_script(script, [], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    alerts = [json.loads(line) for line in lines]
    assert [(a["rule"], a["step"]) for a in alerts if a["severity"] != "info"] == told


def _freeze_after(quiet_watch, optimizer: str, freeze_at: int):
    """Four steps; the first layer frozen after step ``freeze_at``'s update."""
    model = _model()
    params = model.parameters()
    opt = (
        torch.optim.LBFGS(params, max_iter=3)
        if optimizer == "lbfgs"
        else torch.optim.SGD(params, 0.1)
    )
    monitor = quiet_watch(model, opt)
    x, y = _data()

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x).squeeze(1), y)
        loss.backward()
        return loss

    audits = []
    for step in range(4):
        if optimizer == "lbfgs":
            opt.step(closure)
        else:
            closure()
            opt.step()
        audit = monitor.setup_audit
        if not audits or audits[-1] is not audit:
            audits.append(audit)
        if step == freeze_at:
            model[0].requires_grad_(False)
    return [audit.step for audit in audits]


@pytest.mark.parametrize("optimizer", ["lbfgs", "sgd"])
def test_a_closure_steps_setup_tables_carry_the_steps_own_number(quiet_watch, optimizer):
    """A closure's step is gathered after step() returned; its setup table is dated
    by that step, as a plain step's is (SGD stepped after the same closure: the control)."""
    assert _freeze_after(quiet_watch, optimizer, freeze_at=1) == [0, 2]
