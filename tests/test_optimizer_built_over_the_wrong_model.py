"""A second optimizer built over the first model's parameters: both sides told at once.

The seq2seq tutorial's copy-paste slip, ``decoder_optimizer =
torch.optim.Adam(encoder.parameters())``, leaves the decoder in no optimizer
and the encoder in two, each backward's gradient stepped twice. Before, the
decoder (a whole model called by the loop) was told only at its 50th step,
with a hint about a criterion's or temperature's weights, and nothing said that
two optimizers step the encoder. Now, under ``trainwatch run``, ``tw.watch`` and
a Lightning Trainer in manual optimization: the parameters two optimizers both
stepped on one gradient are one ``not_optimized`` warning (``data.kind:
stepped_twice``) at the first step where both stepped, naming the module and
both optimizers; the decoder is told at its second step (the first where a
hand-written update is ruled out) with its own optimizer as the fix
(``data.kind: model_in_no_optimizer``). Each planted bug has its healthy twin
beside it, silent, and the legitimate shapes of two optimizers over the same
parameters (a GAN sharing a module, each half with its own backward; an
optimizer rebuilt each epoch; SWA; a learning-rate finder's throwaway
optimizer; a wrapper stepping the optimizer it wraps) stay silent.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import trainwatch as tw
from trainwatch.runner import run_script

SEQ2SEQ = """
import sys
import torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1); torch.manual_seed(0)
BUG = sys.argv[1] == "bug"

class EncoderRNN(nn.Module):
    def __init__(self, v, h):
        super().__init__()
        self.embedding = nn.Embedding(v, h)
        self.gru = nn.GRU(h, h, batch_first=True)
    def forward(self, x):
        return self.gru(self.embedding(x))

class DecoderRNN(nn.Module):
    def __init__(self, h, v):
        super().__init__()
        self.embedding = nn.Embedding(v, h)
        self.gru = nn.GRU(h, h, batch_first=True)
        self.out = nn.Linear(h, v)
    def forward(self, enc_hidden, target):
        inp = torch.cat([torch.zeros_like(target[:, :1]), target[:, :-1]], 1)
        out, _ = self.gru(self.embedding(inp), enc_hidden)
        return F.log_softmax(self.out(out), -1)

V, H = 20, 32
encoder, decoder = EncoderRNN(V, H), DecoderRNN(H, V)
encoder_optimizer = torch.optim.Adam(encoder.parameters(), lr=1e-3)
decoder_optimizer = torch.optim.Adam((encoder if BUG else decoder).parameters(), lr=1e-3)
criterion = nn.NLLLoss()
for it in range(60):
    x = torch.randint(2, V, (32, 6)); y = x.flip(1)
    encoder_optimizer.zero_grad(); decoder_optimizer.zero_grad()
    _, h = encoder(x)
    loss = criterion(decoder(h, y).reshape(-1, V), y.reshape(-1))
    loss.backward()
    encoder_optimizer.step(); decoder_optimizer.step()
