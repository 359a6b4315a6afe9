"""stalled_training: a run that leaves what the model computes as it was, seen on its first batch.

Planted stalls (a learning rate of 1e-12, a warm-up schedule in the wrong
unit, adapters on a branch scaled by 1e-6, a new phase whose optimizer does
nothing) in a plain loop, a Lightning module and a script under
``trainwatch run``, each beside the same run made healthy; five healthy
families (small learning rates included) that must stay silent; and the
re-run's promises: training bit for bit as without it, modes and buffers
as they were, a model that cannot be re-run left alone.
"""

from __future__ import annotations

import copy
import io
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import trainwatch as tw
from tests.lightning_models import BoringNet
from trainwatch.config import Config, StalledTrainingConfig
from trainwatch.errors import ConfigError
from trainwatch.lightning import TrainWatchCallback
from trainwatch.record import StallReport, StepRecord
from trainwatch.rules.stalled import StalledTrainingRule
from trainwatch.tensorboard_plugin import metadata

# Short phases for the tests: a re-run every 20 steps, verdicts from step 40.
SHORT = {"stalled_training": {"every": 20, "warmup": 40, "loss_window": 10}}


def _stalls(alerts) -> list[tw.Alert]:
    return [a for a in alerts if a.rule == "stalled_training"]


# -- models ------------------------------------------------------------------------
def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


class Scaled(nn.Module):
    """A branch whose output the model scales down to almost nothing."""

    def __init__(self, inner: nn.Module, scale: float) -> None:
        super().__init__()
        self.inner = inner
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank ``B @ A`` (B starts at zero), as LoRA does."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * 2.0


