"""A linear probe that keeps the whole model in eval mode, its backbone frozen.

``model.eval()`` for the whole run is a linear probe's recipe when the only
mode-dependent modules are the frozen backbone's batch norms (the trained head
has no dropout or batch norm): their statistics stay frozen. trainwatch warned
that a training step ran in eval mode and advised ``model.train()``, which would
make those statistics drift: the frozen parts were looked for only where some
module in eval was not a normalisation layer. Now the frozen backbone's batch
norm is the one info line of the fine-tuning idiom, and a trained part left in
eval (the head's dropout, a trained neck's batch norm: ``model.train()``
forgotten after an evaluation) still warns, named at it.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import trainwatch as tw
from trainwatch.runner import run_script


class Probe(nn.Module):
    """A frozen conv backbone with batch norm, and a trained head. ``head``: "linear"
    (nothing mode-dependent), "dropout" (a dropout before the linear layer) or
    "norm" (a trained neck with batch norm before it)."""

    def __init__(self, head: str = "linear", backbone_in_forward_no_grad: bool = False) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        layers: list[nn.Module] = []
        if head == "dropout":
            layers.append(nn.Dropout(0.2))
        if head == "norm":
            layers += [nn.Linear(8, 8), nn.BatchNorm1d(8)]
        self.head = nn.Sequential(*layers, nn.Linear(8, 4))
        self.backbone.requires_grad_(False)
        self.no_grad_backbone = backbone_in_forward_no_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.no_grad_backbone:
            with torch.no_grad():
                features = self.backbone(x)
            return self.head(features)
        return self.head(self.backbone(x))


def _probe(model: Probe, steps: int = 6) -> list:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.05, momentum=0.9)
    with tw.watch(model, opt, console=False) as monitor:
        model.eval()  # the whole model, for the whole run
        for _ in range(steps):
            loss = F.cross_entropy(model(torch.randn(16, 3, 8, 8)), torch.randint(0, 4, (16,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return monitor.alerts


@pytest.mark.parametrize("no_grad", [False, True], ids=["plain", "backbone_under_no_grad"])
def test_the_frozen_backbones_batch_norm_in_eval_is_the_one_info_line(no_grad):
    alerts = _probe(Probe(backbone_in_forward_no_grad=no_grad))
    assert [(a.rule, a.severity, a.step, a.module) for a in alerts] == [
        ("train_in_eval_mode", "info", 0, "backbone.1")
    ]
    assert alerts[0].data["in_frozen_parts"] == ["backbone.1"]
    assert "model.train()" not in alerts[0].hint


@pytest.mark.parametrize("head", ["dropout", "norm"])
def test_the_trained_heads_modules_left_in_eval_still_warn_named_at_them(head):
    alerts = _probe(Probe(head))
    (warning,) = [a for a in alerts if a.severity == "warning"]
    assert (warning.rule, warning.step) == ("train_in_eval_mode", 0)
    assert warning.module == ("head.0" if head == "dropout" else "head.1")
    assert warning.data["in_frozen_parts"] == ["backbone.1"]
    assert "model.train()" in warning.hint


def test_a_model_trained_end_to_end_left_in_eval_still_warns():
    model = Probe()
    model.backbone.requires_grad_(True)
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with tw.watch(model, opt, console=False) as monitor:
        model.eval()
        for _ in range(4):
            loss = F.cross_entropy(model(torch.randn(16, 3, 8, 8)), torch.randint(0, 4, (16,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    told = [(a.rule, a.severity, a.module) for a in monitor.alerts]
    assert told == [("train_in_eval_mode", "warning", "backbone.1")]


SCRIPT = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
head = [nn.Dropout(0.2)] if sys.argv[1] == "head_dropout" else []
model = nn.Sequential(
    nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                  nn.AdaptiveAvgPool2d(1), nn.Flatten()),
    nn.Sequential(*head, nn.Linear(8, 4)),
)
model[0].requires_grad_(False)
opt = torch.optim.SGD(model[1].parameters(), lr=0.05)
model.eval()
for step in range(8):
    loss = F.cross_entropy(model(torch.randn(16, 3, 8, 8)), torch.randint(0, 4, (16,)))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("how", ["probe", "head_dropout"])
def test_trainwatch_run_on_a_probe_in_eval(tmp_path, how):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    run_script(script, [how], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    told = [(a["rule"], a["severity"], a["module"]) for a in map(json.loads, lines)]
    if how == "probe":
        assert told == [("train_in_eval_mode", "info", "0.1")]
    else:
        assert told == [("train_in_eval_mode", "warning", "1.0")]
