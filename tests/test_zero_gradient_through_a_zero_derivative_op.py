"""zero_gradient names an op with a zero derivative (torch.round, torch.sign) when every
path from the model's output to the silent parameters passes through one: a weight
fake-quantised or binarised without a straight-through estimator, a rounded
activation. Not the dead-ReLU story: the layer's bias learns, nothing is dead. Each
beside its healthy twin (the same op with a straight-through estimator), and dead
units, which have no such op, keep their own story."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.conftest import rules_of


def _rounded(t: torch.Tensor, op, ste: bool) -> torch.Tensor:
    return t + (op(t) - t).detach() if ste else op(t)


class QLinear(nn.Linear):
    """A Linear whose weight is fake-quantised to 8 bits in its forward."""

    ste = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.weight.detach().abs().max() / 127
        return F.linear(x, _rounded(self.weight / s, torch.round, self.ste) * s, self.bias)


class BinaryConv(nn.Conv2d):
    """A conv whose weight is binarised (BinaryConnect)."""

    ste = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _rounded(self.weight, torch.sign, self.ste) * 0.1
        return F.conv2d(x, w, self.bias, padding=1)


class RoundedActivation(nn.Module):
    """An activation quantised to steps of 1/4."""

    def __init__(self, ste: bool) -> None:
        super().__init__()
        self.ste = ste

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rounded(x * 4, torch.round, self.ste) / 4


def _with_ste(model: nn.Module, ste: bool) -> nn.Module:
    for module in model.modules():
        if isinstance(module, (QLinear, BinaryConv)):
            module.ste = ste
    return model


def _train(quiet_watch, shape: str, ste: bool, steps: int = 8):
    torch.manual_seed(0)
    if shape == "mlp":
        model = nn.Sequential(QLinear(16, 64), nn.ReLU(), QLinear(64, 1))
        x = torch.randn(256, 16)
        y, loss_of = x[:, :4].sum(1, keepdim=True), F.mse_loss
    elif shape == "conv":
        model = nn.Sequential(
            BinaryConv(3, 8, 3),
            nn.ReLU(),
            BinaryConv(8, 8, 3),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(8 * 8 * 8, 2),
        )
        x = torch.randn(64, 3, 8, 8)
        y, loss_of = (x[:, 0].mean((1, 2)) > 0).long(), F.cross_entropy
    else:  # "activation"
        model = nn.Sequential(
            nn.Linear(16, 32), RoundedActivation(ste), nn.ReLU(), nn.Linear(32, 1)
        )
        x = torch.randn(256, 16)
        y, loss_of = x[:, :4].sum(1, keepdim=True), F.mse_loss
    model = _with_ste(model, ste)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(steps):
        opt.zero_grad()
        loss_of(model(x), y).backward()
        opt.step()
    return monitor


def _zero(monitor) -> dict[str, object]:
    return {a.module: a for a in monitor.alerts if a.rule == "zero_gradient"}


@pytest.mark.parametrize("shape, op", [("mlp", "torch.round"), ("conv", "torch.sign")])
def test_a_weight_quantised_without_a_straight_through_estimator_names_the_op(
    quiet_watch, shape, op
):
    found = _zero(_train(quiet_watch, shape, ste=False))
    assert set(found) == {"0", "2"}
    for module, alert in found.items():
        assert alert.data["parameters"] == [f"{module}.weight"]  # the bias learns
        assert alert.data["cause"] == "zero_derivative_op"
        assert alert.data["ops"] == [op]
        assert f"passes through {op}, whose derivative is zero" in alert.message
        assert "the layer's bias got a gradient" in alert.message
        assert "dead" not in alert.hint  # the old hint blamed dead units upstream
        assert "(w.round() - w).detach()" in alert.hint


@pytest.mark.parametrize("shape", ["mlp", "conv", "activation"])
def test_control_the_same_op_with_a_straight_through_estimator_is_silent(quiet_watch, shape):
    monitor = _train(quiet_watch, shape, ste=True)
    assert rules_of(monitor) == []
    # The graph is kept only while a zero streak is open: never here.
    assert "zero-derivative look" not in monitor._pipeline.passes.listener_names()


def test_a_rounded_activation_names_round_for_the_layer_behind_it(quiet_watch):
    found = _zero(_train(quiet_watch, "activation", ste=False))
    assert set(found) == {"0"}  # the layer after the rounding learns
    alert = found["0"]
    assert alert.data["parameters"] == ["0.weight", "0.bias"]
    assert alert.data["cause"] == "zero_derivative_op" and alert.data["ops"] == ["torch.round"]
    assert "every path from the model's output back to them passes through torch.round" in (
        alert.message
    )
    assert "bias got a gradient" not in alert.message  # it did not


def test_the_graph_is_let_go_once_the_zero_gradient_is_told(quiet_watch):
    monitor = _train(quiet_watch, "mlp", ste=False, steps=6)
    look = monitor._pipeline._zero_look
    assert not look.wanted and look._roots is None
    assert "zero-derivative look" not in monitor._pipeline.passes.listener_names()


class DeadBeforeFc2(nn.Module):
    """fc1's units all dead (a bias far below zero before the ReLU): fc2's input is zero."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)
        with torch.no_grad():
            self.fc1.bias.fill_(-100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_control_dead_units_name_no_op_and_say_where_the_zero_is(quiet_watch):
    torch.manual_seed(0)
    model = DeadBeforeFc2()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for _ in range(5):
        x = torch.randn(32, 8)
        opt.zero_grad()
        F.mse_loss(model(x), x[:, :1]).backward()
        opt.step()
    found = _zero(monitor)
    assert set(found) == {"fc1", "fc2"}
    for alert in found.values():
        assert "cause" not in alert.data and "ops" not in alert.data
        assert "dead (ReLU stuck at 0)" in alert.hint
    # fc2's bias learns: its weight's input (fc1's dead units) is what is zero.
    assert found["fc2"].data["bias_learns"] is True
    assert "while fc2.bias got a gradient" in found["fc2"].message
    assert "its input is exactly zero" in found["fc2"].hint
    # fc1's weight and bias are both silent: its own units are dead.
    assert "bias_learns" not in found["fc1"].data
    assert found["fc1"].data["parameters"] == ["fc1.weight", "fc1.bias"]


ROUNDED_SCRIPT = textwrap.dedent(
    """
    import torch
    from torch import nn
    from torch.nn import functional as F

    STE = {ste}

    class QLinear(nn.Linear):
        def forward(self, x):
            s = self.weight.detach().abs().max() / 127
            w = self.weight / s
            w = w + (w.round() - w).detach() if STE else torch.round(w)
            return F.linear(x, w * s, self.bias)

    torch.manual_seed(0)
    model = nn.Sequential(QLinear(16, 64), nn.ReLU(), QLinear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(256, 16)
    for _ in range(8):
        opt.zero_grad()
        F.mse_loss(model(x), x[:, :4].sum(1, keepdim=True)).backward()
        opt.step()
    """
)


@pytest.mark.parametrize("ste", [False, True], ids=["no_ste", "ste"])
def test_trainwatch_run_names_the_op_too(tmp_path, ste):
    from trainwatch.runner import run_script

    script = tmp_path / "quantised.py"
    script.write_text(ROUNDED_SCRIPT.format(ste=ste))
    assert run_script(script, log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [a for a in map(json.loads, lines) if a["severity"] != "info"]
    if ste:
        assert found == []
    else:
        assert [(a["rule"], a["module"], a["data"].get("cause")) for a in found] == [
            ("zero_gradient", "0", "zero_derivative_op"),
            ("zero_gradient", "2", "zero_derivative_op"),
        ]


@pytest.mark.parametrize("ste", [False, True], ids=["no_ste", "ste"])
def test_lightning_names_the_op_for_a_module_trained_through_its_parts(tmp_path, ste):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from tests.lightning_models import quiet_trainer
    from trainwatch.lightning import TrainWatchCallback

    class Quantised(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = _with_ste(QLinear(8, 32), ste)
            self.head = _with_ste(QLinear(32, 1), ste)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.head(torch.relu(self.fc1(x))), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    x = torch.randn(128, 8)
    data = DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=16)
    callback = TrainWatchCallback(console=False)
    quiet_trainer(tmp_path, [callback], max_epochs=1).fit(Quantised(), data)
    found = [a for a in callback.alerts if a.severity != "info"]
    if ste:
        assert found == []
    else:
        assert [(a.module, a.data.get("cause"), a.data.get("ops")) for a in found] == [
            ("fc1", "zero_derivative_op", ["torch.round"]),
            ("head", "zero_derivative_op", ["torch.round"]),
        ]
