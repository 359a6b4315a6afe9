"""``trainwatch run``'s closing line beside a monitor the script opened itself.

A script that calls ``tw.watch(model)`` and updates the weights by hand without
calling ``monitor.step()`` watches no step: its monitor says so when it closes
("the model ran 60 forward passes, but no optimizer stepped and monitor.step()
was never called"). The run leaves that model to the script's monitor, so its
own monitors saw no backward; it used to add "no optimizer stepped and no
backward pass reached a model during the run", false next to 60 backward
passes through the script's model. A script that never closed its monitor
fared worse under the run: runpy dropped the script's globals as it returned,
the monitor was collected unheard (no summary, no note, where plain ``python``
closes it at exit and prints them), and the run printed that same false line
even over a healthy ``torch.optim`` loop of 30 watched steps.

Now the script's monitors still open when the script ends close as at the
interpreter's exit, and the run adds no line where the script's monitor told
why it watched no step. Run through the real command line, in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import trainwatch

pytestmark = pytest.mark.slow

# The word_language_model example's manual update: no optimizer, zero_grad
# forgotten, clipping; argv: "step" calls monitor.step() after each update,
# "open" leaves the monitor unclosed.
MANUAL_SGD = """
import sys
import torch
from torch import nn
import trainwatch as tw

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(50, 32), nn.Flatten(), nn.Linear(32 * 4, 50))
monitor = tw.watch(model)
for step in range(60):
    data = torch.randint(0, 50, (16, 4))
    loss = nn.functional.cross_entropy(model(data), data[:, -1])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-0.5)
    if "step" in sys.argv:
        monitor.step()
if "open" not in sys.argv:
    monitor.close()
"""

# Another hand-written update: a regression MLP, gradients reset, the update
# under no_grad, the monitor a ``with`` block's (so always closed).
WITH_BLOCK = """
import sys
import torch
from torch import nn
import trainwatch as tw

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
with tw.watch(model) as monitor:
    for step in range(20):
        x = torch.randn(32, 8)
        model.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :1].sin()).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
        if "step" in sys.argv:
            monitor.step()
"""

# A healthy torch.optim loop the script watches itself; "open": never closed.
OPTIM = """
import sys
import torch
from torch import nn
import trainwatch as tw

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
monitor = tw.watch(model, opt)
for step in range(30):
    x = torch.randn(16, 8)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
    opt.step()
if "open" not in sys.argv:
    monitor.close()
"""

NOTHING_WATCHED = "no training step watched"
# The run's own line, false where the script's monitor held a model backward reached.
NO_BACKWARD = "no backward pass reached a model"
NO_MONITOR_STEP = "no optimizer stepped and monitor.step() was never called"


def _python(tmp_path: Path, source: str, *args: str, run: bool = True) -> str:
    """The script's stderr (where every trainwatch line goes), run under ``trainwatch
    run`` or plain ``python``, importing the trainwatch under test."""
    script = tmp_path / "train.py"
    script.write_text(source)
    env = dict(os.environ, PYTHONPATH=str(Path(trainwatch.__file__).resolve().parents[1]))
    command = ["-m", "trainwatch", "run", "--log-dir", str(tmp_path / "run")] if run else []
    done = subprocess.run(
        [sys.executable, *command, str(script), *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def _run_counts(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "run" / "alert_counts.json").read_text())


@pytest.mark.parametrize("closed", ["closed", "open"])
def test_manual_sgd_without_monitor_step_gets_the_scripts_note_alone(tmp_path, closed):
    err = _python(tmp_path, MANUAL_SGD, closed)
    assert NO_BACKWARD not in err
    assert err.count(NOTHING_WATCHED) == 1, err
    assert f"the model ran 60 forward passes, but {NO_MONITOR_STEP}" in err


def test_a_hand_written_update_in_a_with_block_gets_the_scripts_note_alone(tmp_path):
    err = _python(tmp_path, WITH_BLOCK)
    assert NO_BACKWARD not in err
    assert err.count(NOTHING_WATCHED) == 1, err
    assert f"the model ran 20 forward passes, but {NO_MONITOR_STEP}" in err


@pytest.mark.parametrize("closed", ["closed", "open"])
def test_manual_sgd_with_monitor_step_is_watched_step_by_step(tmp_path, closed):
    """The clean twin: monitor.step() after each update. Every step is watched, the
    forgotten zero_grad is told at step 1, and no line says nothing was watched."""
    err = _python(tmp_path, MANUAL_SGD, "step", closed)
    assert NOTHING_WATCHED not in err
    assert "60 steps watched" in err
    assert "step 1 ERROR accumulated_gradient" in err
    counts = _run_counts(tmp_path)
    assert counts["steps"] == 60
    assert [c["rule"] for c in counts["counts"]] == ["accumulated_gradient"]


def test_a_with_block_calling_monitor_step_stays_silent(tmp_path):
    err = _python(tmp_path, WITH_BLOCK, "step")
    assert NOTHING_WATCHED not in err
    assert "20 steps watched" in err and "no alerts" in err
    assert _run_counts(tmp_path) == {"steps": 20, "counts": []}


@pytest.mark.parametrize("closed", ["closed", "open"])
def test_a_healthy_optim_loop_watched_by_the_script_gets_no_false_line(tmp_path, closed):
    """The script's own summary is told once (under plain python an unclosed monitor
    tells it at exit, and now under the run too), and the run adds nothing."""
    err = _python(tmp_path, OPTIM, closed)
    assert NOTHING_WATCHED not in err
    assert err.count("30 steps watched") == 1, err
    assert _run_counts(tmp_path) == {"steps": 30, "counts": []}


@pytest.mark.parametrize(
    ("source", "args", "said", "unsaid"),
    [
        (MANUAL_SGD, ("open",), f"60 forward passes, but {NO_MONITOR_STEP}", "steps watched"),
        (OPTIM, ("open",), "30 steps watched", NOTHING_WATCHED),
    ],
    ids=["no-step", "healthy"],
)
def test_plain_python_closes_an_open_monitor_at_exit_as_close_would(
    tmp_path, source, args, said, unsaid
):
    """Without the run: a monitor never closed is closed at the interpreter's exit,
    and tells what close() tells (the note where no step was watched, the summary
    where steps were), once."""
    err = _python(tmp_path, source, *args, run=False)
    assert err.count(said) == 1, err
    assert unsaid not in err
