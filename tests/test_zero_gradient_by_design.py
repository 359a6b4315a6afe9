"""zero_gradient stays silent on gradients that are zero or missing by design.

- A warm-up from a learning rate of 0 moves no weight at its first step, so a
  zero-initialised gate (DiT's adaLN-Zero) keeps the layers behind it at a
  zero gradient one step longer: that step repeats the one before.
- Stochastic depth in torchvision's ``mode="batch"`` multiplies a residual
  branch by 0 for the whole batch: exact zeros, several steps in a row by
  chance, in a layer that trained before.
- An early-exit network trained at an exit drawn at random: an exit is not
  run on some steps and left out of the loss on others.

Each has its planted bug beside it, still reported.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.conftest import rules_of


class _AdaLNBlock(nn.Module):
    def __init__(self, d: int, cut_gate: bool) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ada = nn.Linear(d, d)  # the gate: zero at init, as in adaLN-Zero
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)
        self.cut_gate = cut_gate

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        gate = self.ada(c)
        if self.cut_gate:
            gate = gate.detach()  # the bug: the gate never learns
        return x + gate * self.mlp(x)


class _Denoiser(nn.Module):
    def __init__(self, cut_gate: bool = False, d: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.cemb = nn.Embedding(10, d)
        self.block = _AdaLNBlock(d, cut_gate)
        self.final = nn.Linear(d, 8)  # zero-initialised output layer
        nn.init.zeros_(self.final.weight)
        nn.init.zeros_(self.final.bias)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.final(self.block(self.inp(x), self.cemb(y)))


def _denoising_run(quiet_watch, cut_gate: bool, warmup_from_zero: bool):
    torch.manual_seed(0)
    model = _Denoiser(cut_gate)
    opt = torch.optim.AdamW(model.parameters(), 1e-4)
    start = 0.0 if warmup_from_zero else 0.1
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, start + s / 10))
    monitor = quiet_watch(model, opt)
    for _ in range(30):
        x, y, noise = torch.randn(16, 8), torch.randint(0, 10, (16,)), torch.randn(16, 8)
        loss = F.mse_loss(model(x + noise, y), noise)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    monitor.close()
    return monitor


def test_nested_zero_init_gates_under_a_warmup_from_zero_are_silent(quiet_watch):
    for warmup_from_zero in (True, False):
        monitor = _denoising_run(quiet_watch, cut_gate=False, warmup_from_zero=warmup_from_zero)
        assert rules_of(monitor) == [], warmup_from_zero


def test_the_same_warmup_with_the_gate_cut_off_names_the_gate_at_step_0(quiet_watch):
    monitor = _denoising_run(quiet_watch, cut_gate=True, warmup_from_zero=True)
    found = {(a.module, a.step) for a in monitor.alerts if a.rule == "zero_gradient"}
    assert ("block.ada", 0) in found


class _DroppedBlock(nn.Module):
    def __init__(self, d: int, p: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.p = p
        self.scale: float | None = None  # a fixed factor instead of the draw (the bug)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch = F.gelu(self.fc(x))
        if self.scale is not None:
            return x + self.scale * branch
        if self.training and self.p > 0:  # torchvision.ops.stochastic_depth, mode="batch"
            keep = torch.empty(1, 1).bernoulli_(1 - self.p).div_(1 - self.p)
            branch = branch * keep
        return x + branch


def _stochastic_depth_run(quiet_watch, steps: int, kill_at: int | None = None):
    torch.manual_seed(0)
    blocks = [_DroppedBlock(32, 0.2), _DroppedBlock(32, 0.5)]
    model = nn.Sequential(nn.Linear(16, 32), *blocks, nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    monitor = quiet_watch(model, opt)
    data = torch.randn(512, 16)
    labels = data[:, :4].argmax(1)
    for step in range(steps):
        if step == kill_at:
            blocks[1].scale = 0.0  # the branch multiplied by zero for good
        idx = torch.randint(0, 512, (32,))
        opt.zero_grad()
        F.cross_entropy(model(data[idx]), labels[idx]).backward()
        opt.step()
    monitor.close()
    return monitor


def test_stochastic_depth_dropping_a_whole_batchs_branch_is_silent(quiet_watch):
    monitor = _stochastic_depth_run(quiet_watch, 300)
    assert "zero_gradient" not in rules_of(monitor)


def test_a_branch_zeroed_for_good_after_training_is_still_reported(quiet_watch):
    monitor = _stochastic_depth_run(quiet_watch, 120, kill_at=40)
    found = [a for a in monitor.alerts if a.rule == "zero_gradient"]
    assert [(a.module, a.data["kind"]) for a in found] == [("2.fc", "zero")]
    assert 35 <= found[0].step <= 40  # the streak's first step (drops just before join it)


class _EarlyExit(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.exits = nn.ModuleList(nn.Linear(d, 4) for _ in range(3))

    def forward(self, x: torch.Tensor, depth: int = 3) -> list[torch.Tensor]:
        h, outs = self.inp(x), []
        for i in range(depth):
            h = h + F.gelu(self.blocks[i](h))
            outs.append(self.exits[i](h))
        return outs


def _early_exit_run(quiet_watch, depths: list[int]):
    torch.manual_seed(0)
    draw = random.Random(0)
    model = _EarlyExit()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    data = torch.randn(512, 16)
    labels = data[:, :4].argmax(1)
    for _ in range(100):
        idx = torch.randint(0, 512, (32,))
        opt.zero_grad()
        outs = model(data[idx], depth=draw.choice(depths))
        F.cross_entropy(outs[-1], labels[idx]).backward()  # the deepest exit run
        opt.step()
    monitor.close()
    return monitor


def test_an_exit_drawn_at_random_each_step_is_silent(quiet_watch):
    monitor = _early_exit_run(quiet_watch, [1, 2, 3])
    assert "zero_gradient" not in rules_of(monitor)


def test_an_exit_the_draw_never_picks_is_reported(quiet_watch):
    monitor = _early_exit_run(quiet_watch, [1, 3])  # off by one: depth 2 never drawn
    found = [a for a in monitor.alerts if a.rule == "zero_gradient"]
    assert [a.module for a in found] == ["exits.1"]
    assert found[0].step == 0


class _Tabular(nn.Module):
    """One embedding table per categorical column; missing values are index 0,
    the table's padding row. ``cut``: "times_zero" multiplies the sparse column's
    vectors by zero, "detached" detaches them (both planted, for good)."""

    def __init__(self, bag: bool = False, cut: str | None = None) -> None:
        super().__init__()
        self.dense = nn.Embedding(10, 4)
        table = nn.EmbeddingBag if bag else nn.Embedding
        kwargs = {"mode": "sum"} if bag else {}
        self.sparse = table(20, 4, padding_idx=0, **kwargs)
        self.out = nn.Linear(8, 1)
        self.cut = cut

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        sparse = (
            self.sparse(b[:, None]) if isinstance(self.sparse, nn.EmbeddingBag) else self.sparse(b)
        )
        if self.cut == "times_zero":
            sparse = sparse * 0
        elif self.cut == "detached":
            sparse = sparse.detach()
        return self.out(torch.cat([self.dense(a), sparse], 1)).squeeze(1)


def _sparse_column_batch(step: int, present_from: int) -> tuple[torch.Tensor, ...]:
    """A column 98% missing; the first ``present_from`` batches hold no value of it."""
    a = torch.randint(0, 10, (64,))
    b = torch.zeros(64, dtype=torch.long)
    if step >= present_from:
        b[:2] = torch.randint(1, 20, (2,))
    return a, b, torch.rand(64).round()


def _tabular_run(quiet_watch, bag: bool = False, cut: str | None = None, steps: int = 60):
    torch.manual_seed(0)
    model = _Tabular(bag, cut)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    monitor = quiet_watch(model, opt)
    for step in range(steps):
        a, b, y = _sparse_column_batch(step, present_from=3)
        loss = F.binary_cross_entropy_with_logits(model(a, b), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    return [(a.module, a.step, a.data["kind"]) for a in monitor.alerts if a.rule == "zero_gradient"]


@pytest.mark.parametrize("bag", [False, True], ids=["Embedding", "EmbeddingBag"])
def test_a_table_whose_first_batches_look_up_only_padding_is_silent(quiet_watch, bag):
    assert _tabular_run(quiet_watch, bag=bag) == []


def test_a_table_whose_vectors_are_multiplied_by_zero_is_still_told_later(quiet_watch):
    assert _tabular_run(quiet_watch, cut="times_zero") == [("sparse", 0, "zero")]
    assert _tabular_run(quiet_watch, cut="times_zero", steps=40) == []  # within its patience


def test_a_detached_table_is_still_told_after_the_usual_patience(quiet_watch):
    assert _tabular_run(quiet_watch, cut="detached", steps=5) == [("sparse", 0, "none")]


TABULAR_SCRIPT = """
import pytest
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
dense, sparse = nn.Embedding(10, 4), nn.Embedding(20, 4, padding_idx=0)
head = nn.Linear(8, 1)
model = nn.ModuleDict({"dense": dense, "sparse": sparse, "head": head})
opt = torch.optim.Adam(model.parameters(), 1e-2)
for step in range(30):
    a = torch.randint(0, 10, (64,))
    b = torch.zeros(64, dtype=torch.long)
    if step >= 3:  # the first batches hold no value of the sparse column
        b[:2] = torch.randint(1, 20, (2,))
    logit = head(torch.cat([dense(a), sparse(b)], 1)).squeeze(1)
    loss = F.binary_cross_entropy_with_logits(logit, torch.rand(64).round())
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_trainwatch_run_on_a_sparse_column_whose_first_batches_are_missing_is_silent(tmp_path):
    from trainwatch.runner import run_script

    script = tmp_path / "tabular.py"
    script.write_text(TABULAR_SCRIPT)
    assert run_script(script, log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    assert [a for a in map(json.loads, lines) if a["rule"] == "zero_gradient"] == []
