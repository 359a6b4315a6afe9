"""A teacher trained only a few steps, or loaded with none, then distilled from in
training mode, is told within a few student steps, dated at the student's step,
with the teacher's advice.

A teacher trained 20 steps or more alone was told so already. One trained
fewer (16) fell to the path of a model whose training merely paused: held
until 200 passes or the run's end, then told at close as an evaluation
("call model.eval() before evaluating"), dated by the teacher's own step count.
A model that trained alone, stopped, and now runs under ``no_grad`` at every
step of another model with its parameters frozen since, or with dropout in
training mode, is the teacher case whatever its own steps. A teacher kept in
eval mode stays silent beside each.
"""

from __future__ import annotations

import json

import pytest

from trainwatch.runner import run_script

# The sweep's repro: a conv teacher (batch norm and dropout) pre-trained 16 steps,
# frozen, left in training mode.
CONV = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

mode, teacher_steps = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
x_all, y_all = torch.randn(512, 3, 8, 8), torch.randint(0, 10, (512,))
teacher = nn.Sequential(
    nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.3), nn.Linear(16, 10),
)
topt = torch.optim.SGD(teacher.parameters(), lr=0.05, momentum=0.9)
for i in range(teacher_steps):
    j = i % 8
    loss = F.cross_entropy(teacher(x_all[j * 64:(j + 1) * 64]), y_all[j * 64:(j + 1) * 64])
    topt.zero_grad()
    loss.backward()
    topt.step()
for p in teacher.parameters():
    p.requires_grad_(False)
if mode == "eval":
    teacher.eval()
student = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
opt = torch.optim.Adam(student.parameters(), 3e-3)
for step in range(40):
    j = step % 8
    x, y = x_all[j * 64:(j + 1) * 64], y_all[j * 64:(j + 1) * 64]
    with torch.no_grad():
        t = teacher(x)
    s = student(x)
    loss = F.kl_div(F.log_softmax(s, 1), F.log_softmax(t, 1), reduction="batchmean",
                    log_target=True) + F.cross_entropy(s, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

# An MLP teacher with dropout fine-tuned a few steps and never frozen (only run under
# no_grad), or loaded from a checkpoint with no training in the script at all.
MLP = """
import sys
import torch
from torch import nn

mode, teacher_steps, checkpoint = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)


def net(width):
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Dropout(0.3), nn.Linear(width, 4))


teacher = net(64)
if checkpoint != "-":
    torch.save(net(64).state_dict(), checkpoint)
    teacher.load_state_dict(torch.load(checkpoint))
else:
    opt_t = torch.optim.Adam(teacher.parameters(), 1e-3)
    for step in range(teacher_steps):
        x = torch.randn(32, 16)
        loss = nn.functional.cross_entropy(teacher(x), x[:, :4].argmax(1))
        opt_t.zero_grad()
        loss.backward()
        opt_t.step()
if mode == "eval":
    teacher.eval()
student = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
opt_s = torch.optim.Adam(student.parameters(), 1e-3)
for step in range(30):
    x = torch.randn(32, 16)
    with torch.no_grad():
        target = teacher(x).softmax(-1)
    loss = nn.functional.kl_div(student(x).log_softmax(-1), target, reduction="batchmean")
    opt_s.zero_grad()
    loss.backward()
    opt_s.step()
"""


def _run(tmp_path, script: str, args: list[str]) -> list[dict]:
    path = tmp_path / "script.py"
    path.write_text(script)
    run_script(path, args, log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["rule"] == "eval_in_train_mode"]


def _is_the_teacher_finding(alert: dict, trained_first: bool) -> None:
    assert alert["severity"] == "warning"
    assert alert["data"]["finding"] == "frozen model used in training mode"
    assert alert["data"]["trained_first"] is trained_first
    assert "as a teacher or target" in alert["message"]
    assert "teacher.eval()" in alert["hint"] and "evaluating" not in alert["hint"]


@pytest.mark.parametrize("teacher_steps", [16, 3])
def test_a_frozen_teacher_trained_a_few_steps_is_told_at_the_students_first_step(
    tmp_path, teacher_steps
):
    """The repro (16 steps) and fewer: dated at student step 0, not at the teacher's
    own count, and told within the run, not at its close."""
    (alert,) = _run(tmp_path, CONV, ["train", str(teacher_steps)])
    assert alert["step"] == 0 and alert["module"] == "1"
    _is_the_teacher_finding(alert, True)


def test_a_frozen_teacher_in_eval_mode_is_silent(tmp_path):
    assert _run(tmp_path, CONV, ["eval", "16"]) == []


def test_a_teacher_fine_tuned_briefly_never_frozen_but_with_dropout_on_is_told(tmp_path):
    """Not frozen, only run under no_grad: its dropout in training mode tells it."""
    (alert,) = _run(tmp_path, MLP, ["train", "5", "-"])
    assert alert["step"] == 0 and alert["module"] == "2"
    _is_the_teacher_finding(alert, True)


def test_a_teacher_loaded_from_a_checkpoint_is_told_at_the_students_steps(tmp_path):
    """No training in the script: told at its third pass, dated at the student's step."""
    path = str(tmp_path / "teacher.pt")
    (alert,) = _run(tmp_path, MLP, ["train", "0", path])
    assert alert["step"] <= 2 and alert["module"] == "2"
    _is_the_teacher_finding(alert, False)


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_briefly_trained_or_loaded_teacher_in_eval_mode_is_silent(tmp_path, checkpoint):
    path = str(tmp_path / "teacher.pt") if checkpoint else "-"
    assert _run(tmp_path, MLP, ["eval", "0" if checkpoint else "5", path]) == []
