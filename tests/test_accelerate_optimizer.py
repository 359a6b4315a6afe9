"""An optimizer prepared by accelerate is watched through the torch optimizer it wraps.

``AcceleratedOptimizer`` subclasses ``Optimizer`` without running its
``__init__``: it has no hook tables, so ``tw.watch`` failed with an
``AttributeError`` and ``trainwatch run`` reported an internal error and
listed the wrapper as a second optimizer. Its inner optimizer's ``step`` runs
only on the steps that apply an update, so accelerate's own gradient
accumulation is counted one step per update.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")

from trainwatch.runner import run_script  # noqa: E402


def _prepared(accumulation: int = 1):
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    return accelerator, model, opt


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
    return x, (x[:, 0] > 0).long()


@pytest.mark.parametrize("reset_until", [None, 10], ids=["healthy", "zero_grad_dropped"])
def test_a_prepared_optimizer_is_watched(quiet_watch, reset_until):
    accelerator, model, opt = _prepared()
    monitor = quiet_watch(model, opt)
    for step in range(30):
        x, y = _batch(step)
        loss = nn.functional.cross_entropy(model(x), y)
        if reset_until is None or step < reset_until:
            opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
    assert monitor.optimizers == [opt.optimizer]
    assert monitor.step_count == 30
    found = [(a.rule, a.step) for a in monitor.alerts if a.severity != "info"]
    assert found == ([] if reset_until is None else [("accumulated_gradient", 10)])


def test_accelerate_s_own_gradient_accumulation_is_one_step_per_update(quiet_watch):
    accelerator, model, opt = _prepared(accumulation=4)
    monitor = quiet_watch(model, opt)
    for step in range(40):
        with accelerator.accumulate(model):
            x, y = _batch(step)
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
    assert monitor.step_count == 10
    assert [a.rule for a in monitor.alerts if a.severity != "info"] == []


SCRIPT = """
import torch
from torch import nn
from accelerate import Accelerator

accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = accelerator.prepare(model, opt)
for step in range(30):
    x = torch.randn(16, 8)
    loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
    opt.zero_grad()
    accelerator.backward(loss)
    opt.step()
"""


def test_trainwatch_run_watches_a_prepared_optimizer_once(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_script(script, [], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    assert [a["rule"] for a in map(json.loads, lines)] == []
    audits = json.loads((tmp_path / "log" / "setup.json").read_text())["audits"]
    assert [o["kind"] for o in audits[-1]["optimizers"]] == ["AdamW"]
    assert json.loads((tmp_path / "log" / "alert_counts.json").read_text())["steps"] == 30
