"""broadcast: (N, 1) against (N,) in the loss, in both usual forms, and the shapes that are fine."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tests.conftest import TinyNet, batches, rules_of
from trainwatch.collect.broadcast import batch_broadcast


def _regression(model, opt, steps: int, loss_fn) -> None:
    for x, y in batches(steps):
        opt.zero_grad()
        loss_fn(model(x), y.squeeze(-1)).backward()  # y: (N,), output: (N, 1)
        opt.step()


def test_regression_output_n1_minus_target_n_is_caught_at_step_0(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _regression(model, opt, 5, lambda out, y: ((out - y) ** 2).mean())
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    assert alert.step == 0 and alert.module is None and alert.severity == "error"
    assert alert.data["op"] == "sub"
    assert alert.data["shapes"] == [[32, 1], [32]]
    assert alert.data["result"] == [32, 32]
    assert alert.data["source"].endswith(f"{__name__.split('.')[-1]}.py:{_line('(out - y)')}")
    assert ".squeeze(-1)" in alert.hint and "view_as" in alert.hint
    assert "torch.cat them instead of torch.stack" in alert.hint  # (N, 1): maybe stacked


def test_mse_loss_with_mismatched_target_is_caught(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's own warning says the same
        _regression(model, opt, 3, nn.MSELoss())
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    assert alert.data["op"] == "mse_loss" and alert.data["result"] == [32, 32]


def test_policy_gradient_log_prob_n_times_advantage_n1_is_caught(quiet_watch):
    torch.manual_seed(0)
    policy = TinyNet(outputs=4)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    monitor = quiet_watch(policy, opt)
    for _ in range(4):
        obs = torch.randn(32, 8)
        dist = torch.distributions.Categorical(logits=policy(obs))
        actions = dist.sample()
        advantages = torch.randn(32, 1)  # e.g. returns - values, kept as (N, 1)
        loss = -(dist.log_prob(actions) * advantages).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    assert alert.step == 0
    assert alert.data["op"] == "mul"
    assert sorted(alert.data["shapes"], key=len) == [[32], [32, 1]]
    assert alert.data["result"] == [32, 32]


def test_matching_shapes_pairwise_and_outer_products_are_silent(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    freqs = torch.arange(1, 9).float()
    for x, y in batches(4):
        out = model(x)  # (N, 1) against (N, 1)
        pairwise = (out[:, None, :] - out[None, :, :]).pow(2).mean()  # explicit (N, N)
        outer = (out * freqs).mean()  # (N, 1) * (8,): features, not a batch axis
        loss = nn.functional.mse_loss(out, y) + 1e-3 * (pairwise + outer)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert rules_of(monitor) == []


def test_audit_ends_after_its_steps_and_leaves_no_mode_behind(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, broadcast={"audit_steps": 2})
    _regression(model, opt, 2, lambda out, y: nn.functional.mse_loss(out.squeeze(-1), y))
    assert torch._C._len_torch_function_stack() == 0
    _regression(model, opt, 3, lambda out, y: ((out - y) ** 2).mean())  # too late to see
    assert "broadcast" not in rules_of(monitor)
    assert torch._C._len_torch_function_stack() == 0


def test_close_between_forward_and_step_pops_the_audit_mode(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    model(torch.randn(4, 8))
    assert torch._C._len_torch_function_stack() == 1
    monitor.close()
    assert torch._C._len_torch_function_stack() == 0


def test_a_no_grad_pass_after_the_forward_keeps_the_mode_until_the_step_or_close(
    model, quiet_watch
):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    x, y = next(batches(1))
    out = model(x)
    with torch.no_grad():
        model(x)  # a target or bootstrap pass: the loss is still to come
    assert torch._C._len_torch_function_stack() == 1
    opt.zero_grad()
    (out - y.squeeze(-1)).abs().mean().backward()
    opt.step()
    assert torch._C._len_torch_function_stack() == 0
    with torch.no_grad():
        model(x)  # an evaluation between steps: nothing of the step is left to follow
    # Only the evaluation audit's mode, following what the evaluation computes.
    assert torch._C._len_torch_function_stack() == 1
    top = torch._C._get_function_stack_at(0).audit()
    assert top is monitor._pipeline.behaviour.evaluations.follower
    model(x)  # a training pass ends the evaluation's span
    assert torch._C._len_torch_function_stack() == 1  # the training audit's, for its loss
    assert torch._C._get_function_stack_at(0).audit() is monitor._pipeline.behaviour.broadcast
    with torch.no_grad():
        model(x)
    monitor.close()
    assert torch._C._len_torch_function_stack() == 0
    assert rules_of(monitor) == ["broadcast"]


def test_a_no_grad_pass_inside_the_users_own_mode_leaves_their_mode_to_pop(model, quiet_watch):
    from torch.overrides import TorchFunctionMode

    class UserMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    x, y = next(batches(1))
    out = model(x)
    with UserMode() as user:
        with torch.no_grad():
            model(x)
        assert torch._C._get_function_stack_at(1) is user
    assert torch._C._len_torch_function_stack() == 1  # theirs popped, ours still on
    opt.zero_grad()
    (out - y.squeeze(-1)).abs().mean().backward()
    opt.step()
    assert torch._C._len_torch_function_stack() == 0
    assert rules_of(monitor) == ["broadcast"]


@pytest.mark.parametrize(
    ("first", "second", "result"),
    [
        ((32, 1), (32,), (32, 32)),
        ((32,), (32, 1), (32, 32)),
        ((8, 32, 1), (32,), (8, 32, 32)),
        ((32, 1), (1, 32), None),  # same rank: an explicit pairwise op
        ((32, 1, 4), (32, 4), None),  # pairwise over a middle axis
        ((32, 1), (8,), None),  # outer product with a feature axis
        ((32, 4), (4,), None),  # one side expands only
        ((1,), (32, 1), None),
    ],
)
def test_batch_broadcast_pattern(first, second, result):
    assert batch_broadcast(first, second) == result


def _line(text: str) -> int:
    import inspect

    lines = inspect.getsource(inspect.getmodule(_line)).splitlines()
    return next(i + 1 for i, line in enumerate(lines) if text in line and "lambda" in line)


def test_a_pass_inside_the_users_own_function_mode_is_not_audited(model, quiet_watch):
    from torch.overrides import TorchFunctionMode

    class UserMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    quiet_watch(model, opt)
    x, y = next(batches(1))
    with UserMode():
        out = model(x)  # ours would sit above theirs and be popped by their exit
    assert torch._C._len_torch_function_stack() == 0
    opt.zero_grad()
    nn.functional.mse_loss(out, y).backward()
    opt.step()
    assert torch._C._len_torch_function_stack() == 0


def test_audit_works_under_a_default_device(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    torch.set_default_device("cpu")  # pushes a DeviceContext mode for good
    try:
        _regression(model, opt, 2, lambda out, y: ((out - y) ** 2).mean())
    finally:
        torch.set_default_device(None)
    assert "broadcast" in rules_of(monitor)
    assert torch._C._len_torch_function_stack() == 0
