"""A short run of no-grad passes in training mode at every step is part of training.

A mean teacher (an EMA copy of the student, dropout on on purpose) makes its
consistency targets from K noisy views under ``no_grad`` at every step; MixMatch
guesses labels with the same model over K augmentations; DINO runs its teacher
once per global crop. Each is a run of three to eight passes in a row, at every
step: held until the next step shows it recurs, then silent. A validation loop
that forgot ``model.eval()`` is still told, dated at the step it ran in: three
batches every ten steps (at most two steps late), twenty batches an epoch (at
once), three batches once before training.
"""

from __future__ import annotations

import json
import sys

import pytest

from trainwatch.runner import run_script

SCRIPT = """
import copy
import sys
import torch
from torch import nn
import torch.nn.functional as F

shape, k, val = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
teacher = copy.deepcopy(model)
for p in teacher.parameters():
    p.requires_grad_(False)
opt = torch.optim.Adam(model.parameters(), 1e-3)
monitors = []
if len(sys.argv) > 4:
    import trainwatch as tw

    monitors.append(tw.watch(model, opt, console=False))
    if shape in ("mean_teacher", "multicrop"):
        monitors.append(tw.watch(teacher, console=False))
seen = []  # the loop step at which each warning was first seen


def view(x):
    return x + 0.1 * torch.randn_like(x)


def validate(batches):
    with torch.no_grad():  # forgot model.eval()
        for _ in range(batches):
            model(torch.randn(64, 8))


if val == "before":
    validate(3)
for step in range(30):
    x = torch.randn(32, 8)
    y = x[:, :3].argmax(1)
    if shape == "mean_teacher":
        logits = model(view(x))
        with torch.no_grad():
            target = torch.stack([teacher(view(x)).softmax(1) for _ in range(k)]).mean(0)
        loss = F.cross_entropy(logits, y) + F.mse_loss(logits.softmax(1), target)
    elif shape == "multicrop":
        with torch.no_grad():  # the teacher once per global crop, before the student
            targets = [teacher(view(x)).softmax(1) for _ in range(k)]
        loss = sum(-(t * model(view(x)).log_softmax(1)).sum(1).mean() for t in targets)
    elif shape == "mixmatch":
        with torch.no_grad():  # labels guessed by the same model, in training mode
            guess = torch.stack([model(view(x)).softmax(1) for _ in range(k)]).mean(0)
        loss = F.mse_loss(model(view(x)).softmax(1), guess) + F.cross_entropy(model(x), y)
    else:
        loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        for pt, ps in zip(teacher.parameters(), model.parameters()):
            pt.mul_(0.99).add_(ps, alpha=0.01)
    if step % 10 == 9 and val in ("every10", "epoch"):
        validate(3 if val == "every10" else 20)
    told = [
        a
        for m in monitors
        for a in m.alerts
        if a.rule == "eval_in_train_mode" and a.severity != "info"
    ]
    seen += [step] * (len(told) - len(seen))
for m in monitors:
    m.close()
"""

CONTROLS = [
    ("mean_teacher", 3),
    ("mean_teacher", 5),
    ("mixmatch", 3),
    ("multicrop", 4),
]

# (shape, K, validation): the step the warning is dated at. The validation after
# loop step 9 runs at the model's step 10.
PLANTED = [
    ("plain", 0, "every10", 10),
    ("plain", 0, "epoch", 10),
    ("plain", 0, "before", 0),
    ("mean_teacher", 3, "every10", 10),
    ("mixmatch", 3, "epoch", 10),
]


def _watched(shape: str, k: int, val: str) -> tuple[list, list[int]]:
    """The script under tw.watch: its warnings, and the loop step each was first seen."""
    argv = sys.argv
    sys.argv = ["loop.py", shape, str(k), val, "watch"]
    try:
        namespace: dict = {"__name__": "__main__"}
        exec(compile(SCRIPT, "loop.py", "exec"), namespace)
    finally:
        sys.argv = argv
    told = [
        a
        for m in namespace["monitors"]
        for a in m.alerts
        if a.rule == "eval_in_train_mode" and a.severity != "info"
    ]
    return told, namespace["seen"]


def _run(tmp_path, shape: str, k: int, val: str) -> list[int]:
    """The script under ``trainwatch run``: the steps its warnings are dated at."""
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    run_script(script, [shape, str(k), val], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    alerts = [json.loads(line) for line in lines]
    return [
        a["step"] for a in alerts if a["rule"] == "eval_in_train_mode" and a["severity"] != "info"
    ]


@pytest.mark.parametrize(("shape", "k"), CONTROLS)
def test_a_short_no_grad_run_at_every_step_is_silent_under_watch(shape, k):
    assert _watched(shape, k, "none") == ([], [])


@pytest.mark.parametrize(("shape", "k"), CONTROLS)
def test_a_short_no_grad_run_at_every_step_is_silent_under_run(tmp_path, shape, k):
    assert _run(tmp_path, shape, k, "none") == []


@pytest.mark.parametrize(("shape", "k", "val", "dated"), PLANTED)
def test_a_validation_that_forgot_eval_is_told_under_watch(shape, k, val, dated):
    told, seen = _watched(shape, k, val)
    assert [a.step for a in told] == [dated]
    assert told[0].module == "2" and "(evaluation)" in told[0].message
    assert seen[0] <= dated + 2  # at most two steps late


@pytest.mark.parametrize(("shape", "k", "val", "dated"), PLANTED[:3])
def test_a_validation_that_forgot_eval_is_told_under_run(tmp_path, shape, k, val, dated):
    assert _run(tmp_path, shape, k, val) == [dated]
