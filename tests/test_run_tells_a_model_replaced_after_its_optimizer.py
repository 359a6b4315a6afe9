"""A model replaced after its optimizer was built: the copy trains, nothing updates it.

``model = copy.deepcopy(best)`` mid-training ("restore the best weights"),
``model = prepare_qat(model)`` (a copy, ``inplace=False``) after the optimizer
was built over the float model, or a new instance loaded over the model's
name: the loop trains the new model, whose
gradients no optimizer applies, while the optimizer steps the old model's
parameters, which no longer get any. Under ``trainwatch run`` the prepared copy
said nothing for 299 steps, then ``stalled_training`` blamed a learning rate
that had collapsed; the deep copy was told as the old model's layers cut off
by a ``.detach()``. Now the model trained is told, within a few steps, as
``not_optimized`` (``data.kind: replaced_model``), naming the optimizer that
steps the stale copy; the old model, no longer called, says nothing of its
layers (``tw.watch``, which sees only it, tells it as not called).

Clean beside them: the restore done with ``load_state_dict``, the optimizer
built after ``prepare_qat``, an EMA copy used under ``no_grad``, a best-model
copy kept for evaluation, a model made anew with its own optimizer each round,
and two task heads with their own optimizers stepped on alternate batches.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import trainwatch as tw
from trainwatch.runner import run_script

RESTORE_BEST = """
import copy
import sys
import torch
from torch import nn

torch.manual_seed(0)
x_all = torch.randn(512, 8)
y_all = (x_all[:, 0] > 0).long()
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
best = copy.deepcopy(model)
for epoch in range(6):
    model.train()
    for i in range(0, 512, 64):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x_all[i:i + 64]), y_all[i:i + 64])
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        model(x_all[:64])
    if epoch == 1:
        best = copy.deepcopy(model)  # kept for evaluation: never trained
    if epoch == 2:
        if sys.argv[1] == "bug":
            model = copy.deepcopy(best)  # the optimizer still holds the old model
        else:
            model.load_state_dict(best.state_dict())
best.eval()
with torch.no_grad():
    best(x_all[:64])
"""

QAT = """
import sys
import warnings

import torch
import torch.ao.quantization as tq
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant = tq.QuantStub()
        self.fc1 = nn.Linear(8, 32)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(32, 2)
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))


warnings.filterwarnings("ignore")  # torch.ao.quantization's deprecation notes
torch.manual_seed(0)
torch.backends.quantized.engine = "{engine}"
float_model = Net().train()
float_model.qconfig = tq.get_default_qat_qconfig("{engine}")
if sys.argv[1] == "bug":
    opt = torch.optim.SGD(float_model.parameters(), lr=0.05, momentum=0.9)
    model = tq.prepare_qat(float_model)  # a copy: inplace=False
