"""Noise the loop adds to ``.grad`` after backward is no exploding gradient.

Stochastic-gradient Langevin dynamics (SGLD) adds Gaussian noise to every
gradient once its burn-in is over, in place, between ``backward()`` and
``optimizer.step()``. The norms read at the step then jump 84x in one step
while the gradients backward made did not move: exploding_gradient told it,
with the advice to clip or lower the learning rate. Now the steps after such a
jump are judged by the norms backward left (taken at its end), so the noise is
no jump, while an explosion backward makes under the noise (a batch scaled
1e4x, a learning rate that blows the weights up) is told at its step as
without it. Each loop with its planted explosion beside it; the noise loops
are the healthy twins, silent.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import trainwatch as tw
from trainwatch.runner import run_script

N, LR = 2000, 1e-5
NOISE_FROM, PLANTED_AT, STEPS = 100, 140, 170
NOISE = math.sqrt(2.0 / N / LR)  # SGLD's: sqrt(2 / (dataset size * lr)) per element


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(26)
    x = torch.randn(N, 8)
    return x, x @ torch.randn(8, 1) + 0.3 * torch.randn(N, 1)


def _add_noise(model: nn.Module, scale: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.grad.add_(torch.randn_like(p) * scale)


def _langevin_loop(
    *,
    noise: str = "after_burn_in",
    clip: bool = False,
    bad_batch: bool = False,
    blow_up: bool = False,
    **watch: object,
) -> list[tw.Alert]:
    """SGD at lr 1e-5 on a small regression; ``noise``: "after_burn_in" (SGLD, from
    step NOISE_FROM), "annealed" (from step 0, decaying) or "none". At PLANTED_AT:
    ``bad_batch`` scales that batch's targets 1e4x, ``blow_up`` raises the learning
    rate to 0.5 (the weights blow up). ``clip``: clip_grad_norm_ after the noise."""
    x, y = _data()
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with tw.watch(model, opt, console=io.StringIO(), **watch) as monitor:
        for step in range(STEPS):
            if blow_up and step == PLANTED_AT:
                opt.param_groups[0]["lr"] = 0.5
            idx = torch.randint(0, N, (64,))
            target = y[idx] * (1e4 if bad_batch and step == PLANTED_AT else 1.0)
            opt.zero_grad()
            F.mse_loss(model(x[idx]), target).backward()
            if noise == "after_burn_in" and step >= NOISE_FROM:
                _add_noise(model, NOISE)
            elif noise == "annealed":
                _add_noise(model, 10 * NOISE / (1 + step) ** 0.55)
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return monitor.alerts


def _exploding(alerts: list) -> list[tuple[int, str]]:
    return [(a.step, a.module) for a in alerts if a.rule == "exploding_gradient"]


# -- plain loops (tw.watch) ----------------------------------------------------


def test_langevin_noise_switched_on_after_burn_in_is_silent():
    assert _langevin_loop() == []


def test_with_the_readback_a_step_late_the_noise_is_silent_too():
    """The look at backward's end begins a step after the jump was read."""
    assert _langevin_loop(readback="lagged") == []


def test_noise_annealed_from_the_first_step_stays_silent():
    assert _langevin_loop(noise="annealed") == []


def test_noise_added_before_the_loops_clip_is_silent():
    assert _langevin_loop(clip=True) == []


def test_a_batch_scaled_1e4_under_the_noise_is_told_at_its_step():
    alerts = _langevin_loop(bad_batch=True)
    assert _exploding(alerts)[:1] == [(PLANTED_AT, "0")]
    told = alerts[0]
    assert told.data["ratio"] > 1000  # backward's own jump, not the noise-diluted one
    assert told.data["before_loop_writes"] is True
    assert "norms as backward made them" in told.message


def test_the_same_batch_without_noise_is_told_at_its_step():
    assert [step for step, _ in _exploding(_langevin_loop(noise="none", bad_batch=True))] == [
        PLANTED_AT
    ]


def test_a_batch_scaled_1e4_under_the_noise_and_a_clip_is_told_at_its_step():
    assert _exploding(_langevin_loop(bad_batch=True, clip=True))[:1] == [(PLANTED_AT, "0")]


