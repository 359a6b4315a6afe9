"""A finite loss whose backward is not: the ``torch.where`` gradient trap in the loss.

FixMatch guards its unlabelled loss against an empty confidence mask with
``torch.where(n > 0, s / n, 0)``: the loss stays finite (``where`` picks 0),
but backward still runs through ``s / n``, and at ``n == 0`` its 0 * inf =
NaN reaches every gradient. With the loss not handed over (a plain loop,
``trainwatch run``) this was told as ``nonfinite_loss``, "the loss is
non-finite", contradicting the finite loss the script prints. It is
``nonfinite_backward``, in the loss's backward, with the op (``aten::div``
under the ``where``) and the line, whichever way trainwatch is attached; a
loss that really is NaN stays ``nonfinite_loss``. Each planted bug has a clean
twin (``s / n.clamp_min(1)``) that stays silent.
"""

from __future__ import annotations

import inspect
import io
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.test_run import alerts as logged_alerts
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

EMPTY_AT = 3  # the step whose confidence mask is all zero
# "auto" judges each pass as it ends on CPU; "step" takes the path a GPU takes
# (one scalar read at the step boundary).
CHECKS = ["auto", "step"]


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))


def _fixmatch(guard: str, check: str) -> tuple[tw.Monitor, list[float]]:
    """FixMatch's unlabelled loss, the loss never handed over; the losses it printed."""
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    printed = []
    with tw.watch(model, opt, console=io.StringIO(), nonfinite_forward={"check": check}) as monitor:
        for step in range(6):
            x, y, xu = torch.randn(16, 16), torch.randint(0, 2, (16,)), torch.randn(8, 16)
            loss = F.cross_entropy(model(x), y)
            with torch.no_grad():
                conf, pseudo = model(xu).softmax(-1).max(-1)
                mask = (conf >= (1.1 if step == EMPTY_AT else 0.0)).float()
            n = mask.sum()
            s = (F.cross_entropy(model(xu), pseudo, reduction="none") * mask).sum()
            loss_u = (  # the where guard
                torch.where(n > 0, s / n, torch.zeros(()))
                if guard == "where"
                else s / n.clamp_min(1)
            )
            loss = loss + loss_u
            opt.zero_grad()
            loss.backward()
            opt.step()
            printed.append(loss.item())
    return monitor, printed


def _nonfinite(alerts) -> list:
    return [a for a in alerts if a.rule.startswith("nonfinite")]


def _line(function, text: str) -> int:
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("check", CHECKS)
def test_a_where_guarded_division_is_the_losss_backward_not_a_nonfinite_loss(check):
    monitor, printed = _fixmatch("where", check)
    assert math.isfinite(printed[EMPTY_AT])  # the loss the user sees
    found = _nonfinite(monitor.alerts)
    assert [(a.rule, a.step, a.module, a.data["cause"]) for a in found] == [
        ("nonfinite_backward", EMPTY_AT, None, "loss")
    ], [(a.rule, a.message) for a in found]
    (alert,) = found
    assert "in the loss's backward, before the gradient reached the model" in alert.message
    assert "the loss is non-finite" not in alert.message
    assert alert.data["loss"] == pytest.approx(printed[EMPTY_AT])
    assert f"({printed[EMPTY_AT]:.4g}) is finite" in alert.message
    assert (alert.data["op"], alert.data["under_where"]) == ("aten::div", True)
    assert alert.data["source"] == f"{__file__}:{_line(_fixmatch, '# the where guard')}"
    assert "torch.where" in alert.hint and "clamp_min(1)" in alert.hint


@pytest.mark.parametrize("check", [*CHECKS, "deferred"])
def test_the_division_by_a_clamped_count_is_silent(check):
    monitor, printed = _fixmatch("clamp", check)
    assert all(map(math.isfinite, printed))
    assert [a.key for a in monitor.alerts if a.severity != "info"] == []


def masked_mean(values: torch.Tensor, mask: torch.Tensor, guard: str) -> torch.Tensor:
    """The same guard in a helper the loop calls: its frame is gone at the step."""
    n = mask.sum()
    if guard == "where":
        return torch.where(n > 0, (values * mask).sum() / n, 0.0)
    return (values * mask).sum() / n.clamp_min(1)


def sqrt_loss(out: torch.Tensor, y: torch.Tensor, zero: bool, guard: str) -> torch.Tensor:
    """A squared error plus the sqrt of a spread that is exactly 0 when ``zero``:
    sqrt's derivative there is infinite, and 0 * inf = NaN."""
    spread = ((out - out.detach()) ** 2 if zero else (out - y) ** 2).sum()
    return F.mse_loss(out, y) + 1e-3 * torch.sqrt(spread if guard == "bare" else spread + 1e-12)


