"""A non-finite loss whose NaN/Inf the model's own ReLU keeps from every parameter.

A rate model ending in ``relu`` (or ``clamp(min=0)``) gives exactly 0 on some
rows, and a hand-written ``log(rate)`` there makes the loss Inf/NaN. Its
gradient is non-finite where it enters the model (``1 - y / rate``), but the
model's own ReLU backward zeroes those rows, so every parameter's gradient is
finite and training goes on silently, the printed loss ``inf``. The gradient
entering the model rides with the step's gradient norms (no op of its own),
so the step is told as ``nonfinite_loss`` at step 0 without the loss being
handed over: under ``tw.watch`` in each check mode, under ``trainwatch run``,
on a feed-forward and a recurrent model, behind a ``clamp(min=0)`` and a
mask, and behind a loop of rollouts under ``no_grad``. Each planted bug has
its healthy twin (``log(rate + eps)``), which stays silent, and the step's
gradient norms are the parameters' only. A loss handed over finite, whose
backward is NaN only where the model zeroes it, and a step whose gradients
were wiped after backward, say nothing of it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainwatch as tw
from tests.test_run import alerts as logged_alerts
from trainwatch.runner import run_script

CHECKS = ["auto", "step", "deferred"]


class RateNet(nn.Module):
    """A Poisson rate, >= 0, from a ReLU (or a clamp) at its end."""

    def __init__(self, end: str = "relu") -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)
        self.end = end

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.out(torch.tanh(self.fc1(x)))
        return F.relu(h) if self.end == "relu" else h.clamp(min=0)


def poisson_nll(rate: torch.Tensor, y: torch.Tensor, eps: float) -> torch.Tensor:
    return (rate - y * torch.log(rate + eps)).mean()


def masked_nll(p: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """A masked negative log-likelihood: rows left out are multiplied by 0, and
    ``0 * log(0)`` is NaN (a loss of NaN, its gradient NaN on those rows)."""
    return -(mask * torch.log(p + eps)).sum() / mask.sum() + p.mean()


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.randn(256, 8), torch.poisson(torch.full((256, 1), 3.0))


def _watched(
    model: nn.Module,
    loss_of,
    check: str,
    steps: int = 4,
    hand_over: bool = False,
    batch: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    x, y = batch if batch is not None else _batch()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with tw.watch(model, opt, console=False, nonfinite_forward={"check": check}) as monitor:
        for _ in range(steps):
            loss = loss_of(model(x), x, y)
            opt.zero_grad()
            loss.backward()
            if hand_over:
                monitor.step(loss=loss)
            opt.step()
    return monitor


def _told(monitor) -> list[tuple[str, int]]:
    return [(a.rule, a.step) for a in monitor.alerts if a.severity != "info"]


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_a_log_of_a_relu_rate_at_zero_is_a_nonfinite_loss(check, eps):
    torch.manual_seed(0)
    model = RateNet("relu")
    monitor = _watched(model, lambda rate, x, y: poisson_nll(rate, y, eps), check)
    if eps:
        assert _told(monitor) == []
        return
    assert _told(monitor)[:1] == [("nonfinite_loss", 0)]
    assert {rule for rule, _ in _told(monitor)} == {"nonfinite_loss"}
    alert = monitor.alerts[0]
    assert alert.module is None
    assert alert.data["gradients_finite"] is True
    assert alert.data["cause"] == "loss"
    assert "every parameter's gradient stayed finite" in alert.message
    assert "softplus" in alert.hint


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_a_masked_nll_of_a_clamped_output_is_a_nonfinite_loss(check, eps):
    """A second shape: a clamp(min=0) at the model's end, and a mask over the rows."""
    torch.manual_seed(1)
    model = RateNet("clamp")

    def loss_of(p, x, y):
        return masked_nll(p, (y > 2).float(), eps)

    monitor = _watched(model, loss_of, check)
    if eps:
        assert _told(monitor) == []
        return
    assert _told(monitor)[:1] == [("nonfinite_loss", 0)]
    data = monitor.alerts[0].data
    # The loss's kind; deferred checks read the sums a step later, the loss gone by then.
    assert data.get("kind") == "nan" or check == "deferred"
    assert data["entering_kind"] in ({"nan_or_inf"} if check == "deferred" else {"nan"}), data


