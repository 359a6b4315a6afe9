"""Two no-grad passes of a model in training mode at every step are training.

MixMatch guesses the labels of an unlabelled batch by averaging the model's
predictions over two augmentations under ``no_grad``, batch norm in training
mode on purpose; a double-DQN target runs the online network twice under
``no_grad`` after its training pass. Either runs the same two passes in a row
at every step, as a single pseudo-label pass does. A validation loop of the
same model that forgot ``eval()`` is still told, at the step it ran in.
"""

from __future__ import annotations

import json
import sys

import pytest

from trainwatch.runner import run_script

SCRIPT = """
import sys
import torch
from torch import nn
import torch.nn.functional as F

shape, val_batches = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
if shape == "mixmatch":
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))
else:
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3))
opt = torch.optim.Adam(model.parameters(), 1e-3)
monitor = None
if len(sys.argv) > 3:
    import trainwatch as tw

    monitor = tw.watch(model, opt, console=False)


def augment(x):
    return x + 0.1 * torch.randn_like(x)


for step in range(25):
    x = torch.randn(32, 8)
    if shape == "mixmatch":
        with torch.no_grad():
            guess = (model(augment(x)).softmax(1) + model(augment(x)).softmax(1)) / 2
        loss = F.mse_loss(model(augment(x)).softmax(1), guess)
    else:
        q = model(x).max(1).values
        with torch.no_grad():
            best = model(x).argmax(1, keepdim=True)
            target = 0.5 + 0.9 * model(x).gather(1, best).squeeze(1)
        loss = F.smooth_l1_loss(q, target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if val_batches and step == 9:
        with torch.no_grad():  # forgot model.eval()
            for _ in range(val_batches):
                model(torch.randn(64, 8))
if monitor is not None:
    monitor.close()
"""

CASES = [
    ("mixmatch", 0, []),
    ("mixmatch", 1, [(10, "1")]),
    ("mixmatch", 3, [(10, "1")]),
    ("double_dqn", 0, []),
    ("double_dqn", 3, [(10, "2")]),
]


def _told(alerts) -> list[tuple[int, str]]:
    return [(a.step, a.module) for a in alerts if a.rule == "eval_in_train_mode"]


@pytest.mark.parametrize(("shape", "val_batches", "expected"), CASES)
def test_two_no_grad_passes_a_step_are_silent_and_a_forgotten_eval_is_told(
    shape, val_batches, expected
):
    argv = sys.argv
    sys.argv = ["loop.py", shape, str(val_batches), "watch"]
    try:
        namespace: dict = {"__name__": "__main__"}
        exec(compile(SCRIPT, "loop.py", "exec"), namespace)
    finally:
        sys.argv = argv
    monitor = namespace["monitor"]
    assert _told(a for a in monitor.alerts if a.severity != "info") == expected


@pytest.mark.parametrize(("shape", "val_batches", "expected"), CASES[1:4])
def test_under_trainwatch_run_the_same_loops(tmp_path, shape, val_batches, expected):
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    run_script(script, [shape, str(val_batches)], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    alerts = [json.loads(line) for line in lines]
    found = [
        (a["step"], a["module"])
        for a in alerts
        if a["rule"] == "eval_in_train_mode" and a["severity"] != "info"
    ]
    assert found == expected


def test_a_two_batch_evaluation_after_the_last_step_is_told_at_close_with_its_step():
    import torch
    from torch import nn

    import trainwatch as tw

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    monitor = tw.watch(model, opt, console=False)
    for _ in range(5):
        loss = model(torch.randn(16, 8)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():  # forgot model.eval()
        for _ in range(2):
            model(torch.randn(16, 8))
    assert _told(monitor.alerts) == []  # it may yet recur at every step
    monitor.close()
    assert _told(monitor.alerts) == [(5, "1")]
