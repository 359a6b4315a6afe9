"""A NaN/Inf born of the pass's own random draws is found where it was born.

A replay re-runs the pass module by module. It must draw what the pass drew
(its dropout masks, a ``torch.rand`` in a forward): else a NaN that hangs on
them (every token of a text dropped, so a mean pools 0/0; dropout making two
embeddings equal, so a distance's sqrt meets 0) is not made again, and the
alert names the wrong module.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import trainwatch as tw


class TokenDropMean(nn.Module):
    """Word dropout, then a mean over the tokens kept: 0/0 when none is kept."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, emb: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.training:
            mask = mask * (torch.rand(mask.shape) > self.p).float()
        return (emb * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)


class TextNet(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.pool = TokenDropMean(p)
        self.fc = nn.Linear(16, 2)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.emb(tokens), mask))


def _train(p: float, check: str, steps: int = 60):
    torch.manual_seed(0)
    model = TextNet(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = None
    with tw.watch(model, opt, console=False, config={"nonfinite_forward": {"check": check}}) as mon:
        for step in range(steps):
            tokens = torch.randint(0, 100, (32, 6))
            lengths = torch.randint(3, 7, (32,))
            mask = (torch.arange(6) < lengths[:, None]).float()
            out = model(tokens, mask)
            if first is None and not torch.isfinite(out).all():
                first = step
            loss = F.cross_entropy(out, torch.randint(0, 2, (32,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return first, [a for a in mon.alerts if a.rule.startswith("nonfinite")]


@pytest.mark.parametrize("check", ["auto", "step"])
def test_a_mean_over_tokens_all_dropped_is_told_at_the_pooling_module(check):
    first, alerts = _train(p=0.3, check=check)
    assert first is not None  # the planted 0/0 happens
    origin = alerts[0]
    assert (origin.rule, origin.step, origin.module) == ("nonfinite_forward", first, "pool")
    assert origin.data["cause"] == "module"
    assert origin.data["op"] == "aten::div"


@pytest.mark.parametrize("check", ["auto", "step"])
def test_the_same_model_with_few_tokens_dropped_is_silent(check):
    first, alerts = _train(p=0.01, check=check)
    assert first is None and alerts == []


def test_the_replay_leaves_training_draws_as_they_were():
    """The replay sets the pass's state inside a fork: training's next draws are
    those of a run without trainwatch."""
    torch.manual_seed(0)
    model = TextNet(0.3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tw.watch(model, opt, console=False) as mon:
        tokens = torch.randint(0, 100, (32, 6))
        mask = torch.zeros(32, 6)  # every token masked: 0/0 at once
        model(tokens, mask)
        after_watched = torch.rand(4)
    assert [a.module for a in mon.alerts if a.rule == "nonfinite_forward"] == ["pool"]
    torch.manual_seed(0)
    plain = TextNet(0.3)
    plain(torch.randint(0, 100, (32, 6)), torch.zeros(32, 6))
    assert torch.equal(torch.rand(4), after_watched)


class Distance(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((a - b) ** 2).sum(1).sqrt()


class DroppedTwin(nn.Module):
    """A distance between a dropped-out copy and its undropped double: zero exactly
    when the mask keeps every unit (dropout scales kept units by exactly 2), where
    the sqrt's gradient is infinite."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.drop = nn.Dropout(0.5)
        self.dist = Distance()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x)
        return self.dist(self.drop(z), 2 * z)


@pytest.mark.parametrize("seed", [1, 2, 5])
@pytest.mark.parametrize("check", ["auto", "step"])
def test_a_gradient_nan_that_hangs_on_a_dropout_mask_is_told_at_its_module(check, seed):
    torch.manual_seed(seed)
    model = DroppedTwin()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first = None
    with tw.watch(model, opt, console=False, config={"nonfinite_forward": {"check": check}}) as mon:
        for step in range(40):
            opt.zero_grad()
            model(torch.randn(1, 4)).sum().backward()
            if first is None and not all(torch.isfinite(p.grad).all() for p in model.parameters()):
                first = step
            opt.step()
    assert first is not None  # the mask kept every unit at some step
    origin = next(a for a in mon.alerts if a.rule.startswith("nonfinite"))
    assert (origin.rule, origin.step, origin.module) == ("nonfinite_backward", first, "dist")
    assert origin.data["op"] == "aten::sqrt"
