"""A finite loss whose gradient overflows fp16 where it enters the model's fp16 output
is told as that overflow, never as a non-finite loss; a NaN loss and NaN targets
are still told as the loss's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainwatch as tw

CHECKS = ["spot", "step", "deferred"]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs up to 1000 and targets near 20: the untrained model's squared error,
    summed over the batch, is about 8e7 (finite in fp32)."""
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2048, 16, generator=g) * 1000
    return x, x[:, :4].sum(1, keepdim=True) / 100


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))


def _watch(model: nn.Module, opt: torch.optim.Optimizer, check: str) -> tw.Monitor:
    kwargs = {} if check == "spot" else {"nonfinite_forward": {"check": check}}
    return tw.watch(model, opt, console=False, **kwargs)


def _pure_fp16(
    check: str, *, hand_loss: bool, nan_target: bool = False, steps: int = 3
) -> tuple[list[tw.Alert], list[float]]:
    """A pure fp16 model, an fp32 loss on ``out.float()``, a static loss scale of 1024
    by hand: the loss's gradient (2 * error * 1024) passes 65504 on its way in."""
    x, y = _data()
    if nan_target:
        y = y.clone()
        y[3] = float("nan")
    model = _model().half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-8)
    losses = []
    with _watch(model, opt, check) as monitor:
        for _ in range(steps):
            opt.zero_grad()
            loss = ((model(x.half()).float() - y) ** 2).sum()
            (loss * 1024).backward()
            if hand_loss:
                monitor.step(loss=loss)
            losses.append(loss.item())
            opt.step()
    return [a for a in monitor.alerts if a.rule.startswith("nonfinite")], losses


@pytest.mark.parametrize("check", CHECKS)
def test_a_finite_loss_whose_gradient_overflows_fp16_is_told_as_a_gradient_overflow(check):
    alerts, losses = _pure_fp16(check, hand_loss=False)
    assert losses[0] == pytest.approx(7.94e7, rel=0.01)  # finite: only its gradient overflows
    (alert,) = alerts
    assert (alert.rule, alert.step, alert.module) == ("nonfinite_backward", 0, None)
    assert alert.data["cause"] == "gradient_overflow"
    assert alert.data["dtype"] == "torch.float16"
    assert "overflowed float16's range (65504)" in alert.message
    assert "entering the model's output" in alert.message
    # Not handed over: the loss is neither called non-finite nor finite.
    assert "loss is non-finite" not in alert.message and "is finite" not in alert.message
    assert "not handed over" in alert.message
    assert "GradScaler" in alert.hint and "bf16" in alert.hint
    assert "log of a probability" not in alert.hint and "epsilon" not in alert.hint


@pytest.mark.parametrize("check", CHECKS)
def test_a_finite_loss_handed_over_whose_gradient_overflows_fp16_says_the_loss_is_finite(check):
    alerts, _ = _pure_fp16(check, hand_loss=True)
    (alert,) = alerts
    assert (alert.rule, alert.step) == ("nonfinite_backward", 0)
    assert alert.data["cause"] == "gradient_overflow"
    assert "the loss (7.94e+07) is finite" in alert.message
    assert "GradScaler" in alert.hint and "epsilon" not in alert.hint


@pytest.mark.parametrize("check", CHECKS)
def test_a_grad_scaler_that_skips_the_overflowing_steps_raises_no_nonfinite_alert(check):
    """The healthy shape: fp32 weights under fp16 autocast and a GradScaler, whose
    first scales overflow fp16 the same way; it skips those steps, then trains."""
    g = torch.Generator().manual_seed(1)
    x = torch.rand(256, 16, generator=g)
    y = x[:, :4].sum(1, keepdim=True)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = torch.amp.GradScaler("cpu")  # from 65536: the summed loss's gradient overflows
    scales = []
    with _watch(model, opt, check) as monitor:
        for _ in range(14):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            assert out.dtype == torch.float16
            loss = ((out.float() - y) ** 2).sum()
            scaler.scale(loss).backward()
            monitor.step(loss=loss)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    assert scales[0] < 65536.0 and scales[-1] == scales[-2]  # skipped, then trained
    assert [a for a in monitor.alerts if a.rule.startswith("nonfinite")] == []


@pytest.mark.parametrize("check", CHECKS)
def test_a_nan_loss_handed_over_on_an_fp16_model_is_still_the_loss_s(check):
    alerts, losses = _pure_fp16(check, hand_loss=True, nan_target=True)
    assert losses[0] != losses[0]  # NaN
    (alert,) = alerts
    assert (alert.rule, alert.step, alert.module) == ("nonfinite_loss", 0, None)
    assert alert.data["cause"] == "loss"
    assert alert.message.startswith("the loss is non-finite (nan)")
    assert "NaN or Inf in the targets" in alert.hint


@pytest.mark.parametrize("check", ["spot", "step"])
def test_nan_targets_on_an_fp16_model_without_the_loss_value_are_still_the_loss_s(check):
    """Checked as it came, the gradient entering the output is NaN, not Inf: no overflow."""
    alerts, _ = _pure_fp16(check, hand_loss=False, nan_target=True)
    (alert,) = alerts
    assert (alert.rule, alert.data["cause"]) == ("nonfinite_loss", "loss")
    assert "65504" not in alert.message


@pytest.mark.parametrize("check", CHECKS)
def test_nan_targets_in_fp32_without_the_loss_value_are_told_as_before(check):
    x, y = _data()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    with _watch(model, opt, check) as monitor:
        for step in range(3):
            opt.zero_grad()
            target = y.clone()
            if step == 1:
                target[3] = float("nan")
            ((model(x) - target) ** 2).mean().backward()
            opt.step()
    alert = next(a for a in monitor.alerts if a.rule.startswith("nonfinite"))
    assert (alert.rule, alert.step, alert.data["cause"]) == ("nonfinite_loss", 1, "loss")
    # The loss is held by no variable: the gradient entering the model cannot
    # tell a NaN loss from a finite loss whose backward made the NaN.
    assert alert.message.startswith("the loss is non-finite, or its backward is")
    assert "model's output was finite" in alert.message and "not handed over" in alert.message
    assert "NaN or Inf in the targets" in alert.hint


_SCRIPT = """
import torch
from torch import nn

g = torch.Generator().manual_seed(1)
x = torch.rand(2048, 16, generator=g) * 1000
y = x[:, :4].sum(1, keepdim=True) / 100
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).half()
opt = torch.optim.SGD(model.parameters(), lr=1e-8)
for _ in range(3):
    opt.zero_grad()
    loss = ((model(x.half()).float() - y) ** 2).sum()
    (loss * 1024).backward()
    opt.step()
"""


def test_under_trainwatch_run_the_overflow_message_asks_for_no_monitor_call(tmp_path):
    """The script has no monitor to hand the loss to: the message says the loss was
    not seen instead of pointing at ``monitor.step(loss=loss)``."""
    import json

    from trainwatch.runner import run_script

    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    run_script(script, [], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    (alert,) = [a for a in map(json.loads, lines) if a["rule"].startswith("nonfinite")]
    assert alert["data"]["cause"] == "gradient_overflow"
    assert "the loss was not seen" in alert["message"]
    assert "monitor.step" not in alert["message"]
