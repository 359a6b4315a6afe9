"""What trainwatch writes as JSON is strict JSON, a non-finite loss's alert included.

The alerts that matter most carry a NaN or an Inf (``data.loss``). Python's
``json`` writes ``NaN``/``Infinity``, which ``jq``, ``JSON.parse``, Go and
serde reject: the line with the finding would break the tooling reading it.
They are written as the strings ``"nan"``, ``"inf"``, ``"-inf"``, and
``trainwatch report`` reads them back as before.

And the alert's ``data`` agrees with its message: ``kind`` and ``loss`` are the
loss's own (``inf`` for a CTC target its input cannot align to), while what
the gradient entering the model was (the NaN an inf loss sends back) keeps
``entering_`` names.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import trainwatch as tw
from tests.lightning_models import BoringNet, quiet_trainer
from trainwatch.cli import main
from trainwatch.lightning import TrainWatchCallback


def _no_constants(token: str) -> float:
    raise ValueError(f"not strict JSON: {token}")


def _strict(text: str) -> object:
    """What ``jq`` / ``JSON.parse`` would read: no NaN, Infinity or -Infinity tokens."""
    return json.loads(text, parse_constant=_no_constants)


def _strict_lines(log_dir: Path) -> list[dict]:
    path = log_dir / "alerts.jsonl"
    if not path.exists():
        return []
    return [_strict(line) for line in path.read_text().splitlines() if line.strip()]


def _every_json_file_is_strict(log_dir: Path) -> None:
    _strict_lines(log_dir)
    for name in ("alert_counts.json", "setup.json"):
        if (log_dir / name).exists():
            _strict((log_dir / name).read_text())


def _ctc_step(impossible: bool) -> Callable[[nn.Module], torch.Tensor]:
    """CTC with zero_infinity=False: 10 labels cannot align to 4 frames (loss +inf)."""
    ctc = nn.CTCLoss(zero_infinity=False)
    targets = torch.randint(1, 10, (2, 10))
    lengths = torch.tensor([10, 3]) if impossible else torch.tensor([2, 3])

    def loss_of(model: nn.Module) -> torch.Tensor:
        logp = model(torch.randn(4, 2, 8)).log_softmax(-1)  # (T, N, C)
        return ctc(logp, targets, torch.tensor([4, 4]), lengths)

    return loss_of


def _log_of_zero_step(zero: bool) -> Callable[[nn.Module], torch.Tensor]:
    """A hand-written log-likelihood of a softmax probability that underflowed to 0:
    the loss is -inf, the gradient it sends back NaN (0 * inf in softmax's backward)."""

    def loss_of(model: nn.Module) -> torch.Tensor:
        logits = model(torch.randn(16, 8)) * (1e4 if zero else 1.0)
        return torch.log(torch.softmax(logits, -1)[:, 0]).mean()

    return loss_of


def _log_of_relu_step(zero: bool) -> Callable[[nn.Module], torch.Tensor]:
    """The log of a ReLU'd output: -inf where it is 0, its gradient kept finite by
    the ReLU's mask; seen in the loss handed over only."""

    def loss_of(model: nn.Module) -> torch.Tensor:
        out = model(torch.randn(16, 8))
        return torch.log(torch.relu(out) + (0.0 if zero else 1.0)).sum()

    return loss_of


def _empty_mask_mean_step(empty: bool) -> Callable[[nn.Module], torch.Tensor]:
    """A masked mean over an empty mask: 0 / 0, a NaN loss."""

    def loss_of(model: nn.Module) -> torch.Tensor:
        out = model(torch.randn(16, 8))
        mask = torch.zeros_like(out) if empty else torch.ones_like(out)
        return (out.pow(2) * mask).sum() / mask.sum()

    return loss_of


SHAPES = {
    "ctc": (_ctc_step, "inf"),
    "log_of_zero": (_log_of_zero_step, "-inf"),
    "log_of_relu": (_log_of_relu_step, "-inf"),
    "empty_mask_mean": (_empty_mask_mean_step, "nan"),
}


def _train(
    loss_of: Callable[[nn.Module], torch.Tensor], log_dir: Path, hand_over: bool
) -> tw.Monitor:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = tw.watch(model, opt, log_dir=log_dir, console=False)
    for _ in range(3):
        opt.zero_grad()
        loss = loss_of(model)
        loss.backward()
        opt.step()
        if hand_over:
            monitor.step(loss=loss)
    monitor.close()
    return monitor


# A -inf loss whose gradients stay finite (log_of_relu) is seen only handed over.
CASES = [(shape, True) for shape in SHAPES] + [
    (shape, False) for shape in SHAPES if shape != "log_of_relu"
]


@pytest.mark.parametrize(("shape", "hand_over"), CASES)
def test_a_nonfinite_loss_is_written_as_strict_json_and_reported(
    shape, hand_over, tmp_path, capsys
):
    make, kind = SHAPES[shape]
    monitor = _train(make(True), tmp_path, hand_over)
    _every_json_file_is_strict(tmp_path)
    lines = _strict_lines(tmp_path)
    first = lines[0]
    assert (first["rule"], first["step"], first["module"]) == ("nonfinite_loss", 0, None)
    # The loss's own value and kind, as the message tells them.
    assert first["data"]["loss"] == kind
    assert first["data"]["kind"] == kind
    assert f"({kind})" in first["message"]
    told = monitor.alerts[0]
    assert math.isnan(told.data["loss"]) if kind == "nan" else told.data["loss"] == float(kind)
    assert "count" not in first["data"] and "shape" not in first["data"]
    if shape == "log_of_relu":
        # Told from the loss's value: no gradient entered the model non-finite.
        assert first["data"]["cause"] == "value"
        assert not any(key.startswith("entering_") for key in first["data"])
    else:
        # The gradient it sent into the model: under names of its own.
        assert first["data"]["cause"] == "loss"
        assert first["data"]["entering_kind"] == "nan"
    if shape == "ctc":
        assert first["data"]["entering_count"] == 40
        assert first["data"]["entering_shape"] == [4, 2, 10]
        assert "zero_infinity" in first["hint"]
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "nonfinite_loss" in out and f"the loss is non-finite ({kind})" in out
    assert main(["report", str(tmp_path), "--json"]) == 0
    groups = _strict(capsys.readouterr().out)["groups"]
    assert groups[0]["rule"] == "nonfinite_loss" and f"({kind})" in groups[0]["message"]


@pytest.mark.parametrize("shape", ["ctc", "log_of_zero", "empty_mask_mean"])
def test_the_alert_data_is_the_losss_and_the_entering_gradient_is_named_so(shape, tmp_path):
    """``monitor.alerts``, whatever is written: ``kind`` is the loss's (inf for CTC,
    while the gradient it sent back is NaN), the gradient's facts are ``entering_``."""
    make, kind = SHAPES[shape]
    data = _train(make(True), tmp_path, hand_over=False).alerts[0].data
    assert data["kind"] == kind and data["entering_kind"] == "nan"
    assert {"count", "shape", "dtype"}.isdisjoint(data)
    assert {"entering_count", "entering_shape", "entering_dtype"} <= set(data)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_healthy_twin_writes_no_alert(shape, tmp_path):
    make, _ = SHAPES[shape]
    monitor = _train(make(False), tmp_path, hand_over=True)
    assert monitor.alerts == []
    assert _strict_lines(tmp_path) == []
    _every_json_file_is_strict(tmp_path)
    assert _strict((tmp_path / "alert_counts.json").read_text())["counts"] == []


def test_lines_a_second_model_rewrites_stay_strict(tmp_path):
    """A second model in the same dir names the first's lines: rewritten strict too."""
    _train(_empty_mask_mean_step(True), tmp_path, hand_over=True)
    _train(_empty_mask_mean_step(False), tmp_path, hand_over=True)
    lines = _strict_lines(tmp_path)
    assert [(line["data"]["loss"], line["data"]["model"]) for line in lines] == [
        ("nan", "Sequential")
    ]
    _every_json_file_is_strict(tmp_path)


class _MaskedMeanNet(BoringNet):
    """A LightningModule whose loss is a masked mean: an empty mask makes it 0 / 0."""

    def __init__(self, empty: bool) -> None:
        super().__init__()
        self.empty = empty

    def training_step(self, batch, batch_idx):
        x, y = batch
        error = (self(x) - y).pow(2)
        mask = torch.zeros_like(error) if self.empty else torch.ones_like(error)
        return (error * mask).sum() / mask.sum()


@pytest.mark.parametrize("empty", [True, False], ids=["nan_loss", "healthy"])
def test_a_lightning_fit_writes_strict_json(empty, tmp_path):
    torch.manual_seed(0)
    callback = TrainWatchCallback(log_dir=tmp_path, console=False)
    quiet_trainer(tmp_path, [callback], max_steps=3).fit(_MaskedMeanNet(empty))
    _every_json_file_is_strict(tmp_path)
    lines = _strict_lines(tmp_path)
    if not empty:
        assert lines == [] and callback.alerts == []
        return
    assert (lines[0]["rule"], lines[0]["step"]) == ("nonfinite_loss", 0)
    assert lines[0]["data"]["loss"] == lines[0]["data"]["kind"] == "nan"


def test_numbers_keep_their_type_and_only_nonfinite_ones_become_names():
    import numpy as np

    from trainwatch.strict_json import dumps

    written = dumps({"a": [np.float32("nan"), np.float64(-np.inf), np.float32(0.5), np.int64(3)]})
    assert _strict(written) == {"a": ["nan", "-inf", 0.5, 3]}
    assert [float(name) for name in _strict(written)["a"][:2]] == [
        pytest.approx(float("nan"), nan_ok=True),
        float("-inf"),
    ]
