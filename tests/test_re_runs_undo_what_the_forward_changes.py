"""trainwatch's re-runs of a model's forward leave its training bit for bit as without it.

stalled_training re-runs the model's forward on a few rows of the phase's
first batch, and a NaN replay re-runs a bad pass to locate its origin. A
forward that changes the model's own state as it runs did it once more for
real each time: MoCo's key encoder moved by ``param_k.data = ...`` (new
storage, no write the re-run saw) and its queue, a plain tensor attribute,
written in place at a pointer; a mean teacher's in-place EMA (seen, not
undone, and the model never re-run again); a cross-batch memory's deque
appended to; a memory bank kept in a plain object; a ``global`` counter.
Losses and weights differed from the step after the first re-run.

Planted: each of those forwards (``tests/forward_side_effect_models.py``),
trained with and without trainwatch under ``tw.watch``, ``trainwatch run`` of
an unmodified script and a Lightning Trainer with the callback, re-run at
every other step; and under a GradScaler whose skipped fp16 overflow is
replayed. Losses, the final ``state_dict`` and every plain attribute the
forward keeps are compared bit for bit. A forward that writes into a tensor
whose values cannot be copied is stopped before the write, not re-run again
and told once (info). Controls: the same models with a learning rate of 0
for the whole run still stall at the first check past warm-up, as a model
without state of its own does.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import ClassVar

import lightning.pytorch as pl
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import trainwatch as tw
from tests import forward_side_effect_models as models
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.tensorboard_plugin import metadata

# A re-run at every other step from the first: the reference, then steps 1, 3, 5...
OFTEN = {"every": 2, "warmup": 1}
WITH_STATE = ["moco", "ema", "hidden_ema", "xbm", "counter", "bank"]


def _internal(alerts) -> list[tw.Alert]:
    return [a for a in alerts if a.rule == "internal_error"]


class _ReRuns:
    """Counts the calls of a model in eval mode: trainwatch's re-runs (training calls
    it in training mode). A re-run puts back what a forward pre-hook of the user's
    reaches (its closure, its object, its module's globals), as it does the model's
    own state: the counts are kept on the class, which it leaves alone."""

    counts: ClassVar[dict[int, int]] = {}

    def __init__(self, model: nn.Module) -> None:
        _ReRuns.counts[id(self)] = 0
        model.register_forward_pre_hook(self._called)

    def _called(self, module: nn.Module, args: object) -> None:
        if not module.training:
            _ReRuns.counts[id(self)] += 1

    def __len__(self) -> int:
        return _ReRuns.counts[id(self)]


def _counting_re_runs(model: nn.Module) -> _ReRuns:
    return _ReRuns(model)


# -- tw.watch ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [*WITH_STATE, "plain"])
def test_a_forward_changing_its_state_trains_as_without_trainwatch(quiet_watch, name):
    plain_losses, plain_state, _ = models.train(name)
    re_runs: list[_ReRuns] = []

    def watch(model, opt, **config):
        re_runs.append(_counting_re_runs(model))
        return quiet_watch(model, opt, stalled_training=OFTEN)

    losses, state, monitor = models.train(name, watch=watch)
    assert losses == plain_losses
    assert models.same(state, plain_state)
    assert len(re_runs[0]) == 7  # the reference, then steps 1, 3, 5, 7, 9, 11
    assert monitor.alerts == []


# -- NaN replays --------------------------------------------------------------------------------
CORRUPT_AT = 12


def _train_fp16(name: str, watch) -> tuple[list[str], dict, list[tw.Alert]]:
    """fp16 autocast under a GradScaler; one batch overflows fp16, its step skipped."""
    models.CALLS = 0
    models.LOG.clear()
    torch.manual_seed(0)
    model = models.MODELS[name]()
    opt = torch.optim.SGD(models.trainable(model), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    monitor = None
    if watch is not None:
        monitor = watch(model, opt, scaler=scaler, stalled_training=False)
    losses = []
    for step, (x, idx, noise) in enumerate(models.batches(20)):
        if step == CORRUPT_AT:
            x = x.clone()
            x[:, 0] = 1e30  # a corrupt sample: inf in fp16
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = models.step_loss(model, (x, idx, noise))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(repr(loss.item()))
    if monitor is None:
        return losses, models.final_state(model), []
    monitor.close()
    return losses, models.final_state(model), monitor.alerts


@pytest.mark.parametrize("name", WITH_STATE)
def test_the_replay_of_an_overflow_the_scaler_skipped_leaves_the_state_alone(quiet_watch, name):
    """The step is skipped and training goes on; the replay that locates the
    overflow ran the forward once more."""
    plain_losses, plain_state, _ = _train_fp16(name, None)
    losses, state, alerts = _train_fp16(name, quiet_watch)
    assert [a.rule for a in alerts] == ["nonfinite_forward"]  # located: the replay ran
    assert losses == plain_losses
    assert models.same(state, plain_state)


# -- a change that cannot be put back ---------------------------------------------------------
class SparseTraces(nn.Module):
    """Eligibility traces kept as a sparse tensor, decayed in place at every call:
    a write whose values the re-run could not copy."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)
        self.traces = torch.eye(4).to_sparse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.traces.mul_(0.5)
        return self.fc(x)


def _train_traced(watch) -> tuple[list[float], torch.Tensor, _ReRuns, tw.Monitor | None]:
    torch.manual_seed(0)
    model = SparseTraces()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    re_runs = _counting_re_runs(model)
    monitor = watch(model, opt, stalled_training=OFTEN) if watch is not None else None
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(10):
        x = torch.randn(16, 8, generator=gen)
        loss = (model(x) - x[:, :1]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.traces.to_dense(), re_runs, monitor


def test_a_write_that_cannot_be_put_back_stops_the_re_run_before_it(quiet_watch):
    plain_losses, plain_traces, _, _ = _train_traced(None)
    losses, traces, re_runs, monitor = _train_traced(quiet_watch)
    assert losses == plain_losses
    assert torch.equal(traces, plain_traces)
    assert len(re_runs) == 1  # the reference, stopped at the write: never again
    (alert,) = monitor.alerts
    assert (alert.rule, alert.severity, alert.data["kind"]) == (
        "stalled_training",
        "info",
        "rerun_stopped",
    )
    assert "no plain storage" in alert.message


# -- the stall is still told ------------------------------------------------------------------
@pytest.mark.parametrize("lr, stalled", [(0.0, True), (0.05, False)])
@pytest.mark.parametrize("name", [*WITH_STATE, "plain"])
def test_a_learning_rate_of_0_stalls_at_the_first_check_past_warm_up(
    quiet_watch, name, lr, stalled
):
    """Re-run at every sampled step whatever its forward changes (an in-place EMA
    was re-run once, then judged from the updates alone: told later, another way)."""

    def watch(model, opt, **config):
        return quiet_watch(model, opt, stalled_training={"every": 10, "warmup": 20})

    _, _, monitor = models.train(name, steps=35, lr=lr, watch=watch)
    found = [(a.rule, a.step, a.data.get("criterion")) for a in monitor.alerts]
    assert found == ([("stalled_training", 19, "output_change")] if stalled else [])


# -- Lightning --------------------------------------------------------------------------------
class LitSideEffects(pl.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        models.CALLS = 0
        models.LOG.clear()
        torch.manual_seed(0)
        self.net = models.MODELS[name]()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = models.step_loss(self.net, batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(models.trainable(self.net), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(models.batches(10), batch_size=None)


@pytest.mark.slow
@pytest.mark.parametrize("name", WITH_STATE)
def test_a_lightning_module_whose_forward_changes_its_state_trains_as_without(tmp_path, name):
    callback = TrainWatchCallback(console=io.StringIO(), stalled_training=OFTEN)
    runs = []
    for callbacks in ([], [callback]):
        module = LitSideEffects(name)
        re_runs = _counting_re_runs(module.net)
        quiet_trainer(tmp_path, callbacks, max_steps=10).fit(module)
        runs.append((module.losses, models.final_state(module.net), len(re_runs)))
    (plain, plain_state, none), (watched, watched_state, re_run) = runs
    assert len(watched) == 10 and watched == plain
    assert models.same(watched_state, plain_state)
    assert none == 0 and re_run >= 5
    assert _internal(callback.alerts) == []


# -- trainwatch run -----------------------------------------------------------------------------
SCRIPT = """
import sys
import torch
from tests.forward_side_effect_models import train

losses, state, _ = train(sys.argv[1])
torch.save({"losses": losses, "state": state}, sys.argv[2])
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", WITH_STATE)
def test_trainwatch_run_of_an_unmodified_script_trains_as_without(tmp_path, name):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    (tmp_path / "often.yaml").write_text("stalled_training: {every: 2, warmup: 1}\n")
    root = str(Path(__file__).resolve().parent.parent)
    env = {"PYTHONPATH": root, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    plain = subprocess.run(
        [sys.executable, str(script), name, str(tmp_path / "plain.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plain.returncode == 0, plain.stderr
    options = ["--config", str(tmp_path / "often.yaml"), "--log-dir", str(tmp_path / "out")]
    watched = subprocess.run(
        [sys.executable, "-m", "trainwatch", "run", *options, "--no-console"]
        + [str(script), name, str(tmp_path / "watched.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert watched.returncode == 0, watched.stdout + watched.stderr
    alerts = tmp_path / "out" / "alerts.jsonl"
    lines = alerts.read_text().splitlines() if alerts.exists() else []
    assert [json.loads(line)["rule"] for line in lines] == []
    events = EventAccumulator(str(tmp_path / "out"))
    events.Reload()
    moved = [e.step for e in events.Scalars(metadata.OUTPUT_CHANGE_TAG)]
    assert moved == [1, 3, 5, 7, 9, 11]  # re-run and measured at every sampled step
    expected = torch.load(tmp_path / "plain.pt")
    found = torch.load(tmp_path / "watched.pt")
    assert found["losses"] == expected["losses"]
    assert models.same(found["state"], expected["state"])
