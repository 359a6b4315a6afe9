"""constant_output in adversarial loops: a discriminator and a clipped critic are no collapse.

A discriminator's sampled pass may be on its generator's narrow fakes while
its largest spread was seen on real data: its output varies less there by as
much as its input does, which no collapse is. A WGAN critic's weights are
clipped after every step (``p.data.clamp_(-c, c)``): the first clip shrinks
the initial weights ~70x by design, and the check made before it is no level
the critic's outputs fell from. Neither loop tells a thing.

Each healthy loop has a twin with a real collapse planted (a layer's weights
scaled towards zero and frozen), still told at its module and its first check.
"""

from __future__ import annotations

import json
import math
import runpy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import trainwatch as tw
from trainwatch.runner import run_script


def _grid(n: int) -> torch.Tensor:
    """25 Gaussians on a grid: real data far wider than a young generator's samples."""
    return torch.randint(-2, 3, (n, 2)).float() + 0.05 * torch.randn(n, 2)


def _ring(n: int) -> torch.Tensor:
    a = torch.rand(n) * 2 * math.pi
    return torch.stack([a.cos(), a.sin()], 1) * 2 + 0.05 * torch.randn(n, 2)


def _mlp(inputs: int, width: int, outputs: int, act: type[nn.Module]) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(inputs, width), act(), nn.Linear(width, width), act(), nn.Linear(width, outputs)
    )


def _collapse(layer: nn.Linear) -> None:
    """The layer's output no longer depends on its input: weights ~0 (not exactly), frozen."""
    with torch.no_grad():
        layer.weight.mul_(1e-5)
    layer.weight.requires_grad_(False)


def _told(monitor: tw.Monitor) -> dict[str, int]:
    return {a.module: a.step for a in monitor.alerts if a.rule == "constant_output"}


def _first_check_from(step: int, every: int = 25) -> int:
    return -(-step // every) * every


# -- a discriminator: non-saturating loss with lazy R1, or BCE on real, fake or both ------------


def _gan(
    d_calls: str, iterations: int, collapse_at: int | None = None, every: int = 25
) -> tuple[tw.Monitor, int]:
    """D is watched. Its step's first pass is mostly the generator's, on fresh fakes;
    the lazy R1 penalty (``nonsaturating``, every 4th iteration) is a step of its
    own whose first pass is on real data. D's own loss calls it on fakes then real
    data, real data then fakes, or one batch of both (``concatenated``)."""
    torch.manual_seed(0)
    G = _mlp(16, 128, 2, lambda: nn.LeakyReLU(0.2))
    D = _mlp(2, 128, 1, lambda: nn.LeakyReLU(0.2))
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-4, betas=(0.5, 0.99))
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-4, betas=(0.5, 0.99))
    monitor = tw.watch(D, opt_d, console=False, constant_output={"every": every})
    collapsed_step = -1
    for it in range(iterations):
        x = _grid(128)
        with torch.no_grad():
            fake = G(torch.randn(128, 16))
        if d_calls == "nonsaturating":
            d_loss = F.softplus(D(fake)).mean() + F.softplus(-D(x)).mean()
        elif d_calls == "real_then_fake":
            d_loss = F.binary_cross_entropy_with_logits(
                D(x), torch.ones(128, 1)
            ) + F.binary_cross_entropy_with_logits(D(fake), torch.zeros(128, 1))
        else:
            labels = torch.cat([torch.zeros(128, 1), torch.ones(128, 1)])
            d_loss = F.binary_cross_entropy_with_logits(D(torch.cat([fake, x])), labels)
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        if d_calls == "nonsaturating" and it % 4 == 0:
            xr = _grid(128).requires_grad_(True)
            (g,) = torch.autograd.grad(D(xr).sum(), xr, create_graph=True)
            opt_d.zero_grad()
            (20.0 * g.pow(2).sum(1).mean()).backward()
            opt_d.step()
        if it == collapse_at:
            # After D's step: the next step's first pass is the generator's, through D.
            _collapse(D[4])
            collapsed_step = _steps(opt_d)
        g_loss = F.softplus(-D(G(torch.randn(128, 16)))).mean()
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
    monitor.close()
    return monitor, collapsed_step


