"""stalled_training on steps taken with a closure and on modules called through their parts.

An optimizer stepped with a closure (``opt.step(closure)``; Lightning's
automatic optimization under ``trainwatch run`` does it at every step) is
gathered once ``step()`` returned, its update made: the weights "before the
update" used to be copied then, every update ratio read 0, and a healthy run
whose learning rate a schedule lowered was told "training stopped". A
LightningModule whose ``training_step`` calls a frozen encoder and then a
head had the encoder's output kept as the first batch's, which nothing
trains: "training changes nothing". The weights are now copied as the
closure step begins, and the pass kept is the first step's last through a
module that trains. Each healthy run beside its planted stall: a learning
rate set to 0 after 30 steps, a head at a learning rate of 1e-12.
"""

from __future__ import annotations

import copy
import io
import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.nn import functional as F

import trainwatch as tw
from trainwatch.runner import run_script
from trainwatch.tensorboard_plugin import metadata

# A re-run every 20 steps, verdicts from step 40; the learning rates' own look
# (which tells a rate set to 0 much earlier) put off past the run, so that the
# update ratios alone tell it.
SHORT = {"every": 20, "warmup": 40, "loss_window": 10, "lr_collapse_steps": 10**6}


def _stalls(alerts: list[dict]) -> list[dict]:
    return [a for a in alerts if a["rule"] == "stalled_training"]


def _alerts(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "alerts.jsonl").open()]


def _scalars(log_dir: Path, tag: str) -> dict[int, float]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


# -- a plain loop stepping with a closure ---------------------------------------------------
def _train(model, opt, variant: str, *, closure: bool, steps: int = 100, monitor=None) -> None:
    """StepLR(20, 0.1) (healthy: the weights move less and less, never not at all),
    or a learning rate of 0 from step 30; stepped with a closure or without."""
    if variant == "lr-0-from-step-30":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step < 30 else 0.0)
    else:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(64, 8, generator=gen)

        def evaluate(x: torch.Tensor = x) -> torch.Tensor:
            opt.zero_grad()
            loss = F.mse_loss(model(x), x[:, :1].sin())
            loss.backward()
            return loss

        if closure:
            opt.step(evaluate)
        else:
            evaluate()
            opt.step()
        sched.step()
        if monitor is not None:
            monitor.step()  # the loss not handed over


def _watched(tmp_path: Path, variant: str, closure: bool) -> tuple[list[dict], dict[int, float]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    log_dir = tmp_path / f"{variant}-{closure}"
    with tw.watch(
        model, opt, log_dir=log_dir, console=io.StringIO(), stalled_training=SHORT
    ) as monitor:
        _train(model, opt, variant, closure=closure)  # the loss not handed over
    return [a.to_dict() for a in monitor.alerts], _scalars(
        log_dir, metadata.UPDATE_RATIO_PREFIX + "0"
    )


def test_a_healthy_closure_step_measures_the_update_ratios_of_the_same_step_without_it(tmp_path):
    """The learning rate falls to 5e-6 of its peak by step 99; the weights still move."""
    with_closure, ratios = _watched(tmp_path, "steplr", closure=True)
    without, twin = _watched(tmp_path, "steplr", closure=False)
    assert _stalls(with_closure) == [] and _stalls(without) == []
    assert sorted(ratios) == [19, 39, 59, 79, 99]
    assert ratios == pytest.approx(twin, rel=1e-4)  # the same steps, bit for bit
    assert all(r > 1e-7 for r in ratios.values())


def test_a_closure_step_whose_learning_rate_went_to_0_is_told_as_updates_that_stopped(tmp_path):
    alerts, ratios = _watched(tmp_path, "lr-0-from-step-30", closure=True)
    (alert,) = _stalls(alerts)
    assert alert["step"] == 79 and alert["data"]["criterion"] == "updates_stopped"
    assert alert["data"]["stopped_since"] == 39 and alert["data"]["update_ratio_max"] == 0.0
    assert "every learning rate is 0" in alert["message"]
    assert ratios[19] > 1e-4 and ratios[39] == ratios[59] == 0.0


def test_a_closure_step_of_an_optimizer_over_another_copy_of_the_model_stalls():
    """The model watched alone, its steps marked by hand: the optimizer stepping with
    the closure holds a deepcopy's weights, so the model itself never moves."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.05, momentum=0.9)
    with tw.watch(model, console=io.StringIO(), stalled_training=SHORT) as monitor:
        _train(model, opt, "steplr", closure=True, steps=45, monitor=monitor)
    (alert,) = _stalls([a.to_dict() for a in monitor.alerts])
    assert alert["step"] == 39 and alert["data"]["criterion"] == "output_change"


def test_an_lbfgs_step_measures_its_update_from_the_weights_before_its_evaluations(tmp_path):
    """Each LBFGS step evaluates its closure several times, updating the weights in
    between: the ratio is the whole step's, the first batch its first evaluation's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=5)
    x = torch.randn(256, 8)
    with tw.watch(
        model, opt, log_dir=tmp_path, console=io.StringIO(), stalled_training=SHORT
    ) as monitor:
        for _ in range(60):

            def evaluate() -> torch.Tensor:
                opt.zero_grad()
                loss = F.mse_loss(model(x), x[:, :1].sin())
                loss.backward()
                return loss

            opt.step(evaluate)
    assert _stalls([a.to_dict() for a in monitor.alerts]) == []
    ratios = _scalars(tmp_path, metadata.UPDATE_RATIO_PREFIX + "0")
    assert sorted(ratios) == [19, 39, 59] and all(r > 1e-3 for r in ratios.values())
    change = _scalars(tmp_path, metadata.OUTPUT_CHANGE_TAG)
    assert change[19] > 1.0


