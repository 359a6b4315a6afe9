"""zero_gradient gives a layer not fed at the first steps the grace of one that
trained before, and still tells real bugs from the first step at the usual patience.

A Switch/GShard mixture of experts dispatching into capacity buffers gives an
expert the router sends no token an all-zero buffer and a zero combine weight:
its gradient is exactly zero (not None), and a freshly initialised router often
leaves one expert so for the first steps. Stochastic depth in torchvision's
``mode="batch"`` multiplies a whole branch by 0, by chance at steps 0, 1 and 2.
Both are a group of layers whose every gradient is zero while the model around
it learns, reached from the output past no activation of their own: silent.

Planted beside them, each told at step 0 within 3 steps: units dead from a large
negative bias (a group reached only through its ReLU), a rounded activation
without a straight-through estimator, LoRA's A and B both initialised to zero.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.conftest import rules_of

E, D = 8, 32


class SwitchFFN(nn.Module):
    """Top-1 routing into per-expert capacity buffers, dispatched and combined by einsum."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(
            [nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, D)) for _ in range(E)]
        )
        self.counts: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.gate(x).softmax(-1)
        mask = F.one_hot(gates.argmax(-1), E).float()
        cap = int(1.25 * x.shape[0] / E)
        pos = (mask.cumsum(0) - 1) * mask
        keep = (pos < cap).float() * mask
        slot = F.one_hot(pos.sum(-1).long().clamp(max=cap - 1), cap)
        dispatch = keep[:, :, None] * slot[:, None, :]
        combine = (gates * keep).sum(-1)[:, None, None] * dispatch
        exp_in = torch.einsum("sec,sd->ecd", dispatch, x)
        exp_out = torch.stack([f(exp_in[e]) for e, f in enumerate(self.experts)])
        self.counts = keep.sum(0).tolist()
        return torch.einsum("sec,ecd->sd", combine, exp_out)


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.norm = nn.Linear(8, D), nn.LayerNorm(D)
        self.moe, self.out = SwitchFFN(), nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h + self.moe(self.norm(h))).squeeze(-1)


def test_an_expert_given_no_token_from_the_first_step_is_silent(quiet_watch):
    torch.manual_seed(3)
    model = MoENet()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    monitor = quiet_watch(model, opt)
    empty = []
    for _ in range(40):
        x = torch.randn(16, 8)
        loss = F.mse_loss(model(x), torch.sin(2 * x[:, 0]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        empty.append({e for e, n in enumerate(model.moe.counts) if n == 0})
    assert 3 in empty[0] & empty[1] & empty[2]  # the case: expert 3 unfed from step 0
    assert rules_of(monitor) == []


class Block(nn.Module):
    """A residual MLP block whose branch stochastic depth drops for the whole batch
    (torchvision's ``StochasticDepth(p, mode="batch")``), by a draw handed in."""

    def __init__(self, d: int, act: type[nn.Module] = nn.GELU) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), act(), nn.Linear(4 * d, d)
        self.keep = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x))) * self.keep / 0.5


class Stack(nn.Module):
    def __init__(self, depth: int = 3, act: type[nn.Module] = nn.GELU) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList([Block(32, act) for _ in range(depth)])
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


# Block 1's branch dropped at steps 0, 1 and 2, then drawn (p = 0.5).
_DRAWS = [0, 0, 0, 1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0, 1] * 4


@pytest.mark.parametrize("act", [nn.GELU, nn.ReLU], ids=["gelu", "relu"])
def test_a_branch_stochastic_depth_drops_at_the_first_steps_is_silent(quiet_watch, act):
    torch.manual_seed(0)
    model = Stack(act=act)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for kept in _DRAWS:
        model.blocks[1].keep = float(kept)
        x = torch.randn(32, 16)
        loss = F.cross_entropy(model(x), x[:, :5].argmax(1))
        opt.zero_grad()
        loss.backward()
        assert (model.blocks[1].fc1.weight.grad.abs().sum() > 0) == bool(kept)
        opt.step()
    assert rules_of(monitor) == []


