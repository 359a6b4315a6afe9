"""A hand-trained model's mode findings are dated at the step they began, as an
optimizer-trained one's are.

Under ``trainwatch run`` a loop that updates the weights by hand (no
``torch.optim`` optimizer: ``p.data.add_(p.grad, alpha=-lr)``, or ``p -= lr *
p.grad`` under ``no_grad``) ends each step as its backward ends. A model left in
eval mode after an evaluation (``model.train()`` forgotten) trains in eval mode
from that step on, and ``train_in_eval_mode`` says that step, not the next one:
the eval-mode backward's report is filed before the step it ran in closes.

Planted at one step in an MLP loop (both update styles) and in a word-level LSTM
language model loop shaped as pytorch/examples' (hidden state carried across
batches, ``clip_grad_norm_``, ``evaluate()`` calling ``model.eval()``), checked
against the same loops with ``torch.optim.SGD`` and under ``tw.watch`` with
``monitor.step()``; ``eval_in_train_mode`` and ``constant_output`` planted in
the same hand-update loop are dated at their step too. The twins that call
``model.train()`` again stay silent.
"""

from __future__ import annotations

import io
import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.optim import optimizer as optimizer_hooks

import trainwatch as tw
from trainwatch.runner import run_script

PLANTED_AT = 10

MLP_LOOP = """
import sys
import torch
from torch import nn
import torch.nn.functional as F

BUG, UPDATE = sys.argv[1], sys.argv[2]
torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(16, 2)
        self.flat = False

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.flat:
            h = h * 0.0
        return self.fc2(self.drop(h))


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1) if UPDATE == "sgd" else None
for step in range(20):
    if step == PLANTED_AT:
        if BUG == "train_in_eval":
            model.eval()  # an evaluation's model.eval(), model.train() forgotten
        elif BUG == "eval_in_train":
            with torch.no_grad():  # a validation without model.eval()
                model(torch.randn(64, 8))
        elif BUG == "constant_output":
            model.flat = True
        elif BUG == "clean":
            model.eval()
            with torch.no_grad():
                model(torch.randn(64, 8))
            model.train()
    x = torch.randn(32, 8)
    y = torch.randint(0, 2, (32,))
    model.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if opt is not None:
        opt.step()
    elif UPDATE == "data_add":
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)
    else:
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
""".replace("PLANTED_AT", str(PLANTED_AT))

LSTM_LM = """
import sys
import torch
from torch import nn

FORGET_TRAIN = sys.argv[1] == "forget_train"
torch.manual_seed(1111)
NTOK, BPTT = 50, 10


class RNNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(NTOK, 16)
        self.rnn = nn.LSTM(16, 16, 2, dropout=0.2)
        self.decoder = nn.Linear(16, NTOK)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        return nn.functional.log_softmax(self.decoder(output), dim=-1).view(-1, NTOK), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(2, bsz, 16), weight.new_zeros(2, bsz, 16))


def repackage(h):
    return tuple(v.detach() for v in h)


def batches(data):
    for i in range(0, data.size(0) - 1, BPTT):
        n = min(BPTT, len(data) - 1 - i)
        yield data[i:i + n], data[i + 1:i + 1 + n].reshape(-1)


def evaluate(model, data):
    model.eval()
    hidden = model.init_hidden(4)
    with torch.no_grad():
        for x, y in batches(data):
            output, hidden = model(x, hidden)
            hidden = repackage(hidden)


def train(model, data, criterion, lr):
    if not FORGET_TRAIN:
        model.train()
    hidden = model.init_hidden(4)
    for x, y in batches(data):
        hidden = repackage(hidden)
        model.zero_grad()
        output, hidden = model(x, hidden)
        loss = criterion(output, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)


corpus = torch.randint(0, NTOK, (4 * 121,))
train_data = corpus.view(4, -1).t().contiguous()  # 121 rows: 12 batches an epoch
val_data = torch.randint(0, NTOK, (4 * 21,)).view(4, -1).t().contiguous()
model = RNNModel()
model.train()
criterion = nn.NLLLoss()
for epoch in range(3):
    train(model, train_data, criterion, lr=20.0)
    evaluate(model, val_data)
"""
LM_STEPS_AN_EPOCH = 12


@pytest.fixture(autouse=True)
def _no_hook_left():
    yield
    assert not module_hooks._global_forward_pre_hooks
    assert not module_hooks._global_forward_hooks
    assert not optimizer_hooks._global_optimizer_pre_hooks
    assert not optimizer_hooks._global_optimizer_post_hooks


def _run(tmp_path: Path, body: str, *args: str, config=None) -> list[tuple[str, int, str | None]]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    log_dir = tmp_path / "log"
    code = run_script(script, list(args), log_dir=log_dir, console=False, config=config)
    assert code == 0
    lines = (log_dir / "alerts.jsonl").read_text().splitlines()
    return [(a["rule"], a["step"], a["module"]) for a in map(json.loads, lines)]


@pytest.mark.parametrize("update", ["data_add", "no_grad_sub", "sgd"])
def test_training_in_eval_mode_is_told_at_the_step_it_began(tmp_path, update):
    found = _run(tmp_path, MLP_LOOP, "train_in_eval", update)
    assert found == [("train_in_eval_mode", PLANTED_AT, "drop")]


@pytest.mark.parametrize("update", ["data_add", "no_grad_sub", "sgd"])
def test_a_loop_that_trains_again_after_its_evaluation_stays_silent(tmp_path, update):
    assert _run(tmp_path, MLP_LOOP, "clean", update) == []


@pytest.mark.parametrize("update", ["data_add", "sgd"])
def test_an_evaluation_in_training_mode_is_told_at_its_step(tmp_path, update):
    found = _run(tmp_path, MLP_LOOP, "eval_in_train", update)
    assert found == [("eval_in_train_mode", PLANTED_AT, "drop")]


@pytest.mark.parametrize("update", ["data_add", "sgd"])
def test_a_constant_output_is_told_at_its_step(tmp_path, update):
    # Sampled at every step, so the collapse is told where it begins.
    every = {"constant_output": {"every": 1, "first_steps": 0, "warmup": 0}}
    found = _run(tmp_path, MLP_LOOP, "constant_output", update, config=every)
    assert found == [("constant_output", PLANTED_AT, "")]


def test_a_language_model_trained_in_eval_after_its_first_evaluation(tmp_path):
    found = _run(tmp_path, LSTM_LM, "forget_train")
    # The first evaluation ends epoch 0: epoch 1's first step trains in eval mode.
    assert found == [("train_in_eval_mode", LM_STEPS_AN_EPOCH, "drop")]


def test_a_language_model_put_back_in_training_mode_stays_silent(tmp_path):
    assert _run(tmp_path, LSTM_LM, "train_each_epoch") == []


@pytest.mark.parametrize("forget", [True, False], ids=["eval_left_on", "train_again"])
def test_tw_watch_with_monitor_step_dates_it_alike(forget):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 2))
    with tw.watch(model, console=io.StringIO()) as monitor:
        for step in range(20):
            if step == PLANTED_AT:
                model.eval()
                if not forget:
                    model.train()
            x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
            monitor.step()
    found = [(a.rule, a.step, a.module) for a in monitor.alerts]
    assert found == ([("train_in_eval_mode", PLANTED_AT, "1")] if forget else [])


@pytest.fixture(autouse=True)
def _forget_script_modules():
    yield
    sys.modules.pop("train", None)
