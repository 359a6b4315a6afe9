"""stalled_training tells a learning rate that collapsed, long before the re-runs would.

A schedule meant per epoch stepped every batch (StepLR, ExponentialLR) drives
the learning rate to a millionth of its start within a couple of hundred
steps, and training goes on changing nothing. The optimizers' learning rates,
read one sampled step in ten, tell it about 20 steps after it happened: in a
plain loop under tw.watch, in Lightning (a per-epoch StepLR returned with
interval "step") and under ``trainwatch run``. Schedules meant to train,
those that end at 0 or at a few millionths included, stay silent.
"""

from __future__ import annotations

import io
import json
import math
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import get_linear_schedule_with_warmup

from tests.lightning_models import quiet_trainer
from trainwatch.config import Config, StalledTrainingConfig
from trainwatch.errors import ConfigError
from trainwatch.lightning import TrainWatchCallback
from trainwatch.record import LearningRates, StepRecord
from trainwatch.rules.stalled import StalledTrainingRule
from trainwatch.runner import run_script

LR = torch.optim.lr_scheduler


def _collapses(alerts) -> list:
    return [a for a in alerts if a.rule == "stalled_training"]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def _train(monitor, model, opt, scheduler, steps, *, per_epoch=20, plateau=False, each=None):
    """A regression trained ``steps`` steps, the scheduler stepped every batch (with
    ``plateau``, ReduceLROnPlateau every ``per_epoch`` batches on their mean loss);
    ``each(step)`` runs before each step."""
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        if each is not None:
            each(step)
        x = torch.randn(64, 8, generator=gen)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), x[:, :1].sin())
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if plateau:
            if (step + 1) % per_epoch == 0:
                scheduler.step(sum(losses[-per_epoch:]) / per_epoch)
        elif scheduler is not None:
            scheduler.step()
    monitor.close()


# -- planted: per-epoch schedulers stepped every batch, under tw.watch ------------------
@pytest.mark.parametrize(
    "make, fell_by, told_at",
    [
        # 0.9 a step: below 1e-6 of the start from step 132, seen at the look at 140.
        (lambda opt: LR.ExponentialLR(opt, gamma=0.9), 140, 160),
        # 10x down every 30 steps: 1e-7 of the start from step 210.
        (lambda opt: LR.StepLR(opt, step_size=30, gamma=0.1), 210, 230),
    ],
    ids=["exponentiallr-0.9-per-batch", "steplr-30-per-batch"],
)
def test_a_per_epoch_scheduler_stepped_every_batch_is_told_20_steps_after_the_collapse(
    quiet_watch, make, fell_by, told_at
):
    """Told once, 20 steps after the look that saw the rate fall, with the optimizer,
    the step, the peak and the rate now; the re-runs' later finding is not told again."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    monitor = quiet_watch(model, opt)
    _train(monitor, model, opt, make(opt), 400)
    (alert,) = _collapses(monitor.alerts)
    assert (alert.step, alert.module) == (told_at, "")
    data = alert.data
    assert data["kind"] == "learning_rate_collapsed"
    assert (data["optimizer"], data["optimizer_class"]) == (0, "AdamW")
    assert (data["collapsed_since"], data["steps_collapsed"]) == (fell_by, 20)
    assert data["peak_learning_rates"] == [pytest.approx(3e-3)]
    assert data["learning_rates"][0] < 1e-6 * 3e-3
    assert alert.message.startswith("learning rate collapsed: optimizer 0 (AdamW) keeps ")
    assert f"by step {fell_by}" in alert.message and "peak 3.0e-03" in alert.message
    assert "stepped every batch" in alert.hint and "min_lr" in alert.hint


@pytest.mark.parametrize("restart, told", [(True, 2), (False, 1)])
def test_a_collapse_is_told_again_only_after_the_rate_rose(quiet_watch, restart, told):
    """The rate collapses by step 70; set back by hand at step 300 (a restart), it
    collapses again and is told again. Left collapsed, it is told once in 500 steps."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scheduler = LR.ExponentialLR(opt, gamma=0.8)
    monitor = quiet_watch(model, opt)

    def set_back(step: int) -> None:
        if restart and step == 300:
            opt.param_groups[0]["lr"] = 1e-2

    _train(monitor, model, opt, scheduler, 500, each=set_back)
    (first,) = _collapses(monitor.alerts)  # repeats are counted
    assert (first.step, first.data["collapsed_since"]) == (90, 70)
    assert monitor.alert_counts[("stalled_training", "")] == told


def test_lr_collapse_steps_sets_how_long_the_optimizer_steps_there_first(quiet_watch):
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    monitor = quiet_watch(model, opt, stalled_training__lr_collapse_steps=50)
    _train(monitor, model, opt, LR.ExponentialLR(opt, gamma=0.9), 300)
    (alert,) = _collapses(monitor.alerts)
    assert (alert.step, alert.data["steps_collapsed"]) == (190, 50)