class Backbone(nn.Module):
    """A trunk, a side branch whose output is scaled by 1e-6, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32))
        self.side = Scaled(nn.Linear(32, 32), 1e-6)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return self.head(h + self.side(h))


def _target(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([x[:, :4].sum(1).sin(), x[:, 4:8].prod(1), x[:, 8].cos(), x[:, 9]], 1)


def _pretrained() -> Backbone:
    """A backbone trained a little on a task of its own: the start of a fine-tune."""
    torch.manual_seed(0)
    model = Backbone()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        x = torch.randn(64, 16, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), _target(x)).backward()
        opt.step()
    return model


def _with_adapters(model: Backbone, where: str) -> list[nn.Parameter]:
    """LoRA on the Linear at ``where``, everything else frozen; the trainable parameters."""
    model.requires_grad_(False)
    parent_name, _, child = where.rpartition(".")
    parent = model.get_submodule(parent_name)
    setattr(parent, child, LoRALinear(getattr(parent, child)))
    return [p for p in model.parameters() if p.requires_grad]


def _regression(model, opt, steps, *, monitor=None, seed=1, inputs=8, target=None):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(64, inputs, generator=gen)
        y = target(x) if target is not None else x[:, :1].sin()
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if monitor is not None:
            monitor.step(loss=loss)


# -- plain loops ---------------------------------------------------------------------
@pytest.mark.parametrize("lr, stalled", [(1e-12, True), (1e-3, False)])
def test_a_learning_rate_of_1e_12_stalls_at_the_first_check_past_warm_up(quiet_watch, lr, stalled):
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    monitor = quiet_watch(model, opt)  # the defaults: a re-run every 100 steps, from step 200
    _regression(model, opt, 220, monitor=monitor)
    found = _stalls(monitor.alerts)
    if not stalled:
        assert found == []
        return
    (alert,) = found
    assert (alert.step, alert.module, alert.severity) == (199, "", "warning")
    assert alert.data["change"] < 1e-5 and alert.data["learning_rates"] == [1e-12]
    assert alert.data["update_ratio_median"] < 1e-6
    assert "the loss flat" in alert.message and "lr 1.0e-12" in alert.message
    assert "trainable 321 of 321 parameters" in alert.message


@pytest.mark.parametrize("where, stalled", [("side.inner", True), ("trunk.2", False)])
def test_adapters_on_a_branch_scaled_by_1e_6_stall_while_adapters_on_the_trunk_train(
    quiet_watch, where, stalled
):
    model = _pretrained()
    trainable = _with_adapters(model, where)
    opt = torch.optim.Adam(trainable, lr=1e-3)
    monitor = quiet_watch(model, opt, **SHORT)
    _regression(model, opt, 45, monitor=monitor, inputs=16, target=_target)
    found = _stalls(monitor.alerts)
    assert len(found) == int(stalled)
    if stalled:
        alert = found[0]
        assert alert.step == 39
        # The audit in brief: few trainable parameters, and where they sit.
        assert alert.data["trainable"] == 4 * 32 * 2
        assert set(alert.data["trainable_in"]) == {"side.inner.lora_A", "side.inner.lora_B"}
        # The adapters themselves move at a healthy rate: their output is what does not count.
        assert alert.data["update_ratio_median"] > 1e-4


def test_a_new_optimizer_restarts_the_comparison_from_its_own_first_batch(quiet_watch):
    """Pre-training moves the model; a fine-tune whose optimizer does nothing is its own phase."""
    torch.manual_seed(0)
    model = _mlp()
    pretrain = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, pretrain, **SHORT)
    _regression(model, pretrain, 30, monitor=monitor)
    fine_tune = torch.optim.Adam(model.parameters(), lr=1e-12)
    monitor.add_optimizer(fine_tune)
    _regression(model, fine_tune, 45, monitor=monitor, seed=2)
    (alert,) = _stalls(monitor.alerts)
    assert alert.step == 30 + 39 and alert.data["steps"] == 40


def _frozen_pretraining_then_adapters(quiet_watch, adapter_lr: float) -> list[tw.Alert]:
    """Pre-training at 3e-3, then the model frozen and adapters put on the side branch
    with an optimizer of their own: the first optimizer holds nothing trainable now."""
    torch.manual_seed(0)
    model = Backbone()
    pretrain = torch.optim.Adam(model.parameters(), lr=3e-3)
    monitor = quiet_watch(model, pretrain, **SHORT)
    _regression(model, pretrain, 30, monitor=monitor, inputs=16, target=_target)
    trainable = _with_adapters(model, "side.inner")
    fine_tune = torch.optim.Adam(trainable, lr=adapter_lr)
    monitor.add_optimizer(fine_tune)
    _regression(model, fine_tune, 45, monitor=monitor, seed=2, inputs=16, target=_target)
    return _stalls(monitor.alerts)


def test_a_stall_lists_no_learning_rate_of_an_optimizer_over_frozen_weights(quiet_watch):
    (alert,) = _frozen_pretraining_then_adapters(quiet_watch, 1e-12)
    assert alert.data["learning_rates"] == [1e-12]
    assert "; lr 1.0e-12" in alert.message and "3.0e-03" not in alert.message
    assert "the loss flat" in alert.message


def test_control_adapters_that_train_after_a_frozen_pretraining_do_not_stall(quiet_watch):
    """(On the trunk: the side branch's output is scaled by 1e-6 and stalls at any rate.)"""
    torch.manual_seed(0)
    model = Backbone()
    pretrain = torch.optim.Adam(model.parameters(), lr=3e-3)
    monitor = quiet_watch(model, pretrain, **SHORT)
    _regression(model, pretrain, 30, monitor=monitor, inputs=16, target=_target)
    fine_tune = torch.optim.Adam(_with_adapters(model, "trunk.2"), lr=1e-3)
    monitor.add_optimizer(fine_tune)
    _regression(model, fine_tune, 45, monitor=monitor, seed=2, inputs=16, target=_target)
    assert _stalls(monitor.alerts) == []


def test_a_phase_that_trains_stays_silent_after_a_phase_that_did_not(quiet_watch):
    torch.manual_seed(0)
    model = _mlp()
    first = torch.optim.Adam(model.parameters(), lr=1e-12)
    monitor = quiet_watch(model, first, **SHORT)
    _regression(model, first, 30, monitor=monitor)
    second = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor.add_optimizer(second)
    _regression(model, second, 85, monitor=monitor, seed=2)
    assert _stalls(monitor.alerts) == []


def test_an_optimizer_over_another_copy_of_the_model_stalls(quiet_watch):
    """Watched without its optimizer (a hand-marked step): the model itself never moves."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.Adam(copy.deepcopy(model).parameters(), lr=1e-3)
    monitor = quiet_watch(model, **SHORT)
    _regression(model, opt, 45, monitor=monitor)
    found = _stalls(monitor.alerts)
    assert [(a.step, a.module) for a in found] == [(39, "")]
    assert "no trainable weight moved" in found[0].message or (
        found[0].data["update_ratio_median"] == 0.0
    )


# -- updates that stopped after real steps ----------------------------------------------
def _scheduled(name: str, opt: torch.optim.Optimizer, steps: int):
    """A learning-rate schedule and how it is stepped: "batch", "epoch" or "plateau"."""
    lr = torch.optim.lr_scheduler
    if name == "steplr-per-batch":  # 10x every 3 epochs, stepped every batch
        return lr.StepLR(opt, step_size=3, gamma=0.1), "batch"
    if name == "exponentiallr-per-batch":  # 0.8 per epoch, stepped every batch
        return lr.ExponentialLR(opt, gamma=0.8), "batch"
    if name == "learning-rate-0-from-step-30":
        return lr.LambdaLR(opt, lambda step: 1.0 if step < 30 else 0.0), "batch"
    if name == "steplr-per-epoch":
        return lr.StepLR(opt, step_size=3, gamma=0.1), "epoch"
    if name == "exponentiallr-per-epoch":
        return lr.ExponentialLR(opt, gamma=0.8), "epoch"
    if name == "cosine-to-0":
        return lr.CosineAnnealingLR(opt, T_max=steps), "batch"
    if name == "warm-up-then-cosine-to-0":

        def warm_cosine(step: int) -> float:
            if step < 40:
                return step / 40
            return 0.5 * (1 + math.cos(math.pi * (step - 40) / (steps - 40)))

        return lr.LambdaLR(opt, warm_cosine), "batch"
    if name == "onecycle":
        return lr.OneCycleLR(opt, max_lr=1e-2, total_steps=steps), "batch"
    assert name == "reduce-on-plateau"
    return lr.ReduceLROnPlateau(opt, factor=0.3, patience=1), "plateau"


STOPPED = ["steplr-per-batch", "exponentiallr-per-batch", "learning-rate-0-from-step-30"]
SCHEDULES = [
    "steplr-per-epoch",
    "exponentiallr-per-epoch",
    "cosine-to-0",
    "warm-up-then-cosine-to-0",
    "onecycle",
    "reduce-on-plateau",
]


@pytest.mark.parametrize("schedule", STOPPED + SCHEDULES)
def test_a_learning_rate_that_collapses_after_real_steps_stalls_once_the_updates_stop(
    quiet_watch, schedule
):
    """A per-epoch scheduler stepped every batch moves the output in its first steps,
    then leaves the weights bit for bit as they were: told at the second sampled step
    past the warm-up where the updates stopped (steps 199 and 299). Schedules that end
    at 0, or decay as designed, stay silent. The loss is not handed over, as in a plain
    loop watched with tw.watch. The learning rates' own look, which tells these much
    earlier (tests/test_learning_rate_collapse.py), is put off past the run: the re-runs
    alone tell it, as for updates whose rate no optimizer holds."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    steps, per_epoch = 400, 20
    scheduler, stepped = _scheduled(schedule, opt, steps)
    # The defaults otherwise: re-runs every 100 steps, from step 200.
    monitor = quiet_watch(model, opt, stalled_training__lr_collapse_steps=10**6)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x = torch.randn(64, 8, generator=gen)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), x[:, :1].sin())
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if stepped == "batch":
            scheduler.step()
        elif (step + 1) % per_epoch == 0:
            if stepped == "plateau":
                scheduler.step(sum(losses[-per_epoch:]) / per_epoch)
            else:
                scheduler.step()
    monitor.close()
    found = _stalls(monitor.alerts)
    if schedule not in STOPPED:
        assert found == []
        return
    (alert,) = found
    assert (alert.step, alert.module) == (299, "")
    assert alert.data["criterion"] == "updates_stopped"
    assert alert.data["stopped_since"] == 99 and alert.data["update_ratio_max"] < 1e-8
    assert alert.data["change"] > 1e-2  # the first steps moved the output: not that criterion
    assert alert.message.startswith("training stopped: from step 99 on, the updates ")
    assert "at 3 sampled steps in a row" in alert.message
    if schedule == "learning-rate-0-from-step-30":
        assert "every learning rate is 0" in alert.message
    else:
        assert "lr " in alert.message and " now" in alert.message
        assert alert.data["learning_rates"][0] < alert.data["learning_rates_then"][0] < 1e-9
    assert "stepped every batch" in alert.hint


