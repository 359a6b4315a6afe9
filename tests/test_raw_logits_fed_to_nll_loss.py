"""loss_input: raw logits given to nll_loss, which expects log-probabilities (told at step 0)."""

from __future__ import annotations

import json
import sys
import textwrap

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

CLASSES = 10


class MnistNet(nn.Module):
    """The PyTorch mnist example's shape, small; ``log_softmax`` at the end or not."""

    def __init__(self, log_softmax: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.conv2 = nn.Conv2d(4, 8, 3)
        self.fc1 = nn.Linear(8 * 5 * 5, 16)
        self.fc2 = nn.Linear(16, CLASSES)
        self.log_softmax = log_softmax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))
        return F.log_softmax(x, dim=1) if self.log_softmax else x


def _told(monitor) -> list:
    return [a for a in monitor.alerts if a.rule == "loss_input"]


def _train_mnist(quiet_watch, log_softmax: bool, steps: int = 4) -> list:
    model = MnistNet(log_softmax)
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(16, 1, 14, 14, generator=gen)
        y = torch.randint(0, CLASSES, (16,), generator=gen)
        opt.zero_grad()
        loss = F.nll_loss(model(x), y)  # the loss line
        loss.backward()
        opt.step()
    return _told(monitor)


def _line(text: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line and "_line(" not in line)


def test_nll_loss_on_a_cnns_raw_logits_is_told_at_step_0(quiet_watch):
    (alert,) = _train_mnist(quiet_watch, log_softmax=False)
    assert alert.step == 0 and alert.module is None
    assert alert.data["kind"] == "logits_into_nll" and alert.data["loss"] == "nll_loss"
    assert alert.data["source"].endswith(
        f"test_raw_logits_fed_to_nll_loss.py:{_line('# the loss line')}"
    )
    assert alert.data["largest"] > 0 and alert.data["logsumexp"] > 0.5
    assert "raw logits" in alert.message and "log-probabilities" in alert.message
    assert "log_softmax" in alert.hint and "cross_entropy" in alert.hint


def test_nll_loss_on_a_cnns_log_softmax_is_silent(quiet_watch):
    assert _train_mnist(quiet_watch, log_softmax=True) == []


# -- a token loop: (N, C, T) inputs, the class dimension second --------------------------

VOCAB, PAD = 12, 0


class TokenModel(nn.Module):
    """An embedding and a GRU over tokens, scores per position (N, T, V)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.rnn = nn.GRU(16, 16, batch_first=True)
        self.out = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(self.embed(tokens))[0])


def _train_tokens(quiet_watch, loss_fn, steps: int = 3) -> list:
    model = TokenModel()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(1, VOCAB, (8, 7), generator=gen)
        tokens[:, 5:] = PAD  # padded tails
        opt.zero_grad()
        scores = model(tokens[:, :-1])  # (N, T, V)
        loss_fn(scores, tokens[:, 1:]).backward()
        opt.step()
    return _told(monitor)


def _masked_temperature(scores, targets):
    """Log-probabilities of temperature-scaled scores with classes masked to -inf."""
    masked = (scores / 0.7).masked_fill(torch.arange(VOCAB) >= VOCAB - 2, float("-inf"))
    return F.nll_loss(F.log_softmax(masked, -1).transpose(1, 2), targets, ignore_index=PAD)


def _zeroed_padding(scores, targets):
    """Padded positions' rows multiplied to zero: no distribution, and ignored."""
    logp = F.log_softmax(scores, -1) * (targets != PAD).unsqueeze(-1)
    return F.nll_loss(logp.transpose(1, 2), targets, ignore_index=PAD)


def _smoothed_by_hand(scores, targets):
    logp = F.log_softmax(scores, -1).transpose(1, 2)
    return 0.9 * F.nll_loss(logp, targets) - 0.1 * logp.mean()


