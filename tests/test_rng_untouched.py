"""trainwatch's own re-runs of a forward leave Python's and numpy's generators as they were.

A forward that draws from Python's ``random`` (teacher forcing written as
``random.random() < ratio``) or numpy's global generator moves them at each
call: a stalled-training re-run, a NaN replay or an op trace would shift
every later draw, and the watched training would differ from the same
script run plain. Each test trains a watched and a plain copy on the same
seeds and compares the weights and the generators' next draws.
"""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import torch
from torch import nn

import trainwatch as tw


class CoinFlipNet(nn.Module):
    """Doubles its hidden layer on a coin from Python's random, adds numpy noise."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if random.random() < 0.5:
            h = h * 2
        h = h + float(np.random.normal(scale=1e-3))
        return self.out(torch.tanh(h))


def _train(steps: int, watched: bool, nan_at: int | None = None, **overrides):
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = CoinFlipNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = tw.watch(model, opt, console=False, **overrides) if watched else None
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    try:
        for step in range(steps):
            batch = x.clone()
            if step == nan_at:
                batch[0, 0] = float("nan")  # one corrupt batch, skipped by the loop
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(batch), y)
            if not torch.isfinite(loss):
                continue
            loss.backward()
            opt.step()
    finally:
        alerts = monitor.alerts if monitor is not None else []
        if monitor is not None:
            monitor.close()
    draws = (random.random(), float(np.random.random()), float(torch.rand(())))
    return [p.detach().clone() for p in model.parameters()], draws, alerts


def _same(a, b) -> None:
    weights_a, draws_a, _ = a
    weights_b, draws_b, _ = b
    assert draws_a == draws_b
    for wa, wb in zip(weights_a, weights_b):
        assert torch.equal(wa, wb)


def test_stalled_training_reruns_leave_python_and_numpy_draws_alone():
    watched = _train(40, True, stalled_training={"every": 5, "warmup": 1})
    _same(watched, _train(40, False))


def test_a_nan_replay_and_op_trace_leave_python_and_numpy_draws_alone():
    watched = _train(20, True, nan_at=7)
    assert any(alert.rule == "nonfinite_forward" for alert in watched[2])
    _same(watched, _train(20, False, nan_at=7))


def test_importing_trainwatch_after_seeding_draws_nothing():
    """rich draws from Python's generator as it is imported; trainwatch puts it back."""
    code = (
        "import random; random.seed(0); first = random.random(); random.seed(0);"
        " import trainwatch; print(random.random() == first)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"