@pytest.mark.parametrize("planted", ["scaler-skips-every-step", "learning-rate-0"])
def test_a_grad_scaler_skipping_every_step_is_not_told_as_updates_that_stopped(
    quiet_watch, planted
):
    """Watched with monitor.step(), a step GradScaler skipped leaves the weights as they
    were, as a learning rate of 0 does; its gradients hold NaN/Inf. Skips that go on are
    amp_skipped_steps' finding, told once; the same loop whose learning rate drops to 0
    has its updates stopped."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    monitor = quiet_watch(model, scaler=scaler)
    gen = torch.Generator().manual_seed(1)
    for step in range(400):
        x = torch.randn(64, 8, generator=gen)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), x[:, :1].sin())
        if step == 150:
            if planted == "learning-rate-0":
                opt.param_groups[0]["lr"] = 0.0
        if step >= 150 and planted == "scaler-skips-every-step":
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        monitor.step(loss=loss)
    monitor.close()
    found = _stalls(monitor.alerts)
    if planted == "scaler-skips-every-step":
        assert found == []
        assert "amp_skipped_steps" in {a.rule for a in monitor.alerts}
        return
    # Stopped from the sampled step 199 on: at least as long as it ran by step 399.
    (alert,) = found
    assert (alert.step, alert.data["criterion"], alert.data["stopped_since"]) == (
        399,
        "updates_stopped",
        199,
    )
    assert "the loss flat" in alert.message  # since the updates stopped, not since step 0


@pytest.mark.parametrize("hand_loss", [False, True])
def test_a_fit_that_converged_exactly_is_no_stall(quiet_watch, hand_loss):
    """The first script of many: y = 3x + 2 fitted by full-batch SGD for 800 steps. From
    about step 300 the gradients are zero and the weights stay exactly as they are, at
    the learning rate the run began with: converged, not stalled (the control beside a
    learning rate that collapses, which stops the updates while the gradients push)."""
    torch.manual_seed(0)
    x = torch.linspace(-1, 1, 100).unsqueeze(1)
    y = 3 * x + 2
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = quiet_watch(model, opt)
    for _ in range(800):
        loss = nn.functional.mse_loss(model(x), y)
        if hand_loss:  # the loss known too: flat at about 1e-13 from there on
            monitor.record_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    assert loss.item() < 1e-9
    assert _stalls(monitor.alerts) == []


# -- healthy families ------------------------------------------------------------------
class _TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.position = nn.Parameter(torch.randn(12, 16) * 0.02)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(16, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.position)).flatten(0, 1)


class _LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.emb(tokens))[0]).flatten(0, 1)


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 2),
    )


def _tokens(gen):
    t = torch.randint(0, 50, (8, 13), generator=gen)
    return t[:, :12], t[:, 1:].reshape(-1)


def _images(gen):
    x = torch.randn(16, 3, 8, 8, generator=gen)
    return x, (x.mean((1, 2, 3)) > 0).long()


HEALTHY = {
    "mlp-sgd": (_mlp, lambda ps: torch.optim.SGD(ps, lr=1e-2), "regression"),
    "cnn-batchnorm-dropout": (_cnn, lambda ps: torch.optim.AdamW(ps, lr=1e-3), _images),
    "transformer": (_TinyTransformer, lambda ps: torch.optim.AdamW(ps, lr=3e-4), _tokens),
    "lstm": (_LSTM, lambda ps: torch.optim.Adam(ps, lr=1e-3), _tokens),
    "pretrained-fine-tune-lr-1e-5": (
        _pretrained,
        lambda ps: torch.optim.Adam(ps, lr=1e-5),
        "fine-tune",
    ),
}


@pytest.mark.parametrize("family", list(HEALTHY))
def test_healthy_runs_of_five_families_small_learning_rates_included_stay_silent(
    quiet_watch, family
):
    make, optimizer, data = HEALTHY[family]
    torch.manual_seed(0)
    model = make()
    opt = optimizer(model.parameters())
    monitor = quiet_watch(model, opt)  # the defaults: checks at steps 199 and 299
    if data == "regression":
        _regression(model, opt, 300, monitor=monitor)
    elif data == "fine-tune":
        _regression(model, opt, 300, monitor=monitor, inputs=16, target=lambda x: _target(x) * 2)
    else:
        gen = torch.Generator().manual_seed(1)
        for _ in range(300):
            x, y = data(gen)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            monitor.step(loss=loss)
    assert _stalls(monitor.alerts) == []
    assert not [a for a in monitor.alerts if a.rule == "internal_error"]


# -- the re-run changes nothing -------------------------------------------------------
def test_training_is_bit_identical_with_the_re_runs_and_modes_come_back(quiet_watch):
    """Dropout's RNG, batch norm's statistics and each module's mode stay as they were."""
    torch.manual_seed(0)
    plain = _cnn()
    watched = copy.deepcopy(plain)
    watched[3].eval()  # a mode of the user's own, kept through the re-runs
    plain[3].eval()
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, watched)]
    quiet_watch(watched, opts[1], stalled_training={"every": 3, "warmup": 1})
    for model, opt in zip((plain, watched), opts):
        torch.manual_seed(1)
        gen = torch.Generator().manual_seed(2)
        for _ in range(10):
            x, y = _images(gen)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for a, b in zip(plain.state_dict().values(), watched.state_dict().values()):
        assert torch.equal(a, b)
    assert [m.training for m in watched.modules()] == [m.training for m in plain.modules()]