"""


def _run(tmp_path: Path, body: str, *args: str) -> list[dict]:
    script = tmp_path / "train.py"
    script.write_text(body)
    run_script(script, list(args), log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["severity"] != "info"]


def _kind(alerts: list[dict], kind: str) -> list[dict]:
    return [a for a in alerts if a["data"].get("kind") == kind]


# -- trainwatch run, the script unmodified -------------------------------------


def test_run_tells_the_encoder_stepped_twice_and_the_decoder_left_out_at_once(tmp_path):
    found = _run(tmp_path, SEQ2SEQ, "bug")
    assert {a["rule"] for a in found} == {"not_optimized"}
    (twice,) = _kind(found, "stepped_twice")
    assert twice["step"] == 1 and twice["module"] == ""
    assert twice["data"]["model"] == "EncoderRNN"
    assert sorted(twice["data"]["optimizer_names"]) == ["decoder_optimizer", "encoder_optimizer"]
    assert len(twice["data"]["parameters"]) == 5
    assert "encoder_optimizer" in twice["message"] and "decoder_optimizer" in twice["message"]
    (left,) = _kind(found, "model_in_no_optimizer")
    assert left["step"] <= 1 and left["module"] == ""
    assert left["data"]["model"] == "DecoderRNN" and left["data"]["model_name"] == "decoder"
    assert "decoder_optimizer = torch.optim.Adam(decoder.parameters())" in left["hint"]
    assert "criterion" not in left["hint"] and "temperature" not in left["hint"]
    assert not _kind(found, "never_updated")


def test_run_of_the_healthy_seq2seq_is_silent(tmp_path):
    assert _run(tmp_path, SEQ2SEQ, "ok") == []


LOSS_WEIGHTS_AND_A_MODEL = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
WHAT = sys.argv[1]

class TaskWeights(nn.Module):  # learned loss weights: a criterion with parameters
    def __init__(self):
        super().__init__()
        self.log_vars = nn.Parameter(torch.zeros(2))
    def forward(self, losses):
        return sum(torch.exp(-lv) * l + lv for lv, l in zip(self.log_vars, losses))

body, head = nn.Linear(8, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 2))
weights = TaskWeights()
opt = torch.optim.Adam(body.parameters(), 1e-2)
extra = torch.optim.Adam(head.parameters(), 1e-2) if WHAT == "both" else None
for step in range(70):
    x = torch.randn(16, 8)
    out = head(body(x))
    loss = weights([out[:, 0].pow(2).mean(), (out[:, 1] - 1).pow(2).mean()])
    opt.zero_grad()
    if extra is not None:
        extra.zero_grad()
    loss.backward()
    opt.step()
    if extra is not None:
        extra.step()
"""


def test_run_keeps_the_criterion_hint_and_its_patience_for_learned_loss_weights(tmp_path):
    found = _run(tmp_path, LOSS_WEIGHTS_AND_A_MODEL, "both")
    assert [(a["data"]["kind"], a["data"]["model"], a["step"]) for a in found] == [
        ("never_updated", "TaskWeights", 50)
    ]
    assert "criterion" in found[0]["hint"]


def test_run_tells_a_head_model_in_no_optimizer_beside_loss_weights(tmp_path):
    found = _run(tmp_path, LOSS_WEIGHTS_AND_A_MODEL, "one")
    kinds = [(a["data"]["kind"], a["data"]["model"]) for a in found]
    assert ("model_in_no_optimizer", "Sequential") in kinds
    left = next(a for a in found if a["data"]["kind"] == "model_in_no_optimizer")
    assert left["step"] <= 1
    assert "torch.optim.Adam(head.parameters())" in left["hint"]


HAND_ACCUMULATED_BESIDE = """
import torch
from torch import nn

torch.manual_seed(0)
model, probe = nn.Linear(8, 4), nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), 0.05)
for step in range(80):
    x = torch.randn(16, 8)
    loss = model(x).pow(2).mean() + probe(x).pow(2).mean()
    (loss / 4).backward()
    if step % 4 == 3:  # both accumulate four micro-batches: the probe updated by hand
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p in probe.parameters():
                p -= 0.05 * p.grad
                p.grad = None
"""


def test_run_of_a_model_updated_by_hand_beside_an_accumulating_optimizer_is_silent(tmp_path):
    found = _run(tmp_path, HAND_ACCUMULATED_BESIDE)
    assert not [a for a in found if a["rule"] == "not_optimized"]