# -- the same loops under trainwatch run ------------------------------------------------------
PLAIN = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

variant = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
if variant == "lr-0-from-step-30":
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step < 30 else 0.0)
else:
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.1)
X = torch.randn(512, 20)
Y = X @ torch.randn(20, 1) + 0.3 * torch.randn(512, 1)
for step in range(100):
    idx = torch.randint(0, 512, (64,))
    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(X[idx]), Y[idx])
        loss.backward()
        return loss
    opt.step(closure)
    sched.step()
"""


@pytest.mark.parametrize("variant, stalled", [("steplr", False), ("lr-0-from-step-30", True)])
def test_trainwatch_run_of_a_closure_loop(tmp_path, variant, stalled):
    script = tmp_path / "train.py"
    script.write_text(PLAIN)
    config = {"stalled_training": SHORT}
    assert (
        run_script(script, [variant], log_dir=tmp_path / "log", console=False, config=config) == 0
    )
    found = _stalls(_alerts(tmp_path / "log"))
    assert [(a["step"], a["data"]["criterion"]) for a in found] == (
        [(79, "updates_stopped")] if stalled else []
    )
    ratios = _scalars(tmp_path / "log", metadata.UPDATE_RATIO_PREFIX + "0")
    assert ratios[19] > 1e-4 and (ratios[59] == 0.0) == stalled


# -- Lightning: automatic optimization steps with a closure ---------------------------------
LIGHTNING = """
import sys
import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

variant = sys.argv[1]
pl.seed_everything(0, verbose=False)
protos = torch.randn(5, 32)
y = torch.randint(0, 5, (640,))
X = protos[y] + 0.8 * torch.randn(640, 32)


class Transfer(pl.LightningModule):
    # training_step calls the parts: a frozen encoder, then the head.
    def __init__(self, lr):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.encoder.requires_grad_(False)
        self.head = nn.Linear(32, 5)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.encoder(x)), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.head.parameters(), lr=self.lr)


class AutoEncoder(pl.LightningModule):
    # A stray detach cuts the encoder off: the decoder alone trains.
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 3))
        self.decoder = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 32))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return F.mse_loss(self.decoder(self.encoder(x).detach()), x)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Regressor(pl.LightningModule):
    # Its own forward; a per-epoch StepLR, or a learning rate of 0 from step 30.
    def __init__(self, schedule):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
        self.schedule = schedule

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y.float().unsqueeze(1))

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=3e-3)
        if self.schedule == "steplr":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step < 30 else 0.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


module = {
    "parts": lambda: Transfer(1e-3),
    "parts-lr-1e-12": lambda: Transfer(1e-12),
    "detach": AutoEncoder,
    "steplr": lambda: Regressor("steplr"),
    "lr-0-from-step-30": lambda: Regressor("lr-0"),
}[variant]()
callbacks = []
if len(sys.argv) > 2:  # the callback instead of trainwatch run
    from trainwatch.lightning import TrainWatchCallback
    callbacks.append(TrainWatchCallback(log_dir=sys.argv[2], console=False, stalled_training=SHORT))