def test_a_branch_multiplied_by_zero_for_good_is_still_told_later(quiet_watch):
    torch.manual_seed(0)
    model = Stack()
    model.blocks[1].keep = 0.0  # the bug: the branch never contributes
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(60):
        x = torch.randn(32, 16)
        loss = F.cross_entropy(model(x), x[:, :5].argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    told = {a.module: a for a in monitor.alerts if a.rule == "zero_gradient"}
    assert set(told) == {"blocks.1.fc1", "blocks.1.fc2"}
    assert all(a.step == 0 and a.data["steps"] == 50 for a in told.values())


class DeadBlock(nn.Module):
    """A residual block whose branch is one layer and a ReLU, optionally dead."""

    def __init__(self, d: int, dead: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        if dead:
            nn.init.constant_(self.fc.bias, -1e3)  # every unit below zero, for good

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.fc(x))


class RoundedBlock(nn.Module):
    """A residual block whose branch is quantised to steps of 1/4, optionally with
    the straight-through estimator."""

    def __init__(self, d: int, ste: bool) -> None:
        super().__init__()
        self.fc, self.ste = nn.Linear(d, d), ste

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * 4
        h = h + (h.round() - h).detach() if self.ste else h.round()
        return x + h / 4


class LoRALinear(nn.Module):
    """A frozen Linear with a low-rank adapter beside it."""

    def __init__(self, d: int, both_zero: bool) -> None:
        super().__init__()
        self.base = nn.Linear(d, d).requires_grad_(False)
        self.lora_A = nn.Parameter(torch.zeros(4, d) if both_zero else torch.randn(4, d) * 0.1)
        self.lora_B = nn.Parameter(torch.zeros(d, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_A.t() @ self.lora_B.t()


def _planted(kind: str, bug: bool) -> nn.Module:
    if kind == "dead_relu_flat":
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))
        if bug:
            nn.init.constant_(model[0].bias, -1e3)
        return model
    blocks: list[nn.Module]
    if kind == "dead_relu_block":
        blocks = [DeadBlock(16, dead=bug and i == 1) for i in range(3)]
    elif kind == "round":
        blocks = [RoundedBlock(16, ste=not bug) for _ in range(2)]
    else:  # "lora"
        blocks = [nn.Linear(16, 16), nn.GELU(), LoRALinear(16, both_zero=bug)]
    return nn.Sequential(*blocks, nn.Linear(16, 5))


_TOLD = {
    "dead_relu_flat": {"0": None, "2": None},  # "2": its bias learns, its input is dead
    "dead_relu_block": {"1.fc": None},
    "round": {"0.fc": "zero_derivative_op", "1.fc": "zero_derivative_op"},
    "lora": {"2": "all_zero_partner"},  # reached past no activation: its partner tells
}


@pytest.mark.parametrize("kind", list(_TOLD))
def test_a_bug_from_the_first_step_is_told_at_step_0_within_the_usual_patience(quiet_watch, kind):
    torch.manual_seed(0)
    model = _planted(kind, bug=True)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(3):  # patience 3: told by the third step, or not at all
        x = torch.randn(32, 16)
        loss = F.cross_entropy(model(x), x[:, :5].argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    told = {a.module: a for a in monitor.alerts if a.rule == "zero_gradient"}
    assert {m: a.data.get("cause") for m, a in told.items()} == _TOLD[kind]
    assert all(a.step == 0 and a.severity == "warning" for a in told.values())


@pytest.mark.parametrize("kind", list(_TOLD))
def test_control_the_same_models_without_the_bug_are_silent(quiet_watch, kind):
    torch.manual_seed(0)
    model = _planted(kind, bug=False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(10):
        x = torch.randn(32, 16)
        loss = F.cross_entropy(model(x), x[:, :5].argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert rules_of(monitor) == []


STOCHDEPTH_SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(1)


    class Block(nn.Module):
        def __init__(self, d, p):
            super().__init__()
            self.fc1, self.fc2, self.p = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), p

        def forward(self, x):
            h = self.fc2(F.gelu(self.fc1(x)))
            if self.training:  # StochasticDepth(p, mode="batch")
                h = h * torch.empty(1, 1).bernoulli_(1 - self.p) / (1 - self.p)
            return x + h


    model = nn.Sequential(nn.Linear(16, 32), Block(32, 0.5), nn.Linear(32, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kept = []
    for step in range(30):
        x = torch.randn(32, 16)
        loss = F.cross_entropy(model(x), x[:, :5].argmax(1))
        opt.zero_grad()
        loss.backward()
        kept.append(int(model[1].fc1.weight.grad.abs().sum() > 0))
        opt.step()
    assert kept[:3] == [0, 0, 0], kept  # the case: dropped at steps 0, 1 and 2
    """
)


def test_trainwatch_run_on_a_branch_dropped_at_the_first_steps_is_silent(tmp_path):
    from trainwatch.runner import run_script

    script = tmp_path / "stochdepth.py"
    script.write_text(STOCHDEPTH_SCRIPT)
    assert run_script(script, log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    assert [a for a in map(json.loads, lines) if a["severity"] != "info"] == []


def test_lightning_expert_given_no_token_from_the_first_step_is_silent(tmp_path):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from tests.lightning_models import quiet_trainer
    from trainwatch.lightning import TrainWatchCallback

    class Switch(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = MoENet()
            self.empty: list[set[int]] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.empty.append({e for e, n in enumerate(self.net.moe.counts) if n == 0})
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=2e-3)

    torch.manual_seed(3)
    module = Switch()
    x = torch.randn(320, 8)
    data = DataLoader(TensorDataset(x, torch.sin(2 * x[:, 0])), batch_size=16)
    callback = TrainWatchCallback(console=False)
    quiet_trainer(tmp_path, [callback], max_epochs=1).fit(module, data)
    assert module.empty[0] & module.empty[1] & module.empty[2]  # the case
    assert [a for a in callback.alerts if a.severity != "info"] == []
