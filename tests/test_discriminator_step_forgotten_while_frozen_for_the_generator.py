"""A discriminator whose ``opt_d.step()`` is forgotten, frozen for the generator's step.

A common GAN loop freezes the discriminator around the generator's step
(``for p in D.parameters(): p.requires_grad_(False)``, then back to True): the
generator's loss runs through it and its gradients are not wanted. With
``opt_d.step()`` forgotten (``opt_d.zero_grad()`` and the discriminator's
backward still run), nothing was told under ``tw.watch(gan)`` without an
optimizer, nor under ``tw.watch(gan, opt_g)``: the step boundary met only
parameters trainable at the generator's step, and the discriminator's never
were. Under ``tw.watch(G)`` beside ``tw.watch(D)`` the discriminator's monitor,
whose optimizer never steps, watched nothing at all, frozen or not.

Now the look for optimizers not given sees the discriminator's gradients
thrown away between two generator steps, and watches ``opt_d`` as if passed:
``not_optimized`` tells it, naming D and ``opt_d``, within a few iterations,
as it does with both optimizers passed (the twin); under ``tw.watch(gan,
opt_g)`` the frozen discriminator waits for ``opt_d``'s verdict as a trainable
one does. The same loops with ``opt_d.step()`` stay silent. WGAN with weight
clipping, WGAN-GP, DCGAN, on 2-D points and small images; Lightning's manual
optimisation with ``toggle_optimizer``, which freezes the other optimizer's
parameters the same way; ``trainwatch run`` of the unmodified script. Real
torch, real Lightning, no mocks.
"""

from __future__ import annotations

import io
import json
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainwatch as tw
from tests.gan_loops import Loop
from trainwatch.runner import run_script

# Iterations within which the forgotten step is told (the twin tells it within four).
TOLD_WITHIN = 6


def _watched(loop: Loop, how: str) -> tuple[list[tw.Monitor], list[tuple[str, int, str]]]:
    """``how``: "gan" (tw.watch of the module holding both, no optimizer), "halves"
    (tw.watch(G) and tw.watch(D)), "opt_g" (tw.watch(gan, opt_g)), "given" (the twin:
    both passed). The findings are read before the monitors close."""
    gan, opt_g, opt_d = loop.build()
    console = io.StringIO()
    if how == "gan":
        monitors = [tw.watch(gan, console=console)]
    elif how == "halves":
        monitors = [tw.watch(gan.G, console=console), tw.watch(gan.D, console=console)]
    elif how == "opt_g":
        monitors = [tw.watch(gan, opt_g, console=console)]
    else:
        monitors = [tw.watch(gan, [opt_g, opt_d], console=console)]
    loop.train(gan, opt_g, opt_d)
    found = [(a.rule, a.step, a.module) for m in monitors for a in m.alerts if a.severity != "info"]
    for monitor in monitors:
        monitor.close()
    return monitors, found


@pytest.mark.parametrize("d_step", [False, True], ids=["d_step_forgotten", "d_steps"])
@pytest.mark.parametrize(
    ("kind", "images"),
    [("wgan_clip", False), ("wgan_gp", False), ("wgan_gp", True), ("dcgan", False)],
)
def test_watched_without_optimizers_the_forgotten_step_is_told_at_d(kind, images, d_step):
    loop = Loop(kind, images, TOLD_WITHIN, freeze_d=True, d_step=d_step)
    monitors, found = _watched(loop, "gan")
    if d_step:
        assert found == []
        return
    assert found == [("not_optimized", 1, "D")]
    message = monitors[0].alerts[0].message
    assert "opt_d (optimizer 1, " in message and "has not stepped once" in message
    assert "D.0.weight" in message and "G." not in message.split("|")[0]
    _, twin_found = _watched(loop, "given")
    assert [(rule, module) for rule, _, module in twin_found] == [("not_optimized", "D")]


