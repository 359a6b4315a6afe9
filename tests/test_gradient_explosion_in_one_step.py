"""A gradient norm that jumps past any healthy step's jump in one step is told at
that step, warm-up or not, naming the layer that jumped most; and what the hint
advises depends on the model: a recurrent network, or one trained with a
classification loss, is told to clip its gradients with a small max_norm and to
lower the learning rate, a regression keeps the outlier and robust-loss advice.

Two shapes: a ReLU RNN language model (pytorch/examples' word_language_model, a
hand-written SGD update at lr 20, watched by ``trainwatch run``), whose norm goes
from about 0.1 to 1e8-1e18 in one step of its warm-up and whose weights overflow
at the next; and a plain MLP or CNN regression (or classifier) whose learning
rate is raised 1e5x, or whose batch holds a corrupt target. Each beside its
healthy twin: the same LM clipped to 0.25 (its norm before the clip goes from 0.1
to 1e18 in its first steps, the clip keeping that from the weights), the same
loops at a steady learning rate, or with the corrupt batch clipped.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import trainwatch as tw
from trainwatch.runner import run_script

# pytorch/examples' word_language_model, shortened: 2-layer ReLU RNN, dropout, SGD
# written by hand at lr 20, optionally clipped. Arguments: the seed, the clip's
# max_norm (0: no clip) and the steps.
LANGUAGE_MODEL = """
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

SEED, CLIP, STEPS = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(SEED)
V, E, H, B, T = 100, 32, 32, 20, 35
g = torch.Generator().manual_seed(0)
trans = torch.softmax(torch.randn(V, V, generator=g) * 3, -1)
ids = [0]
for _ in range(11999):
    ids.append(int(torch.multinomial(trans[ids[-1]], 1, generator=g)))