def _steps(opt: torch.optim.Optimizer) -> int:
    """How many steps the optimizer took: the step the monitor counts next."""
    state = next(iter(opt.state.values()))
    return int(state["step"])


@pytest.mark.parametrize("d_calls", ["nonsaturating", "real_then_fake", "concatenated"])
def test_a_discriminator_is_no_collapse(d_calls):
    monitor, _ = _gan(d_calls, 80)
    assert _told(monitor) == {}


def test_a_discriminator_checked_on_real_data_and_fakes_in_turn_is_no_collapse():
    """Checked at every step: the R1 steps' passes on real data come between the
    generator's passes on its fakes."""
    monitor, _ = _gan("nonsaturating", 60, every=1)
    assert _told(monitor) == {}


@pytest.mark.parametrize("d_calls", ["nonsaturating", "concatenated"])
def test_control_a_discriminator_whose_output_collapsed_is_told(d_calls):
    monitor, collapsed = _gan(d_calls, 120, collapse_at=40)
    assert _told(monitor) == {"": _first_check_from(collapsed)}


# -- a WGAN critic whose weights the loop clips after every step --------------------------------


def _wgan(iterations: int, collapse_at: int | None = None) -> tuple[tw.Monitor, int]:
    """The WGAN paper's settings: RMSprop 5e-5, c = 0.01, n_critic = 5."""
    torch.manual_seed(0)
    G = _mlp(8, 64, 2, nn.ReLU)
    C = _mlp(2, 64, 1, nn.ReLU)
    opt_g = torch.optim.RMSprop(G.parameters(), lr=5e-5)
    opt_c = torch.optim.RMSprop(C.parameters(), lr=5e-5)
    monitor = tw.watch(C, opt_c, console=False)
    collapsed_step = -1
    for it in range(iterations):
        for _ in range(5):
            with torch.no_grad():
                fake = G(torch.randn(64, 8))
            c_loss = C(fake).mean() - C(_ring(64)).mean()
            opt_c.zero_grad()
            c_loss.backward()
            opt_c.step()
            for p in C.parameters():
                p.data.clamp_(-0.01, 0.01)
        if it == collapse_at:
            # After the critic's steps: the next step's first pass is the generator's.
            _collapse(C[2])
            collapsed_step = 5 * (it + 1)
        g_loss = -C(G(torch.randn(64, 8))).mean()
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
    monitor.close()
    return monitor, collapsed_step


def test_a_critic_whose_weights_the_loop_clips_is_no_collapse():
    monitor, _ = _wgan(60)
    assert _told(monitor) == {}


def test_control_a_clipped_critic_whose_hidden_layer_collapsed_is_told_there():
    monitor, collapsed = _wgan(60, collapse_at=20)
    told = _told(monitor)
    assert told["2"] == _first_check_from(collapsed)
    assert set(told) <= {"2", ""}  # the layers after it see a constant input: it explains them


# -- a classifier without a loss target: its own history is the reference -----------------------