class CarriesState(nn.Module):
    """Keeps plain attributes across calls: a call counter, a hidden state carried
    between batches (truncated BPTT), a record of what it was called with."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.calls = 0
        self.hidden: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        carried = self.hidden if self.hidden is not None else torch.zeros_like(x)
        self.hidden = torch.tanh(self.fc(x) + carried[: len(x)]).detach()
        return self.head(self.hidden)


def _trained_beside(plain: nn.Module, quiet_watch) -> nn.Module:
    """A copy of ``plain`` trained watched, with a re-run every 2 steps, beside
    ``plain`` trained the same way unwatched: the copy, to compare."""
    watched = copy.deepcopy(plain)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, watched)]
    quiet_watch(watched, opts[1], stalled_training={"every": 2, "warmup": 1})
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 8, generator=gen) for _ in range(7)]
    for model, opt in zip((plain, watched), opts):
        for x in batches:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1]).backward()
            opt.step()
    return watched


def test_a_re_run_leaves_the_models_own_attributes_as_training_left_them(quiet_watch):
    """The re-run of the first batch is never seen by a forward that keeps state."""
    torch.manual_seed(0)
    plain = CarriesState()
    watched = _trained_beside(plain, quiet_watch)
    assert watched.calls == plain.calls == 7
    assert torch.equal(watched.hidden, plain.hidden)
    for a, b in zip(plain.state_dict().values(), watched.state_dict().values()):
        assert torch.equal(a, b)


class MarksEvalCalls(nn.Module):
    """Keeps its last training input, and on a call in eval mode drops it and marks
    itself with a new attribute: a re-run that left either behind would show."""

    eval_calls = 0  # on the class: no re-run puts it back

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.cache = x.detach()
        else:
            type(self).eval_calls += 1
            self.evaluated = True
            del self.cache
        return self.fc(x)


def test_a_re_run_takes_away_what_it_added_and_brings_back_what_it_removed(quiet_watch):
    """Attributes an eval-mode forward adds go, and those it deletes come back."""
    torch.manual_seed(0)
    plain = MarksEvalCalls()
    watched = _trained_beside(plain, quiet_watch)
    assert MarksEvalCalls.eval_calls >= 3  # the re-runs ran, in eval mode
    assert "evaluated" not in watched.__dict__
    assert torch.equal(watched.cache, plain.cache)
    assert list(watched.__dict__) == list(plain.__dict__)


def _ratios_by_hand(model: nn.Module, before: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each layer's ||dW|| / ||W|| over its trainable weights, in the model's order."""
    moved: dict[str, float] = {}
    size: dict[str, float] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            layer, now = name.rsplit(".", 1)[0], param.detach()
            moved[layer] = moved.get(layer, 0.0) + float((now - before[name]).norm()) ** 2
            size[layer] = size.get(layer, 0.0) + float(now.norm()) ** 2
    return {layer: math.sqrt(moved[layer] / size[layer]) for layer in moved}


