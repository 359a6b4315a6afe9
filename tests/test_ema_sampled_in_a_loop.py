"""An EMA copy sampled in a loop now and then, without ``.eval()``: one evaluation finding.

A diffusion model's EMA copy (``AveragedModel``, ``update_parameters`` after every
optimizer step) is sampled every few hundred steps by a loop of denoising passes
under ``no_grad``. Left in training mode, its dropout is on: an evaluation that
forgot ``ema.eval()``, told once at the first sampling, the later ones counted in
its row. Its weights move at every step between samplings, so it is never a
frozen teacher: each sampling loop starts a run of its own, and nothing from the
loops before (passes that came after other models' steps) makes the third sampling
look like a teacher's passes, one after each student step.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import trainwatch as tw
from trainwatch.runner import run_script

FROZEN = "frozen model used in training mode"

# Four samplings of six denoising passes each, every five steps (an EMA copy is
# evaluated every few hundred steps; five is already far apart for a target).
SAMPLED = """
import sys
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

forgot_eval = sys.argv[1] == "forgot_eval"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 2))
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


@torch.no_grad()
def sample(net, n=64):
    x = torch.randn(n, 2)
    for i in range(6, 0, -1):
        t = torch.full((n, 1), i / 6)
        x = x - net(torch.cat([x, t], 1)) / 6
    return x


for step in range(20):
    x0, eps, t = torch.randn(32, 2), torch.randn(32, 2), torch.rand(32, 1)
    loss = nn.functional.mse_loss(model(torch.cat([x0 + t * eps, t], 1)), eps)
    opt.zero_grad()
    loss.backward()
    opt.step()
    ema.update_parameters(model)
    if (step + 1) % 5 == 0:
        if not forgot_eval:
            ema.eval()
        sample(ema)
        ema.train()
"""


def _run(tmp_path, how: str) -> list[dict]:
    script = tmp_path / "ema_sampled.py"
    script.write_text(SAMPLED)
    run_script(script, [how], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["rule"] == "eval_in_train_mode"]


def test_under_run_an_ema_copy_sampled_in_training_mode_is_one_evaluation_finding(tmp_path):
    (alert,) = _run(tmp_path, "forgot_eval")
    assert alert["step"] == 5 and alert["module"] == "module.2"
    assert alert["data"].get("finding") != FROZEN
    assert "(evaluation)" in alert["message"] and "teacher" not in alert["message"]


def test_under_run_an_ema_copy_sampled_in_eval_mode_is_silent(tmp_path):
    assert _run(tmp_path, "eval") == []


def _watched(forgot_eval: bool) -> tuple[list, dict]:
    """tw.watch on the model and on its EMA copy (no optimizer of its own): the
    copy monitor's alerts and their counts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 2))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=False), tw.watch(ema, console=False) as ema_monitor:
        for step in range(20):
            x0, eps, t = torch.randn(32, 2), torch.randn(32, 2), torch.rand(32, 1)
            loss = nn.functional.mse_loss(model(torch.cat([x0 + t * eps, t], 1)), eps)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ema.update_parameters(model)
            if (step + 1) % 5 == 0:
                if forgot_eval:
                    ema.train()
                else:
                    ema.eval()
                with torch.no_grad():
                    x = torch.randn(64, 2)
                    for i in range(6, 0, -1):
                        x = x - ema(torch.cat([x, torch.full((64, 1), i / 6)], 1)) / 6
    return ema_monitor.alerts, ema_monitor.alert_counts


def test_under_watch_an_ema_copy_sampled_in_training_mode_is_one_evaluation_finding():
    alerts, counts = _watched(forgot_eval=True)
    (alert,) = [a for a in alerts if a.rule == "eval_in_train_mode"]
    assert alert.module == "module.2" and alert.data.get("finding") != FROZEN
    assert "(evaluation)" in alert.message and "teacher" not in alert.message
    # Every pass of the four samplings is a repeat of it, counted in its row.
    assert counts[alert.key] == 4 * 6


def test_under_watch_an_ema_copy_sampled_in_eval_mode_is_silent():
    alerts, _ = _watched(forgot_eval=False)
    assert [a for a in alerts if a.severity != "info"] == []


@pytest.mark.parametrize("passes", [3, 20])
def test_no_sampling_of_a_moving_copy_is_told_as_a_frozen_teacher(passes):
    # The judge alone: a copy moved at every step, sampled every 100 steps by a
    # loop of passes; never marked as a frozen model's use, however many loops.
    from trainwatch.collect.eval_passes import EvalPassJudge
    from trainwatch.record import ModeReport, StepRecord

    judge = EvalPassJudge()
    told = []
    for at in range(100, 1100, 100):
        for _ in range(passes):
            record = StepRecord(step=at, source="forward")
            record.eval_in_train = ModeReport(["2"], ["Dropout"], False, 1)
            told += judge.nograd_pass(record, at, at, steps=(at, at))
        told += judge.step_boundary()
    told += judge.flush()
    assert len(told) == 10 * passes
    assert not any(r.eval_in_train.frozen_use for r in told)
