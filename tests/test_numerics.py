"""Watching never changes what the model computes: bit-identical runs, RNG untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainwatch as tw


class InplaceNet(nn.Module):
    """In-place activations and ops, dropout and batch norm: the usual hook breakers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.act = nn.ReLU(inplace=True)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        h = self.drop(self.bn(h))
        r = self.fc2(h)
        r += h  # in-place residual
        return self.head(torch.relu_(r))


EVERY_CHECK_EVERY_STEP = {
    "constant_output": {"every": 1},
    "dead_units": {"every": 1},
    "nonfinite_parameter": {"check_every": 1},
    "tensorboard": {"histograms": True, "histogram_every": 1},
}


class FaultyDropoutNet(InplaceNet):
    """Dropout draws from the global RNG; a division by zero at a chosen step."""

    def __init__(self) -> None:
        super().__init__()
        self.fault_step: int | None = None
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.step += 1
        return out / 0.0 if self.step - 1 == self.fault_step else out


def _train_with(config: dict | None, fault_step: int | None, log_dir=None, steps: int = 15):
    """Every step's loss and the final weights; config None: unwatched."""
    torch.manual_seed(0)
    model = FaultyDropoutNet()
    model.fault_step = fault_step
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = None
    if config is not None:
        monitor = tw.watch(model, opt, console=False, log_dir=log_dir, **config)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 8), torch.randn(16, 1)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    rng_after = torch.get_rng_state()
    alerts = []
    if monitor is not None:
        alerts = monitor.alerts
        monitor.close()
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], rng_after, alerts


@pytest.mark.parametrize("fault_step", [None, 4], ids=["healthy", "nan-at-step-4"])
@pytest.mark.parametrize(
    "config",
    [
        {},
        EVERY_CHECK_EVERY_STEP,
        {**EVERY_CHECK_EVERY_STEP, "nonfinite_forward": {"check": "step"}},
        {**EVERY_CHECK_EVERY_STEP, "nonfinite_forward": {"check": "deferred"}},
    ],
    ids=["default", "every-check-every-step", "step", "deferred"],
)
def test_losses_weights_and_rng_are_bit_identical_with_and_without_trainwatch(
    config, fault_step, tmp_path
):
    plain = _train_with(None, fault_step)
    watched = _train_with(config, fault_step, log_dir=tmp_path)
    exact = {"rtol": 0.0, "atol": 0.0, "equal_nan": True}
    torch.testing.assert_close(watched[0], plain[0], **exact)
    for after_watched, after_plain in zip(watched[1], plain[1]):
        torch.testing.assert_close(after_watched, after_plain, **exact)
    assert torch.equal(watched[2], plain[2])  # trainwatch drew no random numbers
    if fault_step is None:
        assert watched[3] == []
    else:  # the replays and traces did run
        first = next(a for a in watched[3] if a.rule.startswith("nonfinite"))
        assert (first.step, first.module) == (fault_step, "")