def _mixture(scores, targets):
    """Log-probabilities of a two-component mixture, logsumexp of weighted log_softmaxes."""
    parts = torch.stack([F.log_softmax(scores, -1), F.log_softmax(scores * 0.5, -1)])
    logp = torch.logsumexp(parts + torch.tensor([0.3, 0.7]).log().view(2, 1, 1, 1), dim=0)
    return F.nll_loss(logp.transpose(1, 2), targets, reduction="sum")


def _bf16_log_of_softmax(scores, targets):
    """bf16 probabilities' log under autocast: rows off from 0 by rounding only."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp = F.softmax(scores.bfloat16() * 1.5, -1).log()
        return F.nll_loss(logp.transpose(1, 2), targets)


def _categorical_and_a_gather(scores, targets):
    """A distribution's log_prob (no nll_loss), and nll_loss as a gather of scores."""
    log_prob = torch.distributions.Categorical(logits=scores).log_prob(targets)
    picked = -F.nll_loss(scores.transpose(1, 2), targets, reduction="none")  # scores[target]
    margin = (scores.logsumexp(-1) - picked).mean()
    return -log_prob.mean() + 0.0 * margin


TOKEN_CONTROLS = {
    "log_softmax_3d": lambda s, t: F.nll_loss(F.log_softmax(s, -1).transpose(1, 2), t),
    "ignore_index_and_weights": lambda s, t: nn.NLLLoss(
        weight=torch.linspace(0.5, 1.5, VOCAB), ignore_index=PAD
    )(F.log_softmax(s, -1).transpose(1, 2), t),
    "masked_temperature": _masked_temperature,
    "zeroed_padding": _zeroed_padding,
    "smoothed_by_hand": _smoothed_by_hand,
    "mixture": _mixture,
    "bf16_autocast": _bf16_log_of_softmax,
    "categorical_and_a_gather": _categorical_and_a_gather,
    "log_softmax_over_a_temperature": lambda s, t: F.nll_loss(
        (F.log_softmax(s, -1) / 2.0).transpose(1, 2), t
    ),
    "log_softmax_flattened": lambda s, t: F.nll_loss(
        F.log_softmax(s, -1).reshape(-1, VOCAB), t.reshape(-1), reduction="sum"
    ),
}


@pytest.mark.parametrize("name", list(TOKEN_CONTROLS))
def test_a_token_loss_given_log_probabilities_is_silent(name, quiet_watch):
    assert _train_tokens(quiet_watch, TOKEN_CONTROLS[name]) == []


@pytest.mark.parametrize(
    "loss_fn",
    [
        lambda s, t: F.nll_loss(s.transpose(1, 2), t, ignore_index=PAD),
        lambda s, t: nn.NLLLoss(reduction="sum")(s.reshape(-1, VOCAB), t.reshape(-1)),
    ],
    ids=["3d", "flattened"],
)
def test_a_token_loss_given_raw_scores_is_told(loss_fn, quiet_watch):
    (alert,) = _train_tokens(quiet_watch, loss_fn)
    assert alert.step == 0 and alert.data["kind"] == "logits_into_nll"


