"""Gradient checkpointing re-runs forward hooks during backward: no double counting, no alarm."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import trainwatch as tw


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.drop(self.fc(x)))


class CheckpointedNet(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = Block()
        self.head = nn.Linear(16, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, self.inp(x), use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_training_with_evaluations_raises_nothing(reentrant):
    torch.manual_seed(0)
    model = CheckpointedNet(reentrant)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(40):
            x = torch.randn(32, 8, requires_grad=reentrant)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1].detach().sin()).backward()
            opt.step()
            if step % 10 == 9:
                model.eval()
                with torch.no_grad():
                    model(torch.randn(8, 8))
                model.train()
    assert monitor.step_count == 40
    assert monitor.alerts == []
    assert set(monitor.grad_norms()) == {"inp", "block.fc", "head"}
