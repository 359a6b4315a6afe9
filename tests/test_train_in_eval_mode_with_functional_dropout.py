"""train_in_eval_mode for models whose only dropout is called as a function.

``F.dropout(x, p, training=self.training)`` (the classic mnist example, many
tutorials and research models) leaves no ``Dropout`` module to read a mode
from. The loop that calls ``model.eval()`` in its evaluation and never
``model.train()`` again trains every later epoch with that dropout off: told
at the first such step, at the module whose forward calls the function, as it
is for ``nn.Dropout``. The first training passes show which modules turn
dropout on; the evaluation in eval mode shows their calls turn it off, so
they depend on the mode. A call that never acts (``training=False``) or acts
in any mode (``F.dropout(x, p)``, its ``training`` left at its default) does
not, and a model with no dropout at all has nothing to tell.
"""

from __future__ import annotations

import io
import json

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import rules_of
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

EPOCH = 6  # training steps an epoch


class MnistNet(nn.Module):
    """The mnist example's shape: dropout only through ``F.dropout``/``F.dropout2d``."""

    def __init__(self, dropout=F.dropout) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x))
        if self.dropout is F.dropout2d:
            x = F.dropout2d(x[:, :, None, None], p=0.5, training=self.training).flatten(1)
        else:
            x = F.dropout(x, p=0.5, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


class Block(nn.Module):
    """A hidden block that drops its own output: the block is what calls the function."""

    def __init__(self, p: float = 0.3) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(F.gelu(self.lin(x)), self.p, self.training)


class BlockMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 16)
        self.block = Block()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.head(self.block(self.stem(x))), dim=1)


class FixedDropoutNet(nn.Module):
    """Dropout that does not follow the module's mode: never on, or always on."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x))
        if self.how == "never":
            x = F.dropout(x, 0.5, training=False)
        elif self.how == "always":
            x = F.dropout(x, 0.5)  # its default training=True
        return F.log_softmax(self.fc2(x), dim=1)


MODELS = {
    "root_dropout": (MnistNet, ""),
    "root_dropout2d": (lambda: MnistNet(F.dropout2d), ""),
    "block_dropout": (BlockMLP, "block"),
}
CONTROLS = {
    "no_dropout": lambda: FixedDropoutNet("none"),
    "never_on": lambda: FixedDropoutNet("never"),
    "always_on": lambda: FixedDropoutNet("always"),
}


def _data(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=gen)
    return x, x[:, :4].argmax(1)


def _fit(model: nn.Module, opt, epochs: int, train_each_epoch: bool) -> None:
    """The mnist loop: ``train()`` once before the loop (or each epoch), ``test()``
    calling ``model.eval()`` after each epoch."""
    x, y = _data(EPOCH * 8, 0)
    xt, _ = _data(32, 1)
    model.train()
    for _ in range(epochs):
        if train_each_epoch:
            model.train()
        for i in range(0, EPOCH * 8, 8):
            opt.zero_grad()
            F.nll_loss(model(x[i : i + 8]), y[i : i + 8]).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            model(xt)


def _watched(quiet_watch, build):
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    return model, opt, quiet_watch(model, opt)


@pytest.mark.parametrize("case", sorted(MODELS))
def test_training_on_after_the_evaluation_is_told_at_the_module_calling_dropout(quiet_watch, case):
    build, caller = MODELS[case]
    model, opt, monitor = _watched(quiet_watch, build)
    _fit(model, opt, epochs=3, train_each_epoch=False)
    alerts = [a for a in monitor.alerts if a.rule == "train_in_eval_mode"]
    assert alerts, rules_of(monitor, ("info", "warning", "error"))
    first = alerts[0]
    assert (first.step, first.module, first.severity) == (EPOCH, caller, "warning")
    assert first.data["modules"] == [caller]
    assert first.data["kinds"][0].startswith("F.dropout")
    assert first.data["whole_model"] is True
    assert rules_of(monitor, ("info", "warning", "error")) == ["train_in_eval_mode"] * len(alerts)


@pytest.mark.parametrize("case", sorted(MODELS))
def test_train_called_back_each_epoch_is_silent(quiet_watch, case):
    model, opt, monitor = _watched(quiet_watch, MODELS[case][0])
    _fit(model, opt, epochs=3, train_each_epoch=True)
    assert rules_of(monitor, ("info", "warning", "error")) == []


@pytest.mark.parametrize("case", sorted(CONTROLS))
@pytest.mark.parametrize("train_each_epoch", [False, True], ids=["forgotten", "switched"])
def test_dropout_that_does_not_follow_the_mode_is_silent_in_either_mode(
    quiet_watch, case, train_each_epoch
):
    model, opt, monitor = _watched(quiet_watch, CONTROLS[case])
    _fit(model, opt, epochs=3, train_each_epoch=train_each_epoch)
    assert rules_of(monitor, ("info", "warning", "error")) == []


def test_a_model_in_eval_mode_from_the_start_is_silent(quiet_watch):
    """Nothing was seen acting in training mode: the model is not known to hold dropout."""
    model, opt, monitor = _watched(quiet_watch, MnistNet)
    model.eval()
    x, y = _data(24, 0)
    for i in range(0, 24, 8):
        opt.zero_grad()
        F.nll_loss(model(x[i : i + 8]), y[i : i + 8]).backward()
        opt.step()
    assert rules_of(monitor, ("info", "warning", "error")) == []


class LookedAt(MnistNet):
    """Records, inside each forward, whether a function mode is looking at the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.looked: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.looked.append(torch._C._len_torch_function_stack() > 0)
        return super().forward(x)


