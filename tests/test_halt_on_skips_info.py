"""``halt_on`` stops training on a rule's warnings and errors, not on its info lines
(a task's head switched off by a zero loss weight, a knock-on of an origin told
elsewhere): an info line is no fault of the training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainwatch as tw


class _TwoTasks(nn.Module):
    """A shared body with a classification head and an auxiliary regression head."""

    def __init__(self, cut_body: bool = False) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.cls_head = nn.Linear(16, 2)
        self.aux_head = nn.Linear(16, 1)
        self.cut_body = cut_body

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        if self.cut_body:  # the planted bug: the body learns nothing
            h = h.detach()
        return self.cls_head(h), self.aux_head(h).squeeze(-1)


def _train(model: nn.Module, aux_weight: float, steps: int = 8) -> tw.Monitor:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y, z = torch.randn(32, 8), torch.randint(0, 2, (32,)), torch.randn(32)
    with tw.watch(model, opt, console=False, halt_on=["zero_gradient"]) as monitor:
        for _ in range(steps):
            opt.zero_grad()
            logits, aux = model(x)
            loss = nn.functional.cross_entropy(logits, y)
            loss = loss + aux_weight * nn.functional.mse_loss(aux, z)  # aux off at first
            loss.backward()
            opt.step()
    return monitor


def test_a_head_whose_loss_weight_is_zero_is_told_as_info_and_does_not_halt() -> None:
    monitor = _train(_TwoTasks(), aux_weight=0.0)
    told = [a for a in monitor.alerts if a.rule == "zero_gradient"]
    assert told and {a.severity for a in told} == {"info"}
    assert {a.module for a in told} == {"aux_head"}


def test_a_body_cut_off_by_detach_halts_under_the_same_halt_on() -> None:
    with pytest.raises(tw.TrainingHealthError) as raised:
        _train(_TwoTasks(cut_body=True), aux_weight=1.0)
    assert raised.value.alert.rule == "zero_gradient"
    assert raised.value.alert.severity != "info"
    assert raised.value.alert.module == "body"