def test_update_ratios_and_trainable_counts_follow_a_layer_frozen_between_re_runs():
    """The per-layer sums and the trainable counts kept from one re-run to the next are
    worked out again once a layer is frozen or thawed, and a weight the model does not
    hold is named the general way."""
    from trainwatch.collect.passes import ModelPasses
    from trainwatch.collect.stall import FirstBatchProbe
    from trainwatch.layers import EXTERNAL, LayerMap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4), nn.Linear(4, 1))
    layers = LayerMap(model)
    probe = FirstBatchProbe(ModelPasses(lambda *_: None), every=10, rows=4, loss_window=2)

    def sampled_step(extra: list[torch.Tensor]) -> tuple[StallReport, dict[str, float]]:
        params = [*model.parameters(), *extra]
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        kept = [p.detach().clone() for p in params]
        with torch.no_grad():
            for param in params:
                if param.requires_grad:
                    param.add_(torch.randn_like(param) * 1e-3)
        return probe.report(10, params, kept, layers), _ratios_by_hand(model, before)

    # Layers 2 and 3 hold two weights each: frozen in turn, the same count of them moves.
    for frozen, extra in [
        (None, []),
        (2, []),
        (2, []),
        (3, []),
        (None, []),
        (None, [nn.Parameter(torch.ones(3))]),
    ]:
        for param in model.parameters():
            param.requires_grad_(True)
        if frozen is not None:
            model[frozen].requires_grad_(False)
        report, expected = sampled_step(extra)
        ratios = {k: v for k, v in report.update_ratios.items() if k != EXTERNAL}
        assert list(ratios) == list(expected)
        assert ratios == pytest.approx(expected, rel=1e-6)
        assert (EXTERNAL in report.update_ratios) == bool(extra)
        held_out = sum(p.numel() for p in model[frozen].parameters()) if frozen else 0
        assert report.total == sum(p.numel() for p in model.parameters())
        assert report.trainable == report.total - held_out
        assert report.trainable_in == [layer for layer in ("0", "2", "3") if layer != str(frozen)]


