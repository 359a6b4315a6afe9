"""A loop without an optimizer pays for a healthy step what it pays at any depth.

Weights updated by hand, ``monitor.step()`` after each update: trainwatch's
bytecodes on a healthy step (past the first-steps audits, off the sampled
steps) at depth 64 stay within a small constant of depth 4's, as an
optimizer's step does (``tests/test_opcount.py``). Two loop shapes: the
gradients reset to None after the update, before ``monitor.step()`` (the
boundary reads none), and reset at the top of the next iteration (the
boundary reads them all). A sign update keeps the deep stack finite.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from opcount import BATCH, WIDTH, _count_bytecodes, residual_stack

import trainwatch as tw

# Slack for a constant or two that depends on the step's shape, never on depth.
SAME = 40
WARM_STEPS = 41  # past the first-steps audits, off the sampled steps


def _healthy_step_bytecodes(depth: int, reset_first: bool) -> int:
    torch.manual_seed(0)
    model = residual_stack(depth)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, 1)

    def step(monitor: tw.Monitor) -> torch.Tensor:
        if reset_first:
            model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= 1e-3 * param.grad.sign()
        if not reset_first:
            model.zero_grad(set_to_none=True)
        monitor.step()
        return loss.detach()

    with tw.watch(model, console=False) as monitor:
        for _ in range(WARM_STEPS):
            loss = step(monitor)
        counted = _count_bytecodes(lambda: step(monitor))
        assert torch.isfinite(loss)  # a healthy step, not a non-finite one
        assert not monitor.alerts
    return counted


@pytest.mark.parametrize("reset_first", [False, True], ids=["reset_before_step", "reset_first"])
def test_hand_written_updates_cost_the_same_at_any_depth(reset_first):
    shallow = _healthy_step_bytecodes(4, reset_first)
    deep = _healthy_step_bytecodes(64, reset_first)
    assert abs(deep - shallow) <= SAME, (shallow, deep)


def _hand_loop_rules(reset: str, steps: int = 12) -> set[str]:
    torch.manual_seed(0)
    model = residual_stack(8)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, 1)
    with tw.watch(model, console=False) as monitor:
        for _ in range(steps):
            if reset == "first":
                model.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            with torch.no_grad():
                for param in model.parameters():
                    param -= 1e-3 * param.grad.sign()
            if reset == "before_step":
                model.zero_grad(set_to_none=True)
            monitor.step()
        return {alert.rule for alert in monitor.alerts}


@pytest.mark.parametrize("reset", ["first", "before_step"])
def test_the_cheap_step_still_tells_gradients_never_reset(reset):
    assert "accumulated_gradient" not in _hand_loop_rules(reset)
    assert "accumulated_gradient" in _hand_loop_rules("never")