def _regression(guard: str, loss_of: str = "masked") -> tw.Monitor:
    """A regression loop with the masked mean (or the sqrt) in a helper, its loss
    accumulated over two micro-batches and scaled by hand."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for step in range(4):
            opt.zero_grad()
            for _ in range(2):
                x, y = torch.randn(32, 8), torch.randn(32)
                out = model(x).squeeze(-1)
                keep = (y.abs() < (0.0 if step == 2 else 9.0)).float()
                loss = (  # the helper's line
                    masked_mean((out - y) ** 2, keep, guard) / 2
                    if loss_of == "masked"
                    else sqrt_loss(out, y, step == 2, guard) / 2
                )
                loss.backward()
            opt.step()
    return monitor


def test_a_where_guard_inside_a_helper_names_the_loops_line():
    (alert,) = _nonfinite(_regression("where").alerts)
    assert (alert.rule, alert.step, alert.data["cause"]) == ("nonfinite_backward", 2, "loss")
    # ``loss / 2`` is a division too: the one under the where is named.
    assert (alert.data["op"], alert.data["under_where"]) == ("aten::div", True)
    assert alert.data["source"] == f"{__file__}:{_line(_regression, '# the helper')}"


def test_a_sqrt_at_zero_in_the_loss_is_its_backward_without_a_where():
    (alert,) = _nonfinite(_regression("bare", loss_of="sqrt").alerts)
    assert (alert.rule, alert.step, alert.data["cause"]) == ("nonfinite_backward", 2, "loss")
    # Neither the squared error's ``** 2`` nor the finite ``loss / 2`` can blow up.
    assert alert.data["op"] == "aten::sqrt" and "under_where" not in alert.data
    assert "sqrt" in alert.hint and "torch.where gradient trap" not in alert.hint


@pytest.mark.parametrize("loss_of", ["masked", "sqrt"])
def test_the_helpers_clean_twins_are_silent(loss_of):
    monitor = _regression("clamp" if loss_of == "masked" else "eps", loss_of=loss_of)
    assert [a.key for a in monitor.alerts if a.severity != "info"] == []


def test_a_nan_loss_the_loop_holds_is_still_a_nonfinite_loss_with_its_value():
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for step in range(3):
            x, y = torch.randn(16, 16), torch.randn(16, 2)
            if step == 1:
                y[0, 0] = float("nan")  # a NaN target: the loss itself is NaN
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (alert, *_) = _nonfinite(monitor.alerts)
    assert (alert.rule, alert.step, alert.data["cause"]) == ("nonfinite_loss", 1, "loss")
    assert alert.message.startswith("the loss is non-finite (nan)")
    assert "op" not in alert.data


def test_deferred_checks_do_not_claim_a_loss_they_never_saw_is_non_finite():
    """No sync at the step: by the time the sums are read the loss is gone."""
    monitor, _ = _fixmatch("where", "deferred")
    (alert, *_) = _nonfinite(monitor.alerts)
    assert (alert.rule, alert.step, alert.data["cause"]) == ("nonfinite_loss", EMPTY_AT, "loss")
    assert alert.message.startswith("the loss is non-finite, or its backward is")
    assert "torch.where" in alert.hint


SCRIPT = """\
import torch, torch.nn as nn, torch.nn.functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    x, y, xu = torch.randn(16, 16), torch.randint(0, 2, (16,)), torch.randn(8, 16)
    loss = F.cross_entropy(model(x), y)
    with torch.no_grad():
        conf, pseudo = model(xu).softmax(-1).max(-1)
        mask = (conf >= (0.0 if step != 3 else 1.1)).float()
    n = mask.sum()
    s = (F.cross_entropy(model(xu), pseudo, reduction="none") * mask).sum()
    loss_u = {guard}
    loss = loss + loss_u
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.parametrize(
    "guard", ["torch.where(n > 0, s / n, torch.zeros(()))", "s / n.clamp_min(1)"]
)
def test_trainwatch_run_tells_the_losss_backward_with_its_line(tmp_path, guard):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(guard=guard))
    run_script(script, [], log_dir=tmp_path / "log", console=False)
    logged = logged_alerts(tmp_path / "log")
    if "clamp_min" in guard:
        assert [a["rule"] for a in logged if a["severity"] != "info"] == []
        return
    found = [a for a in logged if a["rule"].startswith("nonfinite")]
    assert [(a["rule"], a["step"], a["data"]["cause"]) for a in found] == [
        ("nonfinite_backward", 3, "loss")
    ]
    assert (found[0]["data"]["op"], found[0]["data"]["source"]) == ("aten::div", f"{script}:14")


class FixMatch(L.LightningModule):
    def __init__(self, guard: str) -> None:
        super().__init__()
        self.net, self.guard = _model(), guard

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, index):
        x, y, xu = batch
        loss = F.cross_entropy(self(x), y)
        with torch.no_grad():
            conf, pseudo = self(xu).softmax(-1).max(-1)
            mask = (conf >= (1.1 if index == EMPTY_AT else 0.0)).float()
        n = mask.sum()
        s = (F.cross_entropy(self(xu), pseudo, reduction="none") * mask).sum()
        unlabelled = torch.where(n > 0, s / n, 0.0) if self.guard == "where" else s / n.clamp_min(1)
        return loss + unlabelled

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("guard", ["where", "clamp"])
def test_lightning_names_the_op_of_the_losss_backward(tmp_path, guard):
    torch.manual_seed(0)
    callback = TrainWatchCallback(console=False, log_dir=tmp_path / "log")
    data = TensorDataset(torch.randn(96, 16), torch.randint(0, 2, (96,)), torch.randn(96, 16))
    L.Trainer(
        max_steps=6,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=tmp_path,
    ).fit(FixMatch(guard), DataLoader(data, batch_size=16))
    found = _nonfinite(callback.alerts)
    if guard == "clamp":
        assert [a.key for a in callback.alerts if a.severity != "info"] == []
        return
    assert [(a.rule, a.step, a.data["cause"]) for a in found] == [
        ("nonfinite_backward", EMPTY_AT, "loss")
    ]
    assert "is finite" in found[0].message
    assert (found[0].data["op"], found[0].data["under_where"]) == ("aten::div", True)
