"""Bugs that begin mid-run, after hundreds of healthy steps, in scripts under ``trainwatch run``.

The unmodified-script side of test_bugs_that_begin_mid_run.py: scripts that know
nothing of trainwatch, healthy until step ``S`` = 350, where a bug begins. An
LSTM language model trained by epochs and validated after each (``S`` is the
first step of its sixth epoch); a regressor fine-tuned from ``S`` on with a
fresh optimizer, which ``trainwatch run`` joins to the model's monitor at its
first ``step()``, after that step's forward and backward. Run without the bug,
each says nothing.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from trainwatch.runner import run_script

S = 350

SCRIPT = """
import sys

import torch
import torch.nn.functional as F
from torch import nn

BUG = sys.argv[1]
EPOCHS, BATCHES, S, VOCAB, T = 6, 70, 350, 32, 12


class LanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 24)
        self.drop = nn.Dropout(0.1)
        self.rnn = nn.LSTM(24, 32, batch_first=True)
        self.decoder = nn.Linear(32, VOCAB)
        self.freeze_embeddings = False

    def forward(self, tokens):
        e = self.drop(self.embed(tokens))
        if self.freeze_embeddings:
            e = e.detach()
        h, _ = self.rnn(e)
        return self.decoder(self.drop(h))


def batch(i):
    g = torch.Generator().manual_seed(i)
    start = torch.randint(0, VOCAB, (16, 1), generator=g)
    seq = (start + torch.arange(T + 1) * 3) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def evaluate(model):
    model.eval()
    with torch.no_grad():
        x, y = batch(10_000)
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()


torch.manual_seed(0)
model = LanguageModel()
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
step = 0
for epoch in range(EPOCHS):
    for i in range(BATCHES):
        if BUG == "embeddings_detached" and step == S:
            model.freeze_embeddings = True  # a flag meant for a later phase, switched on early
        x, y = batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        step += 1
    val = evaluate(model)
    if not (BUG == "left_in_eval" and step >= S):
        model.train()  # the last validation forgets to switch back
    print(f"epoch {epoch} loss {loss.item():.4f} val {val:.4f}")
"""


FINE_TUNE = """
import sys

import torch
import torch.nn.functional as F
from torch import nn

BUG = sys.argv[1]
S, STEPS = 350, 420


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(32, 32)
        self.out = nn.Linear(32, 1)

    def forward(self, x):
        return self.out(torch.relu(self.fc2(self.drop(torch.relu(self.fc1(x))))))


torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
w = torch.randn(8, generator=g) / 3
model = Regressor()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(STEPS):
    x = torch.randn(32, 8, generator=g)
    y = torch.sin(x @ w)
    if step == S:  # fine-tuning on new data, with a fresh optimizer at a lower rate
        if BUG == "nan_label":
            y[7] = float("nan")  # a missing label in the new data
        if BUG == "nan_feature":
            x[4, 1] = float("nan")  # a missing feature in the new data
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    opt.zero_grad()
    pred = model(x)
    if BUG == "huber_loss" and step >= S:
        loss = F.huber_loss(pred, y)  # (N, 1) against (N,): (N, N)
    else:
        loss = F.mse_loss(pred.squeeze(-1), y)
    loss.backward()
    opt.step()
print("loss", loss.item())
"""


@pytest.fixture(autouse=True)
def _forget_script_modules():
    yield
    sys.modules.pop("train_lm", None)
    sys.modules.pop("fine_tune", None)


def run(bug: str, tmp_path: Path, script_text: str = SCRIPT, check: str = "auto") -> list[dict]:
    name = "train_lm.py" if script_text is SCRIPT else "fine_tune.py"
    script = tmp_path / name
    script.write_text(textwrap.dedent(script_text))
    log_dir = tmp_path / "log"
    config = {"nonfinite_forward": {"check": check}}
    assert run_script(script, [bug], log_dir=log_dir, config=config, console=False) == 0
    lines = (log_dir / "alerts.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def told(alerts: list[dict]) -> list[tuple[str, int, str | None]]:
    return [(a["rule"], a["step"], a["module"]) for a in alerts]


@pytest.mark.slow
def test_the_clean_script_says_nothing(tmp_path):
    assert run("none", tmp_path) == []


@pytest.mark.slow
def test_a_validation_that_leaves_the_model_in_eval_is_told_at_the_next_step(tmp_path):
    """The word-language-model bug, after five healthy epochs."""
    assert told(run("left_in_eval", tmp_path)) == [("train_in_eval_mode", S, "drop")]


@pytest.mark.slow
def test_embeddings_detached_mid_run_are_a_zero_gradient_at_that_step(tmp_path):
    assert told(run("embeddings_detached", tmp_path)) == [
        ("unused_parameter", S, "embed"),
        ("zero_gradient", S, "embed"),
    ]


@pytest.mark.slow
def test_the_clean_fine_tune_says_nothing(tmp_path):
    assert run("none", tmp_path, FINE_TUNE) == []


# How NaN/Inf are looked for: on the spot (CPU's default), at the step boundary
# (a GPU's default), and summed per module for the next step's readback.
CHECKS = ("auto", "step", "deferred")


@pytest.mark.slow
@pytest.mark.parametrize("check", CHECKS)
def test_a_nan_label_in_the_first_batch_of_a_fine_tune_is_a_nonfinite_loss(tmp_path, check):
    """The fresh optimizer is joined at its first step(), after that step's passes:
    they are still that step's to judge (they were taken as the joining's own and
    lost: told as a gradient no hook saw made, at the first layer)."""
    assert told(run("nan_label", tmp_path, FINE_TUNE, check)) == [("nonfinite_loss", S, None)]


@pytest.mark.slow
@pytest.mark.parametrize("check", CHECKS)
def test_a_nan_feature_in_the_first_batch_of_a_fine_tune_is_told_as_the_input(tmp_path, check):
    alerts = run("nan_feature", tmp_path, FINE_TUNE, check)
    assert told(alerts) == [("nonfinite_forward", S, "fc1")]
    assert alerts[0]["data"]["cause"] == "input"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Using a target size")
def test_a_broadcasting_loss_of_a_fine_tune_is_told_the_step_after_its_optimizer_joins(
    tmp_path,
):
    """``trainwatch run`` sees the fresh optimizer at its first ``step()``, after the
    phase's first loss: the phase's audit runs from the next step (as for an
    optimizer handed over late)."""
    assert told(run("huber_loss", tmp_path, FINE_TUNE)) == [("broadcast", S + 1, None)]
