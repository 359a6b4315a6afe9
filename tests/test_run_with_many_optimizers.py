"""``trainwatch run`` over a loop that builds a model copy and an optimizer per task.

Reptile trains a deep copy of the meta-model with a fresh SGD for each task,
then moves the meta-model (never called itself) by hand and one Adam step.
Each fresh optimizer met while the forward hooks were off made a heap search
for its model (three scans of every live object: its holder, its optimizers,
compile wrappers), so the run went ten times slower than the plain script.
A fresh optimizer's building now turns the forward hooks back on and its model
is found at its first call, the optimizer known already (no search), and only
a model no call brings (the meta-model) is searched for.
"""

from __future__ import annotations

import gc
import json

from trainwatch.runner import run_script

REPTILE = """
import copy
import sys
import torch
from torch import nn
import torch.nn.functional as F

variant, meta_iterations, TASKS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
INNER = 4
model = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
meta_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for it in range(meta_iterations):
    meta_opt.zero_grad()
    for t in range(TASKS):
        amp, phase = 0.1 + 4.9 * torch.rand(1), 3.14 * torch.rand(1)
        learner = copy.deepcopy(model)
        inner = torch.optim.SGD(learner.parameters(), lr=0.02)
        forgets_zero_grad = variant == "late_task_accumulates" and it == meta_iterations - 1
        for _ in range(INNER):
            x = 10 * torch.rand(10, 1) - 5
            if not forgets_zero_grad:
                inner.zero_grad()
            F.mse_loss(learner(x), amp * torch.sin(x + phase)).backward()
            inner.step()
        with torch.no_grad():
            for p, q in zip(model.parameters(), learner.parameters()):
                g = (p - q) / TASKS
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.add_(g)
    meta_opt.step()
"""


def _run(
    tmp_path, monkeypatch, variant: str, meta_iterations: int = 15, tasks: int = 4
) -> tuple[int, list, list]:
    """Heap scans made, alerts, and the optimizer kinds of each model's setup audit
    (a table standing for copies set up alike, once for each)."""
    tmp_path.mkdir(exist_ok=True)
    script = tmp_path / "reptile.py"
    script.write_text(REPTILE)
    scans = 0
    scan = gc.get_objects

    def counted(*args, **kwargs):
        nonlocal scans
        scans += 1
        return scan(*args, **kwargs)

    monkeypatch.setattr(gc, "get_objects", counted)
    log = tmp_path / "log"
    run_script(script, [variant, str(meta_iterations), str(tasks)], log_dir=log, console=False)
    monkeypatch.setattr(gc, "get_objects", scan)
    alerts = [json.loads(line) for line in (log / "alerts.jsonl").read_text().splitlines()]
    audits = json.loads((log / "setup.json").read_text())["audits"]
    kinds = [
        tuple(o["kind"] for o in a["optimizers"])
        for a in audits
        if a["revision"] == 0
        for _ in range(1 + a["alike"])
    ]
    return scans, alerts, kinds


def test_an_optimizer_per_task_makes_a_bounded_number_of_heap_scans(tmp_path, monkeypatch):
    # 60 task optimizers (and their models): three scans per fresh optimizer
    # made about 180; now those of the first few models and the meta-model only.
    scans, alerts, kinds = _run(tmp_path, monkeypatch, "healthy")
    assert scans <= 15
    assert alerts == []
    # Every task's copy is still watched, and so is the meta-model, which is
    # never called (found by the search at its optimizer's first step).
    assert kinds.count(("SGD",)) == 60
    assert kinds.count(("Adam",)) == 1


def test_a_meta_model_past_the_first_searches_is_found_by_its_parameters(tmp_path, monkeypatch):
    # Six tasks: the first searches go to the copies, and the meta-model,
    # never called, is searched for at its optimizer's third step.
    _, alerts, kinds = _run(tmp_path, monkeypatch, "healthy", meta_iterations=4, tasks=6)
    assert alerts == []
    assert kinds.count(("SGD",)) == 24
    assert kinds.count(("Adam",)) == 1


def test_heap_scans_do_not_grow_with_the_number_of_tasks(tmp_path, monkeypatch):
    few, _, _ = _run(tmp_path / "few", monkeypatch, "healthy", meta_iterations=5)
    many, _, kinds = _run(tmp_path / "many", monkeypatch, "healthy", meta_iterations=30)
    assert kinds.count(("SGD",)) == 120
    assert many == few


def test_a_late_tasks_copy_found_by_its_call_is_checked(tmp_path, monkeypatch):
    # The last meta-iteration's inner loops forget zero_grad(): their copies,
    # found by their first calls (not a heap scan), are told at their second
    # step: the first of them once, the others counted with it (copies set up alike).
    _, alerts, _ = _run(tmp_path, monkeypatch, "late_task_accumulates")
    told = [a for a in alerts if a["rule"] == "accumulated_gradient"]
    assert len(told) == 1, alerts
    counts = json.loads((tmp_path / "log" / "alert_counts.json").read_text())["counts"]
    # Four copies, each at its second, third and fourth step.
    assert [(c["rule"], c["count"]) for c in counts] == [("accumulated_gradient", 12)]


def test_a_script_importing_lightning_and_transformers_scans_no_more(tmp_path, monkeypatch):
    # With Lightning or the Hugging Face Trainer imported, a new model's first call
    # and its first step once looked for a LightningModule holding it and for a
    # Trainer training it: one heap scan each, per task. Neither loop runs here.
    import lightning.pytorch  # noqa: F401
    import transformers.trainer  # noqa: F401

    scans, alerts, kinds = _run(tmp_path, monkeypatch, "healthy")
    assert scans <= 15
    assert alerts == []
    assert kinds.count(("SGD",)) == 60
