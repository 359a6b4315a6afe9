"""What the non-finite rules say must be true of the loop: gradients that are finite
but too large for their norm, steps the loop skips itself, matmul overflows in
fp32, and a non-finite batch the loop's own guard skips."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import trainwatch as tw
from trainwatch.config import NonfiniteConfig
from trainwatch.record import NonfiniteReport, StepRecord
from trainwatch.rules.nonfinite import NonfiniteBackwardRule


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 64)
        self.fc2 = nn.Linear(64, 64)
        self.out = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.fc2(F.relu(self.fc1(x))))).squeeze(-1)


class RootFeatures(nn.Module):
    """sqrt of a pre-activation that goes negative once ``broken`` (meant: relu first)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 32)
        self.broken = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x)
        return torch.sqrt(z - 10.0) if self.broken else torch.sqrt(F.relu(z) + 1e-6)


def regress(
    monitor_kwargs: dict | None = None,
    *,
    bad_step: int = 5,
    steps: int = 10,
    where: str = "target",
    value: float = 1e21,
    clip: bool = True,
    guard: bool = False,
    hand_loss: bool = False,
) -> list[tw.Alert]:
    """A regression loop with one corrupt batch at ``bad_step``; ``guard``: the loop
    skips the update when the clipped norm is non-finite."""
    torch.manual_seed(0)
    w = torch.randn(10)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with tw.watch(model, opt, console=False, **(monitor_kwargs or {})) as monitor:
        for step in range(steps):
            x = torch.randn(64, 10)
            y = x @ w + 0.1 * torch.randn(64)
            if step == bad_step:
                if where == "target":
                    y[7] = value
                else:
                    x[7, 3] = value
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if hand_loss:
                monitor.step(loss=loss)
            norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0) if clip else None
            if guard and norm is not None and not torch.isfinite(norm):
                continue
            opt.step()
    return monitor.alerts


@pytest.mark.parametrize("check", ["auto", "step"])
def test_finite_gradients_whose_norm_overflows_are_told_as_exploding_not_as_nan(check):
    # "step": the path a GPU takes (the norms read at the step boundary).
    alerts = regress({"nonfinite_forward": {"check": check}})
    assert [(a.rule, a.step) for a in alerts] == [("exploding_gradient", 5)]
    (alert,) = alerts
    assert alert.data["cause"] == "norm_overflow"
    # Named where the largest gradient element is, and told as it is.
    assert alert.data["parameter"].rsplit(".", 1)[0] == alert.module
    assert 1e19 < alert.data["largest"] < 1e21
    assert "every gradient is finite" in alert.message
    # clip_grad_norm_ divided by an infinite total: the update carried zeros.
    assert alert.data["clipped_to_zero"] is True and "= 0" in alert.message
    assert "epsilon" not in alert.hint and "outlier" in alert.hint


def test_a_large_outlier_whose_norm_still_fits_raises_nothing():
    assert regress(value=1e12) == []


def test_an_overflowing_norm_without_a_clip_says_nothing_of_one_and_the_nan_it_leads_to_says_so():
    alerts = regress(clip=False)
    assert (alerts[0].rule, alerts[0].step) == ("exploding_gradient", 5)
    assert alerts[0].data["cause"] == "norm_overflow" and "clip" not in alerts[0].message
    assert "clipped_to_zero" not in alerts[0].data
    assert not [a for a in alerts if a.rule == "nonfinite_backward"]
    later = [a for a in alerts if a.rule.startswith("nonfinite")]
    assert later and all(a.step > 5 and a.data["after_exploding"] for a in later)


def test_an_overflowing_norm_the_loop_skips_says_no_step_followed():
    alerts = regress(guard=True)
    assert [(a.rule, a.data["cause"]) for a in alerts] == [("exploding_gradient", "norm_overflow")]
    assert "no optimizer step followed" in alerts[0].message


def test_the_loss_handed_over_as_inf_is_the_finding_when_the_norm_overflows():
    alerts = regress(hand_loss=True)
    assert [(a.rule, a.step) for a in alerts] == [("nonfinite_loss", 5)]
    (alert,) = alerts
    assert "(inf)" in alert.message and "every gradient is finite" in alert.message
    assert alert.data["largest"] > 1e19 and "outlier" in alert.hint


def test_a_finite_loss_handed_over_with_a_large_outlier_raises_nothing():
    assert regress(hand_loss=True, value=1e12) == []


def test_a_matmul_overflowing_fp32_is_told_with_fp32_s_range_not_fp16_advice():
    alerts = regress(where="input", value=1e30, clip=False)
    (alert,) = [a for a in alerts if a.rule.startswith("nonfinite")][:1]
    assert alert.rule == "nonfinite_backward" and alert.data["op"] == "aten::addmm"
    assert "float32's range" in alert.hint and "65504" not in alert.hint


def test_a_matmul_overflowing_fp16_keeps_the_fp16_advice():
    rule = NonfiniteBackwardRule(NonfiniteConfig())
    record = StepRecord(step=3)
    record.nonfinite_backward = NonfiniteReport(
        module="out", cause="module", op="aten::addmm", dtype="torch.float16"
    )
    (alert,) = rule.evaluate(record)
    assert "65504" in alert.hint


