"""Mode checks name the first module that behaves differently, in the order the model calls them.

Registration order (``named_modules()``) is not call order: a positional
encoding defined after the encoder runs before it; an input batch norm added
last in ``__init__`` runs first; a stack may run its blocks in reverse.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from tests.conftest import rules_of
from trainwatch.runner import run_script


class PositionalEncoding(nn.Module):
    def __init__(self, width: int, dropout: float = 0.1, length: int = 64) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        position = torch.arange(length)[:, None]
        scale = torch.exp(torch.arange(0, width, 2) * (-math.log(10000.0) / width))
        table = torch.zeros(length, width)
        table[:, 0::2] = torch.sin(position * scale)
        table[:, 1::2] = torch.cos(position * scale)
        self.register_buffer("table", table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x + self.table[: x.shape[1]])


class SequenceModel(nn.Module):
    """The encoder is registered before the positional encoding that feeds it."""

    def __init__(self, vocab: int = 20, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 2, 32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.pos = PositionalEncoding(width)
        self.head = nn.Linear(width, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.pos(self.embed(tokens))).mean(dim=1))


class InputNormCNN(nn.Module):
    """The input's batch norm is added last in ``__init__`` and called first."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(8, 1)
        self.input_norm = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(self.input_norm(x))))
        return self.head(self.drop(h.mean(dim=(2, 3))))


class ReversedStack(nn.Module):
    """Blocks held in a list and run from the last to the first."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.2)) for _ in range(3)
        )
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks):
            x = torch.relu(block(x))
        return self.head(x)


def _sequences(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        tokens = torch.randint(0, 20, (4, 8), generator=gen)
        yield tokens, tokens.float().mean(dim=1, keepdim=True) / 20


def _images(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(4, 3, 6, 6, generator=gen)
        yield x, x.mean(dim=(1, 2, 3))[:, None]


def _vectors(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(16, 8, generator=gen)
        yield x, x[:, :1].sin()


# model, its data, the first mode-dependent module it calls
CASES = {
    "transformer": (SequenceModel, _sequences, "pos.dropout"),
    "cnn": (InputNormCNN, _images, "input_norm"),
    "reversed_stack": (ReversedStack, _vectors, "blocks.2.1"),
}


def _setup(quiet_watch, case: str):
    build, data, first = CASES[case]
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, data, first, quiet_watch(model, opt)


def _train(model, opt, data, steps: int, seed: int = 0) -> None:
    for x, y in data(steps, seed):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _evaluate(model, data, passes: int = 3) -> None:
    with torch.no_grad():
        for x, _ in data(passes, seed=7):
            model(x)


def test_transformer_evaluated_in_train_mode_is_reported_at_the_positional_dropout(quiet_watch):
    model, opt, data, _, monitor = _setup(quiet_watch, "transformer")
    _train(model, opt, data, 2)
    _evaluate(model, data)  # model.eval() forgotten
    (alert,) = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert (alert.step, alert.module) == (2, "pos.dropout")
    assert alert.data["modules"][:2] == ["pos.dropout", "encoder.layers.0.self_attn"]


def test_cnn_evaluated_in_train_mode_is_reported_at_the_input_norm_called_first(quiet_watch):
    model, opt, data, _, monitor = _setup(quiet_watch, "cnn")
    _train(model, opt, data, 2)
    _evaluate(model, data)
    (alert,) = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert (alert.step, alert.module) == (2, "input_norm")
    assert alert.data["modules"] == ["input_norm", "bn", "drop"]


def test_stack_run_in_reverse_is_reported_at_the_block_run_first(quiet_watch):
    model, opt, data, _, monitor = _setup(quiet_watch, "reversed_stack")
    _train(model, opt, data, 2)
    _evaluate(model, data)
    (alert,) = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert alert.module == "blocks.2.1"
    assert alert.data["modules"][:3] == ["blocks.2.1", "blocks.2.2", "blocks.1.1"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_training_left_in_eval_mode_names_the_module_called_first(quiet_watch, case):
    model, opt, data, first, monitor = _setup(quiet_watch, case)
    _train(model, opt, data, 2)
    model.eval()
    _evaluate(model, data)
    _train(model, opt, data, 2, seed=1)  # model.train() forgotten
    (alert,) = [a for a in monitor.alerts if a.rule == "train_in_eval_mode"]
    assert (alert.step, alert.module) == (2, first)


@pytest.mark.parametrize("case", sorted(CASES))
def test_evaluation_done_right_is_silent(quiet_watch, case):
    model, opt, data, _, monitor = _setup(quiet_watch, case)
    _train(model, opt, data, 2)
    model.eval()
    _evaluate(model, data)
    model.train()
    _train(model, opt, data, 2, seed=1)
    assert rules_of(monitor, ("info", "warning", "error")) == []


def test_call_order_is_learned_again_when_a_module_is_added_in_front(quiet_watch):
    model, opt, data, _, monitor = _setup(quiet_watch, "cnn")
    _train(model, opt, data, 1)
    inner = model.input_norm
    model.input_norm = nn.Sequential(nn.Dropout(0.1), inner)  # a new first step
    _train(model, opt, data, 1, seed=1)
    _evaluate(model, data)
    (alert,) = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert alert.module == "input_norm.0"
    assert alert.data["modules"][:2] == ["input_norm.0", "input_norm.1"]


def test_learning_the_order_leaves_no_hook_behind(quiet_watch):
    model, opt, data, _, monitor = _setup(quiet_watch, "transformer")
    _train(model, opt, data, 2)
    monitor.close()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules()), (
        "a hook stayed on the model"
    )


TRANSFORMER_SCRIPT = """
import math
import sys
import torch
from torch import nn


class PositionalEncoding(nn.Module):
    def __init__(self, width, length=32):
        super().__init__()
        self.dropout = nn.Dropout(0.1)
        position = torch.arange(length)[:, None]
        scale = torch.exp(torch.arange(0, width, 2) * (-math.log(10000.0) / width))
        table = torch.zeros(length, width)
        table[:, 0::2] = torch.sin(position * scale)
        table[:, 1::2] = torch.cos(position * scale)
        self.register_buffer("table", table)

    def forward(self, x):
        return self.dropout(x + self.table[: x.shape[1]])


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(30, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.pos_encoder = PositionalEncoding(16)
        self.classify = nn.Linear(16, 3)

    def forward(self, tokens):
        return self.classify(self.encoder(self.pos_encoder(self.embed(tokens))).mean(dim=1))


torch.manual_seed(0)
model = Classifier()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    tokens = torch.randint(0, 30, (4, 10))
    opt.zero_grad()
    nn.functional.cross_entropy(model(tokens), tokens[:, 0] % 3).backward()
    opt.step()
if sys.argv[1] == "eval":
    model.eval()
with torch.no_grad():
    held_out = torch.randint(0, 30, (3, 4, 10))
    accuracy = sum((model(t).argmax(-1) == t[:, 0] % 3).float().mean() for t in held_out)
print("accuracy", float(accuracy) / 3)
"""


@pytest.mark.parametrize("mode", ["forgotten", "eval"])
def test_trainwatch_run_names_the_positional_dropout_of_an_unmodified_script(tmp_path, mode):
    script = tmp_path / "classify.py"
    script.write_text(TRANSFORMER_SCRIPT)
    assert run_script(script, [mode], log_dir=tmp_path / "log") == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [(a["rule"], a["step"], a["module"]) for a in map(json.loads, lines)]
    if mode == "forgotten":
        assert found == [("eval_in_train_mode", 3, "pos_encoder.dropout")]
    else:
        assert found == []
