"""zero_gradient stays silent on a bias that a derivative-only loss never reaches.

An energy model trained on derivatives of its output alone (a Hamiltonian
network fitted to dH/d(q, p), a potential fitted to forces ``-dE/dx``, through
``torch.autograd.grad(..., create_graph=True)``) cannot see a constant shift of
that output: the output layer's bias gets no gradient at all (None) by design,
while its weight learns. That is the shift-free bias already excused when its
gradient is exactly zero (a WGAN critic's output bias), unreached instead of
zeroed.

Still told: a bias the layer's own forward leaves out (a module of the user's
own, an ``nn.Linear`` subclass redefining forward), a layer whose weight is read
without the layer running, a layer cut off whole (its weight None too), and any
of it under DDP, whose next iteration fails on a parameter without a gradient.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrizations
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import rules_of
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback

STEPS = 8


def _hamiltonian() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 1))


def _pendulum_loss(model: nn.Module, step: int) -> torch.Tensor:
    """Hamilton's equations for a pendulum: (dq/dt, dp/dt) = (dH/dp, -dH/dq)."""
    qp = torch.randn(256, 2, generator=torch.Generator().manual_seed(step)).requires_grad_(True)
    d_h = torch.autograd.grad(model(qp).sum(), qp, create_graph=True)[0]
    predicted = torch.stack([d_h[:, 1], -d_h[:, 0]], 1)
    target = torch.stack([qp[:, 1], -torch.sin(qp[:, 0])], 1).detach()
    return F.mse_loss(predicted, target)


def _potential() -> nn.Module:
    """An interatomic-potential-like MLP: positions in, one energy out."""
    return nn.Sequential(
        nn.Linear(3, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 1)
    )


def _energy_force_loss(model: nn.Module, step: int, with_energy: bool) -> torch.Tensor:
    """Forces as ``-dE/dx`` fitted to reference forces, and the energy itself
    too where ``with_energy`` (then the output bias gets a gradient)."""
    x = torch.randn(128, 3, generator=torch.Generator().manual_seed(step))
    energy_ref, force_ref = x.pow(2).sum(1), -2.0 * x
    positions = x.clone().requires_grad_(True)
    energy = model(positions).squeeze(-1)
    force = -torch.autograd.grad(energy.sum(), positions, create_graph=True)[0]
    loss = F.mse_loss(force, force_ref)
    if with_energy:
        loss = loss + F.mse_loss(energy, energy_ref)
    return loss


class _ConvEnergy(nn.Module):
    """A convolution and a layer norm before the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 8, 3, padding=1)
        self.norm = nn.LayerNorm(3)
        self.out = nn.Linear(8 * 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.conv(x.unsqueeze(1)))).flatten(1))


def _weight_normed_potential() -> nn.Module:
    model = _potential()
    parametrizations.weight_norm(model[4])  # its weight now lives in a parametrization
    return model


def _train(quiet_watch, model: nn.Module, loss_of, steps: int = STEPS):
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for step in range(steps):
        loss = loss_of(model, step)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return monitor


def _no_gradient(monitor) -> dict[str, list[str]]:
    return {
        a.module: a.data["parameters"]
        for a in monitor.alerts
        if a.rule == "zero_gradient" and a.severity == "warning"
    }


SILENT_SHAPES = {
    "hamiltonian": (_hamiltonian, _pendulum_loss),
    "forces only": (_potential, lambda m, s: _energy_force_loss(m, s, with_energy=False)),
    "energy and forces": (_potential, lambda m, s: _energy_force_loss(m, s, with_energy=True)),
    "conv and layer norm": (_ConvEnergy, lambda m, s: _energy_force_loss(m, s, with_energy=False)),
    "weight-normed output": (
        _weight_normed_potential,
        lambda m, s: _energy_force_loss(m, s, with_energy=False),
    ),
}


@pytest.mark.parametrize("shape", list(SILENT_SHAPES))
def test_a_bias_a_derivative_only_loss_never_reaches_is_silent(quiet_watch, shape):
    build, loss_of = SILENT_SHAPES[shape]
    torch.manual_seed(0)
    monitor = _train(quiet_watch, build(), loss_of)
    assert monitor.step_count == STEPS
    assert [a.rule for a in monitor.alerts] == []


def test_a_wgan_gp_critic_is_silent(quiet_watch):
    """The critic's loss, ``D(fake) - D(real)`` plus a gradient penalty taken with
    ``create_graph``: its output bias is cancelled (an exact zero), not unreached."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.0, 0.9))
    monitor = quiet_watch(critic, opt)
    for _ in range(STEPS):
        real, fake = torch.randn(32, 8) + 1.0, torch.randn(32, 8)
        mix = torch.rand(32, 1)
        between = (mix * real + (1 - mix) * fake).requires_grad_(True)
        slope = torch.autograd.grad(critic(between).sum(), between, create_graph=True)[0]
        penalty = ((slope.norm(dim=1) - 1) ** 2).mean()
        opt.zero_grad()
        (critic(fake).mean() - critic(real).mean() + 10.0 * penalty).backward()
        opt.step()
    assert rules_of(monitor) == []