def _nan_at_step_8(watch, check: str, stall: dict | bool) -> list[tuple]:
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = watch(model, opt, nonfinite_forward={"check": check}, stalled_training=stall)
    gen = torch.Generator().manual_seed(1)
    for step in range(12):
        x = torch.randn(16, 8, generator=gen)
        if step == 8:
            with torch.no_grad():
                model[2].weight[0, 0] = float("nan")
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :1].sin()).backward()
        opt.step()
    return [(a.rule, a.step, a.module) for a in monitor.alerts]


@pytest.mark.parametrize("check", ["auto", "deferred"])
def test_re_runs_at_every_step_leave_the_other_checks_as_they_were(quiet_watch, check):
    """A NaN planted in a weight after many re-runs is found as it is without them."""
    with_re_runs = _nan_at_step_8(quiet_watch, check, {"every": 1, "warmup": 1})
    without = _nan_at_step_8(quiet_watch, check, False)
    assert with_re_runs == without
    assert with_re_runs[0][1:] in [(7, "2"), (8, "2")]


def test_a_model_that_cannot_run_on_a_few_rows_is_left_alone(quiet_watch):
    class FixedBatch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert x.shape[0] == 64, "this model only takes batches of 64"
            return self.fc(x)

    torch.manual_seed(0)
    model = FixedBatch()
    opt = torch.optim.SGD(model.parameters(), lr=1e-12)
    monitor = quiet_watch(model, opt, **SHORT)
    _regression(model, opt, 45, monitor=monitor)
    assert monitor.alerts == []  # no verdict, and no internal error: training went on


# -- the decision ---------------------------------------------------------------------
def _report(change: float, steps: int = 200) -> StallReport:
    return StallReport(steps=steps, change=change, update_ratios={"fc": 1e-9}, trainable=9, total=9)


def test_a_still_output_with_a_falling_loss_is_no_stall():
    rule = StalledTrainingRule(StalledTrainingConfig(loss_window=5))
    for step in range(10):
        rule.evaluate(StepRecord(step=step, loss=1.0 - 0.05 * step, stall_phase=1))
    record = StepRecord(step=199, loss=0.3, stall_phase=1, stall=_report(1e-7))
    assert rule.evaluate(record) == []
    flat = StalledTrainingRule(StalledTrainingConfig(loss_window=5))
    for step in range(10):
        flat.evaluate(StepRecord(step=step, loss=1.0 + 0.01 * (step % 2), stall_phase=1))
    record = StepRecord(step=199, loss=1.0, stall_phase=1, stall=_report(1e-7))
    assert [a.rule for a in flat.evaluate(record)] == ["stalled_training"]


