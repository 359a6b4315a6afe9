"""zero_gradient on an nn.MultiheadAttention whose block is skipped by design.

MultiheadAttention reads ``out_proj``'s weight itself and never calls it, so
``out_proj`` is judged by whether the attention holding it ran: a block that
layer-drop skips, or a task head not drawn for the batch, leaves ``out_proj``
without a gradient as it does the attention's own weights (silent), while an
attention that runs and is cut off (its output detached) is still told, with
``out_proj``, from the step the cut began. Plain loops and ``trainwatch run``,
each beside its planted bug."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn

from trainwatch.runner import run_script


class AttentionBlock(nn.Module):
    """Pre-norm attention and MLP, the attention's output detached from step
    ``cut_from`` on (the planted bug; None: never)."""

    def __init__(self, d: int = 16, cut_from: int | None = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = nn.Linear(d, d)
        self.cut_from = cut_from
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        a = self.attn(h, h, h, need_weights=False)[0]
        if self.cut_from is not None and self.step >= self.cut_from:
            a = a.detach()
        x = x + a
        return x + self.mlp(x)


class LayerDropEncoder(nn.Module):
    """Three blocks, each skipped whole in training on the steps that ``skip`` names."""

    def __init__(self, blocks: list[nn.Module], residual: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(16, 1)
        self.residual = residual  # blocks that return their branch only
        self.skip: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for index, layer in enumerate(self.layers):
            if self.training and index in self.skip:
                continue  # layer-drop: the whole block is skipped
            h = h + layer(h) if self.residual else layer(h)
        return self.head(h.mean(1))


def _train(quiet_watch, model: LayerDropEncoder, skipped: dict[int, set[int]], steps: int = 30):
    torch.manual_seed(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for step in range(steps):
        model.skip = skipped.get(step, set())
        for layer in model.layers:
            layer.step = step
        x = torch.randn(8, 5, 8)
        loss = nn.functional.mse_loss(model(x), x[:, 0, :1])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {a.module: a.step for a in monitor.alerts if a.rule == "zero_gradient"}


# Layer 1 dropped three and four steps in a row.
_DROPPED = {step: {1} for step in (5, 6, 7, 12, 13, 14, 15)}


def test_layer_drop_of_a_transformer_encoder_layer_leaves_its_out_proj_silent(quiet_watch):
    torch.manual_seed(0)
    layers = [
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True) for _ in range(3)
    ]
    assert _train(quiet_watch, LayerDropEncoder(layers), _DROPPED) == {}


def test_layer_drop_of_a_block_holding_an_attention_is_silent(quiet_watch):
    torch.manual_seed(0)
    model = LayerDropEncoder([AttentionBlock() for _ in range(3)])
    assert _train(quiet_watch, model, _DROPPED) == {}


def test_an_attention_detached_in_a_block_layer_drop_skips_is_told_from_its_first_step(
    quiet_watch,
):
    """Cut at step 10, skipped at steps 12-15: the steps it ran cut are no skip."""
    torch.manual_seed(0)
    model = LayerDropEncoder([AttentionBlock(cut_from=10 if i == 1 else None) for i in range(3)])
    found = _train(quiet_watch, model, _DROPPED, steps=70)
    assert found == {"layers.1.norm": 10, "layers.1.attn": 10, "layers.1.attn.out_proj": 10}


def test_an_attention_detached_from_the_first_step_is_told_beside_a_dropped_block(quiet_watch):
    torch.manual_seed(0)
    model = LayerDropEncoder([AttentionBlock(cut_from=0 if i == 2 else None) for i in range(3)])
    found = _train(quiet_watch, model, _DROPPED)
    assert found == {"layers.2.norm": 0, "layers.2.attn": 0, "layers.2.attn.out_proj": 0}


@pytest.mark.parametrize("cut", [None, 2])
def test_layer_drop_of_plain_linear_blocks_is_unchanged(quiet_watch, cut):
    """No holder reads these weights: a dropped block is silent, a cut one told."""

    class Cut(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).detach()

    torch.manual_seed(0)
    blocks = [(Cut if i == cut else nn.Sequential)(nn.Linear(16, 16), nn.ReLU()) for i in range(3)]
    found = _train(quiet_watch, LayerDropEncoder(blocks, residual=True), _DROPPED)
    assert found == ({} if cut is None else {"layers.2.0": 0})


def test_random_layer_drop_of_transformer_encoder_layers_is_silent(quiet_watch):
    """Stochastic depth done by skipping whole layers, drawn at random per batch."""
    torch.manual_seed(0)
    layers = [
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True) for _ in range(3)
    ]
    model = LayerDropEncoder(layers)
    draws = torch.rand(80, 3, generator=torch.Generator().manual_seed(3))
    rates = torch.tensor([0.0, 0.3, 0.6])
    skipped = {step: {i for i in range(3) if draws[step, i] < rates[i]} for step in range(80)}
    run = longest = 0
    for step in range(80):
        run = run + 1 if 2 in skipped[step] else 0
        longest = max(longest, run)
    assert longest >= 3  # the shape: three drops in a row happened
    assert _train(quiet_watch, model, skipped, steps=80) == {}


MULTITASK_SCRIPT = """
import random
import sys

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
random.seed(0)
CUT = sys.argv[1] == "detach"


class AttentionPoolHead(nn.Module):
    def __init__(self, d, classes, cut):
        super().__init__()
        self.query = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.fc = nn.Linear(d, classes)
        self.cut = cut

    def forward(self, h):
        q = self.query.expand(h.shape[0], -1, -1)
        pooled = self.attn(q, h, h, need_weights=False)[0][:, 0]
        if self.cut:
            pooled = pooled.detach()  # planted: this task's attention pooling cut off
        return self.fc(pooled + h.mean(1))


class MultiTask(nn.Module):
    def __init__(self, d=32, tasks=(2, 3, 5)):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, d), nn.GELU(), nn.Linear(d, d))
        self.heads = nn.ModuleList(
            AttentionPoolHead(d, c, CUT and i == 1) for i, c in enumerate(tasks)
        )

    def forward(self, x, task):
        return self.heads[task](self.enc(x))


model = MultiTask()
opt = torch.optim.AdamW(model.parameters(), 1e-3)
classes = (2, 3, 5)
for step in range(80):
    task = random.randrange(3)  # one task drawn per batch
    x = torch.randn(16, 6, 8)
    y = (x[:, :, task].sum(1) > 0).long() % classes[task]
    loss = F.cross_entropy(model(x, task), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("mode", ["clean", "detach"])
def test_trainwatch_run_on_a_random_task_head_with_attention_pooling(tmp_path, mode):
    """A head not drawn for the batch is skipped, its attention's out_proj with it;
    the head whose pooled attention output is detached is told, out_proj included."""
    script = tmp_path / "multitask.py"
    script.write_text(textwrap.dedent(MULTITASK_SCRIPT))
    assert run_script(script, [mode], log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = {a["module"] for a in map(json.loads, lines) if a["rule"] == "zero_gradient"}
    cut = {"heads.1", "heads.1.attn", "heads.1.attn.out_proj"}  # its query, the attention
    assert found == (set() if mode == "clean" else cut)
