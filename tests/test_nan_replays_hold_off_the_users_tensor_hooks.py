"""A backward replay calls none of the user's gradient hooks on tensors.

When a step's gradients come out non-finite, trainwatch runs the step's last
pass forward and backward again to name the module and op that made the
NaN. Its module hooks were held off for it, but the user's gradient hooks on
tensors fired: a per-weight gradient-norm log registered by the loop
(``p.register_hook(...)``) got one more entry per weight, a hook its forward
registers on an activation (``h.register_hook(self.on_grad)``, a callback
handed in) logged once more, and a gradient-reversal layer whose strength
ramps with the backward passes it has seen (``next(self.seen)`` in its hook)
counted the replay, so every step after it trained with another strength
than the run without trainwatch.

Now the user's hooks on the weights are taken out of their tables for the
replay and put back after it, and those its forward registers are not
registered (a ``TorchFunctionMode`` live for the replay alone); trainwatch's
own and torch's stay. Each planted NaN gradient (an all-zero row reaching a
norm's sqrt) is still placed in ``norm`` (``aten::sqrt``); the logs and
counters hold what they hold without trainwatch, and the training after is
the same, bit for bit. Control: the healthy twin stays silent.
"""

from __future__ import annotations

import itertools
import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from tests.same_training import plain_and_under_run
from trainwatch.lightning import TrainWatchCallback

BAD_STEP = 3
STEPS = 6


def _told(alerts) -> list[tw.Alert]:
    return [a for a in alerts if a.severity != "info"]


class SqrtNorm(nn.Module):
    """Adds each row's norm: finite forward, an Inf derivative at an all-zero row."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.sqrt((h**2).sum(-1, keepdim=True))


class GradientReversal(nn.Module):
    """DANN's layer: the gradient reversed, its strength ramping with the backward
    passes seen (counted by the hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = itertools.count()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.view_as(x)
        if y.requires_grad:
            y.register_hook(self._reverse)
        return y

    def _reverse(self, grad: torch.Tensor) -> torch.Tensor:
        return -min(1.0, 0.2 + next(self.seen) / 10) * grad


class DomainNet(nn.Module):
    """A feature extractor, a label head, and a domain head behind a reversal; the
    forward hands its features' gradient to a callback it was given."""

    def __init__(self, on_grad=None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8, bias=False)
        self.norm = SqrtNorm()
        self.head = nn.Linear(8, 2)
        self.reverse = GradientReversal()
        self.domain = nn.Linear(8, 2)
        self.on_grad = on_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.lin(x))
        if self.on_grad is not None and h.requires_grad:
            h.register_hook(self.on_grad)
        return torch.cat([self.head(h), self.domain(self.reverse(h))], -1)


def _loss(out: torch.Tensor, y: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[:, :2], y) + F.cross_entropy(out[:, 2:], d)


def _batch(step: int, bad: bool):
    gen = torch.Generator().manual_seed(step)
    x = torch.rand(16, 4, generator=gen) + 0.5
    if bad and step == BAD_STEP:
        x[3] = 0.0  # an all-zero row reaches norm's sqrt
    y, d = torch.randint(0, 2, (2, 16), generator=gen)
    return x, y, d


def _train(bad: bool, check: str | None = None):
    """The losses, weights, the per-weight gradient log, the activation log, how many
    backward passes the reversal counted, and the alerts (None unwatched)."""
    torch.manual_seed(0)
    logged: list[float] = []
    model = DomainNet(on_grad=lambda g: logged.append(float(g.norm())))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    norms: dict[str, list[float]] = {n: [] for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: norms[name].append(float(g.norm())))
    monitor = None
    if check is not None:
        monitor = tw.watch(model, opt, console=False, nonfinite_forward={"check": check})
    losses = []
    try:
        for step in range(STEPS):
            x, y, d = _batch(step, bad)
            loss = _loss(model(x), y, d)
            opt.zero_grad()
            loss.backward()
            opt.step()  # (the NaN gradient goes into the weights: every later step is NaN)
            losses.append(loss.item())
    finally:
        if monitor is not None:
            monitor.close()
    weights = [p.detach().clone() for p in model.parameters()]
    counted = next(model.reverse.seen)
    alerts = None if monitor is None else monitor.alerts
    return losses, weights, norms, logged, counted, alerts


