"""A softmax over a fully masked row: its inputs held -inf, not "finite inputs".

An attention module turns a boolean padding mask into -inf scores itself; a
row where every position is padding makes the softmax return NaN. The
module's own inputs are finite, but the op's are not: the message says the
op read -inf (a mask), never that it made the NaN "from finite inputs". A
NaN made from truly finite inputs (the log of a negative) keeps that wording.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainwatch as tw

L = pytest.importorskip("lightning")
from trainwatch.lightning import TrainWatchCallback  # noqa: E402

D, T = 16, 6


def _first(alerts):
    return next(a for a in alerts if a.rule.startswith("nonfinite"))


def _padding(batch: int, step: int, bad_step: int | None) -> torch.Tensor:
    """Trailing padding per row; at ``bad_step`` row 1 is padding throughout."""
    pad = torch.zeros(batch, T, dtype=torch.bool)
    pad[:, T - 2 :] = True
    if step == bad_step:
        pad[1] = True
    return pad


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x, key_padding_mask=pad)[0])


class MaskedScores(nn.Module):
    """Hand-written attention: the -inf comes from ``masked_fill`` inside the module."""

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        scores = x @ x.transpose(1, 2) / D**0.5
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        return scores.softmax(-1) @ x


class HandAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.scores = MaskedScores()
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.head(self.scores(self.proj(x), pad))


def _plain_loop(model: nn.Module, bad_step: int | None) -> list:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(4):
            opt.zero_grad()
            model(torch.randn(4, T, D), _padding(4, step, bad_step)).sum().backward()
            opt.step()
    return monitor.alerts


@pytest.mark.parametrize(
    ("make", "module"), [(Encoder, "attn"), (HandAttention, "scores")], ids=["mha", "hand"]
)
def test_fully_masked_row_in_a_plain_loop(make, module):
    torch.manual_seed(0)
    first = _first(_plain_loop(make(), bad_step=2))
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 2, module)
    assert "_softmax" in first.data["op"]
    assert "from inputs holding -inf (a mask made inside the module" in first.message
    assert "finite inputs" not in first.message
    assert first.data["op_inputs_masked"] is True
    assert "entirely -inf" in first.hint


@pytest.mark.parametrize("make", [Encoder, HandAttention], ids=["mha", "hand"])
def test_partly_masked_rows_stay_silent(make):
    torch.manual_seed(0)
    assert not [a for a in _plain_loop(make(), bad_step=None) if a.rule.startswith("nonfinite")]


class NegativeLog(nn.Module):
    """A log of values that go negative at one step: NaN from finite inputs."""

    bad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x - 10.0 if self.bad else x.abs() + 1.0)


def test_nan_from_finite_inputs_keeps_its_wording():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), NegativeLog(), nn.Linear(D, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(4):
            model[1].bad = step == 2
            opt.zero_grad()
            model(torch.randn(8, D)).sum().backward()
            opt.step()
    first = _first(monitor.alerts)
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 2, "1")
    assert "made by aten::log" in first.message
    assert "from finite inputs in [" in first.message
    assert "holding -inf" not in first.message
    assert "op_inputs_masked" not in first.data


class Tokens(torch.utils.data.Dataset):
    """Padded token rows; with ``empty``, record 9 was filtered down to nothing."""

    def __init__(self, empty: bool) -> None:
        g = torch.Generator().manual_seed(1)
        self.rows = []
        for i in range(16):
            n = 0 if empty and i == 9 else int(torch.randint(1, T + 1, (1,), generator=g))
            row = torch.zeros(T, dtype=torch.long)
            row[:n] = torch.randint(1, 20, (n,), generator=g)
            self.rows.append(row)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i]


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(20, D, padding_idx=0)
        self.encoder = Encoder()

    def training_step(self, batch, i):
        return self.encoder(self.tok(batch), batch == 0).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("empty", [True, False])
def test_empty_sequence_under_lightning(tmp_path, empty):
    L.seed_everything(0, verbose=False)
    callback = TrainWatchCallback(log_dir=str(tmp_path), console=False)
    trainer = L.Trainer(
        max_steps=4,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=str(tmp_path),
    )
    loader = torch.utils.data.DataLoader(Tokens(empty), batch_size=4)
    trainer.fit(Classifier(), loader)
    alerts = [a for a in callback.alerts if a.rule.startswith("nonfinite")]
    if not empty:
        assert not alerts
        return
    first = alerts[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 2, "encoder.attn")
    assert "from inputs holding -inf (a mask made inside the module" in first.message
    assert "finite inputs" not in first.message
