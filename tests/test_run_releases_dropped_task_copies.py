"""``trainwatch run`` over a meta-learning loop that trains a throwaway copy per task.

Reptile and first-order MAML make ``copy.deepcopy(meta_model)`` and a fresh SGD
for each task, take a few inner steps and drop both. Each copy got a monitor
that held it for the rest of the run (121 monitors and copies alive after 120
tasks), and printed a setup table of its own. A monitor whose model and
optimizers the script dropped now closes as the next model is found (its
copy is freed at once); copies set up alike show one setup table and one
closing line counting the rest, and a bug in the inner loop is told once,
the later copies' findings counted with the first's.
"""

from __future__ import annotations

import json

import pytest

from trainwatch.runner import run_script

META_LEARNING = """
import copy
import gc
import json
import math
import sys
import weakref

import torch
from torch import nn
import torch.nn.functional as F

from trainwatch.monitor import Monitor

tasks, method, bug, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
gc.disable()  # a copy must be freed when dropped, not at a later collection
torch.manual_seed(0)
INNER = 5


class SineNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
        )

    def forward(self, x):
        return self.net(x)


meta = SineNet()
meta_opt = torch.optim.Adam(meta.parameters(), lr=1e-3)
copies = []
for t in range(tasks):
    amp, phase = 0.1 + 4.9 * torch.rand(1), math.pi * torch.rand(1)
    learner = copy.deepcopy(meta)
    inner = torch.optim.SGD(learner.parameters(), lr=0.02)
    copies.append(weakref.ref(learner))
    for i in range(INNER):
        x = 10 * torch.rand(10, 1) - 5
        if bug != "missing_zero_grad":
            inner.zero_grad()
        loss = F.mse_loss(learner(x), amp * torch.sin(x + phase))
        if bug == "nan" and t >= 3 and i == 2:
            loss = loss * float("nan")  # a NaN in the inner step, from task 3 on
        loss.backward()
        inner.step()
    meta_opt.zero_grad()
    if method == "fomaml":  # the adapted copy's gradient on a fresh batch
        inner.zero_grad()
        x = 10 * torch.rand(10, 1) - 5
        F.mse_loss(learner(x), amp * torch.sin(x + phase)).backward()
        with torch.no_grad():
            for p, q in zip(meta.parameters(), learner.parameters()):
                p.grad = q.grad.clone()
    else:  # Reptile: towards the adapted weights
        with torch.no_grad():
            for p, q in zip(meta.parameters(), learner.parameters()):
                p.grad = p - q
    meta_opt.step()

alive_copies = sum(ref() is not None for ref in copies)
gc.enable()
gc.collect()
# This run's monitors (an earlier in-process run's may linger).
monitors = [m for m in gc.get_objects() if type(m) is Monitor and type(m.model) is SineNet]
opened = sum(not m.closed for m in monitors)
with open(out, "w") as f:
    json.dump({"copies": alive_copies, "monitors": len(monitors), "open": opened}, f)
"""


