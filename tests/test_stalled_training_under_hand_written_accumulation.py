"""A hand-written update over several micro-batches is no stall.

Without an optimizer, a step boundary is not always an update: under
``trainwatch run`` each backward's end is a step, and a loop that sums two
or four micro-batches before its own update has boundaries with no update
between them. The sampled steps (every 100) then land where every weight is
as it was; that is no stall. The same holds under ``tw.watch`` when
``monitor.step()`` marks each micro-batch. The planted bug beside them, a
hand-written learning rate that falls to 0, is still told, with advice about
the loop's own rate (no optimizer, no scheduler).
"""

from __future__ import annotations

import json
import runpy
import sys

import pytest

from trainwatch.runner import run_script

LOOP = """
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

micro = int(sys.argv[1])
updates = int(sys.argv[2])
stop_at = int(sys.argv[3])  # from this update on the loop's learning rate is 0
momentum = sys.argv[4] == "momentum"
shape = sys.argv[5]  # "run": unmodified; "watch-micro": monitor.step() each micro-batch
torch.manual_seed(0)
X = torch.randn(2000, 8)
Y = (X[:, :2].sum(1) > 0).long()
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
monitor = None
if shape != "run":
    import trainwatch as tw

    monitor = tw.watch(model, console=False, log_dir=sys.argv[6])
buffers = [torch.zeros_like(p) for p in model.parameters()]
for update in range(updates):
    for _ in range(micro):
        idx = torch.randint(0, 2000, (32,))
        (F.cross_entropy(model(X[idx]), Y[idx]) / micro).backward()
        if shape == "watch-micro":
            monitor.step()
    lr = 0.05 if update < stop_at else 0.0
    with torch.no_grad():
        for p, buf in zip(model.parameters(), buffers):
            if momentum:
                buf.mul_(0.9).add_(p.grad)
                p -= lr * buf
            else:
                p -= lr * p.grad
            p.grad = None
    if shape == "watch-update":
        monitor.step()
if monitor is not None:
    monitor.close()
"""


def _stalls(
    tmp_path, monkeypatch, shape: str, micro: int, updates: int, stop_at: int, momentum=False
):
    """The stalled_training alerts of the loop: under ``trainwatch run`` (unmodified),
    or run here under its own ``tw.watch``."""
    script = tmp_path / "hand_written_loop.py"
    script.write_text(LOOP)
    log = tmp_path / "log"
    args = [str(micro), str(updates), str(stop_at), "momentum" if momentum else "plain", shape]
    if shape == "run":
        assert run_script(script, args, log_dir=log, console=False) == 0
    else:
        monkeypatch.setattr(sys, "argv", [str(script), *args, str(log)])
        runpy.run_path(str(script), run_name="__main__")
    alerts = [json.loads(line) for line in (log / "alerts.jsonl").read_text().splitlines()]
    return [a for a in alerts if a["rule"] == "stalled_training"]


@pytest.mark.parametrize(
    ("micro", "momentum"), [(2, True), (4, False)], ids=["momentum-2-micro", "sgd-4-micro"]
)
def test_trainwatch_run_of_a_hand_written_accumulation_is_no_stall(
    tmp_path, monkeypatch, micro, momentum
):
    assert _stalls(tmp_path, monkeypatch, "run", micro, 600 // micro, 10_000, momentum) == []


@pytest.mark.parametrize("micro", [2, 4])
def test_a_boundary_at_each_micro_batch_under_watch_is_no_stall(tmp_path, monkeypatch, micro):
    assert _stalls(tmp_path, monkeypatch, "watch-micro", micro, 400 // micro, 10_000) == []


def test_control_one_boundary_per_update_under_watch_stays_silent(tmp_path, monkeypatch):
    assert _stalls(tmp_path, monkeypatch, "watch-update", 2, 300, 10_000) == []


@pytest.mark.parametrize(
    ("shape", "micro", "updates"),
    [("run", 2, 300), ("watch-micro", 2, 300), ("watch-update", 1, 400)],
    ids=["run-2-micro", "watch-each-micro-batch", "watch-each-update"],
)
def test_a_hand_written_learning_rate_falling_to_zero_is_still_told(
    tmp_path, monkeypatch, shape, micro, updates
):
    (alert,) = _stalls(tmp_path, monkeypatch, shape, micro, updates, stop_at=30)
    assert alert["data"]["criterion"] == "updates_stopped"
    assert alert["data"]["learning_rates"] == []
    hint = alert["hint"]
    assert "hand-written update" in hint and "learning rate fell to 0" in hint
    assert "sched.step()" not in hint and "StepLR" not in hint