# -- controls: schedules meant to train, under tw.watch -----------------------------------
def _warm_up_from_0(opt, steps):
    return LR.LambdaLR(opt, lambda step: min(1.0, step / 100))


def _range_test(opt, steps):  # an LR range test: 1e-7 rising 3% a step
    for group in opt.param_groups:
        group["lr"] = 1e-7
    return LR.ExponentialLR(opt, gamma=1.03)


CONTROLS = {
    "cosine-to-0": lambda opt, steps: LR.CosineAnnealingLR(opt, T_max=steps),
    "linear-to-0-hf": lambda opt, steps: get_linear_schedule_with_warmup(opt, 40, steps),
    "onecycle": lambda opt, steps: LR.OneCycleLR(opt, max_lr=1e-2, total_steps=steps),
    "warm-restarts": lambda opt, steps: LR.CosineAnnealingWarmRestarts(opt, T_0=50),
    "warm-up-from-0": _warm_up_from_0,
    "lr-range-test": _range_test,
}


@pytest.mark.parametrize("name", list(CONTROLS))
def test_control_schedules_meant_to_train_stay_silent(quiet_watch, name):
    """Cosine to 0 (its last step at 1.5e-5 of its peak), HF's warm-up then linear decay
    to 0, OneCycleLR (ending at 4e-6 of its peak), warm restarts, a warm-up from 0 and a
    rising range test."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    steps = 400
    scheduler = CONTROLS[name](opt, steps)
    monitor = quiet_watch(model, opt)
    _train(monitor, model, opt, scheduler, steps)
    assert _collapses(monitor.alerts) == []


def test_control_reduce_on_plateau_reducing_a_few_times_stays_silent(quiet_watch):
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = LR.ReduceLROnPlateau(opt, factor=0.3, patience=1)
    monitor = quiet_watch(model, opt)
    _train(monitor, model, opt, scheduler, 400, plateau=True)
    assert opt.param_groups[0]["lr"] < 3e-4  # it did reduce, more than once
    assert _collapses(monitor.alerts) == []


def test_control_a_param_group_set_to_0_to_freeze_it_while_the_other_trains(quiet_watch):
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=3e-3
    )
    monitor = quiet_watch(model, opt)

    def freeze_first(step: int) -> None:
        if step == 50:
            opt.param_groups[0]["lr"] = 0.0

    _train(monitor, model, opt, None, 300, each=freeze_first)
    assert _collapses(monitor.alerts) == []


def test_a_param_group_held_at_0_from_the_start_does_not_hide_the_others_collapse(quiet_watch):
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters(), "lr": 0.0}, {"params": model[2].parameters()}],
        lr=3e-3,
    )
    monitor = quiet_watch(model, opt)
    _train(monitor, model, opt, LR.ExponentialLR(opt, gamma=0.9), 200)
    (alert,) = _collapses(monitor.alerts)
    assert alert.step == 160 and alert.data["peak_learning_rates"] == [pytest.approx(3e-3)]
    assert "keeps stepping with its learning rate below" in alert.message


# -- the decision, over long runs -------------------------------------------------------
def _looks(rates_at, steps, *, last_step=None, every=10):
    """The rule fed one look every ``every`` steps of a single-group optimizer whose
    rate at a step is ``rates_at(step)``; the steps told."""
    rule = StalledTrainingRule(StalledTrainingConfig())
    told = []
    for step in range(0, steps, every):
        stepped = step if last_step is None else min(step, last_step)
        look = LearningRates(0, "AdamW", [rates_at(step)], stepped)
        record = StepRecord(step=step, stall_phase=1, optimizer_rates=[look])
        told += [a.step for a in rule.evaluate(record)]
    return told


def test_a_long_cosine_to_0_spends_too_short_a_share_below_the_bound_to_be_told():
    """A 100,000-step cosine schedule to 0 has its last 60 steps below 1e-6 of its
    peak: 6.4e-4 of its decay, below the 1% a collapse must last. A constant rate for
    50,000 steps then ExponentialLR(0.9) every step is told 20 steps after its fall."""
    steps = 100_000

    def cosine(step: int) -> float:
        return 1e-3 * 0.5 * (1 + math.cos(math.pi * step / steps))

    assert cosine(steps - 10) < 1e-9 * 0.99  # below the bound at the end
    assert _looks(cosine, steps) == []
    assert _looks(lambda step: 1e-3 * (1 - step / 1_000_000), 1_000_000, every=1000) == []

    def late_collapse(step: int) -> float:
        return 1e-3 * 0.9 ** max(0, step - 50_000)

    assert _looks(late_collapse, 60_000) == [50_160]


def test_an_optimizer_that_stopped_stepping_at_0_is_no_collapse():
    """A finished phase's optimizer, its schedule decayed to exactly 0 at its last
    step, holds lr 0 while the next phase's optimizer trains."""
    finished = _looks(lambda step: max(0.0, 1e-3 * (1 - step / 500)), 2_000, last_step=499)
    assert finished == []
    assert _looks(lambda step: max(0.0, 1e-3 * (1 - step / 500)), 2_000) == [520]