@pytest.mark.parametrize("d_step", [False, True], ids=["d_step_forgotten", "d_steps"])
@pytest.mark.parametrize("freeze", [True, False], ids=["frozen_for_g", "not_frozen"])
@pytest.mark.parametrize("kind", ["wgan_gp", "dcgan"])
def test_each_half_watched_on_its_own_the_forgotten_step_is_told_by_ds_monitor(
    kind, freeze, d_step
):
    loop = Loop(kind, iterations=TOLD_WITHIN, freeze_d=freeze, d_step=d_step)
    (mon_g, mon_d), found = _watched(loop, "halves")
    if d_step:
        assert found == []
        return
    assert found == [("not_optimized", 1, "")]
    (alert,) = [a for a in mon_d.alerts if a.severity != "info"]
    assert "opt_d (Adam) has not stepped once" in alert.message
    assert "D's gradients" in alert.message
    assert [a for a in mon_g.alerts if a.severity != "info"] == []


@pytest.mark.parametrize("d_step", [False, True], ids=["d_step_forgotten", "d_steps"])
@pytest.mark.parametrize("kind", ["wgan_clip", "dcgan"])
def test_watched_with_the_generators_optimizer_the_frozen_d_waits_for_its_verdict(kind, d_step):
    """tw.watch(gan, opt_g): D's gradients thrown away twice, weights unmoved, is
    opt_d.step() forgotten (told at the step D was first met, per layer, as a
    trainable D is); D moving is noted as trained by an optimizer not given."""
    loop = Loop(kind, iterations=TOLD_WITHIN, freeze_d=True, d_step=d_step)
    _, found = _watched(loop, "opt_g")
    assert found == ([] if d_step else [("not_optimized", 0, "D.0"), ("not_optimized", 0, "D.2")])


def test_training_is_the_same_with_and_without_the_monitor():
    """Watching opt_d, found never stepping, changes nothing of the training."""

    def final(watched: bool) -> list[torch.Tensor]:
        loop = Loop("dcgan", iterations=6, freeze_d=True, d_step=False)
        gan, opt_g, opt_d = loop.build()
        monitor = tw.watch(gan, console=False) if watched else None
        loop.train(gan, opt_g, opt_d)
        if monitor is not None:
            monitor.close()
        return [p.detach().clone() for p in gan.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(final(False), final(True)))


# -- Lightning's manual optimisation: toggle_optimizer freezes the other half ---------


def _lightning_wgan_gp(step_disc: bool):
    import lightning.pytorch as pl

    class WGANGP(pl.LightningModule):
        """The manual-optimisation WGAN-GP: a critic step every batch, a generator
        step every fifth, each inside toggle_optimizer/untoggle_optimizer."""

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.generator = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
            self.critic = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))

        def training_step(self, batch, batch_idx):
            (real,) = batch
            opt_g, opt_d = self.optimizers()
            self.toggle_optimizer(opt_d)
            fake = self.generator(torch.randn(len(real), 8)).detach()
            alpha = torch.rand(len(real), 1)
            mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
            (grad,) = torch.autograd.grad(self.critic(mixed).sum(), mixed, create_graph=True)
            penalty = ((grad.norm(dim=1) - 1) ** 2).mean()
            loss_d = self.critic(fake).mean() - self.critic(real).mean() + 10 * penalty
            opt_d.zero_grad()
            self.manual_backward(loss_d)
            if step_disc:
                opt_d.step()
            self.untoggle_optimizer(opt_d)
            if batch_idx % 5 == 0:
                self.toggle_optimizer(opt_g)
                opt_g.zero_grad()
                self.manual_backward(-self.critic(self.generator(torch.randn(len(real), 8))).mean())
                opt_g.step()
                self.untoggle_optimizer(opt_g)

        def configure_optimizers(self):
            return [
                torch.optim.Adam(self.generator.parameters(), 1e-4, betas=(0.5, 0.9)),
                torch.optim.Adam(self.critic.parameters(), 1e-4, betas=(0.5, 0.9)),
            ]

    return WGANGP()