data = torch.tensor(ids)[: (len(ids) // B) * B].view(B, -1).t().contiguous()


class RNNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(V, E)
        self.rnn = nn.RNN(E, H, 2, nonlinearity="relu", dropout=0.2)
        self.decoder = nn.Linear(H, V)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, x, h):
        out, h = self.rnn(self.drop(self.encoder(x)), h)
        return F.log_softmax(self.decoder(self.drop(out)).view(-1, V), dim=1), h


model = RNNModel()
hidden = torch.zeros(2, B, H)
for step in range(STEPS):
    i = step % 16 * T  # 17 batches of 35 in the corpus: epochs of 16
    x, y = data[i:i + T], data[i + 1:i + 1 + T].reshape(-1)
    hidden = hidden.detach()
    model.zero_grad()
    out, hidden = model(x, hidden)
    loss = F.nll_loss(out, y)
    loss.backward()
    if CLIP:
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-20)
"""


def _language_model(tmp_path: Path, seed: int, clip: float, steps: int) -> list[tw.Alert]:
    script = tmp_path / "word_lm.py"
    script.write_text(textwrap.dedent(LANGUAGE_MODEL))
    log = tmp_path / f"log_{seed}_{clip:g}"
    assert run_script(script, [str(seed), str(clip), str(steps)], log_dir=log, console=False) == 0
    return [tw.Alert(**_fields(line)) for line in (log / "alerts.jsonl").read_text().splitlines()]


def _fields(line: str) -> dict:
    found = json.loads(line)
    found.pop("time", None)
    return found


def _serious(alerts: list[tw.Alert]) -> list[tw.Alert]:
    return [a for a in alerts if a.severity != "info"]


def _tells_to_clip_small(hint: str) -> None:
    assert "clip_grad_norm_" in hint and "max_norm" in hint and "0.25 to 1.0" in hint
    assert "learning rate" in hint
    assert "huber" not in hint and "smooth_l1" not in hint and "clamp outliers" not in hint


@pytest.mark.parametrize(("seed", "step", "norm_at_least"), [(5, 3, 1e17), (4, 3, 1e8)])
def test_a_recurrent_language_model_that_explodes_in_one_step_is_told_at_that_step(
    tmp_path, seed, step, norm_at_least
):
    found = _serious(_language_model(tmp_path, seed, clip=0.0, steps=8))
    first, *rest = found
    assert (first.rule, first.step, first.module) == ("exploding_gradient", step, "rnn")
    assert first.data["kind"] == "enormous_jump" and first.data["ratio"] > 1e6
    assert first.data["total_norm"] >= norm_at_least
    assert set(first.data["layers"]) == {"encoder", "rnn", "decoder"}
    assert "in one step" in first.message
    assert "recurrent" in first.hint
    _tells_to_clip_small(first.hint)
    # The overflow it leads to at the next step says where it came from.
    nan = rest[0]
    assert nan.rule.startswith("nonfinite") and nan.step == step + 1
    assert nan.data["after_exploding"] is True


@pytest.mark.parametrize("seed", [5, 2])
def test_the_same_language_model_clipped_to_a_quarter_stays_silent(tmp_path, seed):
    # Before the clip its norm goes from 0.1 to 1e18 (seed 5), or jumps 4e5x (seed
    # 2), in the first steps; the clip keeps it from the weights: the model trains on.
    found = _language_model(tmp_path, seed, clip=0.25, steps=30)
    assert [a for a in found if a.rule.endswith("_gradient") or a.severity == "error"] == []


def test_a_clip_too_loose_to_bound_the_update_is_told_to_be_small(tmp_path):
    first, *_ = _serious(_language_model(tmp_path, 5, clip=1e9, steps=8))
    assert (first.rule, first.step, first.data["kind"]) == (
        "exploding_gradient",
        3,
        "enormous_jump",
    )
    assert "let it through to the weights (max_norm 1e+09)" in first.hint
    _tells_to_clip_small(first.hint)


def test_a_recurrent_model_whose_gradient_norm_overflows_is_not_told_of_outliers(tmp_path):
    """The same explosion past float32's range: told at once as before, but as what
    it is, not as an outlier in the data with a robust loss for a fix."""
    first, *_ = _serious(_language_model(tmp_path, 10, clip=0.0, steps=8))
    assert (first.rule, first.step, first.module) == ("exploding_gradient", 3, "rnn")
    assert first.data["cause"] == "norm_overflow"
    assert "recurrent" in first.hint
    _tells_to_clip_small(first.hint)


class _Conv(nn.Module):
    def __init__(self, outputs: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * 64, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.conv2(F.relu(self.conv1(x)))).flatten(1))


def _model(shape: str, outputs: int) -> nn.Module:
    torch.manual_seed(0)
    if shape == "cnn":
        return _Conv(outputs)
    return nn.Sequential(
        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, outputs)
    )


def _fit(
    shape: str,
    task: str,
    raised_at: int | None = None,
    *,
    outlier: tuple[int, float] | None = None,
    clip: float | None = None,
    steps: int = 16,
) -> list[tw.Alert]:
    """SGD at lr 0.01 on a smooth regression target (or 4 classes). From ``raised_at``
    on the learning rate is 1e3 (a schedule that multiplied where it meant to
    divide), and the weights it makes blow up the next steps' gradients; at
    ``outlier``'s step, one target is its value (a corrupt label)."""
    model = _model(shape, 1 if task == "regression" else 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(steps):
            x = torch.randn(64, 1, 8, 8, generator=gen)
            features = x.flatten(1)
            signal = features[:, :4].sum(1, keepdim=True)
            for group in opt.param_groups:
                group["lr"] = 1e3 if raised_at is not None and step >= raised_at else 0.01
            out = model(x if shape == "cnn" else features)
            if task == "regression":
                y = signal.sin() * 3
                if outlier is not None and step == outlier[0]:
                    y[7] = outlier[1]
                loss = F.mse_loss(out, y)
            else:
                loss = F.cross_entropy(
                    out, (signal.squeeze(1) > 0).long() * 2 + (x[:, 0, 0, 0] > 0)
                )
            opt.zero_grad()
            loss.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
    return _serious(monitor.alerts)


@pytest.mark.parametrize("shape", ["mlp", "cnn"])
def test_a_regression_whose_learning_rate_blows_up_in_the_warm_up_is_told_at_the_jump(shape):
    first, *rest = _fit(shape, "regression", raised_at=10)
    assert (first.rule, first.step, first.data["kind"]) == (
        "exploding_gradient",
        11,
        "enormous_jump",
    )
    assert first.data["ratio"] > 1e6
    # Named: the layer whose norm jumped most, first of those that jumped with it.
    assert first.module == first.data["layers"][0]
    # A regression keeps the usual advice: the learning rate, the batch.
    assert "learning rate" in first.hint and "check the batch" in first.hint
    assert "recurrent" not in first.hint
    assert all(a.step > 11 for a in rest)


@pytest.mark.parametrize("shape", ["mlp", "cnn"])
@pytest.mark.parametrize("task", ["regression", "classification"])
def test_the_same_loops_at_a_steady_learning_rate_stay_silent(shape, task):
    assert _fit(shape, task, raised_at=None, steps=60) == []


def test_a_classifier_s_explosion_is_told_to_clip_not_to_look_for_outliers():
    # Its loss bounds the first jump (3e4x at step 11); the next is past any bound.
    first, *_ = _fit("mlp", "classification", raised_at=10)
    assert (first.rule, first.step, first.data["kind"]) == (
        "exploding_gradient",
        12,
        "enormous_jump",
    )
    assert "cross_entropy bounds each sample's gradient" in first.hint
    _tells_to_clip_small(first.hint)


@pytest.mark.parametrize("shape", ["mlp", "cnn"])
def test_a_corrupt_target_in_the_warm_up_is_told_at_its_batch_with_the_data_advice(shape):
    # Unclipped, its update blows the weights up: what follows is its knock-on.
    alert, *rest = _fit(shape, "regression", outlier=(5, 1e12))
    assert all(a.step > 5 and a.data.get("after_exploding", True) for a in rest)
    assert (alert.rule, alert.step, alert.data["kind"]) == (
        "exploding_gradient",
        5,
        "enormous_jump",
    )
    assert "bad data in this batch" in alert.hint and "check the batch" in alert.hint


@pytest.mark.parametrize("shape", ["mlp", "cnn"])
def test_a_jump_the_loop_s_clip_keeps_from_the_weights_is_left_to_the_warm_up(shape):
    """Clipped to 1.0, the corrupt batch's update is as large as a usual one: its
    gradients jumped before the clip, not in what reached the weights."""
    assert _fit(shape, "regression", outlier=(5, 1e12), clip=1.0, steps=30) == []


def test_a_regression_whose_norm_overflows_keeps_the_outlier_advice():
    (first, *_) = _fit("mlp", "regression", outlier=(5, 1e21))
    assert (first.rule, first.step, first.data["cause"]) == (
        "exploding_gradient",
        5,
        "norm_overflow",
    )
    assert "outlier" in first.hint and "huber_loss" in first.hint