else:
    model = tq.prepare_qat(float_model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(40):
    x = torch.randn(64, 8)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
    loss.backward()
    opt.step()
"""

LOAD_NEW_INSTANCE = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
path = sys.argv[2]
torch.save(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), path)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
if sys.argv[1] == "bug":
    model = torch.load(path, weights_only=False)  # a new instance; the old one is freed
else:
    model.load_state_dict(torch.load(path, weights_only=False).state_dict())
for step in range(20):
    x = torch.randn(32, 8)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
    opt.step()
"""

EMA = """
import copy
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
ema = copy.deepcopy(model).requires_grad_(False)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(30):
    x = torch.randn(64, 8)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
    loss.backward()
    opt.step()
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(0.99).add_(p, alpha=0.01)
        if step % 10 == 9:
            ema(x)
"""

NEW_MODEL_EACH_ROUND = """
import torch
from torch import nn

torch.manual_seed(0)
for round in range(3):
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(12):
        x = torch.randn(64, 8)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
        loss.backward()
        opt.step()
    with torch.no_grad():
        model.eval()
        model(x)
"""

ALTERNATE_HEADS = """
import torch
from torch import nn


class TwoTasks(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 32)
        self.a = nn.Linear(32, 2)
        self.b = nn.Linear(32, 3)

    def forward(self, x, task):
        h = torch.relu(self.trunk(x))
        return self.a(h) if task == 0 else self.b(h)


torch.manual_seed(0)
model = TwoTasks()
opt_trunk = torch.optim.SGD(model.trunk.parameters(), lr=0.05)
opt_a = torch.optim.SGD(model.a.parameters(), lr=0.05)
opt_b = torch.optim.SGD(model.b.parameters(), lr=0.05)
opts = [opt_trunk, opt_a, opt_b]
for step in range(30):
    task = step % 2
    x = torch.randn(64, 8)
    y = (x[:, 0] > 0).long() if task == 0 else (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    for opt in opts:
        opt.zero_grad()
    nn.functional.cross_entropy(model(x, task), y).backward()
    for opt in opts:
        opt.step()
"""


def _run(tmp_path, source: str, args: list[str]) -> tuple[list[dict], int]:
    script = tmp_path / "train.py"
    script.write_text(source)
    code = run_script(script, args, log_dir=tmp_path / "log", console=False)
    assert code == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    counts = json.loads((tmp_path / "log" / "alert_counts.json").read_text())
    return [json.loads(line) for line in lines], counts["steps"]


def _replaced(alerts: list[dict]) -> list[dict]:
    return [
        a
        for a in alerts
        if a["rule"] == "not_optimized" and a["data"].get("kind") == "replaced_model"
    ]


def _engine() -> str:
    engines = torch.backends.quantized.supported_engines
    for engine in ("fbgemm", "x86", "qnnpack"):
        if engine in engines:
            return engine
    pytest.skip("no quantized engine in this torch build")


def test_a_deep_copy_trained_in_place_of_the_model_is_told_as_the_replacement(tmp_path):
    alerts, steps = _run(tmp_path, RESTORE_BEST, ["bug"])
    (told,) = _replaced(alerts)
    # 8 steps an epoch: the copy is first trained at step 24, the old model's
    # optimizer stepped without it from then on.
    assert 24 <= told["step"] <= 27
    assert told["data"]["stale_since"] == 24
    assert told["data"]["optimizer_class"] == "SGD"
    assert told["data"]["model"] != told["data"]["stale_model"] == "Sequential"
    assert sorted(told["data"]["parameters"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert "SGD optimizer steps the parameters of Sequential" in told["message"]
    assert "build the optimizer over the new model" in told["hint"]
    # The old model, no longer called, is not told as layers cut off by a detach.
    assert [a for a in alerts if a["rule"] == "zero_gradient"] == []
    assert [a["rule"] for a in alerts] == ["not_optimized"]
    assert steps == 48  # the copy's steps go on from the old model's


def test_the_best_weights_restored_with_load_state_dict_are_silent(tmp_path):
    alerts, steps = _run(tmp_path, RESTORE_BEST, ["fixed"])
    assert alerts == []
    assert steps == 48


def test_a_qat_copy_prepared_after_the_optimizer_is_told_in_its_first_steps(tmp_path):
    alerts, _ = _run(tmp_path, QAT.replace("{engine}", _engine()), ["bug"])
    (told,) = _replaced(alerts)
    assert told["step"] <= 3
    assert told["data"]["stale_class"] == "Net" and told["data"]["stale_since"] is None
    assert "a module never called while watched" in told["message"]
    # The copy's weights never move: no stalled training blamed on the learning rate.
    assert [a["rule"] for a in alerts] == ["not_optimized"]


def test_the_optimizer_built_after_prepare_qat_is_silent(tmp_path):
    alerts, steps = _run(tmp_path, QAT.replace("{engine}", _engine()), ["fixed"])
    assert alerts == []
    assert steps == 40


def test_a_new_instance_loaded_over_the_models_name_is_told(tmp_path):
    alerts, _ = _run(tmp_path, LOAD_NEW_INSTANCE, ["bug", str(tmp_path / "model.pt")])
    (told,) = _replaced(alerts)
    assert told["step"] <= 3 and told["data"]["stale_class"] is None
    assert "Adam optimizer steps the parameters of a model no module holds" in told["message"]
    assert [a["rule"] for a in alerts] == ["not_optimized"]


def test_weights_loaded_into_the_model_the_optimizer_holds_are_silent(tmp_path):
    alerts, steps = _run(tmp_path, LOAD_NEW_INSTANCE, ["fixed", str(tmp_path / "model.pt")])
    assert alerts == []
    assert steps == 20


@pytest.mark.parametrize(
    "source", [EMA, NEW_MODEL_EACH_ROUND, ALTERNATE_HEADS], ids=["ema", "new_each_round", "heads"]
)
def test_copies_and_idle_heads_of_healthy_loops_are_silent(tmp_path, source):
    alerts, _ = _run(tmp_path, source, [])
    assert _replaced(alerts) == []
    assert [a for a in alerts if a["data"].get("kind") == "model_not_called"] == []


def _deep_copy_under_watch(replace: bool) -> list[tw.Alert]:
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = tw.watch(model, opt, console=False)
    best = copy.deepcopy(model)
    for step in range(20):
        if step == 8:
            if replace:
                model = copy.deepcopy(best)
            else:
                model.load_state_dict(best.state_dict())
        x = torch.randn(32, 8)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
        opt.step()
    monitor.close()
    return monitor.alerts


def test_under_watch_a_model_no_longer_called_is_told_so_not_as_a_detach():
    alerts = _deep_copy_under_watch(replace=True)
    (alert,) = [a for a in alerts if a.rule == "zero_gradient"]
    assert alert.data["kind"] == "model_not_called"
    assert (alert.step, alert.data["since_step"], alert.data["optimizer"]) == (8, 8, 0)
    assert "not called at all" in alert.message
    assert "copy.deepcopy" in alert.hint and ".detach()" not in alert.hint


def test_under_watch_the_restore_into_the_watched_model_is_silent():
    assert _deep_copy_under_watch(replace=False) == []