def test_behind_rollouts_under_no_grad():
    """Many passes a step (an RL loop's rollouts under no_grad), one with grad: the
    gradient entering that one is what the step's norms carry."""
    torch.manual_seed(0)
    model = RateNet("relu")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = _batch()
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(3):
            with torch.no_grad():
                for _ in range(20):
                    model(torch.randn(4, 8))
            loss = poisson_nll(model(x), y, 0.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert _told(monitor)[:1] == [("nonfinite_loss", 0)]


@pytest.mark.parametrize("check", ["auto", "step"])
def test_the_loss_handed_over_is_told_with_what_entered_the_model(check):
    torch.manual_seed(0)
    monitor = _watched(
        RateNet("relu"), lambda rate, x, y: poisson_nll(rate, y, 0.0), check, hand_over=True
    )
    assert _told(monitor)[:1] == [("nonfinite_loss", 0)]
    assert monitor.alerts[0].message.startswith("the loss is non-finite (")
    assert "not handed over" not in monitor.alerts[0].message


@pytest.mark.parametrize("check", CHECKS)
def test_a_finite_loss_handed_over_with_a_nan_the_model_zeroes_is_silent(check):
    """``where(rate > 0, log(rate), 0)``: the loss is finite, its backward NaN
    (``0 * inf``) on rows the model's ReLU zeroes: nothing non-finite reaches
    the update, and the loss handed over says it is finite."""
    torch.manual_seed(0)

    def loss_of(rate, x, y):
        return -(torch.where(rate > 0, y * torch.log(rate), 0)).mean() + rate.mean()

    monitor = _watched(RateNet("relu"), loss_of, check, hand_over=True)
    assert _told(monitor) == []


def test_gradients_wiped_before_the_step_say_nothing_of_it():
    """``zero_grad()`` between backward and the step: the gradients are finite
    because they were wiped, not because the model zeroed anything; the reset is
    told on its own."""
    torch.manual_seed(0)
    model = RateNet("relu")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = _batch()
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(4):
            loss = poisson_nll(model(x), y, 0.0)
            loss.backward()
            opt.zero_grad(set_to_none=False)
            opt.step()
    assert {rule for rule, _ in _told(monitor)} == {"zero_gradient"}


@pytest.mark.parametrize("check", ["auto", "step"])
def test_the_gradient_norms_are_the_parameters_only(check):
    torch.manual_seed(0)
    model = RateNet("relu")
    monitor = _watched(model, lambda rate, x, y: poisson_nll(rate, y, 1e-8), check, steps=3)
    norms = monitor.grad_norms()
    assert set(norms) == {"fc1", "out"}
    for name in ("fc1", "out"):
        layer = getattr(model, name)
        expected = math.sqrt(sum(float(p.grad.norm()) ** 2 for p in layer.parameters()))
        assert norms[name] == pytest.approx(expected, rel=1e-5)


SCRIPT = """
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
x = torch.randn(256, 8)
y = torch.poisson(torch.full((256, 1), 3.0))


class RateNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return F.relu(self.out(torch.tanh(self.fc1(x))))


model = RateNet()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for step in range(10):
    rate = model(x)
    loss = (rate - y * torch.log(rate + {eps})).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_trainwatch_run_tells_the_loss_it_cannot_see(tmp_path, eps):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(eps=eps))
    run_script(script, [], log_dir=tmp_path / "log")
    logged = [a for a in logged_alerts(tmp_path / "log") if a["severity"] != "info"]
    if eps:
        assert logged == []
        return
    assert [(a["rule"], a["step"]) for a in logged][:1] == [("nonfinite_loss", 0)]
    assert {a["rule"] for a in logged} == {"nonfinite_loss"}
    # Not handed over, but held by the script at the step boundary: its value is named.
    assert logged[0]["message"].startswith("the loss is non-finite (inf)")
    assert logged[0]["data"]["gradients_finite"] is True


RECURRENT_SCRIPT = """
# Daily counts forecast by an LSTM, a hand-written Poisson NLL, shuffled batches.
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data as data

torch.manual_seed(0)
rng = np.random.default_rng(0)
t = np.arange(2000)
rate = 3 + 2.5 * np.sin(2 * np.pi * t / 7) + 1.5 * np.sin(2 * np.pi * t / 30)
counts = rng.poisson(np.clip(rate, 0.05, None)).astype(np.float32)
X = np.stack([counts[i : i + 14] for i in range(len(counts) - 14)])
X = torch.tensor(X).unsqueeze(-1) / 5.0
y = torch.tensor(counts[14:]).unsqueeze(-1)
loader = data.DataLoader(data.TensorDataset(X[:1600], y[:1600]), batch_size=64, shuffle=True)


class CountLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(1, 32, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        out, _ = self.lstm(x)
        return F.relu(self.head(out[:, -1]))


model = CountLSTM()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
for epoch in range(2):
    for xb, yb in loader:
        optimizer.zero_grad()
        rate = model(xb)
        loss = (rate - yb * torch.log(rate + {eps})).mean()
        loss.backward()
        optimizer.step()
"""


@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_trainwatch_run_on_a_recurrent_model(tmp_path, eps):
    script = tmp_path / "train.py"
    script.write_text(RECURRENT_SCRIPT.format(eps=eps))
    run_script(script, [], log_dir=tmp_path / "log")
    logged = [a for a in logged_alerts(tmp_path / "log") if a["severity"] != "info"]
    if eps:
        assert logged == []
    else:
        assert [(a["rule"], a["step"]) for a in logged] == [("nonfinite_loss", 0)]