def _skipping_loop(monitor_kwargs: dict, scaler: torch.amp.GradScaler | None, steps: int = 30):
    """Healthy for 5 steps, then a NaN born in a layer on every batch: each update is
    skipped, by the loop's own guard or by the GradScaler."""
    torch.manual_seed(0)
    feat = RootFeatures()
    model = nn.Sequential(feat, nn.Linear(32, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=False, **monitor_kwargs) as monitor:
        for step in range(steps):
            feat.broken = step >= 5
            x = torch.randn(32, 8)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), (x[:, :3]).argmax(1))
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                continue
            loss.backward()
            norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if torch.isfinite(norm):
                opt.step()
    return [a for a in monitor.alerts if a.rule == "amp_skipped_steps"]


def test_steps_the_loop_skips_itself_are_not_told_as_a_grad_scaler_s():
    (alert,) = _skipping_loop({}, None)
    assert alert.data["skipped"] >= 10 and "scale" not in alert.data
    assert "GradScaler keeps skipping" not in alert.message
    assert "loss scale is collapsing" not in alert.message
    assert "guard in the loop" in alert.message


def test_steps_a_watched_grad_scaler_skips_are_told_as_the_scaler_s():
    scaler = torch.amp.GradScaler("cpu")
    (alert,) = _skipping_loop({"scaler": scaler}, scaler)
    assert "GradScaler keeps skipping" in alert.message and "scale" in alert.data


class LogVariance(nn.Module):
    """A heteroscedastic head taking the log of a predicted variance that can go negative."""

    def __init__(self) -> None:
        super().__init__()
        self.var = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.var(x))


def test_the_log_of_a_variance_gone_negative_is_hinted_at_softplus_not_only_log_softmax():
    torch.manual_seed(0)
    model = LogVariance()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        opt.zero_grad()
        model(torch.randn(16, 8)).mean().backward()  # some predicted variances < 0
        opt.step()
    (alert,) = [a for a in monitor.alerts if a.rule == "nonfinite_forward"]
    assert (alert.module, alert.data["op"]) == ("", "aten::log")
    assert "softplus" in alert.hint and "log_softmax" in alert.hint


class Transcriber(nn.Module):
    """A 1-D conv front-end and a GRU, log-probabilities per frame for CTC."""

    def __init__(self, classes: int = 6) -> None:
        super().__init__()
        self.conv = nn.Conv1d(8, 16, 3, padding=1)
        self.rnn = nn.GRU(16, 16, batch_first=True)
        self.out = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(x)).transpose(1, 2)
        return self.out(self.rnn(h)[0]).log_softmax(-1).transpose(0, 1)  # (T, N, C)


def _ctc_alerts(target_length: int, zero_infinity: bool) -> list[tw.Alert]:
    torch.manual_seed(0)
    model = Transcriber()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctc = nn.CTCLoss(zero_infinity=zero_infinity)
    frames = 10
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(3):
            x = torch.randn(4, 8, frames)
            targets = torch.randint(1, 6, (4, target_length))
            loss = ctc(
                model(x),
                targets,
                torch.full((4,), frames),
                torch.full((4,), target_length),
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    return monitor.alerts


def test_a_ctc_target_longer_than_its_input_is_named_in_the_loss_hint():
    alerts = [a for a in _ctc_alerts(target_length=14, zero_infinity=False) if a.severity != "info"]
    assert alerts and alerts[0].rule == "nonfinite_loss"
    assert "zero_infinity=True" in alerts[0].hint


def test_ctc_targets_that_fit_their_input_or_zero_infinity_raise_nothing():
    assert _ctc_alerts(target_length=4, zero_infinity=False) == []
    assert [
        a for a in _ctc_alerts(target_length=14, zero_infinity=True) if a.severity != "info"
    ] == []


class MeanPooled(nn.Module):
    """Token ids, a padding mask and a 0-d count handed along (as the Hugging Face
    Trainer hands ``num_items_in_batch``); mean pooling divides by the mask's sum."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, ids, mask, num_items_in_batch=None):
        summed = (self.embed(ids) * mask[..., None]).sum(1)
        pooled = summed / mask.sum(1, keepdim=True)  # 0/0 for a row of padding only
        return self.head(pooled).squeeze(-1)


def test_a_scalar_argument_is_not_told_as_the_passs_input_range():
    torch.manual_seed(0)
    model = MeanPooled()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(3):
            ids = torch.randint(0, 20, (4, 6))
            mask = torch.ones(4, 6)
            if step == 1:
                mask[2] = 0.0
            out = model(ids, mask, num_items_in_batch=torch.tensor(16.0))
            loss = out.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    first = next(a for a in monitor.alerts if a.rule == "nonfinite_forward")
    assert first.step == 1
    assert "[16, 16]" not in first.message
    assert first.data["input_min"] == 0.0 and first.data["input_max"] == 1.0  # the mask's
