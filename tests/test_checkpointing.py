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


# -- blocks run with gradients off inside the training pass ------------------------------


class _AttentionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)  # reads out_proj's weights
        self.fc = nn.Linear(16, 16)
        self.no_grad = False  # planted: the block's branches under torch.no_grad()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.no_grad):
            h = self.norm(x)
            a = self.attn(h, h, h, need_weights=False)[0]
            f = torch.relu(self.fc(x + a))
        return x + a + f  # the residual stream keeps its gradient


class _EmbeddedStack(nn.Module):
    """An embedding, then two blocks, each checkpointed (or not), then a head."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.blocks = nn.ModuleList(_AttentionBlock() for _ in range(2))
        self.head = nn.Linear(16, 20)
        self.reentrant = reentrant  # None: no checkpoint

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            if self.reentrant is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def _train_embedded(variant: str) -> list:
    torch.manual_seed(0)
    reentrant = None if variant == "no_grad_block" else variant.startswith("reentrant")
    model = _EmbeddedStack(reentrant)
    if variant != "reentrant_input_requires_grad":
        model.emb.weight.requires_grad_(False)  # a frozen pretrained embedding
    if variant == "no_grad_block":
        model.blocks[1].no_grad = True
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], 1e-3)
    data = torch.randint(0, 20, (64, 9))
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(25):
            batch = data[torch.randint(0, 64, (8,))]
            logits = model(batch[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 20), batch[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 10 == 9:
                with torch.no_grad():  # an evaluation: no call of the training pass
                    model(data[:4, :-1])
    return [a for a in monitor.alerts if a.severity != "info"]


_BLOCK_LAYERS = ["norm", "attn", "attn.out_proj", "fc"]


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_blocks_under_a_reentrant_checkpoint_after_a_frozen_embedding_are_told_with_the_cause():
    """A reentrant checkpoint whose input does not require grad runs its block under
    no_grad and never again in backward: the block ran, so it is told after the usual
    patience, not given extra steps as a layer not run yet, and the hint names the cause."""
    alerts = _train_embedded("reentrant_frozen_embedding")
    assert sorted(a.module for a in alerts) == sorted(
        f"blocks.{i}.{layer}" for i in range(2) for layer in _BLOCK_LAYERS
    )
    for alert in alerts:
        assert (alert.rule, alert.step, alert.data["steps"]) == ("zero_gradient", 0, 3)
        assert (alert.data["kind"], alert.data["cause"]) == ("none", "gradients_off")
        assert "use_reentrant=False" in alert.hint and "with gradients off" in alert.message


def test_a_block_under_no_grad_inside_forward_is_told_with_the_same_cause():
    alerts = _train_embedded("no_grad_block")
    assert sorted(a.module for a in alerts) == sorted(f"blocks.1.{n}" for n in _BLOCK_LAYERS)
    for alert in alerts:
        assert (alert.step, alert.data["steps"], alert.data["cause"]) == (0, 3, "gradients_off")


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
@pytest.mark.parametrize(
    "variant", ["non_reentrant_frozen_embedding", "reentrant_input_requires_grad"]
)
def test_control_checkpointed_blocks_whose_gradients_flow_are_silent(variant):
    assert _train_embedded(variant) == []


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_control_a_checkpointed_block_cut_by_a_detach_names_no_gradients_off_cause(reentrant):
    torch.manual_seed(0)
    model = _CheckpointedStack(reentrant)
    model.blocks[1].cut = True
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(10):
            x = torch.randn(32, 8)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1]).backward()
            opt.step()
    (alert,) = monitor.alerts
    assert (alert.module, alert.data["kind"], alert.data["steps"]) == ("blocks.1.fc", "none", 3)
    assert "cause" not in alert.data and "detach" in alert.hint
