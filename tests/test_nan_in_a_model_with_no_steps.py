"""A NaN met by a model that takes no steps of its own (an EMA copy) is told at once.

An EMA copy is run under ``no_grad`` now and then and never steps: the NaN its
forward met waited for a step boundary of its own that never came, and was
told when the run closed, dated step 0, blaming an optimizer it does not have
(so ``halt_on`` could not stop the run, and a killed run lost it). It is told
as the pass ends, dated by the step the process's training is in, and its
non-finite weights are named as written by the training code.
"""

from __future__ import annotations

import copy
import json

import torch
from torch import nn

import trainwatch as tw
from trainwatch.runner import run_script


def _train_with_ema(poison_at: int | None, steps: int = 60):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    ema = copy.deepcopy(model).requires_grad_(False).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    with tw.watch(model, opt, console=False), tw.watch(ema, console=False) as ema_monitor:
        for step in range(steps):
            x = torch.randn(32, 4)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            opt.step()
            with torch.no_grad():
                for mine, theirs in zip(ema.parameters(), model.parameters()):
                    mine.lerp_(theirs, 0.05)
                if step == poison_at:
                    ema[0].weight[0, 0] = float("nan")  # a bad EMA update
                if step % 10 == 9:
                    ema(torch.randn(8, 4))
                    seen.append(len(ema_monitor.alerts))  # told before the run goes on
    return ema_monitor.alerts, seen


def test_a_nan_in_an_ema_copy_is_told_as_its_pass_ends():
    alerts, seen = _train_with_ema(poison_at=33)
    assert [(a.rule, a.step, a.module, a.data.get("cause")) for a in alerts] == [
        ("nonfinite_parameter", 40, "0", "written")
    ]
    assert seen[:4] == [0, 0, 0, 1]  # at the first pass after the NaN (step 39's)


def test_control_a_healthy_ema_copy_is_silent():
    alerts, _ = _train_with_ema(poison_at=None)
    assert alerts == []


SCRIPT = """
import copy
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
ema = copy.deepcopy(model).requires_grad_(False)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(60):
    x = torch.randn(32, 4)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
    opt.step()
    with torch.no_grad():
        for mine, theirs in zip(ema.parameters(), model.parameters()):
            mine.lerp_(theirs, 0.05)
        if step == 33:
            ema[0].weight[0, 0] = float("nan")
    if step % 10 == 9:
        ema.eval()
        with torch.no_grad():
            ema(torch.randn(8, 4))
"""


def test_trainwatch_run_tells_an_ema_copy_s_nan_at_its_step(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_script(script, [], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [(a["rule"], a["step"], a["data"].get("cause")) for a in map(json.loads, lines)]
    assert found == [("nonfinite_parameter", 40, "written")]
