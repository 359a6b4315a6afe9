"""A broadcast in a loss the model computes in its own ``forward`` from labels it is given.

Hugging Face models compute their loss in ``forward`` when ``labels`` are
passed; a hand-made model may do the same. The audit follows the labels
through the pass and judges the op that pairs them with a prediction.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import trainwatch as tw


class LossInForward(nn.Module):
    """An MLP regressor that returns its own MSE; ``squeeze`` fixes the shapes."""

    def __init__(self, squeeze: bool) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.squeeze = squeeze

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        prediction = self.head(torch.tanh(self.body(x)))  # (N, 1)
        if self.squeeze:
            prediction = prediction.squeeze(-1)
        return ((prediction - labels.float()) ** 2).mean()


class TinyEncoderRegressor(nn.Module):
    """A transformer encoder with a regression head, ``F.mse_loss`` inside ``forward``."""

    def __init__(self, squeeze: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1)
        self.head = nn.Linear(16, 1)
        self.squeeze = squeeze

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.head(self.encoder(self.embed(ids)).mean(dim=1))  # (N, 1)
        if targets is None:
            return logits
        if self.squeeze:
            logits = logits.view(-1)
        return nn.functional.mse_loss(logits, targets.view(-1))


def _train(model: nn.Module, batches, steps: int = 4) -> list[tuple[str, int]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, optimizer, console=io.StringIO()) as monitor:
        for step in range(steps):
            args, kwargs = batches(step)
            optimizer.zero_grad()
            model(*args, **kwargs).backward()
            optimizer.step()
    return [(a.rule, a.step) for a in monitor.alerts if a.severity != "info"]


def _mlp_batch(by_keyword: bool):
    def make(step: int):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(8, 8, generator=gen)
        return ((x,), {"labels": x[:, 0]}) if by_keyword else ((x, x[:, 0]), {})

    return make


def _encoder_batch(step: int):
    gen = torch.Generator().manual_seed(step)
    return (torch.randint(0, 32, (8, 6), generator=gen),), {"targets": torch.randn(8, 1)}


@pytest.mark.parametrize("by_keyword", [True, False])
def test_mlp_loss_in_forward_pairing_n_by_1_with_n_labels_is_caught(by_keyword):
    torch.manual_seed(0)
    assert _train(LossInForward(squeeze=False), _mlp_batch(by_keyword)) == [("broadcast", 0)]


@pytest.mark.parametrize("by_keyword", [True, False])
def test_mlp_loss_in_forward_with_matching_shapes_is_silent(by_keyword):
    torch.manual_seed(0)
    assert _train(LossInForward(squeeze=True), _mlp_batch(by_keyword)) == []


def test_encoder_loss_in_forward_with_flattened_targets_is_caught():
    torch.manual_seed(0)
    assert _train(TinyEncoderRegressor(squeeze=False), _encoder_batch) == [("broadcast", 0)]


def test_encoder_loss_in_forward_flattening_both_sides_is_silent():
    torch.manual_seed(0)
    assert _train(TinyEncoderRegressor(squeeze=True), _encoder_batch) == []


def test_the_alert_names_the_op_shapes_and_the_line_inside_forward():
    torch.manual_seed(0)
    model = LossInForward(squeeze=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, optimizer, console=io.StringIO()) as monitor:
        x = torch.randn(8, 8)
        model(x, labels=x[:, 0]).backward()
        optimizer.step()
    (alert,) = monitor.alerts
    assert alert.data["shapes"] == [[8, 1], [8]]
    assert "test_broadcast_in_a_loss_computed_in_forward.py" in alert.message