def _run(tmp_path, tasks: int, method: str = "reptile", bug: str = "none", console=False):
    """What the script counted at its end, the alerts, and the counts file."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "meta_learning.py"
    script.write_text(META_LEARNING)
    counted, log = tmp_path / "counted.json", tmp_path / "log"
    code = run_script(script, [str(tasks), method, bug, str(counted)], log_dir=log, console=console)
    assert code == 0
    alerts = [json.loads(line) for line in (log / "alerts.jsonl").read_text().splitlines()]
    counts = json.loads((log / "alert_counts.json").read_text())["counts"]
    return json.loads(counted.read_text()), alerts, counts


@pytest.mark.parametrize("tasks", [20, 120])
def test_a_copy_per_task_leaves_no_monitor_behind(tmp_path, tasks):
    live, alerts, _ = _run(tmp_path, tasks)
    # The meta-model's and the last copy's: the script still holds both.
    assert live == {"copies": 1, "monitors": 2, "open": 2}
    assert alerts == []


@pytest.mark.parametrize("method", ["reptile", "fomaml"])
def test_a_healthy_meta_learning_loop_is_silent(tmp_path, method):
    live, alerts, counts = _run(tmp_path, 20, method)
    assert live["monitors"] == 2
    assert alerts == [] and counts == []


@pytest.mark.parametrize("tasks", [20, 120])
def test_copies_set_up_alike_print_one_setup_table(tmp_path, capsys, tasks):
    _run(tmp_path, tasks, console=True)
    err = capsys.readouterr().err
    tables = [line for line in err.splitlines() if line.startswith("trainwatch setup of")]
    # The first copy's table and the meta-model's (Adam, not SGD); then one
    # line saying the copies' tables are not printed, and one counting them.
    assert len(tables) == 3, err
    assert "like SineNet's above" in tables[2]
    assert f"trainwatch: {tasks - 1} more models set up like SineNet watched" in err
    audits = json.loads((tmp_path / "log" / "setup.json").read_text())["audits"]
    assert [(a["model"], a["alike"]) for a in audits] == [("SineNet", tasks - 1), ("SineNet#2", 0)]


def test_a_missing_zero_grad_in_every_copy_is_told_once(tmp_path, capsys):
    live, alerts, counts = _run(tmp_path, 20, bug="missing_zero_grad", console=True)
    assert live["monitors"] == 2
    assert [a["rule"] for a in alerts] == ["accumulated_gradient"]
    assert capsys.readouterr().err.count("ERROR accumulated_gradient") == 1
    # Counted for every copy: the first ones watched from their first step (4
    # repeats each), the later ones from their second (found at their next call).
    (tally,) = counts
    assert tally["rule"] == "accumulated_gradient" and tally["count"] > 3 * 20


def test_a_nan_in_the_inner_step_is_told_once_however_many_tasks(tmp_path):
    _, few, _ = _run(tmp_path / "few", 20, bug="nan")
    _, many, counts = _run(tmp_path / "many", 120, bug="nan")
    told = [(a["rule"], a["module"], a["data"]["model"]) for a in many]
    assert ("nonfinite_loss", None, "SineNet#5") in told  # task 3's copy
    assert told == [(a["rule"], a["module"], a["data"]["model"]) for a in few]
    # The later copies, started from the meta-model the NaN reached, are counted.
    assert max(c["count"] for c in counts) >= 100


HELD_MODELS = """
import sys
import torch
from torch import nn
import torch.nn.functional as F

from trainwatch.monitor import Monitor

bug = sys.argv[1]
torch.manual_seed(0)


def train(model, opt, steps, zero_grad=True):
    for _ in range(steps):
        x = torch.randn(16, 4)
        if zero_grad:
            opt.zero_grad()
        F.mse_loss(model(x), x[:, :1]).backward()
        opt.step()


first = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
first_opt = torch.optim.SGD(first.parameters(), lr=0.01)
train(first, first_opt, 6)
second = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
second_opt = torch.optim.SGD(second.parameters(), lr=0.01)
train(second, second_opt, 6)  # found while the script still holds the first model
train(first, first_opt, 6, zero_grad=bug != "missing_zero_grad")
"""


@pytest.mark.parametrize("bug", ["none", "missing_zero_grad"])
def test_a_model_the_script_still_holds_keeps_its_monitor(tmp_path, bug):
    script = tmp_path / "held.py"
    script.write_text(HELD_MODELS)
    assert run_script(script, [bug], log_dir=tmp_path / "log", console=False) == 0
    alerts = [json.loads(x) for x in (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()]
    audits = json.loads((tmp_path / "log" / "setup.json").read_text())["audits"]
    # Two models, each with a table of its own (neither was dropped).
    assert [(a["model"], a.get("alike", 0)) for a in audits] == [
        ("Sequential", 0),
        ("Sequential#2", 0),
    ]
    if bug == "none":
        assert alerts == []
    else:  # the first model, trained again after the second was found, is still watched
        assert [(a["rule"], a["data"]["model"]) for a in alerts] == [
            ("accumulated_gradient", "Sequential")
        ]
