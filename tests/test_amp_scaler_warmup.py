"""Mixed precision: a GradScaler's warm-up is silent; skipping after updates began is not.

Real fp16 autocast on CPU with a real ``torch.amp.GradScaler("cpu")``: a scale
set high on purpose overflows the fp16 backward until it has come down.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw

CHECKS = ["auto", "step", "deferred"]


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4 * 6 * 6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1))


def _batch(family: str) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (16, 8) if family == "mlp" else (16, 1, 6, 6)
    return torch.randn(*shape), torch.randn(16, 1)


def train_fp16(
    family: str,
    steps: int,
    *,
    init_scale: float,
    overflow=lambda i: False,
    pass_scaler: bool = True,
    check: str = "auto",
    growth_interval: int = 2000,
    logged_pass: bool = False,
    **overrides,
) -> tuple[tw.Monitor, int]:
    """A plain fp16 AMP loop; ``overflow(i)`` plants an overflowing loss at iteration i.

    ``logged_pass``: each iteration also runs the model on another batch with
    grad on (a metric written without ``no_grad``), left out of the loss.

    Returns the monitor and how many iterations the scaler skipped.
    """
    model = MLP() if family == "mlp" else CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    skipped = 0
    with tw.watch(
        model,
        opt,
        console=False,
        scaler=scaler if pass_scaler else None,
        nonfinite_forward={"check": check},
        **overrides,
    ) as monitor:
        for i in range(steps):
            x, y = _batch(family)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
                if logged_pass:
                    model(_batch(family)[0]).float().mean().item()
            loss = nn.functional.mse_loss(out.float(), y)
            if overflow(i):
                loss = loss * float("inf")
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
    return monitor, skipped


def amp_alerts(monitor: tw.Monitor) -> list[tw.Alert]:
    return [a for a in monitor.alerts if a.rule == "amp_skipped_steps"]


# A second pass with grad, left out of the loss (a metric taken without no_grad):
# the skipped backward passes are counted through the pass they reached.
LOGGED = pytest.mark.parametrize("logged_pass", [False, True], ids=["", "logged pass"])


@pytest.mark.parametrize("family", ["mlp", "cnn"])
@pytest.mark.parametrize("check", CHECKS)
@LOGGED
def test_a_high_initial_scale_skipping_twenty_steps_before_any_update_is_silent(
    family, check, logged_pass
):
    monitor, skipped = train_fp16(
        family, 36, init_scale=2.0**40, check=check, logged_pass=logged_pass
    )
    assert skipped >= 20
    assert monitor.step_count == 36 - skipped
    assert monitor.alerts == []


@pytest.mark.parametrize("family", ["mlp", "cnn"])
@pytest.mark.parametrize("check", CHECKS)
@LOGGED
def test_skipping_ten_in_a_row_after_updates_began_warns_at_that_step(family, check, logged_pass):
    # Warm-up first (a high scale), then training, then every step overflows.
    monitor, _ = train_fp16(
        family,
        45,
        init_scale=2.0**24,
        overflow=lambda i: i >= 25,
        check=check,
        logged_pass=logged_pass,
    )
    updates = monitor.step_count
    assert updates > 5
    (alert,) = amp_alerts(monitor)
    assert (alert.step, alert.severity, alert.module) == (updates, "warning", None)
    assert alert.data["skipped"] == 10


@pytest.mark.parametrize("family", ["mlp", "cnn"])
def test_skipping_most_of_the_last_hundred_steps_warns(family):
    """Two steps in three overflow: never ten in a row, but over half the window.
    (The scaler is not handed over: its scale would fall below 1 first.)"""
    monitor, _ = train_fp16(
        family,
        160,
        init_scale=2.0**10,
        overflow=lambda i: i >= 10 and i % 3 != 0,
        pass_scaler=False,
    )
    (alert,) = amp_alerts(monitor)
    assert alert.data["recent_skipped_steps"] > 50
    assert alert.data["skipped"] < 10


@pytest.mark.parametrize("family", ["mlp", "cnn"])
def test_skipping_a_third_of_the_steps_is_silent(family):
    monitor, skipped = train_fp16(
        family,
        160,
        init_scale=2.0**10,
        overflow=lambda i: i >= 10 and i % 3 == 0,
        growth_interval=1,
    )
    assert skipped >= 45
    assert amp_alerts(monitor) == []


@pytest.mark.parametrize("family", ["mlp", "cnn"])
def test_a_visible_scale_below_one_warns_and_a_scale_of_one_is_silent(family):
    low, _ = train_fp16(family, 4, init_scale=0.5)
    (alert,) = low.alerts
    assert (alert.rule, alert.step, alert.data["scale"]) == ("amp_skipped_steps", 0, 0.5)
    assert "below 1" in alert.message
    one, _ = train_fp16(family, 4, init_scale=1.0)
    assert one.alerts == []
    hidden, _ = train_fp16(family, 4, init_scale=0.5, pass_scaler=False)
    assert hidden.alerts == []  # no scaler given: the scale is not visible


def test_a_scaler_that_never_lets_an_update_through_warns_once_its_scale_is_below_one():
    """Every step overflows from the start: a warm-up that never ends. Only the
    scale tells it apart, once it has fallen below 1 (16 halvings from 2**16)."""
    monitor, skipped = train_fp16("mlp", 30, init_scale=2.0**16, overflow=lambda i: True)
    assert (monitor.step_count, skipped) == (0, 30)
    (alert,) = monitor.alerts
    assert alert.rule == "amp_skipped_steps" and alert.data["scale"] < 1.0
    unseen, _ = train_fp16(
        "mlp", 30, init_scale=2.0**16, overflow=lambda i: True, pass_scaler=False
    )
    assert unseen.alerts == []


def test_bf16_autocast_without_a_scaler_is_silent():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(20):
            x, y = _batch("mlp")
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
    assert monitor.alerts == []


def test_scaler_must_be_a_grad_scaler():
    with pytest.raises(tw.WatchError, match="scaler"):
        tw.watch(MLP(), console=False, scaler="yes")


# -- Lightning: the precision plugin's scaler ---------------------------------


def _lightning_fit(tmp_path, init_scale: float, overflow_from: int | None, steps: int):
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins.precision import MixedPrecision

    from tests.lightning_models import quiet_trainer
    from trainwatch.lightning import TrainWatchCallback

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = MLP()
            self.batches = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self(x).float(), y)
            self.batches += 1
            if overflow_from is not None and self.batches > overflow_from:
                loss = loss * float("inf")
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(steps * 8, 8, generator=gen)
            return DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=8)

    callback = TrainWatchCallback(console=False, log_dir=tmp_path)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    # "16-mixed" with a GradScaler of the loop's own choosing; Lightning runs it on CPU.
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=1, plugins=[plugin])
    trainer.fit(Regressor())
    return callback


@pytest.mark.slow
def test_lightning_16_mixed_warmup_is_silent_and_later_skipping_warns(tmp_path):
    calm = _lightning_fit(tmp_path / "calm", 2.0**40, None, 36)
    assert calm.monitor.scaler is not None  # picked up from the precision plugin
    assert 0 < calm.monitor.step_count <= 16
    assert calm.alerts == []
    skipping = _lightning_fit(tmp_path / "skipping", 2.0**24, 20, 36)
    updates = skipping.monitor.step_count
    assert updates > 5
    (alert,) = [a for a in skipping.alerts if a.rule == "amp_skipped_steps"]
    assert (alert.step, alert.data["skipped"]) == (updates, 10)


@pytest.mark.slow
def test_lightning_precision_plugin_scale_below_one_warns(tmp_path):
    callback = _lightning_fit(tmp_path, 0.5, None, 4)
    (alert,) = callback.alerts
    assert (alert.rule, alert.step, alert.data["scale"]) == ("amp_skipped_steps", 0, 0.5)


@pytest.mark.parametrize(
    ("section", "key"), [({"window": 1}, "window"), ({"max_fraction": 1.5}, "max_fraction")]
)
def test_bad_window_settings_fail_naming_the_key(section, key):
    with pytest.raises(tw.ConfigError, match=f"amp_skipped_steps.{key}"):
        tw.watch(MLP(), console=False, amp_skipped_steps=section)


def test_a_smaller_window_is_honoured():
    """Half of the last 20 steps skipped: silent with the default window, not with 20."""
    kwargs = dict(init_scale=2.0**10, overflow=lambda i: i >= 10 and i % 2 == 0, pass_scaler=False)
    default, _ = train_fp16("mlp", 50, **kwargs)
    assert amp_alerts(default) == []
    strict, _ = train_fp16(
        "mlp", 50, **kwargs, amp_skipped_steps={"window": 20, "max_fraction": 0.4}
    )
    (alert,) = amp_alerts(strict)
    assert alert.data["recent_skipped_steps"] > 8


def test_a_resumed_run_with_a_fresh_scaler_warms_up_again_silently():
    """Steps continue from the checkpoint; the new GradScaler's warm-up is still a warm-up."""
    first, _ = train_fp16("mlp", 12, init_scale=2.0**10)
    state = first.state_dict()
    assert state["step"] > 0
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    with tw.watch(model, opt, console=False, scaler=scaler) as monitor:
        monitor.load_state_dict(state)
        skipped = 0
        for i in range(45):
            x, y = _batch("mlp")
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
            if i >= 30:
                loss = loss * float("inf")  # and later, skipping that is news
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
    assert skipped >= 30  # over 20 of them the warm-up
    (alert,) = amp_alerts(monitor)
    assert alert.step == monitor.step_count and alert.data["skipped"] == 10