def test_no_verdict_before_warm_up_or_above_min_change():
    # Each alone (one sampled step whose updates stopped is not enough for that criterion).
    for steps, change in [(100, 0.0), (200, 1e-3), (200, None)]:
        rule = StalledTrainingRule(StalledTrainingConfig())
        record = StepRecord(step=steps - 1, stall_phase=1, stall=_report(change, steps=steps))
        assert rule.evaluate(record) == []


@pytest.mark.parametrize("stopped_from, fires_at", [(9_900, None), (4_000, 7_999)])
def test_updates_stopped_at_a_long_runs_last_sampled_steps_are_a_schedule_ending_at_0(
    stopped_from, fires_at
):
    """A 10,000-step cosine schedule to 0 has its last sampled steps' updates below any
    floor: stopped for fewer steps than it ran, silent. Updates that stopped at step
    4,000 are told once they have stayed stopped as long (the loss unknown)."""
    rule = StalledTrainingRule(StalledTrainingConfig())
    fired = []
    for steps in range(100, 10_001, 100):
        ratio = 0.0 if steps >= stopped_from else 1e-3
        report = StallReport(
            steps=steps, change=5.0, update_ratios={"fc": ratio, "out": ratio}, trainable=9, total=9
        )
        alerts = rule.evaluate(StepRecord(step=steps - 1, stall_phase=1, stall=report))
        fired += [a.step for a in alerts]
    assert fired == ([] if fires_at is None else [fires_at])


def test_updates_stopped_before_a_checkpoint_count_after_resuming(tmp_path):
    """The row of stopped sampled steps is plain data in the rule's state (loaded with
    weights_only=True, as Lightning does): the resumed run tells it on time."""

    def record(steps: int) -> StepRecord:
        report = StallReport(
            steps=steps, change=5.0, update_ratios={"fc": 0.0}, trainable=9, total=9
        )
        return StepRecord(step=steps - 1, stall_phase=1, stall=report)

    rule = StalledTrainingRule(StalledTrainingConfig())
    assert rule.evaluate(record(100)) == [] and rule.evaluate(record(200)) == []
    torch.save(rule.state_dict(), tmp_path / "state.pt")
    resumed = StalledTrainingRule(StalledTrainingConfig())
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert [a.step for a in resumed.evaluate(record(300))] == [299]


@pytest.mark.parametrize(
    "key, value",
    [("every", 0), ("warmup", 0), ("min_change", -1.0), ("rows", 0), ("min_update_ratio", -1.0)],
)
def test_bad_values_fail_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"stalled_training.{key}"):
        Config.from_dict({"stalled_training": {key: value}})


# -- TensorBoard -----------------------------------------------------------------------
def test_update_ratios_and_the_output_move_reach_tensorboard_on_sampled_steps(tmp_path):
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, log_dir=tmp_path, console=False, **SHORT):
        _regression(model, opt, 41)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = events.Tags()["scalars"]
    ratio_tags = {t for t in tags if t.startswith(metadata.UPDATE_RATIO_PREFIX)}
    assert ratio_tags == {metadata.UPDATE_RATIO_PREFIX + "0", metadata.UPDATE_RATIO_PREFIX + "2"}
    steps = [e.step for e in events.Scalars(metadata.UPDATE_RATIO_PREFIX + "0")]
    assert steps == [19, 39]
    ratios = [e.value for e in events.Scalars(metadata.UPDATE_RATIO_PREFIX + "0")]
    assert all(1e-5 < r < 1e-1 for r in ratios)
    assert [e.step for e in events.Scalars(metadata.OUTPUT_CHANGE_TAG)] == [19, 39]


# -- Lightning ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("lr, stalled", [(1e-12, True), (0.05, False)])
def test_a_lightning_module_with_a_learning_rate_of_1e_12_stalls(tmp_path, lr, stalled):
    torch.manual_seed(0)
    callback = TrainWatchCallback(console=io.StringIO(), **SHORT)
    trainer = pl.Trainer(
        callbacks=[callback],
        accelerator="cpu",
        max_steps=45,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=tmp_path,
        limit_val_batches=2,
        num_sanity_val_steps=2,  # no-grad passes before training: never the first batch
    )
    trainer.fit(BoringNet(lr=lr))
    found = _stalls(callback.alerts)
    assert len(found) == int(stalled)
    if stalled:
        assert found[0].step == 39 and found[0].module == ""
        assert "the loss flat" in found[0].message  # Lightning hands the loss over


