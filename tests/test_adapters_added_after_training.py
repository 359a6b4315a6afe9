"""Adapters put into a model after it trained, its blocks under activation checkpointing.

A model pre-trained for some steps, then frozen with low-rank adapters wrapped
around its layers and a new optimizer over them: the layer map is refreshed
mid-run. Under a reentrant checkpoint whose input does not require grad (a
frozen embedding before it), the adapters run with gradients off and get no
gradient: told with that cause, not as layers never called (the layer an
adapter wraps was seen called before, under the same name, but the adapter was
not there then). An adapter made and handed to the optimizer but never wired
into forward is still told as never called.
"""

from __future__ import annotations

import pytest
import torch

import trainwatch as tw
from tests.test_run import alerts as run_alerts
from trainwatch.runner import run_script

# Under the reentrant checkpoint with a frozen embedding torch itself warns.
pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")

MODEL = """
import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class LoRA(nn.Module):
    def __init__(self, base, r=2):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.q = nn.Linear(16, 16)
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(torch.tanh(self.q(self.norm(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 20)
        self.reentrant = None  # None: no checkpoint

    def forward(self, idx):
        h = self.emb(idx)
        for block in self.blocks:
            if self.reentrant is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def add_adapters(model, ckpt, unwired=False):
    \"\"\"Freeze the model, wrap each block's q in an adapter, checkpoint the blocks.\"\"\"
    model.requires_grad_(False)
    for block in model.blocks:
        block.q = LoRA(block.q)
        if unwired:
            block.adapter = nn.Linear(16, 16)  # made, optimized, never called
    model.head.requires_grad_(True)  # trained fully beside the adapters
    model.reentrant = ckpt != "non_reentrant"
    if ckpt == "reentrant_input_requires_grad":
        model.emb.register_forward_hook(lambda m, i, out: out.requires_grad_(True))
    return [p for p in model.parameters() if p.requires_grad]


def batch(data):
    rows = data[torch.randint(0, 64, (8,))]
    return rows[:, :-1], rows[:, 1:]


def loss_of(model, data):
    x, y = batch(data)
    return nn.functional.cross_entropy(model(x).reshape(-1, 20), y.reshape(-1))
"""

SCRIPT = (
    MODEL
    + """

import sys

ckpt = sys.argv[1]
torch.manual_seed(0)
data = torch.randint(0, 20, (64, 9))
model = LM()
opt = torch.optim.Adam(model.parameters(), 1e-3)
for _ in range(8):  # pre-training
    loss = loss_of(model, data)
    opt.zero_grad()
    loss.backward()
    opt.step()
opt = torch.optim.AdamW(add_adapters(model, ckpt, "unwired" in sys.argv), 1e-3)
for _ in range(8):  # the adapters' fine-tuning
    loss = loss_of(model, data)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
)

_names: dict = {}
exec(compile(MODEL, "<adapters model>", "exec"), _names)

_ADAPTERS = sorted(f"blocks.{i}.q.lora_{ab}" for i in range(2) for ab in "AB")
_UNWIRED = [f"blocks.{i}.adapter" for i in range(2)]


def _watched(ckpt: str, unwired: bool = False) -> list:
    """Pre-training and fine-tuning under one tw.watch; the alerts past notes."""
    torch.manual_seed(0)
    data = torch.randint(0, 20, (64, 9))
    model = _names["LM"]()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(8):
            loss = _names["loss_of"](model, data)
            opt.zero_grad()
            loss.backward()
            opt.step()
        opt = torch.optim.AdamW(_names["add_adapters"](model, ckpt, unwired), 1e-3)
        monitor.add_optimizer(opt)
        for _ in range(8):
            loss = _names["loss_of"](model, data)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return [
        (a.module, a.step, a.data["kind"], a.data.get("cause"))
        for a in monitor.alerts
        if a.severity != "info"
    ]


def _run(tmp_path, *args: str) -> list:
    script = tmp_path / "lora_ckpt.py"
    script.write_text(SCRIPT)
    assert run_script(script, list(args), log_dir=tmp_path / "log", console=False) == 0
    return [
        (a["module"], a["step"], a["data"]["kind"], a["data"].get("cause"))
        for a in run_alerts(tmp_path / "log")
        if a["severity"] != "info"
    ]


def _gradients_off(step: int) -> list:
    return [(name, step, "none", "gradients_off") for name in _ADAPTERS]


def _never_called(step: int) -> list:
    return [(name, step, "never_called", None) for name in _UNWIRED]


def test_adapters_added_after_training_under_a_reentrant_checkpoint_are_told_gradients_off():
    assert sorted(_watched("reentrant")) == _gradients_off(8)


def test_adapters_added_mid_run_and_never_called_are_still_told_never_called():
    assert sorted(_watched("non_reentrant", unwired=True)) == _never_called(8)


def test_adapters_added_mid_run_tell_both_stories_side_by_side():
    assert sorted(_watched("reentrant", unwired=True)) == sorted(
        _gradients_off(8) + _never_called(8)
    )


@pytest.mark.parametrize("ckpt", ["non_reentrant", "reentrant_input_requires_grad"])
def test_control_adapters_added_after_training_whose_gradients_flow_are_silent(ckpt):
    assert _watched(ckpt) == []


def test_trainwatch_run_tells_late_adapters_under_a_reentrant_checkpoint_gradients_off(
    tmp_path,
):
    assert sorted(_run(tmp_path, "reentrant")) == _gradients_off(8)


def test_trainwatch_run_tells_a_late_adapter_never_wired_in_as_never_called(tmp_path):
    assert sorted(_run(tmp_path, "non_reentrant", "unwired")) == _never_called(8)


@pytest.mark.parametrize("ckpt", ["non_reentrant", "reentrant_input_requires_grad"])
def test_control_trainwatch_run_late_adapters_whose_gradients_flow_are_silent(tmp_path, ckpt):
    assert _run(tmp_path, ckpt) == []