def test_a_collapse_seen_before_a_checkpoint_is_told_on_time_after_resuming(tmp_path):
    """The peaks and the step the rate fell are plain data in the rule's state (loaded
    with weights_only=True, as Lightning does)."""

    def record(step: int, rate: float) -> StepRecord:
        look = LearningRates(0, "SGD", [rate, rate], step)
        return StepRecord(step=step, stall_phase=1, optimizer_rates=[look])

    rule = StalledTrainingRule(StalledTrainingConfig())
    assert rule.evaluate(record(0, 1e-2)) == [] and rule.evaluate(record(10, 1e-12)) == []
    torch.save(rule.state_dict(), tmp_path / "state.pt")
    resumed = StalledTrainingRule(StalledTrainingConfig())
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert resumed.evaluate(record(20, 1e-12)) == []
    (alert,) = resumed.evaluate(record(30, 1e-12))
    assert alert.data["collapsed_since"] == 10 and alert.data["learning_rates"] == [1e-12] * 2


def test_lr_collapse_steps_is_a_key_of_stalled_training():
    config = Config.from_dict({"stalled_training": {"lr_collapse_steps": 5}})
    assert config.stalled_training.lr_collapse_steps == 5
    assert Config().stalled_training.lr_collapse_steps == 20


@pytest.mark.parametrize("value", [0, -5, 1.5])
def test_a_bad_lr_collapse_steps_fails_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"stalled_training\.lr_collapse_steps"):
        Config.from_dict({"stalled_training": {"lr_collapse_steps": value}})


# -- Lightning ----------------------------------------------------------------------------
class ScheduledNet(pl.LightningModule):
    """A regression whose StepLR means 10x down every 10 epochs, returned with ``interval``."""

    def __init__(self, interval: str) -> None:
        super().__init__()
        self.net = _mlp()
        self.interval = interval

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        scheduler = LR.StepLR(opt, step_size=10, gamma=0.1)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": scheduler, "interval": self.interval},
        }

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=gen)
        return DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=8)


@pytest.mark.slow
@pytest.mark.parametrize("interval, told", [("step", True), ("epoch", False)])
def test_lightning_a_per_epoch_steplr_declared_with_interval_step_is_told(tmp_path, interval, told):
    """Stepped every step, 10x down every 10 steps: below 1e-6 of its peak from step
    70, told at the look 20 steps on. Declared per epoch (8 batches), it decays twice."""
    torch.manual_seed(0)
    callback = TrainWatchCallback(console=io.StringIO())
    trainer = quiet_trainer(tmp_path, [callback], max_steps=160)
    trainer.fit(ScheduledNet(interval))
    found = _collapses(callback.alerts)
    if not told:
        assert found == []
        return
    (alert,) = found
    assert (alert.step, alert.data["kind"]) == (90, "learning_rate_collapsed")
    assert alert.data["optimizer_class"] == "AdamW" and alert.data["collapsed_since"] == 70


# -- trainwatch run -----------------------------------------------------------------------
SCRIPT = """
import sys
import torch
from torch import nn

# ExponentialLR(0.9) meant per epoch of 20 batches; "batch" steps it every batch.
PER = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
gen = torch.Generator().manual_seed(1)
for step in range(220):
    x = torch.randn(64, 8, generator=gen)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), x[:, :1].sin()).backward()
    opt.step()
    if PER == "batch" or (step + 1) % 20 == 0:
        sched.step()
print("done")
"""


@pytest.mark.slow
@pytest.mark.parametrize("per, told", [("batch", True), ("epoch", False)])
def test_trainwatch_run_tells_a_per_epoch_exponentiallr_stepped_every_batch(tmp_path, per, told):
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    code = run_script(tmp_path / "train.py", [per], log_dir=tmp_path / "out", console=False)
    assert code == 0
    lines = Path(tmp_path / "out" / "alerts.jsonl").read_text().splitlines()
    found = [a for a in map(json.loads, lines) if a["rule"] == "stalled_training"]
    if not told:
        assert found == []
        return
    (alert,) = found
    assert alert["step"] == 160 and alert["data"]["kind"] == "learning_rate_collapsed"
    assert alert["data"]["optimizer_class"] == "AdamW"
