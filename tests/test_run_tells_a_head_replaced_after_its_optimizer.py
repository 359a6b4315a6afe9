"""A head replaced after the optimizer was built over the old one: nothing trains.

The transfer-learning tutorial freezes the backbone, builds the optimizer over
``model.fc.parameters()`` and sets a new head for its two classes; with the last
two lines swapped, the optimizer holds only the old head, which no module holds
any more, and nothing of the model trains. ``tw.watch(model, opt)`` refuses the
pair; ``trainwatch run`` said nothing at all: no optimizer holds a parameter of
the model, so its backward ends were taken for hand-written updates, and the
run closed on "no alerts". Now the new head is told at step 0 as ``not_optimized``
(``data.kind: replaced_module``, ``data.replaced_module``), saying that the
optimizer steps parameters that no longer belong to the model, and to build it
after replacing the head: for ``model.fc`` and for the last layer of a
``Sequential`` classifier (``model.classifier[-1]``), the old head freed or kept
aside, never called.

Clean beside them: the head replaced before the optimizer is built, and a model
trained by hand (no optimizer) beside a temperature of its own optimizer. An
optimizer over the whole model built before the head was replaced holds the
backbone, so the head is told as before (``not_optimized [fc]`` at step 0).
"""

from __future__ import annotations

import json

from trainwatch.runner import run_script

# The tutorial's "ConvNet as fixed feature extractor", on synthetic images.
TUTORIAL = """
import sys
import torch
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset


class TinyResNet(nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, 2, 1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(torch.relu(self.bn(self.conv(x)))), 1))


order, over = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
y = torch.randint(0, 2, (128,))
x = torch.randn(128, 3, 8, 8)
loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
model = TinyResNet()
if over == "head":
    for param in model.parameters():
        param.requires_grad = False
if order == "after":
    opt = optim.SGD(model.fc.parameters() if over == "head" else model.parameters(), lr=0.01,
                    momentum=0.9)
    model.fc = nn.Linear(model.fc.in_features, 2)  # replaced after the optimizer was built
else:
    model.fc = nn.Linear(model.fc.in_features, 2)
    opt = optim.SGD(model.fc.parameters(), lr=0.01, momentum=0.9)
criterion = nn.CrossEntropyLoss()
for epoch in range(2):
    model.train()
    for inputs, labels in loader:
        opt.zero_grad()
        loss = criterion(model(inputs), labels)
        loss.backward()
        opt.step()
"""

# A VGG-like model whose last classifier layer is swapped; the old one kept aside.
SEQUENTIAL_HEAD = """
import sys
import torch
from torch import nn


class TinyVGG(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.classifier = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1000))

    def forward(self, x):
        return self.classifier(self.features(x))


order, old_head = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = TinyVGG().requires_grad_(False)
if order == "after":
    opt = torch.optim.Adam(model.classifier[-1].parameters(), lr=1e-3)
    kept = model.classifier[-1] if old_head == "kept" else None
    model.classifier[-1] = nn.Linear(16, 2)
else:
    model.classifier[-1] = nn.Linear(16, 2)
    opt = torch.optim.Adam(model.classifier[-1].parameters(), lr=1e-3)
for step in range(20):
    x = torch.randn(64, 8)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
    opt.step()
"""

# Updated by hand, no optimizer, beside a learned loss weight stepped by its own Adam.
HAND_TRAINED = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
weight = nn.Parameter(torch.ones(1, 2))
weight_opt = torch.optim.Adam([weight], lr=1e-3)
for step in range(20):
    x = torch.randn(64, 8)
    weight_opt.zero_grad()
    model.zero_grad()
    logits = model(x) * weight
    nn.functional.cross_entropy(logits, (x[:, 0] > 0).long()).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    weight_opt.step()
"""


def _run(tmp_path, source: str, args: list[str]) -> tuple[list[dict], int]:
    script = tmp_path / "train.py"
    script.write_text(source)
    code = run_script(script, args, log_dir=tmp_path / "log", console=False)
    assert code == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    counts = json.loads((tmp_path / "log" / "alert_counts.json").read_text())
    return [json.loads(line) for line in lines], counts["steps"]


def _not_optimized(alerts: list[dict]) -> list[dict]:
    return [a for a in alerts if a["rule"] == "not_optimized"]


def test_the_tutorials_head_replaced_after_its_optimizer_is_told_at_step_0(tmp_path):
    alerts, steps = _run(tmp_path, TUTORIAL, ["after", "head"])
    (told,) = _not_optimized(alerts)
    assert (told["step"], told["severity"], told["module"]) == (0, "warning", "fc")
    assert told["data"]["kind"] == "replaced_module"
    assert told["data"]["replaced_module"] == "fc"
    assert told["data"]["parameters"] == ["fc.weight", "fc.bias"]
    assert (told["data"]["optimizer_class"], told["data"]["stale_class"]) == ("SGD", None)
    assert "SGD optimizer steps parameters that no module holds any more" in told["message"]
    assert "no longer belong to the model" in told["message"]
    assert "build the optimizer after replacing the head" in told["hint"]
    assert "model.fc.parameters()" in told["hint"]
    assert steps == 16


def test_the_tutorials_head_replaced_before_its_optimizer_is_silent(tmp_path):
    alerts, steps = _run(tmp_path, TUTORIAL, ["before", "head"])
    assert _not_optimized(alerts) == []
    assert steps == 16


def test_an_optimizer_over_the_whole_model_before_the_head_is_still_told_at_step_0(tmp_path):
    alerts, _ = _run(tmp_path, TUTORIAL, ["after", "model"])
    (told,) = _not_optimized(alerts)
    assert (told["step"], told["module"]) == (0, "fc")
    assert "kind" not in told["data"]  # the optimizer holds the backbone: told as before
    assert told["data"]["parameters"] == ["fc.weight", "fc.bias"]


def test_the_last_layer_of_a_sequential_classifier_replaced_is_told(tmp_path):
    alerts, _ = _run(tmp_path, SEQUENTIAL_HEAD, ["after", "freed"])
    (told,) = _not_optimized(alerts)
    assert (told["step"], told["module"]) == (0, "classifier.2")
    assert told["data"]["replaced_module"] == "classifier.2"
    assert told["data"]["optimizer_class"] == "Adam"
    assert "model.classifier.2" not in told["hint"]
    assert "model.get_submodule('classifier.2').parameters()" in told["hint"]


def test_an_old_head_kept_aside_is_told_within_a_few_steps(tmp_path):
    alerts, _ = _run(tmp_path, SEQUENTIAL_HEAD, ["after", "kept"])
    (told,) = _not_optimized(alerts)
    assert told["step"] <= 3 and told["module"] == "classifier.2"
    assert told["data"]["stale_class"] == "Linear"
    assert "the parameters of a Linear never called while watched" in told["message"]


def test_the_sequential_head_replaced_before_its_optimizer_is_silent(tmp_path):
    alerts, steps = _run(tmp_path, SEQUENTIAL_HEAD, ["before", "freed"])
    assert alerts == []
    assert steps == 20


def test_a_model_trained_by_hand_beside_a_loss_weights_optimizer_is_silent(tmp_path):
    alerts, steps = _run(tmp_path, HAND_TRAINED, [])
    assert _not_optimized(alerts) == []
    assert steps == 20