trainer = pl.Trainer(
    max_epochs=10, accelerator="cpu", logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
)
trainer.fit(module, DataLoader(TensorDataset(X, y), batch_size=64, shuffle=True))
"""


def _lightning(tmp_path: Path, variant: str) -> list[dict]:
    script = tmp_path / "lit.py"
    script.write_text(f"SHORT = {SHORT!r}\n" + LIGHTNING)
    config = {"stalled_training": SHORT}
    log_dir = tmp_path / "log"
    assert run_script(script, [variant], log_dir=log_dir, console=False, config=config) == 0
    return _alerts(log_dir)


@pytest.mark.slow
@pytest.mark.parametrize("variant, stalled", [("parts", False), ("parts-lr-1e-12", True)])
def test_trainwatch_run_of_a_module_calling_a_frozen_encoder_then_its_head(
    tmp_path, variant, stalled
):
    found = _stalls(_lightning(tmp_path, variant))
    assert [(a["step"], a["data"]["criterion"]) for a in found] == (
        [(39, "output_change")] if stalled else []
    )
    if stalled:
        assert found[0]["data"]["update_ratios"].keys() == {"head"}
    change = _scalars(tmp_path / "log", metadata.OUTPUT_CHANGE_TAG)
    assert (change[39] < 1e-5) == stalled  # the head's output, not the frozen encoder's


@pytest.mark.slow
def test_trainwatch_run_of_an_encoder_cut_off_by_detach_tells_no_stall(tmp_path):
    """zero_gradient tells the bug; the decoder trains, so nothing stalled."""
    alerts = _lightning(tmp_path, "detach")
    assert {(a["rule"], a["module"]) for a in alerts if a["rule"] == "zero_gradient"} == {
        ("zero_gradient", "encoder.0"),
        ("zero_gradient", "encoder.2"),
    }
    assert _stalls(alerts) == []
    ratios = {
        layer: _scalars(tmp_path / "log", metadata.UPDATE_RATIO_PREFIX + layer)[39]
        for layer in ("encoder.0", "decoder.0", "decoder.2")
    }
    assert ratios["encoder.0"] == 0.0 and ratios["decoder.0"] > 1e-5 and ratios["decoder.2"] > 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("variant, stalled", [("steplr", False), ("lr-0-from-step-30", True)])
def test_trainwatch_run_of_a_lightning_fit_whose_learning_rate_falls(tmp_path, variant, stalled):
    """A per-epoch StepLR(2, 0.1): 1e-4 of its peak by the last epochs, the weights
    still moving; a learning rate of 0 from step 30 stops them."""
    found = _stalls(_lightning(tmp_path, variant))
    assert [(a["data"]["criterion"], a["data"]["stopped_since"]) for a in found] == (
        [("updates_stopped", 39)] if stalled else []
    )
    ratios = _scalars(tmp_path / "log", metadata.UPDATE_RATIO_PREFIX + "net.0")
    assert ratios[19] > 1e-4 and all((r == 0.0) == stalled for s, r in ratios.items() if s >= 39)


def _run_file(script: Path, args: list[str]) -> None:
    """``python script args``, in this process (the callback watches, not trainwatch run)."""
    saved = sys.argv
    sys.argv = [str(script), *args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved


@pytest.mark.slow
@pytest.mark.parametrize("variant, stalled", [("parts", False), ("parts-lr-1e-12", True)])
def test_the_callback_measures_the_head_of_a_module_calling_its_parts(tmp_path, variant, stalled):
    """With the callback the loss is handed over: the healthy run was silent already,
    but it measured the frozen encoder's output, which never moves."""
    script = tmp_path / "lit.py"
    script.write_text(f"SHORT = {SHORT!r}\n" + LIGHTNING)
    log_dir = tmp_path / "log"
    _run_file(script, [variant, str(log_dir)])
    found = _stalls(_alerts(log_dir))
    assert [a["step"] for a in found] == ([39] if stalled else [])
    change = _scalars(log_dir, metadata.OUTPUT_CHANGE_TAG)
    assert (change[39] < 1e-5) == stalled