def _same(a: list[float], b: list[float]) -> bool:
    """Equal, NaN for NaN."""
    return len(a) == len(b) and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b)
    )


@pytest.mark.parametrize("check", ["auto", "step"])
def test_a_backward_replay_calls_none_of_the_users_gradient_hooks_and_training_stays_the_same(
    check,
):
    plain_losses, plain_weights, plain_norms, plain_logged, plain_counted, _ = _train(True)
    losses, weights, norms, logged, counted, alerts = _train(True, check)
    first = _told(alerts)[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_backward", BAD_STEP, "norm")
    assert first.data["cause"] == "module" and first.data["op"] == "aten::sqrt"
    # The per-weight log, the forward's callback and the reversal's count as without it.
    assert {n: len(v) for n, v in norms.items()} == {n: STEPS for n in norms}
    assert all(_same(norms[n], plain_norms[n]) for n in norms)
    assert _same(logged, plain_logged) and len(logged) == STEPS
    assert counted == plain_counted == STEPS
    assert _same(losses, plain_losses)
    assert all(
        torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(weights, plain_weights)
    )


def test_control_the_healthy_twin_stays_silent_and_its_hooks_run_as_without_trainwatch():
    plain_losses, plain_weights, plain_norms, plain_logged, plain_counted, _ = _train(False)
    losses, weights, norms, logged, counted, alerts = _train(False, "auto")
    assert _told(alerts) == []
    assert norms == plain_norms and logged == plain_logged and counted == plain_counted == STEPS
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))


def test_the_users_hooks_are_back_in_their_order_after_the_replay():
    torch.manual_seed(0)
    model = DomainNet()
    calls: list[str] = []
    weight = model.lin.weight
    weight.register_hook(lambda g: calls.append("first"))
    weight.register_hook(lambda g: calls.append("second"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(STEPS):
            x, y, d = _batch(step, True)
            loss = _loss(model(x), y, d)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert _told(monitor.alerts)[0].module == "norm"
    assert calls == ["first", "second"] * STEPS


# -- Lightning --------------------------------------------------------------------------
class LitDomain(pl.LightningModule):
    def __init__(self, bad: bool) -> None:
        super().__init__()
        self.net = DomainNet()
        self.bad = bad

    def training_step(self, batch, batch_idx):
        x, y, d = _batch(batch_idx, self.bad)
        return _loss(self.net(x), y, d)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("bad", [True, False])
def test_lightning_a_backward_replay_leaves_the_reversal_layers_count_alone(tmp_path, bad):
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(tmp_path, [callback], max_steps=BAD_STEP + 1)
    torch.manual_seed(0)
    lit = LitDomain(bad)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(64, 1)))
    trainer.fit(lit, loader)
    assert next(lit.net.reverse.seen) == BAD_STEP + 1
    told = _told(callback.monitor.alerts)
    if not bad:
        assert told == []
        return
    first = told[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_backward", BAD_STEP, "net.norm")


# -- trainwatch run -------------------------------------------------------------------------
SCRIPT = """
import json, sys, torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)

class SqrtNorm(nn.Module):
    def forward(self, h):
        return h + torch.sqrt((h ** 2).sum(-1, keepdim=True))

model = nn.Sequential(nn.Linear(4, 8, bias=False), SqrtNorm(), nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
grad_norms = {name: [] for name, _ in model.named_parameters()}
for name, p in model.named_parameters():
    p.register_hook(lambda g, name=name: grad_norms[name].append(float(g.norm())))
for step in range(6):
    x = torch.rand(16, 4) + 0.5
    if BAD and step == 3:
        x[3] = 0.0
    loss = F.cross_entropy(model(x), torch.randint(0, 2, (16,)))
    opt.zero_grad(); loss.backward(); opt.step()
with open(sys.argv[1], "w") as f:
    json.dump({name: len(v) for name, v in grad_norms.items()}, f)
"""


@pytest.mark.slow
@pytest.mark.parametrize("bad", [True, False])
def test_trainwatch_run_leaves_a_scripts_gradient_log_as_it_is_without(tmp_path, bad):
    plain, watched, rules = plain_and_under_run(tmp_path, SCRIPT.replace("BAD", str(bad)))
    assert watched == plain == {"0.weight": 6, "2.weight": 6, "2.bias": 6}
    assert ("nonfinite_backward" in rules) is bad