class AdaptedRegressor(pl.LightningModule):
    """A LightningModule fine-tuning adapters placed on ``where`` of a pre-trained backbone."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.backbone = _pretrained()
        self.trainable = _with_adapters(self.backbone, where)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.trainable, lr=1e-3)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(512, 16, generator=gen)
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, _target(x)), batch_size=64
        )


@pytest.mark.slow
@pytest.mark.parametrize("where, stalled", [("side.inner", True), ("trunk.0", False)])
def test_lightning_adapters_on_a_branch_scaled_by_1e_6_stall(tmp_path, where, stalled):
    callback = TrainWatchCallback(console=io.StringIO(), **SHORT)
    trainer = pl.Trainer(
        callbacks=[callback],
        accelerator="cpu",
        max_steps=45,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(AdaptedRegressor(where))
    found = _stalls(callback.alerts)
    assert [(a.step, a.module) for a in found] == ([(39, "")] if stalled else [])
    if stalled:
        assert "'backbone.side.inner.lora_" in found[0].message


# -- cost ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_healthy_step_off_the_sampled_ones_costs_nothing_more():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from opcount import count

    with_rule, without = count(4), count(4, {"stalled_training": False})
    assert with_rule.added_ops == without.added_ops
    assert with_rule.python_calls == without.python_calls


# -- trainwatch run -------------------------------------------------------------------------
SCRIPT = """
import sys
import torch
from torch import nn

# A warm-up schedule whose length is given in the wrong unit (samples, not
# steps) keeps the learning rate at about zero for the whole run.
WARMUP = float(sys.argv[1])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / WARMUP))
gen = torch.Generator().manual_seed(1)
for step in range(45):
    x = torch.randn(64, 8, generator=gen)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), x[:, :1].sin()).backward()
    opt.step()
    sched.step()
print("done")
"""


@pytest.mark.slow
@pytest.mark.parametrize("warmup, stalled", [("1e12", True), ("10", False)])
def test_trainwatch_run_finds_a_warm_up_in_the_wrong_unit(tmp_path, warmup, stalled):
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    (tmp_path / "short.yaml").write_text("stalled_training: {every: 20, warmup: 40}\n")
    done = subprocess.run(
        [sys.executable, "-m", "trainwatch", "run", "--log-dir", "out", "--no-console"]
        + ["--config", "short.yaml", "train.py", warmup],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "done" in done.stdout
    lines = Path(tmp_path / "out" / "alerts.jsonl").read_text().splitlines()
    found = [json.loads(line) for line in lines if json.loads(line)["rule"] == "stalled_training"]
    assert len(found) == int(stalled)
    if stalled:
        assert found[0]["step"] == 39 and found[0]["module"] == ""


def test_under_trainwatch_run_a_stall_does_not_ask_for_monitor_step(tmp_path):
    """A script under ``trainwatch run`` has no monitor to hand the loss to."""
    from trainwatch.runner import run_script

    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    config = {"stalled_training": {"every": 20, "warmup": 40}}
    code = run_script(
        tmp_path / "train.py", ["1e12"], log_dir=tmp_path / "out", console=False, config=config
    )
    assert code == 0
    lines = Path(tmp_path / "out" / "alerts.jsonl").read_text().splitlines()
    (found,) = [a for a in map(json.loads, lines) if a["rule"] == "stalled_training"]
    assert "the loss not seen (trainwatch run cannot read it)" in found["message"]
    assert "monitor.step" not in found["message"]


def test_control_a_watched_loop_without_the_loss_is_still_told_how_to_pass_it(quiet_watch):
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-12)
    monitor = quiet_watch(model, opt, **SHORT)
    _regression(model, opt, 45)  # no monitor.step(loss=...)
    (alert,) = _stalls(monitor.alerts)
    assert "the loss unknown (pass it with monitor.step(loss=loss))" in alert.message


# -- the tuning benchmark ---------------------------------------------------------------
@pytest.mark.slow
def test_the_tuning_benchmark_prints_each_run_and_the_margins(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from tune_stalled_training import main

    assert main(["--steps", "12", "--every", "4", "--warmup", "8"]) == 0
    out = capsys.readouterr().out
    assert "fine-tune adam 1e-5" in out and "lora on 1e-6 branch" in out
    assert "steplr per batch" in out and "mlp adamw cosine to 0" in out
    assert "healthy runs move at least" in out and "min_update_ratio 1e-08 sits" in out