def test_a_segmentation_map_of_raw_scores_is_told(quiet_watch):
    model = nn.Conv2d(3, 5, 3, padding=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(2, 3, 32, 32, generator=gen)
        y = torch.randint(0, 5, (2, 32, 32), generator=gen)
        opt.zero_grad()
        F.nll_loss(model(x), y, ignore_index=255).backward()
        opt.step()
    (alert,) = _told(monitor)
    assert alert.data["kind"] == "logits_into_nll"


class LabelledModel(nn.Module):
    """Computes its loss in forward from the labels it is given (Hugging Face's way)."""

    def __init__(self, log_softmax: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, CLASSES)
        self.log_softmax = log_softmax

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        scores = self.fc(x)
        scores = F.log_softmax(scores, dim=-1) if self.log_softmax else scores
        return {"loss": F.nll_loss(scores, labels), "logits": scores}


@pytest.mark.parametrize("log_softmax", [False, True])
def test_nll_loss_inside_forward_on_raw_logits_names_the_model(log_softmax, quiet_watch):
    model = LabelledModel(log_softmax)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(16, 8, generator=gen)
        opt.zero_grad()
        model(x, labels=torch.randint(0, CLASSES, (16,), generator=gen))["loss"].backward()
        opt.step()
    told = _told(monitor)
    if log_softmax:
        assert told == []
        return
    (alert,) = told
    assert alert.module == "" and alert.data["in_forward"] is True


# -- trainwatch run and Lightning ---------------------------------------------------------

SCRIPT = """
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        return {last}


X = torch.randn(256, 20)
Y = X[:, :10].argmax(1)
model = Net()
opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
for i in range(0, 256, 32):
    opt.zero_grad()
    loss = F.nll_loss(model(X[i:i + 32]), Y[i:i + 32])
    loss.backward()
    opt.step()
"""


@pytest.fixture
def _forget_script_modules():
    yield
    sys.modules.pop("train", None)


@pytest.mark.parametrize("log_softmax", [False, True])
def test_nll_loss_on_raw_logits_is_told_under_run(tmp_path, log_softmax, _forget_script_modules):
    last = "self.fc2(F.relu(self.fc1(x)))"
    last = f"F.log_softmax({last}, dim=1)" if log_softmax else last
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(last=last)))
    assert run_script(script, [], log_dir=tmp_path / "log") == 0
    alerts = tmp_path / "log" / "alerts.jsonl"
    found = [json.loads(line) for line in alerts.read_text().splitlines()]
    if log_softmax:
        assert found == []
        return
    assert [(a["rule"], a["step"], a["data"]["kind"]) for a in found] == [
        ("loss_input", 0, "logits_into_nll")
    ]
    assert found[0]["data"]["source"].endswith("train.py:25")


class NllModule(pl.LightningModule):
    def __init__(self, log_softmax: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.head = nn.Linear(16, CLASSES)
        self.log_softmax = log_softmax
        self.criterion = nn.NLLLoss()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(torch.relu(self.fc1(x)))
        return F.log_softmax(out, dim=1) if self.log_softmax else out

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.criterion(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=gen)
        return DataLoader(TensorDataset(x, torch.randint(0, CLASSES, (64,), generator=gen)), 16)


@pytest.mark.parametrize("log_softmax", [False, True])
def test_a_lightning_module_with_nll_loss_on_raw_logits_is_told(tmp_path, log_softmax):
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(tmp_path, [callback], max_steps=4, num_sanity_val_steps=0)
    trainer.fit(NllModule(log_softmax))
    told = [a for a in callback.alerts if a.rule == "loss_input"]
    if log_softmax:
        assert told == []
        return
    (alert,) = told
    assert alert.step == 0 and alert.data["kind"] == "logits_into_nll"


def test_an_explosion_after_nll_loss_on_raw_logits_names_the_loss_not_the_learning_rate(
    quiet_watch,
):
    """The loss falls to -inf and the gradients grow with it: the hint is the loss's."""
    model = MnistNet(log_softmax=False)
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(0)
    protos = torch.randn(CLASSES, 1, 14, 14, generator=gen)
    for _ in range(80):
        y = torch.randint(0, CLASSES, (32,), generator=gen)
        x = protos[y] + 0.8 * torch.randn(32, 1, 14, 14, generator=gen)
        opt.zero_grad()
        F.nll_loss(model(x), y).backward()
        opt.step()
    rules = [a.rule for a in monitor.alerts]
    assert rules[0] == "loss_input"
    exploding = [a for a in monitor.alerts if a.rule == "exploding_gradient"]
    assert exploding, rules
    for alert in exploding:
        assert alert.data["cause"] == "logits_into_nll"
        assert "log_softmax" in alert.hint and "learning rate is far too high" not in alert.hint
