"""zero_gradient on layers skipped by design (stochastic depth, mixture-of-experts
routing): a layer seen not running on its steps without a gradient is skipped,
not cut off; a layer that runs and still gets no gradient (a ``.detach()``) is
found. Plain loops, Lightning and ``trainwatch run``, each beside its planted bug."""

from __future__ import annotations

import json
import textwrap

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import train
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script


class LayerDrop(nn.Module):
    """Residual blocks each skipped at random in training (the last most often)."""

    def __init__(self, depth: int = 4, cut: int | None = None) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(depth)
        )
        self.head = nn.Linear(16, 1)
        self.drop = [0.5 * (i + 1) / depth for i in range(depth)]
        self.cut = cut  # a block whose output is detached (the planted bug)
        self.skips: list[list[int]] = []  # per training pass, the blocks skipped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        skipped = []
        for index, (block, p) in enumerate(zip(self.blocks, self.drop)):
            if index == self.cut:
                h = h + block(h).detach()  # runs every step, cut out of the graph
                continue
            if self.training and torch.rand(()) < p:
                skipped.append(index)
                continue
            h = h + block(h)
        if self.training and torch.is_grad_enabled():
            self.skips.append(skipped)
        return self.head(h)


def _longest_skip_run(skips: list[list[int]], block: int) -> int:
    longest = run = 0
    for skipped in skips:
        run = run + 1 if block in skipped else 0
        longest = max(longest, run)
    return longest


def _zero_gradient(alerts) -> dict[str, int]:
    return {a.module: a.step for a in alerts if a.rule == "zero_gradient"}


@pytest.mark.parametrize("cut", [None, 1])
def test_blocks_stochastic_depth_skips_are_silent_and_a_detached_block_is_found(quiet_watch, cut):
    torch.manual_seed(0)
    model = LayerDrop(cut=cut)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    train(model, opt, 80)
    assert _longest_skip_run(model.skips, 3) >= 3  # the shape: 3 skips in a row happened
    found = _zero_gradient(monitor.alerts)
    if cut is None:
        assert found == {}
    else:
        assert found == {"blocks.1.0": 0}


class LitLayerDrop(pl.LightningModule):
    def __init__(self, cut: int | None = None) -> None:
        super().__init__()
        self.net = LayerDrop(cut=cut)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("cut", [None, 2])
def test_lightning_stochastic_depth_with_validation_between_epochs(tmp_path, cut):
    """Validation runs every block under no_grad between epochs: those calls make
    no step's gradients and say nothing of a block skipped in training."""
    torch.manual_seed(0)
    x = torch.randn(640, 8)
    data = TensorDataset(x, x[:, :1].clone())
    model = LitLayerDrop(cut=cut)
    callback = TrainWatchCallback(console=False)
    trainer = pl.Trainer(
        max_epochs=4,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=tmp_path,
    )
    trainer.fit(model, DataLoader(data, batch_size=32, shuffle=True), DataLoader(data, 128))
    assert _longest_skip_run(model.net.skips, 3) >= 3
    found = _zero_gradient(callback.monitor.alerts)
    if cut is None:
        assert found == {}
    else:
        assert found == {"net.blocks.2.0": 0}


MOE_SCRIPT = """
import sys
import torch
from torch import nn

torch.manual_seed(0)


class MoE(nn.Module):
    \"\"\"Tokens routed by their kind (feature 0): the last expert takes only the rare
    kind, which appears in every fifth batch; on the others it gets no token.\"\"\"

    def __init__(self, experts=4):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(experts))
        self.gate = nn.Linear(8, 1)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        kind = x[:, 0].round().long().clamp(0, len(self.experts) - 1)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = (kind == index).nonzero().flatten()
            if len(rows) == 0:
                continue  # no token for this expert: it does not run
            y = expert(x[rows])
            if sys.argv[1] == "detach" and index == 0:
                y = y.detach()  # planted: expert 0 runs, cut out of the graph
            out = out.index_add(0, rows, y * torch.sigmoid(self.gate(x[rows])))
        return self.head(out)


model = MoE()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(40):
    x = torch.randn(32, 8)
    x[:, 0] = torch.randint(0, 3 if step % 5 else 4, (32,)).float()  # kind 3 every 5th
    opt.zero_grad()
    nn.functional.mse_loss(model(x), x[:, 1:2]).backward()
    opt.step()
"""


@pytest.mark.parametrize("mode", ["clean", "detach"])
def test_trainwatch_run_on_experts_given_no_token_names_only_a_detached_one(tmp_path, mode):
    script = tmp_path / "moe.py"
    script.write_text(textwrap.dedent(MOE_SCRIPT))
    assert run_script(script, [mode], log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = {a["module"] for a in map(json.loads, lines) if a["rule"] == "zero_gradient"}
    assert found == (set() if mode == "clean" else {"experts.0"})


def test_nothing_is_followed_on_a_model_whose_every_layer_gets_its_gradient(quiet_watch):
    """The usual model pays nothing for this: no layer followed, no global hook."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    train(model, opt, 10)
    step_calls = monitor._pipeline._step_calls
    assert not step_calls.following
    assert "step calls" not in monitor._pipeline.passes.listener_names()


def test_a_never_called_head_and_a_cut_layer_stop_being_followed(quiet_watch):
    """A head defined but never called is the call tracker's finding; a block seen
    running without a gradient for 3 steps is cut: neither is followed for good."""
    torch.manual_seed(0)
    model = LayerDrop(cut=1)
    model.unused_head = nn.Linear(16, 1)  # never called
    model.drop = [0.0] * len(model.drop)  # no block skipped
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    train(model, opt, 10)
    found = {a.module: a.data["kind"] for a in monitor.alerts if a.rule == "zero_gradient"}
    assert found == {"blocks.1.0": "none", "unused_head": "never_called"}
    assert not monitor._pipeline._step_calls.following


class _LateRoutedMoE(nn.Module):
    """Four two-layer experts; tokens routed by feature 0, except that the last
    expert gets none before step ``first`` (a router that starts collapsed and is
    balanced later; None: never)."""

    def __init__(self, first: int | None) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(4)
        )
        self.head = nn.Linear(8, 1)
        self.first = first
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        routed = self.first is not None and self.step >= self.first
        kind = x[:, 0].round().long().clamp(0, 3 if routed else 2)
        out = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            rows = (kind == index).nonzero().flatten()
            if len(rows):
                out = out.index_add(0, rows, expert(h[rows]))
        return self.head(out)


def _train_moe(quiet_watch, first: int | None, steps: int):
    torch.manual_seed(0)
    model = _LateRoutedMoE(first)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for step in range(steps):
        model.step = step
        x = torch.randn(32, 8)
        x[:, 0] = torch.randint(0, 4, (32,)).float()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x[:, 1:2]).backward()
        opt.step()
    return [a for a in monitor.alerts if a.severity != "info"]


def test_an_expert_first_given_tokens_at_step_20_is_silent(quiet_watch):
    assert _train_moe(quiet_watch, first=20, steps=60) == []


def test_an_expert_never_given_a_token_is_told_as_not_run_beside_its_siblings(quiet_watch):
    found = _train_moe(quiet_watch, first=None, steps=110)
    assert {(a.rule, a.module, a.data["kind"]) for a in found} == {
        ("zero_gradient", "experts.3.0", "not_run"),
        ("zero_gradient", "experts.3.2", "not_run"),
    }
    assert found[0].data["siblings_ran"] == ["experts.0", "experts.1", "experts.2"]