class _LitPotential(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _potential()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        positions = x.clone().requires_grad_(True)
        energy = self.net(positions).sum()
        force = -torch.autograd.grad(energy, positions, create_graph=True)[0]
        return F.mse_loss(force, -2.0 * x)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        x = torch.randn(256, 3, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x), batch_size=32)


def test_a_force_field_under_lightning_is_silent(tmp_path):
    torch.manual_seed(0)
    callback = TrainWatchCallback(console=False, log_dir=str(tmp_path / "tw"))
    quiet_trainer(tmp_path, [callback], max_steps=STEPS).fit(_LitPotential())
    assert callback.monitor.step_count == STEPS
    assert [a.rule for a in callback.monitor.alerts] == []


class _SometimesCutHead(nn.Module):
    """The learned energy term cut off by a ``.detach()`` on the steps listed in
    ``cut_at`` (its layers' weights and biases None then, while ``scale`` trains),
    connected on the others (the head's bias unreached, its weight learning)."""

    def __init__(self, cut_at: set[int]) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)
        self.scale = nn.Linear(2, 1)
        self.cut_at, self.step = cut_at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.body(x)
        if self.step in self.cut_at:
            hidden = hidden.detach()
        return self.head(hidden) + self.scale(x).pow(2)


def _cut_at_times(quiet_watch, cut_at: set[int]):
    torch.manual_seed(0)
    model = _SometimesCutHead(cut_at)

    def loss_of(m: nn.Module, step: int) -> torch.Tensor:
        m.step = step
        return _pendulum_loss(m, step)

    return _train(quiet_watch, model, loss_of)


def test_steps_with_the_bias_unreached_end_its_streak(quiet_watch):
    """Cut off for two steps, connected for three, cut for two again: never three
    steps in a row without a gradient at the head's weight, nor at its bias."""
    monitor = _cut_at_times(quiet_watch, {0, 1, 5, 6})
    assert _no_gradient(monitor) == {}


def test_control_a_head_cut_for_patience_steps_is_told(quiet_watch):
    monitor = _cut_at_times(quiet_watch, {0, 1, 2})
    assert _no_gradient(monitor) == {
        "body.0": ["body.0.weight", "body.0.bias"],
        "head": ["head.weight", "head.bias"],
    }


# Controls: the same losses, with the bias (or the whole layer) cut off for real.


class _BiasLeftOut(nn.Module):
    """A layer of the user's own that holds a bias and never uses it."""

    def __init__(self, n_in: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, n_in) * 0.1)
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # the bug: self.bias forgotten


class _LinearWithoutBias(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # the bug: the subclass drops the bias


class _HeadWeightOnly(nn.Module):
    """The head's weight read directly, the head itself never called."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.body(x), self.head.weight)


class _DetachedHead(nn.Module):
    """The energy's learned term cut off by a .detach(): its weight gets none either."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)
        self.scale = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).detach()) + self.scale(x).pow(2)


@pytest.mark.parametrize(
    "build, module, parameters",
    [
        (lambda: nn.Sequential(nn.Linear(2, 32), nn.Tanh(), _BiasLeftOut(32)), "2", ["2.bias"]),
        (
            lambda: nn.Sequential(nn.Linear(2, 32), nn.Tanh(), _LinearWithoutBias(32, 1)),
            "2",
            ["2.bias"],
        ),
        (_HeadWeightOnly, "head", ["head.bias"]),
        (_DetachedHead, "head", ["head.weight", "head.bias"]),
    ],
    ids=["own module leaves it out", "subclass leaves it out", "weight read only", "detached"],
)
def test_control_a_bias_cut_off_for_real_is_still_told(quiet_watch, build, module, parameters):
    torch.manual_seed(0)
    monitor = _train(quiet_watch, build(), _pendulum_loss)
    found = _no_gradient(monitor)
    assert found[module] == parameters
    (alert,) = [a for a in monitor.alerts if a.rule == "zero_gradient" and a.module == module]
    assert alert.step == 0


@contextmanager
def _one_process_group() -> Iterator[None]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", world_size=1, rank=0, init_method=f"tcp://127.0.0.1:{port}")
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_control_under_ddp_the_unreached_bias_is_told_at_once(quiet_watch):
    """DDP without find_unused_parameters fails its next iteration on a parameter
    that got no gradient, whatever the reason: told at the first step."""
    torch.manual_seed(0)
    with _one_process_group():
        monitor = _train(quiet_watch, _hamiltonian(), _pendulum_loss, steps=1)
    (alert,) = monitor.alerts
    assert (alert.rule, alert.module, alert.step) == ("zero_gradient", "2", 0)
    assert alert.data["parameters"] == ["2.bias"]