@pytest.mark.parametrize("step_disc", [False, True], ids=["d_step_forgotten", "d_steps"])
def test_lightning_manual_wgan_gp_with_toggle_optimizer(tmp_path, step_disc):
    from torch.utils.data import DataLoader, TensorDataset

    from tests.lightning_models import quiet_trainer
    from trainwatch.lightning import TrainWatchCallback

    torch.manual_seed(0)
    callback = TrainWatchCallback(console=False)
    data = DataLoader(TensorDataset(torch.randn(32 * 30, 2) + 2.0), batch_size=32)
    quiet_trainer(tmp_path, [callback], max_epochs=1).fit(_lightning_wgan_gp(step_disc), data)
    found = [(a.rule, a.module) for a in callback.alerts if a.severity != "info"]
    assert found == ([] if step_disc else [("not_optimized", "critic")])


# -- `trainwatch run` of the unmodified script -------------------------------------

SCRIPT = """
import sys
import torch
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)
G = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
D = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=1e-4, betas=(0.5, 0.9))
opt_d = torch.optim.Adam(D.parameters(), lr=1e-4, betas=(0.5, 0.9))
for it in range(12):
    for _ in range(5):
        real = torch.randn(32, 2) + 2.0
        fake = G(torch.randn(32, 8)).detach()
        opt_d.zero_grad()
        alpha = torch.rand(32, 1)
        mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        (grad,) = torch.autograd.grad(D(mixed).sum(), mixed, create_graph=True)
        penalty = ((grad.norm(dim=1) - 1) ** 2).mean()
        (D(fake).mean() - D(real).mean() + 10 * penalty).backward()
        if "bug" not in sys.argv:
            opt_d.step()
    for p in D.parameters():
        p.requires_grad_(False)
    opt_g.zero_grad()
    (-D(G(torch.randn(32, 8))).mean()).backward()
    opt_g.step()
    for p in D.parameters():
        p.requires_grad_(True)
"""


@pytest.mark.parametrize("bug", [False, True], ids=["d_steps", "d_step_forgotten"])
def test_trainwatch_run_of_the_unmodified_script(tmp_path: Path, bug):
    script = tmp_path / "wgan_gp.py"
    script.write_text(textwrap.dedent(SCRIPT))
    log = tmp_path / "log"
    assert run_script(script, ["bug"] if bug else [], log_dir=log, console=False) == 0
    counts = json.loads((log / "alert_counts.json").read_text())
    told = [(c["rule"], c["module"], c["model"]) for c in counts["counts"]]
    assert told == ([("not_optimized", "", "Sequential#2")] if bug else [])
    if bug:
        alert = json.loads((log / "alerts.jsonl").read_text().splitlines()[0])
        assert "opt_d (Adam) has not stepped once" in alert["message"]
        assert "D's gradients" in alert["message"]


@pytest.mark.parametrize("d_step", [False, True], ids=["d_step_forgotten", "d_steps"])
def test_a_discriminator_frozen_by_a_helper_for_the_generator_step(d_step):
    """pix2pix's set_requires_grad(D, False) for the generator's step and back to True
    before the discriminator's, on images."""

    def set_requires_grad(net: nn.Module, flag: bool) -> None:
        for p in net.parameters():
            p.requires_grad = flag

    loop = Loop("dcgan", images=True, iterations=TOLD_WITHIN)
    gan, opt_g, opt_d = loop.build()
    monitor = tw.watch(gan, console=False)
    data = torch.Generator().manual_seed(3)
    for _ in range(TOLD_WITHIN):
        real = torch.rand(32, 1, 8, 8, generator=data) * 2 - 1
        fake = gan.G(torch.randn(32, 8, generator=data))
        set_requires_grad(gan.D, True)
        opt_d.zero_grad()
        loss_d = F.binary_cross_entropy_with_logits(gan.D(real), torch.ones(32, 1))
        loss_d = loss_d + F.binary_cross_entropy_with_logits(
            gan.D(fake.detach()), torch.zeros(32, 1)
        )
        loss_d.backward()
        if d_step:
            opt_d.step()
        set_requires_grad(gan.D, False)
        opt_g.zero_grad()
        F.binary_cross_entropy_with_logits(gan.D(fake), torch.ones(32, 1)).backward()
        opt_g.step()
    found = [(a.rule, a.module) for a in monitor.alerts if a.severity != "info"]
    monitor.close()
    assert found == ([] if d_step else [("not_optimized", "D")])
