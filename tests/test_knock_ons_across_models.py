"""A finding of one model that another model's monitor told first is not told twice.

Each model has its own monitor (``trainwatch run`` gives every model one; a
script may watch a student and its EMA copy separately). A NaN/Inf born in
the student reaches the EMA copy through ``lerp_``: the copy's weights are
written non-finite by the training code, which is its knock-on, told as info
naming the origin, not a second error. A loss module whose learned weights
were left out of the optimizer is told by ``not_optimized``;
``stalled_training`` does not repeat it.
"""

from __future__ import annotations

import copy
import io
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import trainwatch as tw
from trainwatch.runner import run_script

STUDENT_AND_EMA = """
import copy
import sys
import torch
from torch import nn

BUG = sys.argv[1]
torch.manual_seed(0)


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 16)
        self.plant = False

    def forward(self, x):
        h = self.fc(x)
        if self.plant:
            h = torch.log(h - 100.0)  # NaN: the origin, in the student
        return h


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = Embed()
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))


model = Net()
ema = copy.deepcopy(model).requires_grad_(False)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for step in range(20):
    x = torch.randn(16, 4)
    model.inp.plant = BUG == "nan" and step == 5
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p, 0.1)
        if BUG == "hand" and step == 10:
            ema.inp.fc.weight[0, 0] = float("nan")  # written by hand: an origin of its own
with torch.no_grad():
    ema(torch.randn(8, 4))  # the copy's first pass: sampled at the end
"""


LOSS_MODULE = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

HOW = sys.argv[1]
torch.manual_seed(0)


class UncertaintyWeightedLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.log_vars = nn.Parameter(torch.zeros(2))

    def forward(self, out, y):
        losses = torch.stack([F.mse_loss(out[:, 0], y[:, 0]), F.mse_loss(out[:, 1], y[:, 1])])
        return (torch.exp(-self.log_vars) * losses + self.log_vars).sum(), losses.detach()


model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
crit = UncertaintyWeightedLoss()
params = list(model.parameters())
if HOW != "left_out":
    params += list(crit.parameters())
opt = torch.optim.Adam(params, lr=0.0 if HOW == "lr0" else 3e-3)
for step in range(70):
    x = torch.randn(64, 8)
    y = torch.stack([x[:, 0] * 3, x[:, 1] - x[:, 2]], 1)
    loss, parts = crit(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

# A verdict at the sampled step 59, past not_optimized's 50 steps.
STALL_SOON = {"stalled_training": {"warmup": 60, "every": 20}}


def _run(tmp_path: Path, body: str, arg: str, config=None) -> list[dict]:
    script = tmp_path / "train.py"
    script.write_text(body)
    log = tmp_path / "log"
    assert run_script(script, [arg], log_dir=log, config=config, console=False) == 0
    return [json.loads(line) for line in (log / "alerts.jsonl").read_text().splitlines()]


def _told(found: list[dict]) -> list[tuple[str, str, str, str | None]]:
    return [(a["severity"], a["rule"], a["data"].get("model"), a["module"]) for a in found]


# -- a NaN's knock-on in an EMA copy --------------------------------------------


def test_ema_weights_made_nan_by_the_students_nan_are_its_knock_on(tmp_path):
    found = _run(tmp_path, STUDENT_AND_EMA, "nan")
    assert [t for t in _told(found) if t[0] != "info"] == [
        ("error", "nonfinite_forward", "Net", "inp")
    ]
    (copied,) = [a for a in found if a["data"].get("model") == "Net#2"]
    assert copied["rule"] == "nonfinite_parameter" and copied["severity"] == "info"
    assert copied["data"]["cause"] == "written"
    assert copied["data"]["follows"] == {
        "rule": "nonfinite_forward",
        "model": "Net",
        "module": "inp",
        "step": 5,
    }
    assert "after Net's NaN/Inf reported at step 5 in `inp`" in copied["message"]


def test_ema_weights_written_nan_by_hand_are_still_an_error(tmp_path):
    found = _run(tmp_path, STUDENT_AND_EMA, "hand")
    assert _told(found) == [("error", "nonfinite_parameter", "Net#2", "inp.fc")]
    assert found[0]["data"]["cause"] == "written"
    assert "follows" not in found[0]["data"]


class Student(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, plant: bool = False) -> torch.Tensor:
        h = self.a(x)
        if plant:
            h = torch.log(h - 100.0)
        return self.b(torch.relu(h))


def _watched_student_and_ema(bug: str, readback: str) -> tuple[tw.Monitor, tw.Monitor]:
    """Both watched with tw.watch, the copy run at every step, as a target network is."""
    torch.manual_seed(0)
    model = Student()
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    student = tw.watch(model, opt, console=io.StringIO(), readback=readback)
    copied = tw.watch(ema, console=io.StringIO(), readback=readback)
    try:
        for step in range(12):
            x = torch.randn(16, 4)
            loss = model(x, plant=bug == "nan" and step == 5).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.lerp_(p, 0.1)
                if bug == "hand" and step == 8:
                    ema.a.weight[0, 0] = float("nan")
                ema(x)
    finally:
        student.close()
        copied.close()
    return student, copied


@pytest.mark.parametrize("readback", ["sync", "lagged"])
def test_a_watched_ema_copy_tells_the_students_nan_as_its_knock_on(readback):
    # Lagged: the student's origin is read back only at its next step, after the
    # copy's pass met the NaN; it is read back first, so the origin is told first.
    student, copied = _watched_student_and_ema("nan", readback)
    assert [(a.severity, a.rule, a.step) for a in student.alerts] == [
        ("error", "nonfinite_forward", 5)
    ]
    assert [(a.severity, a.rule, a.step) for a in copied.alerts] == [
        ("info", "nonfinite_parameter", 6)
    ]
    assert copied.alerts[0].data["follows"]["model"] == "Student"


def test_a_watched_ema_copy_written_nan_by_hand_is_an_error():
    student, copied = _watched_student_and_ema("hand", "lagged")
    assert student.alerts == []
    assert [(a.severity, a.rule, a.data["cause"]) for a in copied.alerts] == [
        ("error", "nonfinite_parameter", "written")
    ]


# -- a loss module left out of the optimizer ------------------------------------


def test_a_loss_module_left_out_of_the_optimizer_is_told_once(tmp_path):
    found = _run(tmp_path, LOSS_MODULE, "left_out", STALL_SOON)
    assert [(a["rule"], a["data"].get("kind"), a["data"].get("model")) for a in found] == [
        ("not_optimized", "never_updated", "UncertaintyWeightedLoss")
    ]
    # Its loss audit's mode, entered at each pass given the targets, came off with it.
    assert torch._C._len_torch_function_stack() == 0


def test_a_loss_module_in_the_optimizer_is_silent(tmp_path):
    assert _run(tmp_path, LOSS_MODULE, "in_optimizer", STALL_SOON) == []


def test_a_model_trained_at_learning_rate_zero_still_stalls(tmp_path):
    found = _run(tmp_path, LOSS_MODULE, "lr0", STALL_SOON)
    stalled = {a["data"].get("model") for a in found if a["rule"] == "stalled_training"}
    assert "Sequential" in stalled
    assert not [a for a in found if a["rule"] == "not_optimized"]


@pytest.fixture(autouse=True)
def _forget_script_modules():
    yield
    sys.modules.pop("train", None)