def test_control_a_classifier_whose_head_collapsed_is_told_at_its_first_check():
    torch.manual_seed(0)
    model = _mlp(8, 32, 4, nn.ReLU)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    weights = torch.randn(8, 4)
    monitor = tw.watch(model, opt, console=False, constant_output={"every": 5})
    for step in range(60):
        if step == 32:
            _collapse(model[4])
        x = torch.randn(64, 8)
        loss = F.cross_entropy(model(x), (x @ weights).argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    assert _told(monitor) == {"": 35}


def test_control_a_network_killed_at_its_first_step_is_told_at_once():
    """Its output stops varying at all right after the first check, before any
    level was held twice: an output that does not vary at all needs no reference."""
    torch.manual_seed(0)
    model = _mlp(8, 32, 4, nn.ReLU)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = tw.watch(model, opt, console=False)
    for step in range(10):
        if step == 1:
            with torch.no_grad():
                model[0].bias.fill_(-1e3)  # every unit of the first layer dead for good
        x = torch.randn(64, 8)
        loss = F.cross_entropy(model(x), x[:, :4].argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    assert _told(monitor).get("") == 1


# -- the same loops under Lightning's manual optimization and `trainwatch run` ------------------

LIGHTNING_WGAN = """
import math
import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

COLLAPSE, LOG_DIR = sys.argv[1] == "collapse", sys.argv[2]


def mlp(inputs, outputs):
    return nn.Sequential(
        nn.Linear(inputs, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, outputs)
    )


class WGAN(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.generator = mlp(8, 2)
        self.critic = mlp(2, 1)

    def training_step(self, batch, batch_idx):
        (real,) = batch
        opt_g, opt_c = self.optimizers()
        if COLLAPSE and batch_idx == 20:
            with torch.no_grad():
                self.critic[2].weight.mul_(1e-5)
            self.critic[2].weight.requires_grad_(False)
        for _ in range(5):
            with torch.no_grad():
                fake = self.generator(torch.randn(len(real), 8))
            loss = self.critic(fake).mean() - self.critic(real).mean()
            opt_c.zero_grad()
            self.manual_backward(loss)
            opt_c.step()
            for p in self.critic.parameters():
                p.data.clamp_(-0.01, 0.01)
        self.toggle_optimizer(opt_g)
        loss = -self.critic(self.generator(torch.randn(len(real), 8))).mean()
        opt_g.zero_grad()
        self.manual_backward(loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

    def configure_optimizers(self):
        return [
            torch.optim.RMSprop(self.generator.parameters(), lr=5e-5),
            torch.optim.RMSprop(self.critic.parameters(), lr=5e-5),
        ]


torch.manual_seed(0)
a = torch.rand(64 * 50) * 2 * math.pi
ring = torch.stack([a.cos(), a.sin()], 1) * 2 + 0.05 * torch.randn(len(a), 2)
callbacks = []
if LOG_DIR != "-":
    from trainwatch.lightning import TrainWatchCallback

    callbacks.append(TrainWatchCallback(log_dir=LOG_DIR, console=False))
pl.Trainer(
    accelerator="cpu",
    max_epochs=1,
    callbacks=callbacks,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
).fit(WGAN(), DataLoader(TensorDataset(ring), batch_size=64))
"""


def _alerts(log_dir: Path) -> list[tuple[str, str | None, int]]:
    lines = (log_dir / "alerts.jsonl").read_text().splitlines()
    return [(a["rule"], a["module"], a["step"]) for a in map(json.loads, lines)]


def _lightning_wgan(tmp_path, monkeypatch, bug: str, under_run: bool) -> list[tuple]:
    script, log_dir = tmp_path / "wgan.py", tmp_path / "log"
    script.write_text(LIGHTNING_WGAN)
    if under_run:
        assert run_script(script, [bug, "-"], log_dir=log_dir, console=False) == 0
    else:
        monkeypatch.setattr(sys, "argv", ["wgan.py", bug, str(log_dir)])
        runpy.run_path(str(script), run_name="__main__")
    return [found for found in _alerts(log_dir) if found[0] == "constant_output"]


@pytest.mark.parametrize("under_run", [False, True], ids=["callback", "trainwatch_run"])
def test_a_clipped_critic_under_lightning_manual_optimization_is_no_collapse(
    tmp_path, monkeypatch, under_run
):
    assert _lightning_wgan(tmp_path, monkeypatch, "none", under_run) == []


@pytest.mark.parametrize("under_run", [False, True], ids=["callback", "trainwatch_run"])
def test_control_its_collapsed_hidden_layer_is_told_under_lightning(
    tmp_path, monkeypatch, under_run
):
    found = _lightning_wgan(tmp_path, monkeypatch, "collapse", under_run)
    assert any(module.endswith("2") for _, module, _ in found), found