LEGIT_UNDER_RUN = """
import sys
import torch
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel

torch.manual_seed(0)
SHAPE = sys.argv[1]
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def batch():
    x = torch.randn(32, 8)
    return x, x.sum(1, keepdim=True)


if SHAPE == "lr_finder":  # a throwaway optimizer over the same parameters, kept alive
    finder = torch.optim.SGD(model.parameters(), 1e-4)
    for i in range(10):
        x, y = batch()
        finder.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        finder.step()
        for g in finder.param_groups:
            g["lr"] *= 2
opt = torch.optim.SGD(model.parameters(), 1e-2)
kept = [opt]
swa = AveragedModel(model) if SHAPE == "swa" else None
swa_lr = SWALR(opt, swa_lr=5e-3) if SHAPE == "swa" else None
for epoch in range(4):
    if SHAPE == "rebuilt" and epoch:
        opt = torch.optim.SGD(model.parameters(), 1e-2)  # the old one still alive
        kept.append(opt)
    for i in range(15):
        x, y = batch()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    if swa is not None:
        swa.update_parameters(model)
        swa_lr.step()
"""


@pytest.mark.parametrize("shape", ["lr_finder", "rebuilt", "swa"])
def test_run_of_optimizers_over_the_same_parameters_never_stepping_together_is_silent(
    tmp_path, shape
):
    found = _run(tmp_path, LEGIT_UNDER_RUN, shape)
    assert not [a for a in found if a["rule"] == "not_optimized"]


# -- tw.watch --------------------------------------------------------------------


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 16)
        self.gru = nn.GRU(16, 16, batch_first=True)

    def forward(self, x):
        return self.gru(self.embedding(x))[1]


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 16)
        self.gru = nn.GRU(16, 16, batch_first=True)
        self.out = nn.Linear(16, 20)

    def forward(self, hidden, y):
        out, _ = self.gru(self.embedding(y), hidden)
        return self.out(out)


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.decoder = Decoder()

    def forward(self, x, y):
        return self.decoder(self.encoder(x), y)


def _seq2seq_watched(bug: bool, steps: int = 12) -> list[tw.Alert]:
    torch.manual_seed(0)
    model = Seq2Seq()
    encoder_optimizer = torch.optim.Adam(model.encoder.parameters(), 1e-3)
    decoder_optimizer = torch.optim.Adam(
        (model.encoder if bug else model.decoder).parameters(), 1e-3
    )
    with tw.watch(model, [encoder_optimizer, decoder_optimizer], console=False) as monitor:
        for _ in range(steps):
            x = torch.randint(0, 20, (8, 5))
            encoder_optimizer.zero_grad()
            decoder_optimizer.zero_grad()
            out = model(x, x.flip(1))
            nn.functional.cross_entropy(out.reshape(-1, 20), x.flip(1).reshape(-1)).backward()
            encoder_optimizer.step()
            decoder_optimizer.step()
    return monitor.alerts


def test_watch_tells_the_encoder_stepped_by_both_optimizers_once():
    found = [a for a in _seq2seq_watched(True) if a.data.get("kind") == "stepped_twice"]
    assert [(a.rule, a.module, a.step, a.severity) for a in found] == [
        ("not_optimized", "encoder", 1, "warning")
    ]
    data = found[0].data
    assert data["optimizers"] == [0, 1] and data["optimizer_classes"] == ["Adam", "Adam"]
    assert data["optimizer_names"] == ["encoder_optimizer", "decoder_optimizer"]
    assert data["modules"] == ["encoder.embedding", "encoder.gru"]
    assert "model.encoder.parameters()" in found[0].hint


def test_watch_of_the_healthy_seq2seq_is_silent():
    assert _seq2seq_watched(False) == []


def _gan_sharing_an_embedding(steps: int = 12) -> list[tw.Alert]:
    """A module both halves hold, each stepping it on its own loss's backward."""
    torch.manual_seed(0)

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(8, 8)
            self.g = nn.Linear(8, 8)
            self.d = nn.Linear(8, 1)

    pair = Pair()
    opt_g = torch.optim.Adam([*pair.shared.parameters(), *pair.g.parameters()], 1e-3)
    opt_d = torch.optim.Adam([*pair.shared.parameters(), *pair.d.parameters()], 1e-3)
    with tw.watch(pair, [opt_g, opt_d], console=False) as monitor:
        for _ in range(steps):
            x = torch.randn(16, 8)
            opt_d.zero_grad()
            pair.d(pair.shared(x)).pow(2).mean().backward()
            opt_d.step()
            opt_g.zero_grad()
            pair.g(pair.shared(x)).pow(2).mean().backward()
            opt_g.step()
    return monitor.alerts


