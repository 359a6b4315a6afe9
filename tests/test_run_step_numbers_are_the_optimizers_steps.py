"""Under ``trainwatch run`` a step's number is the loop's own optimizer step, as
``tw.watch`` numbers it, and the run's steps count every step it watched.

``trainwatch run`` finds a model at its first forward. Steps its optimizer took
before that (warm-up batches skipped, ``optimizer.step()`` still called to keep a
scheduler in step) went uncounted: a ``zero_grad`` dropped from step 100 was told
at step 98, the summary said "148 steps watched" for 150 steps, and
``--max-steps`` stopped two steps late. A k-fold loop building each fold's
optimizer before the fold's new model (so over the previous fold's model) had its
replaced models told at steps 22 and 2 (on two counters) instead of 20 and 40,
and a run replacing its models (folds, stages) counted only the last model's
steps. Now a model's count starts at its optimizer's own, a model trained in the
place of another goes on from that one's count, and models trained one after
another add their steps up, while models trained together (a GAN's two halves)
count once.
"""

from __future__ import annotations

import json
import runpy
import sys
import textwrap
from pathlib import Path

import pytest
from torch.nn.modules import module as module_hooks
from torch.optim import Optimizer
from torch.optim import optimizer as optimizer_hooks

from trainwatch.runner import run_script

OPTIMIZER_INIT = Optimizer.__init__

# Two warm-up batches skipped before the model's first forward, the optimizer
# stepped all the same; "bug": zero_grad() dropped from step 30 on.
SKIPPED_WARM_UP = """
import os
import sys

import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
if os.environ.get("TW_WATCH"):
    import trainwatch as tw

    monitor = tw.watch(model, opt, console=False)
for step in range(40):
    x = torch.randn(32, 20)
    y = x[:, :5].argmax(1)
    if step < 30 or sys.argv[1] != "bug":
        opt.zero_grad()
    if step >= 2:  # the first two batches are skipped
        F.cross_entropy(model(x), y).backward()
    opt.step()
    print("stepped", step)
if os.environ.get("TW_WATCH"):
    monitor.close()
    print("watched", [(a.rule, a.step) for a in monitor.alerts], monitor.step_count)
"""

# A GAN whose discriminator takes its first step on real data alone, before the
# generator's first call; the generator's optimizer steps at that batch too.
# "bug": the generator's zero_grad() dropped from its step 25 on.
GAN = """
import sys

import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
D = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
G = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
opt_d = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
opt_g = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
ones, zeros = torch.ones(64, 1), torch.zeros(64, 1)
for step in range(40):
    real = torch.randn(64, 2) * 0.5 + 1.0
    opt_d.zero_grad()
    if step == 0:  # the discriminator's warm-up: the generator is not called yet
        d_loss = F.binary_cross_entropy_with_logits(D(real), ones)
    else:
        fake = G(torch.randn(64, 4)).detach()
        d_loss = F.binary_cross_entropy_with_logits(
            D(real), ones
        ) + F.binary_cross_entropy_with_logits(D(fake), zeros)
    d_loss.backward()
    opt_d.step()
    if step < 25 or sys.argv[1] != "bug":
        opt_g.zero_grad()
    if step > 0:
        F.binary_cross_entropy_with_logits(D(G(torch.randn(64, 4))), ones).backward()
    opt_g.step()  # stepped at step 0 too, before the generator's first call
"""

# Three folds; "bug": each fold's optimizer built before the fold's new model,
# over the previous fold's model. "keep": the optimizers kept in a list (the
# first one alive while the third fold trains).
K_FOLD = """
import sys

import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
X = torch.randn(1500, 12)
Y = X[:, :3].argmax(1)
kept = []
model = nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 3))
for k in range(3):
    if sys.argv[1] in ("bug", "keep"):
        opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    if k > 0:
        model = nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 3))
    if sys.argv[1] == "clean":
        opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    if sys.argv[1] == "keep":
        kept.append(opt)
    for step in range(20):
        idx = torch.randint(0, 1500, (64,))
        loss = F.cross_entropy(model(X[idx]), Y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
"""

# Two stages, the second training a deep copy of the first's model with its own
# optimizer (the first model and optimizer dropped). "bug": a broadcast of the
# (N, 1) output against an (N,) target in the second stage.
STAGES = """
import copy
import sys

import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
X = torch.randn(256, 8)
Y = X.sum(1)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(25):
    opt.zero_grad()
    F.mse_loss(model(X).squeeze(1), Y).backward()
    opt.step()
model = copy.deepcopy(model)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(15):
    opt.zero_grad()
    out = model(X)
    F.mse_loss(out if sys.argv[1] == "bug" else out.squeeze(1), Y).backward()
    opt.step()
"""

# A Lightning fit whose first two batches are skipped (training_step returns None
# before the forward); "bug": a NaN from global_step 30 on, in the module "act".
LIGHTNING = """
import sys
import warnings

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore")
L.seed_everything(0, verbose=False)


class Act(nn.Module):
    def __init__(self):
        super().__init__()
        self.on = False

    def forward(self, h):
        return torch.sqrt(h) if self.on else F.relu(h)


class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(20, 32)
        self.act = Act()
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))

    def training_step(self, batch, index):
        if index < 2:
            return None
        self.act.on = sys.argv[1] == "bug" and self.global_step >= 30
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


X = torch.randn(2048, 20)
Y = (X[:, :4] * 2).argmax(1)
trainer = L.Trainer(
    max_steps=40, logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False, accelerator="cpu",
)
trainer.fit(Lit(), DataLoader(TensorDataset(X, Y), batch_size=32, shuffle=True))
print("global_step", trainer.global_step)
"""


