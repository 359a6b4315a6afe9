"""A model trained in eval mode right after a frozen eval-mode pass of the same step is
told at that step, as a warning, not as a frozen part kept in eval.

Model-based RL and GANs freeze a model and put it in eval for another model's
backward (a world model's imagination pass trains the policy; a discriminator
scores the generator's samples), then unfreeze it. Where ``.train()`` is
forgotten, the model's own next update runs in eval mode, in the same step as
the frozen pass. That pass alone is the frozen-part idiom (an info line at
most); the update after it trains every parameter with dropout off, and is the
warning at its step. Controls: ``.train()`` called back (the info line of the
frozen pass, as before), and a frozen backbone kept in eval under a head that
trains, several passes a step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import trainwatch as tw
from trainwatch.runner import run_script

# ``mode``: forget (``dyn.train()`` never called after imagination), remember
# (called back), no_imagination (``dyn.eval()`` left on without an imagination pass).
WORLD_MODEL = """
import sys
import torch
from torch import nn

mode = sys.argv[1]
watch = globals().get("watch", lambda model, optimizer: None)  # the in-process tests' monitor
torch.manual_seed(0)
dyn = nn.Sequential(nn.Linear(4, 32), nn.Dropout(0.1), nn.Linear(32, 4))
policy = nn.Linear(4, 4)
dyn_opt = torch.optim.Adam(dyn.parameters(), 1e-3)
pol_opt = torch.optim.Adam(policy.parameters(), 1e-3)
watch(dyn, dyn_opt)
x = torch.randn(64, 4)
for it in range(3):
    for k in range(3):  # fit the dynamics model
        loss = (dyn(x) - x.roll(1, 1)).pow(2).mean()
        dyn_opt.zero_grad()
        loss.backward()
        dyn_opt.step()
    if mode == "no_imagination":
        dyn.eval()
        continue
    dyn.eval()  # imagination: the dynamics model frozen, in eval mode
    dyn.requires_grad_(False)
    p_loss = dyn(policy(x)).pow(2).mean()
    pol_opt.zero_grad()
    p_loss.backward()
    pol_opt.step()
    dyn.requires_grad_(True)
    if mode == "remember":
        dyn.train()
"""

# ``mode``: forget (``D.train()`` never called after the generator's update), remember.
GAN = """
import sys
import torch
from torch import nn

mode = sys.argv[1]
watch = globals().get("watch", lambda model, optimizer: None)  # the in-process tests' monitor
torch.manual_seed(0)
G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
D = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Dropout(0.3), nn.Linear(32, 1))
g_opt = torch.optim.Adam(G.parameters(), 2e-4)
d_opt = torch.optim.Adam(D.parameters(), 2e-4)
watch(D, d_opt)
bce = nn.BCEWithLogitsLoss()
for step in range(6):
    real = torch.randn(32, 16) + 2
    fake = G(torch.randn(32, 8))
    d_loss = bce(D(real), torch.ones(32, 1)) + bce(D(fake.detach()), torch.zeros(32, 1))
    d_opt.zero_grad()
    d_loss.backward()
    d_opt.step()
    D.eval()  # the discriminator frozen in eval for the generator's update
    D.requires_grad_(False)
    g_loss = bce(D(fake), torch.ones(32, 1))
    g_opt.zero_grad()
    g_loss.backward()
    g_opt.step()
    D.requires_grad_(True)
    if mode == "remember":
        D.train()