def test_watch_of_a_module_shared_by_two_optimizers_each_with_its_backward_is_silent():
    assert not [a for a in _gan_sharing_an_embedding() if a.rule == "not_optimized"]


class _Wrapping(torch.optim.Optimizer):
    """A wrapper trainwatch does not know, stepping the optimizer it wraps."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        self.base = base
        super().__init__(base.param_groups, {})

    def step(self, closure=None):
        self.base.step()


def test_watch_of_an_unknown_wrapper_stepping_its_inner_optimizer_tells_no_double_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    inner = torch.optim.SGD(model.parameters(), 1e-2)
    wrapper = _Wrapping(inner)
    with tw.watch(model, [wrapper, inner], console=False) as monitor:
        for _ in range(10):
            x = torch.randn(16, 8)
            wrapper.zero_grad()
            model(x).pow(2).mean().backward()
            wrapper.step()
    assert not [a for a in monitor.alerts if a.data.get("kind") == "stepped_twice"]


# -- Lightning, manual optimization ----------------------------------------------

LIGHTNING = """
import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BUG, LOG_DIR = sys.argv[1:3]


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))

    def training_step(self, batch, batch_idx):
        opt_body, opt_head = self.optimizers()
        x, y = batch
        opt_body.zero_grad()
        opt_head.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self(x), y))
        opt_body.step()
        opt_head.step()

    def configure_optimizers(self):
        second = self.body if BUG == "bug" else self.head
        return [
            torch.optim.Adam(self.body.parameters(), lr=1e-3),
            torch.optim.Adam(second.parameters(), lr=1e-3),
        ]


torch.manual_seed(0)
x = torch.randn(256, 8)
callbacks = []
if LOG_DIR != "-":
    from trainwatch.lightning import TrainWatchCallback

    callbacks.append(TrainWatchCallback(log_dir=LOG_DIR, console=False))
pl.Trainer(
    accelerator="cpu",
    max_steps=16,
    callbacks=callbacks,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
).fit(Net(), DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=32))
"""


def _lightning(tmp_path: Path, monkeypatch, bug: str, under_run: bool) -> list[dict]:
    script = tmp_path / "train.py"
    script.write_text(LIGHTNING)
    log_dir = tmp_path / "log"
    if under_run:
        run_script(script, [bug, "-"], log_dir=log_dir, console=False)
    else:
        monkeypatch.setattr(sys, "argv", ["train.py", bug, str(log_dir)])
        runpy.run_path(str(script), run_name="__main__")
    lines = (log_dir / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["severity"] != "info"]


@pytest.mark.parametrize("under_run", [False, True], ids=["callback", "run"])
def test_lightning_manual_optimization_tells_the_body_stepped_twice(
    tmp_path, monkeypatch, under_run
):
    found = _lightning(tmp_path, monkeypatch, "bug", under_run)
    twice = _kind(found, "stepped_twice")
    assert [(a["rule"], a["module"]) for a in twice] == [("not_optimized", "body")]
    assert twice[0]["data"]["optimizer_classes"] == ["Adam", "Adam"]
    assert twice[0]["step"] <= 1


@pytest.mark.parametrize("under_run", [False, True], ids=["callback", "run"])
def test_lightning_manual_optimization_over_disjoint_parts_is_silent(
    tmp_path, monkeypatch, under_run
):
    found = _lightning(tmp_path, monkeypatch, "ok", under_run)
    assert not [a for a in found if a["rule"] == "not_optimized"]