@pytest.fixture(autouse=True)
def _no_hook_leaks():
    yield
    assert not module_hooks._global_forward_pre_hooks
    assert not module_hooks._global_forward_hooks
    assert not optimizer_hooks._global_optimizer_pre_hooks
    assert not optimizer_hooks._global_optimizer_post_hooks
    assert Optimizer.__init__ is OPTIMIZER_INIT


def _run(
    tmp_path: Path, body: str, *args: str, max_steps: int | None = None
) -> tuple[list[dict], int]:
    """The run's warnings and errors, and alert_counts.json's steps."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    log = tmp_path / "log"
    code = run_script(script, args, log_dir=log, console=False, max_steps=max_steps)
    assert code == 0
    found = [json.loads(line) for line in (log / "alerts.jsonl").read_text().splitlines()]
    told = [a for a in found if a["severity"] in ("warning", "error")]
    return told, json.loads((log / "alert_counts.json").read_text())["steps"]


def _dated(told: list[dict]) -> list[tuple[str, int, str]]:
    return [(a["rule"], a["step"], a["data"].get("model", "")) for a in told]


def _under_watch(tmp_path: Path, body: str, *args: str, monkeypatch, capsys) -> str:
    """The script run with its own ``tw.watch`` (plain python, no run): what it printed."""
    script = tmp_path / "watched.py"
    script.write_text(textwrap.dedent(body))
    monkeypatch.setenv("TW_WATCH", "1")
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    runpy.run_path(str(script), run_name="__main__")
    return capsys.readouterr().out


def test_steps_before_the_models_first_forward_are_counted(tmp_path, monkeypatch, capsys):
    told, steps = _run(tmp_path, SKIPPED_WARM_UP, "bug")
    assert [(rule, step) for rule, step, _ in _dated(told)] == [("accumulated_gradient", 30)]
    assert "step 29 had already used" in told[0]["message"]
    assert steps == 40
    # The same step tw.watch(model, opt) gives it.
    watched = _under_watch(tmp_path, SKIPPED_WARM_UP, "bug", monkeypatch=monkeypatch, capsys=capsys)
    assert "watched [('accumulated_gradient', 30)] 40" in watched


def test_skipped_warm_up_batches_of_a_healthy_loop_are_silent_and_counted(tmp_path):
    told, steps = _run(tmp_path, SKIPPED_WARM_UP, "clean")
    assert told == []
    assert steps == 40


def test_max_steps_counts_the_steps_before_the_models_first_forward(tmp_path, capsys):
    told, steps = _run(tmp_path, SKIPPED_WARM_UP, "clean", max_steps=20)
    assert told == []
    assert steps == 20
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("stepped")]
    # Stopped in the 20th optimizer step's hook, before the script printed it.
    assert printed[-1] == "stepped 18"


def test_a_gan_numbers_each_half_by_its_own_optimizer(tmp_path):
    told, steps = _run(tmp_path, GAN, "bug")
    # The discriminator, called first, is Sequential; the generator Sequential#2,
    # its step 0 taken before its first call.
    assert _dated(told) == [("accumulated_gradient", 25, "Sequential#2")]
    assert steps == 40  # the two halves trained together: counted once


def test_a_healthy_gan_with_a_discriminator_warm_up_is_silent(tmp_path):
    told, steps = _run(tmp_path, GAN, "clean")
    assert told == []
    assert steps == 40


@pytest.mark.parametrize("kind", ["bug", "keep"])
def test_folds_trained_under_a_stale_optimizer_are_told_at_their_first_steps(tmp_path, kind):
    told, steps = _run(tmp_path, K_FOLD, kind)
    assert _dated(told) == [
        ("not_optimized", 20, "Sequential#2"),
        ("not_optimized", 40, "Sequential#3"),
    ]
    assert [(a["data"]["stale_model"], a["data"]["stale_since"]) for a in told] == [
        ("Sequential", 20),
        ("Sequential#2", 40),
    ]
    assert "no longer called since step 40" in told[1]["message"]
    assert steps == 60


def test_healthy_folds_are_silent_and_every_folds_steps_are_counted(tmp_path):
    told, steps = _run(tmp_path, K_FOLD, "clean")
    assert told == []
    assert steps == 60


def test_max_steps_stops_within_a_later_fold(tmp_path):
    told, steps = _run(tmp_path, K_FOLD, "clean", max_steps=30)
    assert told == []
    assert steps == 30


@pytest.mark.parametrize("kind", ["bug", "clean"])
def test_a_deep_copy_trained_in_a_second_stage_adds_its_steps(tmp_path, kind):
    told, steps = _run(tmp_path, STAGES, kind)
    # Its own optimizer's steps: its findings dated from its step 0, as tw.watch's.
    assert _dated(told) == ([("broadcast", 0, "Sequential#2")] if kind == "bug" else [])
    assert steps == 40


@pytest.mark.parametrize("kind", ["bug", "clean"])
def test_a_lightning_fit_keeps_its_global_step(tmp_path, capsys, kind):
    told, steps = _run(tmp_path, LIGHTNING, kind)
    assert "global_step 40" in capsys.readouterr().out
    assert steps == 40
    if kind == "bug":
        assert [(a["rule"], a["step"], a["module"]) for a in told][:1] == [
            ("nonfinite_forward", 30, "act")
        ]
    else:
        assert told == []
