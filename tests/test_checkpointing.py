"""Gradient checkpointing re-runs forward hooks during backward: no double counting, no alarm."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import trainwatch as tw


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.drop(self.fc(x)))


class CheckpointedNet(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = Block()
        self.head = nn.Linear(16, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, self.inp(x), use_reentrant=self.reentrant)
        return self.head(h)


# The evaluation under no_grad makes torch itself warn about the reentrant kind.
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_training_with_evaluations_raises_nothing(reentrant):
    torch.manual_seed(0)
    model = CheckpointedNet(reentrant)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(40):
            x = torch.randn(32, 8, requires_grad=reentrant)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1].detach().sin()).backward()
            opt.step()
            if step % 10 == 9:
                model.eval()
                with torch.no_grad():
                    model(torch.randn(8, 8))
                model.train()
    assert monitor.step_count == 40
    assert monitor.alerts == []
    assert set(monitor.grad_norms()) == {"inp", "block.fc", "head"}


class Fault(nn.Module):
    """Armed at one step: a division by zero (forward) or sqrt at 0 (backward only)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return x
        if self.kind == "forward":
            return x / torch.zeros(())
        return x + torch.sqrt(x * 0.0)  # finite value, infinite derivative


class FaultyBlock(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.fault = Fault(kind)
        self.fc2 = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fault(torch.relu(self.fc(x))))


class CheckpointedFaultyNet(nn.Module):
    def __init__(self, kind: str, reentrant: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = FaultyBlock(kind)
        self.head = nn.Linear(16, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, self.inp(x), use_reentrant=self.reentrant))


def _train_with_fault(kind: str, reentrant: bool, check: str, fault_step: int | None):
    torch.manual_seed(0)
    model = CheckpointedFaultyNet(kind, reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False, nonfinite_forward={"check": check}) as monitor:
        for step in range(6):
            model.block.fault.armed = step == fault_step
            x = torch.randn(32, 8, requires_grad=reentrant)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1].detach()).backward()
            opt.step()
    return monitor


@pytest.mark.parametrize("check", ["auto", "step", "deferred"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_nan_inside_a_checkpointed_block_is_located_in_it(kind, reentrant, check):
    # The recomputation runs the block again inside backward: it is neither a
    # new pass nor a place to blame (its recomputed outputs are not in the
    # graph backward runs through, for the non-reentrant kind).
    monitor = _train_with_fault(kind, reentrant, check, fault_step=3)
    first = next(a for a in monitor.alerts if a.rule.startswith("nonfinite"))
    assert (first.rule, first.step, first.module, first.data["cause"]) == (
        f"nonfinite_{kind}",
        3,
        "block.fault",
        "module",
    )
    if check != "deferred":
        assert first.data["op"] == ("aten::div" if kind == "forward" else "aten::sqrt")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_unarmed_fault_in_a_checkpointed_block_stays_silent(reentrant):
    monitor = _train_with_fault("backward", reentrant, "auto", fault_step=None)
    assert monitor.alerts == []


# -- a checkpointed block cut off from the loss ------------------------------------------


class _ResidualBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.cut = False  # planted: the block's branch detached

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch = torch.relu(self.fc(x))
        return x + (branch.detach() if self.cut else branch)


class _CheckpointedStack(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(_ResidualBlock() for _ in range(3))
        self.head = nn.Linear(16, 1)
        self.reentrant = reentrant
        self.skipped: int | None = None  # a block stochastic depth drops this step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for index, block in enumerate(self.blocks):
            if index != self.skipped:
                h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def _train_stack(reentrant: bool, variant: str) -> list:
    torch.manual_seed(0)
    model = _CheckpointedStack(reentrant)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    draw = torch.Generator().manual_seed(1)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(40):
            if variant == "cut" and step == 10:
                model.blocks[1].cut = True
            if variant == "stochastic_depth":
                model.skipped = 1 if torch.rand((), generator=draw) < 0.5 else None
            x = torch.randn(32, 8)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1]).backward()
            opt.step()
    return [(a.rule, a.module, a.step) for a in monitor.alerts if a.severity != "info"]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_block_cut_off_by_a_detach_is_named_at_its_step(reentrant):
    """Reentrant checkpointing runs the block under no_grad in the pass: only its
    re-run inside backward shows that it ran, so it is no block skipped by design."""
    assert _train_stack(reentrant, "cut") == [("zero_gradient", "blocks.1.fc", 10)]


@pytest.mark.parametrize("variant", ["healthy", "stochastic_depth"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_blocks_trained_or_dropped_by_design_are_silent(reentrant, variant):
    assert _train_stack(reentrant, variant) == []
