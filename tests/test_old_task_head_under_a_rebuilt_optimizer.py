"""zero_gradient on task-incremental learning with a fresh optimizer per task: the
old task's head ran under the earlier optimizer and is by design no longer called,
though the new optimizer holds it (``Adam(model.parameters())`` after appending
the new head). That is a head unused now, ``unused_parameter``'s note at most, as
when the new head is added to the same optimizer with ``add_param_group``; not a
member of the container that never ran beside its siblings. Beside them, the
planted bugs still found under the rebuilt optimizer: a new head that never runs
(an off-by-one task index), an expert never given a token, a backbone cut off by
a ``.detach()``. Plain loops under ``tw.watch`` and ``trainwatch run``."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from trainwatch.runner import run_script


class _ListHeads(nn.Module):
    """One linear head per task in a ModuleList; forward calls the task's own."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(20, 64), nn.ReLU())
        self.heads = nn.ModuleList([nn.Linear(64, 4)])
        self.off_by_one = False  # planted: the previous task's head for the new task
        self.detach = False  # planted: the backbone cut off from the new task's loss

    def new_task(self) -> None:
        self.heads.append(nn.Linear(64, 4))

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        h = self.backbone(x)
        if self.detach and task > 0:
            h = h.detach()
        return self.heads[task - 1 if self.off_by_one and task > 0 else task](h)


class _DictHeads(nn.Module):
    """Two-layer heads in a ModuleDict keyed by task name."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.heads = nn.ModuleDict()
        self.new_task()

    def new_task(self) -> None:
        self.heads[f"task{len(self.heads)}"] = nn.Sequential(
            nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4)
        )

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return self.heads[f"task{task}"](self.encoder(x))


def _optimizer(model: nn.Module, shape: str) -> torch.optim.Optimizer:
    if shape == "list":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _tasks(quiet_watch, shape: str, *, rebuild: bool = True, plant: str | None = None) -> list:
    """Trains one task after another (a new head each), under ``tw.watch``: a fresh
    optimizer per task handed to ``monitor.add_optimizer``, or (``rebuild=False``)
    the new head added to the one optimizer with ``add_param_group``."""
    torch.manual_seed(0)
    model = _ListHeads() if shape == "list" else _DictHeads()
    if plant is not None:
        setattr(model, plant, True)
    tasks, steps = (2, [100, 250]) if shape == "list" else (3, [60, 160, 160])
    targets = [torch.randn(20, 4) for _ in range(tasks)]
    opt = _optimizer(model, shape)
    monitor = quiet_watch(model, opt)
    for task in range(tasks):
        if task:
            before = {id(p) for p in model.parameters()}
            model.new_task()
            if rebuild:
                opt = _optimizer(model, shape)
                monitor.add_optimizer(opt)
            else:
                opt.add_param_group(
                    {"params": [p for p in model.parameters() if id(p) not in before]}
                )
        for _ in range(steps[task]):
            x = torch.randn(32, 20)
            loss = F.cross_entropy(model(x, task), (x @ targets[task]).argmax(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return monitor.alerts


def _told(alerts) -> set[tuple[str, str, str | None]]:
    return {(a.rule, a.module, a.data.get("kind")) for a in alerts if a.severity != "info"}


@pytest.mark.parametrize("shape", ["list", "dict"])
@pytest.mark.parametrize("rebuild", [True, False], ids=["fresh_optimizer", "add_param_group"])
def test_an_old_task_head_no_longer_called_is_no_warning(quiet_watch, shape, rebuild):
    alerts = _tasks(quiet_watch, shape, rebuild=rebuild)
    assert _told(alerts) == set()
    # Said as what it is: a head used on some steps only, a note.
    noted = {a.module for a in alerts if a.rule == "unused_parameter"}
    assert ("heads.0" if shape == "list" else "heads.task0") in noted


def test_a_new_head_that_never_runs_is_still_told_beside_its_sibling(quiet_watch):
    """An off-by-one task index: the new task trains the old head, and the new head,
    held by the fresh optimizer, never runs while its sibling does."""
    alerts = _tasks(quiet_watch, "list", plant="off_by_one")
    assert ("zero_gradient", "heads.1", "not_run") in _told(alerts)
    told = next(a for a in alerts if a.rule == "zero_gradient" and a.module == "heads.1")
    assert told.severity == "warning"
    assert told.data["siblings_ran"] == ["heads.0"]


def test_a_backbone_cut_off_under_the_fresh_optimizer_is_still_told(quiet_watch):
    """The backbone ran under the first optimizer and keeps running under the new
    one, its output detached: no gradient while running is a cut, told at once."""
    alerts = _tasks(quiet_watch, "list", plant="detach")
    told = [a for a in alerts if a.rule == "zero_gradient" and a.module == "backbone.0"]
    assert [(a.severity, a.data["kind"], a.step) for a in told] == [("warning", "none", 100)]
    assert ("zero_gradient", "heads.0", "not_run") not in _told(alerts)


class _NeverRoutedMoE(nn.Module):
    """Four experts; tokens routed by feature 0 to the first three only: the last
    expert never gets a token (a collapsed router)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        kind = x[:, 0].round().long().clamp(0, 2)
        out = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            rows = (kind == index).nonzero().flatten()
            if len(rows):
                out = out.index_add(0, rows, expert(h[rows]))
        return self.head(out)


def test_an_expert_never_routed_across_a_rebuilt_optimizer_is_still_told(quiet_watch):
    torch.manual_seed(0)
    model = _NeverRoutedMoE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for step in range(160):
        if step == 40:  # a new phase: a fresh optimizer over the same model
            opt = torch.optim.Adam(model.parameters(), lr=5e-4)
            monitor.add_optimizer(opt)
        x = torch.randn(32, 8)
        x[:, 0] = torch.randint(0, 4, (32,)).float()
        opt.zero_grad()
        F.mse_loss(model(x), x[:, 1:2]).backward()
        opt.step()
    assert _told(monitor.alerts) == {("zero_gradient", "experts.3", "not_run")}


TASKS_SCRIPT = """
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_num_threads(1)
plant = sys.argv[1]


class MultiHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(20, 64), nn.ReLU())
        self.heads = nn.ModuleList([nn.Linear(64, 4)])

    def forward(self, x, t):
        h = self.backbone(x)
        if plant == "detach" and t > 0:
            h = h.detach()  # planted: the backbone cut off for the new task
        return self.heads[t - 1 if plant == "off_by_one" and t > 0 else t](h)


model = MultiHead()
Ws = [torch.randn(20, 4), torch.randn(20, 4)]
for t in range(2):
    if t > 0:
        model.heads.append(nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # fresh optimizer per task
    for step in range(250 if t else 100):
        x = torch.randn(32, 20)
        loss = F.cross_entropy(model(x, t), (x @ Ws[t]).argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


@pytest.mark.parametrize(
    ("plant", "expected"),
    [
        ("clean", set()),
        ("off_by_one", {("heads.1", "not_run")}),
        ("detach", {("backbone.0", "none")}),
    ],
)
def test_trainwatch_run_on_a_fresh_optimizer_per_task(tmp_path, plant, expected):
    script = tmp_path / "tasks.py"
    script.write_text(textwrap.dedent(TASKS_SCRIPT))
    assert run_script(script, [plant], log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = {
        (a["module"], a["data"].get("kind"))
        for a in map(json.loads, lines)
        if a["rule"] == "zero_gradient" and a["severity"] != "info"
    }
    assert found == expected
