"""A missing zero_grad is found on parameters that were frozen when watching began.

A GAN trained by toggling ``requires_grad`` (Lightning's ``toggle_optimizer``,
pix2pix's ``set_requires_grad``) has its discriminator frozen during the
generator's phase, which is where ``trainwatch run`` first meets the model
and where a loop may well call ``tw.watch``. The discriminator's parameters
were left out of the accumulation tracker for good, so a forgotten
``opt_d.zero_grad()`` went unreported.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import rules_of
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

SCRIPT = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.discriminator = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def forward(self, z):
        return self.generator(z)


def train(model, steps, reset_d, watch=None):
    opt_g = torch.optim.Adam(model.generator.parameters(), 2e-4)
    opt_d = torch.optim.Adam(model.discriminator.parameters(), 2e-4)
    monitor = None
    for step in range(steps):
        real = torch.randn(32, 16)
        model.discriminator.requires_grad_(False)  # the generator's phase
        if watch is not None and monitor is None:
            monitor = watch(model, [opt_g, opt_d])
        fake = model(torch.randn(32, 8))
        loss_g = F.binary_cross_entropy_with_logits(model.discriminator(fake), torch.ones(32, 1))
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
        model.discriminator.requires_grad_(True)  # the discriminator's phase
        model.generator.requires_grad_(False)
        loss_d = (
            F.binary_cross_entropy_with_logits(model.discriminator(real), torch.ones(32, 1))
            + F.binary_cross_entropy_with_logits(
                model.discriminator(fake.detach()), torch.zeros(32, 1)
            )
        ) / 2
        if reset_d:
            opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        model.generator.requires_grad_(True)
    return monitor


if __name__ == "__main__":
    train(GAN(), 30, sys.argv[1] == "reset")
"""


def _script_namespace() -> dict:
    namespace: dict = {"__name__": "gan_script"}
    exec(compile(SCRIPT, "gan_script.py", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("reset_d", [True, False], ids=["healthy", "d_zero_grad_missing"])
def test_a_discriminator_frozen_when_watched_is_checked_for_a_reset(quiet_watch, reset_d):
    script = _script_namespace()
    monitor = script["train"](script["GAN"](), 30, reset_d, watch=quiet_watch)
    if reset_d:
        assert rules_of(monitor) == []
        return
    assert rules_of(monitor) == ["accumulated_gradient"]
    alert = monitor.alerts[0]
    # Step 1 is the discriminator's first; step 3 its second, onto step 1's gradients.
    assert alert.step == 3
    assert alert.data["parameters"] == 4
    assert all(name.startswith("discriminator.") for name in alert.data["modules"])


@pytest.mark.parametrize("how", ["reset", "forgot"])
def test_trainwatch_run_checks_a_discriminator_frozen_at_first_sight(tmp_path, how):
    script = tmp_path / "gan.py"
    script.write_text(SCRIPT)
    run_script(script, [how], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = {(a["rule"], a["step"]) for a in map(json.loads, lines) if a["severity"] != "info"}
    assert found == (set() if how == "reset" else {("accumulated_gradient", 3)})


class _ToggledGAN(L.LightningModule):
    """Manual optimisation with toggle_optimizer, as Lightning's GAN example writes it."""

    def __init__(self, reset_d: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.discriminator = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
        self.automatic_optimization = False
        self.reset_d = reset_d

    def forward(self, z):
        return self.generator(z)

    def training_step(self, batch, index):
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_g)
        fake = self(torch.randn(real.shape[0], 8))
        loss_g = F.binary_cross_entropy_with_logits(
            self.discriminator(fake), torch.ones(real.shape[0], 1)
        )
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        loss_d = (
            F.binary_cross_entropy_with_logits(self.discriminator(real), torch.ones(len(real), 1))
            + F.binary_cross_entropy_with_logits(
                self.discriminator(fake.detach()), torch.zeros(len(real), 1)
            )
        ) / 2
        if self.reset_d:
            opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.generator.parameters(), 2e-4),
            torch.optim.Adam(self.discriminator.parameters(), 2e-4),
        )


@pytest.mark.parametrize("reset_d", [True, False], ids=["healthy", "d_zero_grad_missing"])
def test_a_toggled_lightning_gan_is_checked_for_a_discriminator_reset(tmp_path, reset_d):
    data = DataLoader(TensorDataset(torch.randn(640, 16)), batch_size=32, shuffle=True)
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=1)
    trainer.fit(_ToggledGAN(reset_d), data)
    monitor = callback.monitor
    assert rules_of(monitor) == ([] if reset_d else ["accumulated_gradient"])
    if not reset_d:
        modules = monitor.alerts[0].data["modules"]
        assert all(name.startswith("discriminator.") for name in modules)
