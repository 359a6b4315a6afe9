"""Healthy steps see the model from its own two pass hooks, however it came to be watched.

A hook on a child module would run Python on every call of that child at
every step: a cost that grows with the model. Children are hooked only when
steps bring gradients without any pass of the model itself (the loop calls
parts of it on their own).
"""

from __future__ import annotations

import torch
from torch import nn

from tests.conftest import TinyNet, batches, train


def _hooked_children(model: nn.Module) -> list[str]:
    return [
        name
        for name, module in model.named_modules()
        if name and (module._forward_hooks or module._forward_pre_hooks)
    ]


def test_a_model_watched_with_gradients_left_from_earlier_training_hooks_no_child(quiet_watch):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train(model, opt, 3)  # unwatched: its gradients are still there when watching starts
    assert all(p.grad is not None for p in model.parameters())
    monitor = quiet_watch(model, opt)
    train(model, opt, 5)
    assert _hooked_children(model) == []
    assert monitor._pipeline.passes.passes == 5


def test_a_model_watched_before_any_gradient_hooks_no_child(quiet_watch):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    quiet_watch(model, opt)
    train(model, opt, 5)
    assert _hooked_children(model) == []


class _TwoParts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)


def test_a_loop_calling_only_parts_of_the_model_gets_them_hooked(quiet_watch):
    model = _TwoParts()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for x, y in batches(4):
        opt.zero_grad()
        nn.functional.mse_loss(model.head(torch.relu(model.encoder(x))), y).backward()
        opt.step()
    assert sorted(_hooked_children(model)) == ["encoder", "head"]
    assert monitor._pipeline.passes.passes > 0


class _Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []

    def pass_starts(self, module: nn.Module) -> None:
        self.events.append("starts")

    def pass_ends(self, module: nn.Module, args, kwargs, output) -> None:
        self.events.append("ends")


def test_a_listener_without_start_work_is_called_only_as_each_pass_ends():
    from trainwatch.collect.passes import ModelPasses

    model = TinyNet()
    passes = ModelPasses(on_error=lambda name, exc: None)
    passes.hook(model)
    both, ends_only = _Recorder(), _Recorder()
    passes.subscribe("both", both)
    passes.subscribe("ends only", ends_only, starts=False)
    model(torch.randn(2, 8))
    passes.unsubscribe(both)
    model(torch.randn(2, 8))
    passes.detach()
    model(torch.randn(2, 8))
    assert both.events == ["starts", "ends"]
    assert ends_only.events == ["ends", "ends"]
