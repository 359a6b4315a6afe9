"""A frozen backbone left in training mode is named whole, as ``.eval()`` is called on it.

The transfer-learning recipe freezes a ResNet and replaces its ``fc``: the
backbone is then the model's own children (``conv1``, ``bn1``, ``layer1`` to
``layer4``), of which only the largest stage holds a third of the parameters.
The frozen-part note named that stage's batch norms alone, and its hint
("call .eval() on it") left the others' running statistics drifting. The
frozen modules beside a large frozen part now belong to it: every one of them
is named, and the hint lists what to call ``.eval()`` on. A backbone held in
one attribute is named by it.
"""

from __future__ import annotations

import inspect
import json

import torch
from torch import nn
from torch.nn import functional as F

import trainwatch as tw
from trainwatch.runner import run_script

FINDING = "frozen part in training mode"


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.downsample is None else self.downsample(x)
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + skip)


class ResNet(nn.Module):
    """torchvision's layout: stem, four stages, pooling and ``fc``, all children."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.layer1 = nn.Sequential(BasicBlock(width, width, 1))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2))
        self.layer3 = nn.Sequential(BasicBlock(2 * width, 4 * width, 2))
        self.layer4 = nn.Sequential(BasicBlock(4 * width, 8 * width, 2))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8 * width, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


BACKBONE = ["bn1", "layer1", "layer2", "layer3", "layer4"]  # conv1 holds no batch norm
BATCH_NORMS = 12


def _transfer(model: nn.Module, head: nn.Module, before_step, steps: int = 6) -> list:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, 16, 16, generator=gen), torch.randint(0, 2, (16,), generator=gen)
    opt = torch.optim.SGD(head.parameters(), lr=0.01, momentum=0.9)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(steps):
            before_step(model)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return monitor.alerts


def _resnet_with_new_fc() -> ResNet:
    torch.manual_seed(0)
    model = ResNet()
    model.requires_grad_(False)
    model.fc = nn.Linear(64, 2)
    return model


def _backbone_children_in_eval(model: nn.Module) -> None:
    model.train()
    for name, child in model.named_children():
        if name != "fc":
            child.eval()


def test_a_resnet_frozen_but_its_new_fc_names_every_frozen_stage():
    model = _resnet_with_new_fc()
    alerts = _transfer(model, model.fc, lambda m: m.train())
    (note,) = [a for a in alerts if a.data.get("finding") == FINDING]
    assert (note.severity, note.step, note.module) == ("info", 0, "bn1")
    assert note.data["frozen_parts"] == BACKBONE
    assert len(note.data["modules"]) == BATCH_NORMS  # every batch norm, not layer4's alone
    assert "call .eval() on each of bn1, layer1, layer2, layer3 and layer4" in note.hint


def test_a_resnet_frozen_but_its_new_fc_with_its_backbone_in_eval_has_no_note():
    model = _resnet_with_new_fc()
    alerts = _transfer(model, model.fc, _backbone_children_in_eval)
    assert [a for a in alerts if a.data.get("finding") == FINDING] == []
    assert [(a.rule, a.severity) for a in alerts] == [("train_in_eval_mode", "info")]


class Classifier(nn.Module):
    """The backbone held in one attribute, its own fc dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = ResNet()
        self.backbone.fc = nn.Identity()
        self.head = nn.Linear(64, 2)
        self.backbone.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def test_a_frozen_backbone_attribute_is_named_by_it():
    torch.manual_seed(0)
    model = Classifier()
    alerts = _transfer(model, model.head, lambda m: m.train())
    (note,) = [a for a in alerts if a.data.get("finding") == FINDING]
    assert note.data["frozen_parts"] == ["backbone"]
    assert len(note.data["modules"]) == BATCH_NORMS
    assert "call backbone.eval() after every model.train()" in note.hint
    assert "a frozen part of the model (backbone;" in note.message


def test_a_frozen_backbone_attribute_kept_in_eval_has_no_note():
    torch.manual_seed(0)
    model = Classifier()

    def backbone_in_eval(m: Classifier) -> None:
        m.train()
        m.backbone.eval()

    alerts = _transfer(model, model.head, backbone_in_eval)
    assert [a for a in alerts if a.data.get("finding") == FINDING] == []
    assert [(a.rule, a.severity) for a in alerts] == [("train_in_eval_mode", "info")]


# The same classes in a script of their own: the transfer-learning tutorial's loop.
SCRIPT = (
    """
import sys
import torch
from torch import nn
"""
    + inspect.getsource(BasicBlock)
    + inspect.getsource(ResNet)
    + """
torch.manual_seed(0)
model = ResNet()
for p in model.parameters():
    p.requires_grad = False
model.fc = nn.Linear(64, 2)
opt = torch.optim.SGD(model.fc.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 2, (16,))
for step in range(6):
    model.train()
    if sys.argv[1] == "eval":
        for name, child in model.named_children():
            if name != "fc":
                child.eval()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""
)


def _notes_under_run(tmp_path, how: str) -> list[dict]:
    script = tmp_path / "transfer.py"
    script.write_text(SCRIPT)
    run_script(script, [how], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["data"].get("finding") == FINDING]


def test_trainwatch_run_names_the_whole_frozen_resnet_backbone(tmp_path):
    (note,) = _notes_under_run(tmp_path, "train")
    assert note["data"]["frozen_parts"] == BACKBONE
    assert len(note["data"]["modules"]) == BATCH_NORMS


def test_trainwatch_run_on_the_resnet_backbone_kept_in_eval_has_no_note(tmp_path):
    assert _notes_under_run(tmp_path, "eval") == []