"""


def _watched(script: str, mode: str) -> list[tw.Alert]:
    """The script run in this process, the model it hands ``watch`` watched with its
    optimizer from the start: its train_in_eval_mode alerts."""
    monitors: list[tw.Monitor] = []

    def watch(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        monitors.append(tw.watch(model, optimizer, console=False))

    argv, sys.argv = sys.argv, ["script", mode]
    try:
        exec(compile(script, "script", "exec"), {"__name__": "__main__", "watch": watch})
    finally:
        sys.argv = argv
    (monitor,) = monitors
    alerts = [a for a in monitor.alerts if a.rule == "train_in_eval_mode"]
    monitor.close()
    return alerts


def _run(tmp_path: Path, script: str, mode: str) -> list[dict]:
    path = tmp_path / "script.py"
    path.write_text(script)
    run_script(path, [mode], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["rule"] == "train_in_eval_mode"]


def _told(alerts) -> list[tuple[str, int, str]]:
    return [
        (a["severity"], a["step"], a["module"])
        if isinstance(a, dict)
        else (a.severity, a.step, a.module)
        for a in alerts
    ]


# -- a world model's imagination pass, then its own update in eval ------------------
def test_a_world_model_updated_in_eval_after_its_imagination_pass_is_told_at_that_step():
    """Step 3 (the fourth dynamics update) is the first in eval mode, right after
    the frozen imagination pass of that step: the warning, at step 3, and no
    line saying a frozen part was kept in eval."""
    alerts = _watched(WORLD_MODEL, "forget")
    assert _told(alerts) == [("warning", 3, "1")]
    assert "frozen" not in alerts[0].message


def test_a_world_model_left_in_eval_without_imagination_is_told_at_the_same_step():
    """The same forgotten .train() with no imagination pass before the update."""
    assert _told(_watched(WORLD_MODEL, "no_imagination")) == [("warning", 3, "1")]


def test_a_world_model_put_back_in_training_mode_keeps_the_frozen_pass_info():
    """Control: dyn.train() after imagination. The imagination pass alone is the
    frozen model kept in eval: its info line, as before, and no warning."""
    alerts = _watched(WORLD_MODEL, "remember")
    assert _told(alerts) == [("info", 3, "1")]
    assert "frozen part" in alerts[0].message


@pytest.mark.parametrize(
    ("mode", "told"),
    [("forget", [("warning", 3, "1")]), ("remember", [("info", 3, "1")])],
)
def test_under_trainwatch_run_the_world_model_is_told_at_the_step_it_trains_in_eval(
    tmp_path, mode, told
):
    assert _told(_run(tmp_path, WORLD_MODEL, mode)) == told


# -- a GAN's discriminator frozen in eval for the generator ------------------------
def test_a_discriminator_trained_in_eval_after_the_generators_update_is_told():
    """Every step after the first runs the generator's pass through the frozen
    discriminator first, then the discriminator's own update, still in eval:
    the warning at step 1, where that frozen pass used to hide it for good."""
    alerts = _watched(GAN, "forget")
    assert _told(alerts) == [("warning", 1, "2")]
    assert "frozen" not in alerts[0].message


def test_a_discriminator_put_back_in_training_mode_keeps_the_frozen_pass_info():
    assert _told(_watched(GAN, "remember")) == [("info", 1, "2")]


@pytest.mark.parametrize(("mode", "severity"), [("forget", "warning"), ("remember", "info")])
def test_under_trainwatch_run_the_discriminator_trained_in_eval_is_told(tmp_path, mode, severity):
    """Both models watched: the discriminator's line, at step 1, a warning only
    where its own update ran in eval."""
    assert _told(_run(tmp_path, GAN, mode)) == [(severity, 1, "2")]


# -- a frozen backbone kept in eval: still the idiom, several passes a step ---------
def test_a_frozen_backbone_kept_in_eval_over_micro_batches_stays_an_info_line():
    """Control: a head trains over a frozen backbone kept in eval (dropout and
    batch norm inside it), two micro-batches a step: each later pass looked at
    again finds the backbone frozen still. One info line, no warning."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2))
    model = nn.Sequential(backbone, nn.Linear(32, 4), nn.Dropout(0.1), nn.Linear(4, 1))
    backbone.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], 0.01)
    monitor = tw.watch(model, opt, console=False)
    try:
        for _ in range(6):
            model.train()
            backbone.eval()
            for _ in range(2):
                x = torch.randn(16, 8)
                model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        told = [a for a in monitor.alerts if a.rule == "train_in_eval_mode"]
    finally:
        monitor.close()
    assert [(a.severity, a.step) for a in told] == [("info", 0)]
    assert "frozen part" in told[0].message


# -- Lightning, manual optimisation -------------------------------------------------
def _lightning_gan(tmp_path: Path, remember: bool) -> list[tw.Alert]:
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from tests.lightning_models import quiet_trainer
    from trainwatch.lightning import TrainWatchCallback

    class ManualGAN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
            self.D = nn.Sequential(
                nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Dropout(0.3), nn.Linear(32, 1)
            )

        def training_step(self, batch, batch_idx):
            (real,) = batch
            g_opt, d_opt = self.optimizers()
            bce = nn.functional.binary_cross_entropy_with_logits
            ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
            fake = self.G(torch.randn(len(real), 8))
            d_loss = bce(self.D(real), ones) + bce(self.D(fake.detach()), zeros)
            d_opt.zero_grad()
            self.manual_backward(d_loss)
            d_opt.step()
            self.D.eval()
            self.D.requires_grad_(False)
            g_loss = bce(self.D(fake), ones)
            g_opt.zero_grad()
            self.manual_backward(g_loss)
            g_opt.step()
            self.D.requires_grad_(True)
            if remember:
                self.D.train()

        def configure_optimizers(self):
            return [
                torch.optim.Adam(self.G.parameters(), 2e-4),
                torch.optim.Adam(self.D.parameters(), 2e-4),
            ]

    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(128, 16) + 2), batch_size=32)
    callback = TrainWatchCallback(console=False)
    quiet_trainer(tmp_path, [callback], max_epochs=1).fit(ManualGAN(), data)
    return [a for a in callback.alerts if a.rule == "train_in_eval_mode"]


@pytest.mark.parametrize(
    ("remember", "told"),
    [(False, [("info", 1, "D.2"), ("warning", 2, "D.2")]), (True, [("info", 1, "D.2")])],
)
def test_a_lightning_gan_with_manual_optimisation(tmp_path, remember, told):
    """Each optimizer's step is a step under Lightning: the generator's (1, the
    frozen pass) and the discriminator's own (2, in eval where D.train() is
    forgotten) are told apart."""
    assert _told(_lightning_gan(tmp_path, remember)) == told
