"""Hooks come off cleanly, whatever happens; a model is never watched twice."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import trainwatch as tw
from tests.conftest import TinyNet, batches, train


def hook_counts(model: nn.Module, optimizers=()) -> dict[str, int]:
    counts = {
        "param_hooks": sum(len(p._backward_hooks or {}) for p in model.parameters()),
        "post_accumulate": sum(
            len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()
        ),
        "module_hooks": sum(
            len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
            for m in model.modules()
        ),
    }
    counts["optimizer_hooks"] = sum(
        len(o._optimizer_step_pre_hooks) + len(o._optimizer_step_post_hooks) for o in optimizers
    )
    from torch.nn.modules import module as module_globals

    counts["global_registration"] = (
        len(module_globals._global_module_registration_hooks)
        + len(module_globals._global_parameter_registration_hooks)
        + len(module_globals._global_forward_hooks)
        + len(module_globals._global_forward_pre_hooks)
        # side tables: one stale entry makes torch.compile(module) warn at every call
        + len(module_globals._global_forward_hooks_with_kwargs)
        + len(module_globals._global_forward_hooks_always_called)
    )
    return counts


NO_HOOKS = {
    "param_hooks": 0,
    "post_accumulate": 0,
    "module_hooks": 0,
    "optimizer_hooks": 0,
    "global_registration": 0,
}


def test_close_removes_every_hook_and_is_idempotent(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = tw.watch(model, opt, console=False)
    assert hook_counts(model, [opt]) != NO_HOOKS
    train(model, opt, 2)
    monitor.close()
    assert hook_counts(model, [opt]) == NO_HOOKS
    monitor.close()
    assert monitor.closed
    steps = monitor.step_count
    train(model, opt, 2)  # training after close is untouched
    assert monitor.step_count == steps


def test_exception_in_the_loop_leaves_no_hook_behind(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(ZeroDivisionError):
        with tw.watch(model, opt, console=False) as monitor:
            train(model, opt, 2)
            1 / 0  # noqa: B018
    assert monitor.closed
    assert hook_counts(model, [opt]) == NO_HOOKS


def test_context_manager_returns_the_monitor(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        assert isinstance(monitor, tw.Monitor)
        train(model, opt, 3)
        assert monitor.step_count == 3
    assert monitor.closed


def test_garbage_collected_monitor_takes_its_hooks_with_it(model):
    import gc

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tw.watch(model, opt, console=False)  # never closed, never kept
    gc.collect()
    assert hook_counts(model, [opt]) == NO_HOOKS


def test_watching_does_not_change_the_training_numerically():
    def run(watched: bool) -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = TinyNet()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        monitor = tw.watch(model, opt, console=False) if watched else None
        losses = train(model, opt, 10, clip=1.0)
        if monitor:
            monitor.close()
        return losses, [p.detach().clone() for p in model.parameters()]

    plain_losses, plain_params = run(False)
    watched_losses, watched_params = run(True)
    assert plain_losses == watched_losses
    assert all(torch.equal(a, b) for a, b in zip(plain_params, watched_params))


def test_optimizer_added_later_is_watched(model):
    with tw.watch(model, console=io.StringIO()) as monitor:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor.add_optimizer(opt)
        train(model, opt, 3)
        assert monitor.step_count == 3
        assert set(monitor.grad_norms()) == {"fc1", "fc2", "head"}


def test_step_accepts_a_loss_in_optimizer_mode_without_advancing(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        for x, y in batches(3):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            monitor.step(loss=loss)
            opt.step()
        assert monitor.step_count == 3


def test_extra_learnable_loss_weights_in_the_optimizer_are_fine(model):
    log_vars = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([*model.parameters(), log_vars], lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        for x, y in batches(4):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y) * log_vars.exp().sum()
            loss.backward()
            opt.step()
    assert monitor.alerts == []
