"""Missing zero_grad is caught in steps of many passes, with one waiting output hook.

Shapes as people write them: a policy's batch-of-one passes summed into one
loss (REINFORCE), an action chosen with grad on whose output is dropped
before the training pass, and micro-batches each with their own backward.
Each planted bug has its clean control beside it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conftest import TinyNet, calls_from_trainwatch, train


def _policy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def _reinforce(model, opt, steps, zero_grad=True, act_with_grad=False):
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        picked = []
        for _ in range(8):
            obs = torch.randn(1, 8, generator=gen)
            if act_with_grad:
                model(obs).argmax()  # the output dropped at once: its graph goes
            picked.append(torch.log_softmax(model(obs), -1)[0, 0])
        if zero_grad:
            opt.zero_grad()
        (-torch.stack(picked).sum()).backward()
        opt.step()


def _accumulated(monitor) -> list[int]:
    return [a.step for a in monitor.alerts if a.rule == "accumulated_gradient"]


@pytest.mark.parametrize("act_with_grad", [False, True], ids=["reinforce", "acting-with-grad"])
def test_missing_zero_grad_in_a_many_pass_step_fires_and_the_clean_loop_does_not(
    quiet_watch, act_with_grad
):
    clean = _policy()
    opt = torch.optim.SGD(clean.parameters(), lr=0.01)
    watched = quiet_watch(clean, opt)
    _reinforce(clean, opt, 6, act_with_grad=act_with_grad)
    assert _accumulated(watched) == []

    buggy = _policy()
    opt = torch.optim.SGD(buggy.parameters(), lr=0.01)
    monitor = quiet_watch(buggy, opt)
    _reinforce(buggy, opt, 6, zero_grad=False, act_with_grad=act_with_grad)
    assert _accumulated(monitor)[:1] == [1]  # the first step that reuses gradients


def test_micro_batches_with_their_own_backward_are_clean_and_a_missing_reset_fires(quiet_watch):
    def run(zero_grad_until: int | None) -> list[int]:
        torch.manual_seed(0)
        model = TinyNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor = quiet_watch(model, opt)
        train(model, opt, 5, accumulate=4, zero_grad_until=zero_grad_until)
        return _accumulated(monitor)

    assert run(zero_grad_until=None) == []
    assert run(zero_grad_until=0)[:1] == [1]


def test_a_many_pass_step_hooks_one_output_for_its_backward(quiet_watch):
    """Python calls into the tracker during backward: one per backward, not one per pass."""
    model = _policy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    quiet_watch(model, opt)
    _reinforce(model, opt, 3)
    picked = [torch.log_softmax(model(torch.randn(1, 8)), -1)[0, 0] for _ in range(16)]
    opt.zero_grad()
    loss = -torch.stack(picked).sum()
    starts = calls_from_trainwatch(loss.backward).count("backward_starts")
    assert 1 <= starts <= 2  # the output's hook and the one parameter's fallback