def test_a_learning_rate_blowing_the_weights_up_under_the_noise_is_told():
    alerts = _langevin_loop(blow_up=True)
    first = _exploding(alerts)[:1]
    assert first and PLANTED_AT < first[0][0] <= PLANTED_AT + 4
    assert "learning rate" in alerts[0].hint


def test_the_same_learning_rate_blow_up_with_the_readback_a_step_late_is_told():
    first = _exploding(_langevin_loop(blow_up=True, readback="lagged"))[:1]
    assert first and PLANTED_AT < first[0][0] <= PLANTED_AT + 4


# -- trainwatch run --------------------------------------------------------------

SGLD_SCRIPT = f"""
import math, sys
import torch, torch.nn as nn, torch.nn.functional as F

BAD = sys.argv[1] == "bad"
torch.manual_seed(26)
N, lr = {N}, {LR}
X = torch.randn(N, 8); Y = X @ torch.randn(8, 1) + 0.3 * torch.randn(N, 1)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=lr)
for step in range({STEPS}):
    idx = torch.randint(0, N, (64,))
    opt.zero_grad()
    F.mse_loss(model(X[idx]), Y[idx] * (1e4 if BAD and step == {PLANTED_AT} else 1.0)).backward()
    if step >= {NOISE_FROM}:
        with torch.no_grad():
            for p in model.parameters():
                p.grad.add_(torch.randn_like(p) * math.sqrt(2.0 / N / lr))
    opt.step()
"""


def _run(tmp_path: Path, script: str, *args: str) -> list[tuple[str, int, str | None]]:
    path = tmp_path / "train.py"
    path.write_text(script)
    log_dir = tmp_path / "log"
    run_script(path, list(args), log_dir=log_dir, console=False)
    lines = (log_dir / "alerts.jsonl").read_text().splitlines()
    return [(a["rule"], a["step"], a["module"]) for a in map(json.loads, lines)]


def test_trainwatch_run_of_an_sgld_script_is_silent(tmp_path):
    assert _run(tmp_path, SGLD_SCRIPT, "healthy") == []


def test_trainwatch_run_of_the_sgld_script_with_a_bad_batch_tells_it(tmp_path):
    assert _run(tmp_path, SGLD_SCRIPT, "bad")[:1] == [("exploding_gradient", PLANTED_AT, "0")]


# -- Lightning: noise added in the LightningModule's on_before_optimizer_step --------

LIGHTNING_SCRIPT = f"""
import math, sys
import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

BAD, LOG_DIR = sys.argv[1] == "bad", sys.argv[2]
N, LR = {N}, {LR}


class Langevin(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if BAD and self.global_step == {PLANTED_AT}:
            y = y * 1e4
        return F.mse_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer):
        if self.global_step >= {NOISE_FROM}:  # burn-in over: sample the posterior
            with torch.no_grad():
                for p in self.parameters():
                    p.grad.add_(torch.randn_like(p) * math.sqrt(2.0 / N / LR))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


torch.manual_seed(26)
x = torch.randn(N, 8)
y = x @ torch.randn(8, 1) + 0.3 * torch.randn(N, 1)
callbacks = []
if LOG_DIR != "-":
    from trainwatch.lightning import TrainWatchCallback

    callbacks.append(TrainWatchCallback(log_dir=LOG_DIR, console=False))
sampler = RandomSampler(x, replacement=True, num_samples=64 * {STEPS})
pl.Trainer(
    accelerator="cpu",
    max_steps={STEPS},
    callbacks=callbacks,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
).fit(Langevin(), DataLoader(TensorDataset(x, y), batch_size=64, sampler=sampler))
"""


def test_trainwatch_run_of_a_lightning_module_adding_noise_before_its_step_is_silent(tmp_path):
    assert _run(tmp_path, LIGHTNING_SCRIPT, "healthy", "-") == []


def test_trainwatch_run_of_that_lightning_module_with_a_bad_batch_tells_it(tmp_path):
    found = _run(tmp_path, LIGHTNING_SCRIPT, "bad", "-")
    assert [(rule, step) for rule, step, _ in found][:1] == [("exploding_gradient", PLANTED_AT)]


def test_the_callback_on_that_lightning_module_is_silent(tmp_path):
    log_dir = tmp_path / "callback"
    assert _run(tmp_path, LIGHTNING_SCRIPT, "healthy", str(log_dir)) == []