@pytest.mark.parametrize("start_in_eval", [False, True], ids=["train", "eval"])
def test_only_the_first_training_passes_are_looked_at(quiet_watch, start_in_eval):
    """A healthy step past them pays for no look, in training mode or in eval mode
    (a model trained in eval mode from the start has nothing shown acting)."""
    model, opt, monitor = _watched(quiet_watch, LookedAt)
    if start_in_eval:
        model.eval()
    x, y = _data(48, 0)
    for i in range(0, 48, 8):
        opt.zero_grad()
        F.nll_loss(model(x[i : i + 8]), y[i : i + 8]).backward()
        opt.step()
    if start_in_eval:
        assert model.looked == [False] * 6
    else:
        assert model.looked == [True] * 3 + [False] * 3
    assert rules_of(monitor, ("info", "warning", "error")) == []


def test_the_training_looks_are_a_config_key_with_a_clear_error():
    import trainwatch as tw

    with pytest.raises(tw.ConfigError, match="functional_passes"):
        tw.Config.from_dict({"train_in_eval_mode": {"functional_passes": -1}})


def test_no_training_look_turns_the_rule_off_for_functional_dropout(quiet_watch):
    torch.manual_seed(0)
    model = MnistNet()
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    monitor = quiet_watch(model, opt, train_in_eval_mode={"functional_passes": 0})
    _fit(model, opt, epochs=2, train_each_epoch=False)
    assert rules_of(monitor, ("info", "warning", "error")) == []


# -- Lightning: an epoch-end sample in eval mode, train() forgotten -------------------


class SamplingNet(pl.LightningModule):
    """Logs predictions on a fixed batch at each epoch's end, in eval mode.

    Lightning puts the module in eval mode for validation and back as it was
    after, but never calls ``train()`` at an epoch's start: the ``self.eval()``
    of ``on_train_epoch_end`` holds for the next epoch unless undone.
    """

    def __init__(self, forget_train: bool) -> None:
        super().__init__()
        self.net = BlockMLP()
        self.forget_train = forget_train

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.nll_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.nll_loss(self(x), y))

    def on_train_epoch_end(self) -> None:
        self.eval()
        with torch.no_grad():
            self(_data(8, 5)[0])
        if not self.forget_train:
            self.train()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*_data(EPOCH * 8, 0)), batch_size=8)

    def val_dataloader(self):
        return DataLoader(TensorDataset(*_data(16, 1)), batch_size=8)


@pytest.mark.slow
@pytest.mark.parametrize("forget_train", [True, False], ids=["forgotten", "control"])
def test_lightning_epoch_end_eval_never_undone_is_told_at_the_next_epoch(tmp_path, forget_train):
    callback = TrainWatchCallback(console=io.StringIO())
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=3, num_sanity_val_steps=1)
    trainer.fit(SamplingNet(forget_train))
    found = [(a.rule, a.step, a.module) for a in callback.alerts if a.severity != "info"]
    if forget_train:
        assert found[0] == ("train_in_eval_mode", EPOCH, "net.block")
        assert {rule for rule, _, _ in found} == {"train_in_eval_mode"}
    else:
        assert found == []


# -- trainwatch run on an unmodified script ---------------------------------------------

MNIST_SCRIPT = """
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.dropout(x, p=0.5, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def train(model, optimizer, X, Y):
    if sys.argv[1] == "switched":
        model.train()
    for i in range(0, 320, 32):  # 10 steps an epoch
        optimizer.zero_grad()
        F.nll_loss(model(X[i : i + 32]), Y[i : i + 32]).backward()
        optimizer.step()


def test(model, Xt, Yt):
    model.eval()
    with torch.no_grad():
        return (model(Xt).argmax(1) == Yt).float().mean().item()


X = torch.randn(320, 20)
Y = X[:, :4].argmax(1)
Xt = torch.randn(64, 20)
Yt = Xt[:, :4].argmax(1)
model = Net()
optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
model.train()
for epoch in range(3):
    train(model, optimizer, X, Y)
    test(model, Xt, Yt)
print("done")
"""


@pytest.mark.parametrize("mode", ["forgotten", "switched"])
def test_trainwatch_run_tells_the_mnist_loop_that_never_calls_train_again(tmp_path, capsys, mode):
    script = tmp_path / "mnist.py"
    script.write_text(MNIST_SCRIPT)
    assert run_script(script, [mode], log_dir=tmp_path / "log") == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [(a["rule"], a["step"], a["module"]) for a in map(json.loads, lines)]
    if mode == "forgotten":
        assert found[0] == ("train_in_eval_mode", 10, "")
        assert {rule for rule, _, _ in found} == {"train_in_eval_mode"}
    else:
        assert found == []
    assert "done" in capsys.readouterr().out
