"""loss_input: a softmax (sigmoid) output fed to a loss that applies its own, found by the graph."""

from __future__ import annotations

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

CLASSES = 4


class Classifier(nn.Module):
    """An MLP whose forward may end in a softmax or a sigmoid, as tutorials' often do."""

    def __init__(self, last: str = "", outputs: int = CLASSES) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.head = nn.Linear(16, outputs)
        self.last = last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(torch.relu(self.fc1(x)))
        if self.last == "softmax":
            return F.softmax(out, dim=1)
        if self.last == "sigmoid":
            return torch.sigmoid(out)
        return out


class SmallCNN(nn.Module):
    """The CIFAR tutorial's shape, small: softmax after the last linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.relu(self.conv(x)), 2)
        return F.softmax(self.fc(torch.flatten(x, 1)), dim=1)


def _batches(steps: int, shape=(8,), n: int = 16):
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(n, *shape, generator=gen)
        yield x, torch.randint(0, CLASSES, (n,), generator=gen)


def _train(model, opt, loss_fn, steps: int = 4, shape=(8,)) -> None:
    for x, y in _batches(steps, shape):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()


def _told(monitor) -> list:
    return [a for a in monitor.alerts if a.rule == "loss_input"]


def _watched(quiet_watch, model, loss_fn, shape=(8,), **overrides) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt, **overrides)
    _train(model, opt, loss_fn, shape=shape)
    return _told(monitor)


# -- planted ------------------------------------------------------------------------------


def test_softmax_in_forward_before_cross_entropy_loss_is_told(quiet_watch):
    (alert,) = _watched(quiet_watch, Classifier("softmax"), nn.CrossEntropyLoss())
    assert alert.step == 0 and alert.severity == "warning" and alert.module == ""
    assert alert.data["kind"] == "softmax_into_cross_entropy"
    assert alert.data["loss"] == "cross_entropy" and alert.data["in_forward"] is True
    assert alert.data["source"].endswith(".py:" + str(_line("loss_fn(model(x), y)")))
    assert "nn.CrossEntropyLoss" in alert.message and "expects logits" in alert.message
    assert "remove the softmax from forward" in alert.hint and "nll_loss" in alert.hint


def test_softmax_at_the_end_of_a_cnn_is_told(quiet_watch):
    (alert,) = _watched(quiet_watch, SmallCNN(), nn.CrossEntropyLoss(), shape=(3, 14, 14))
    assert alert.data["kind"] == "softmax_into_cross_entropy"


def test_softmax_applied_in_the_loop_names_no_module(quiet_watch):
    def loss_fn(out, y):
        return F.cross_entropy(F.softmax(out, dim=1), y)

    (alert,) = _watched(quiet_watch, Classifier(), loss_fn)
    assert alert.module is None and alert.data["in_forward"] is False
    assert "before the loss" in alert.hint


def test_softmax_through_a_cast_and_a_reshape_is_told(quiet_watch):
    def loss_fn(out, y):
        probs = out.softmax(-1).double().reshape(-1, CLASSES)
        return F.cross_entropy(probs, y)

    (alert,) = _watched(quiet_watch, Classifier(), loss_fn)
    assert alert.data["kind"] == "softmax_into_cross_entropy"


def test_nll_loss_on_softmax_is_told(quiet_watch):
    (alert,) = _watched(quiet_watch, Classifier("softmax"), nn.NLLLoss())
    assert alert.data["kind"] == "softmax_into_nll" and "log_softmax" in alert.hint


def test_bce_with_logits_on_a_sigmoid_output_is_told(quiet_watch):
    def loss_fn(out, y):
        return nn.BCEWithLogitsLoss()(out.squeeze(1), (y % 2).float())

    (alert,) = _watched(quiet_watch, Classifier("sigmoid", outputs=1), loss_fn)
    assert alert.data["kind"] == "sigmoid_into_bce_with_logits" and alert.module == ""
    assert "nn.BCELoss" in alert.hint


def test_cross_entropy_on_a_sigmoid_output_is_told(quiet_watch):
    (alert,) = _watched(quiet_watch, Classifier("sigmoid"), nn.CrossEntropyLoss())
    assert alert.data["kind"] == "sigmoid_into_cross_entropy" and alert.module == ""
    assert "remove the sigmoid from forward" in alert.hint


def test_bce_with_logits_on_a_softmax_is_told(quiet_watch):
    def loss_fn(out, y):
        targets = F.one_hot(y, CLASSES).float()
        return F.binary_cross_entropy_with_logits(out.softmax(-1), targets)

    (alert,) = _watched(quiet_watch, Classifier(), loss_fn)
    assert alert.data["kind"] == "softmax_into_bce_with_logits" and alert.module is None


def _distilled_from_probabilities(out, y):
    """The student's softmax as kl_div's input: log-probabilities expected."""
    with torch.no_grad():
        teacher = F.softmax(out.detach() * 2.0, dim=1)
    return nn.KLDivLoss(reduction="batchmean")(F.softmax(out / 2.0, dim=1), teacher)


def test_kl_div_on_a_softmax_is_told(quiet_watch):
    (alert,) = _watched(quiet_watch, Classifier(), _distilled_from_probabilities)
    assert alert.data["kind"] == "softmax_into_kl_div" and alert.data["loss"] == "kl_div"
    assert "nn.KLDivLoss" in alert.message and "log-probabilities" in alert.message
    assert "log_softmax instead of softmax" in alert.hint


def test_a_disabled_rule_judges_no_loss_input(quiet_watch):
    told = _watched(quiet_watch, Classifier("softmax"), nn.CrossEntropyLoss(), loss_input=False)
    assert told == []


# -- controls: the healthy shapes ---------------------------------------------------------


def _distilled(out, y):
    """Soft targets from a teacher's softmax, under no_grad; the student's logits."""
    with torch.no_grad():
        teacher = F.softmax(out.detach() * 2.0, dim=1)
    kl = F.kl_div(F.log_softmax(out, dim=1), teacher, reduction="batchmean")
    return kl + F.cross_entropy(out, teacher)


def _with_accuracy(out, y):
    probs = F.softmax(out, dim=1)  # a metric, with gradients on: not the loss's input
    (probs.argmax(1) == y).float().mean()
    with torch.no_grad():
        F.softmax(out, dim=1).max(1)
    return F.cross_entropy(out, y)


CONTROLS = {
    "logits_into_cross_entropy": ("", nn.CrossEntropyLoss()),
    "log_softmax_into_nll": ("", lambda out, y: F.nll_loss(F.log_softmax(out, 1), y)),
    "log_of_softmax_into_nll": ("", lambda out, y: F.nll_loss(out.softmax(1).log(), y)),
    "sigmoid_into_bce": (
        "sigmoid",
        lambda out, y: nn.BCELoss()(out[:, 0], (y % 2).float()),
    ),
    "logits_into_bce_with_logits": (
        "",
        lambda out, y: F.binary_cross_entropy_with_logits(out[:, 0], (y % 2).float()),
    ),
    "softmax_for_an_accuracy_metric": ("", _with_accuracy),
    "softmax_as_a_distillation_target": ("", _distilled),
    "label_smoothing_on_logits": ("", nn.CrossEntropyLoss(label_smoothing=0.1)),
    "log_of_softmax_into_kl_div": (
        "",
        lambda out, y: F.kl_div(
            out.softmax(1).log(), F.one_hot(y, CLASSES).float() * 0.9 + 0.025, reduction="sum"
        ),
    ),
    "log_softmax_target_into_kl_div": (
        "",
        lambda out, y: F.kl_div(
            F.log_softmax(out, 1), F.log_softmax(out.detach(), 1), log_target=True
        ),
    ),
    "sigmoid_into_bce_of_many_labels": (
        "sigmoid",
        lambda out, y: F.binary_cross_entropy(out, F.one_hot(y, CLASSES).float()),
    ),
}


@pytest.mark.parametrize("name", list(CONTROLS))
def test_a_loss_given_what_it_expects_is_silent(name, quiet_watch):
    last, loss_fn = CONTROLS[name]
    assert _watched(quiet_watch, Classifier(last), loss_fn) == []


def test_an_evaluation_without_gradients_is_silent(quiet_watch):
    model = Classifier("softmax")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    _train(model, opt, lambda out, y: F.nll_loss(out.log(), y))
    with torch.no_grad():
        for x, y in _batches(2):
            F.cross_entropy(model(x), y)
    assert _told(monitor) == []


# -- trainwatch run and Lightning ---------------------------------------------------------

SCRIPT = """
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x):
        return F.softmax(self.fc3(torch.relu(self.fc1(x))), dim=1)


