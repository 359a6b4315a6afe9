"""Watching never changes what the model computes: bit-identical runs, RNG untouched."""

from __future__ import annotations

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


def _train(watched: bool, steps: int = 15):
    torch.manual_seed(0)
    model = InplaceNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = tw.watch(model, opt, console=False) if watched else None
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 8), torch.randn(16, 1)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    rng_after = torch.get_rng_state()
    if monitor is not None:
        assert monitor.alerts == []
        monitor.close()
    return losses, [p.detach().clone() for p in model.parameters()], rng_after


def test_losses_parameters_and_rng_are_bit_identical_with_and_without_trainwatch():
    plain = _train(watched=False)
    watched = _train(watched=True)
    assert plain[0] == watched[0]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], watched[1]))
    assert torch.equal(plain[2], watched[2])