net = Net()
criterion = nn.CrossEntropyLoss()
opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
for step in range(6):
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    opt.zero_grad()
    loss = criterion(net(x), y)
    loss.backward()
    opt.step()
"""


@pytest.fixture
def _forget_script_modules():
    yield
    sys.modules.pop("train", None)


def test_softmax_before_cross_entropy_is_told_under_run(tmp_path, _forget_script_modules):
    import json

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    assert run_script(script, [], log_dir=tmp_path / "log") == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [json.loads(line) for line in lines]
    assert [(a["rule"], a["module"], a["data"]["kind"]) for a in found] == [
        ("loss_input", "", "softmax_into_cross_entropy")
    ]
    assert found[0]["data"]["source"].endswith("train.py:25")


class SoftmaxModule(pl.LightningModule):
    def __init__(self, softmax: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.head = nn.Linear(16, CLASSES)
        self.softmax = softmax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(torch.relu(self.fc1(x)))
        return F.softmax(out, dim=1) if self.softmax else out

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=gen)
        return DataLoader(TensorDataset(x, torch.randint(0, CLASSES, (64,), generator=gen)), 16)


@pytest.mark.parametrize("softmax", [True, False])
def test_a_lightning_module_returning_probabilities_is_told(tmp_path, softmax):
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(tmp_path, [callback], max_steps=4, num_sanity_val_steps=0)
    trainer.fit(SoftmaxModule(softmax))
    told = [a for a in callback.alerts if a.rule == "loss_input"]
    if not softmax:
        assert told == []
        return
    (alert,) = told
    assert alert.module == "" and alert.data["kind"] == "softmax_into_cross_entropy"


def _line(text: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line and "_line(" not in line)
