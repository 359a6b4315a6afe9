"""trainwatch's re-runs leave the generators a model holds as they were: training stays bit for bit.

A VAE drawing its noise with ``torch.randn(..., generator=self.gen)`` for
reproducible sampling had that generator advanced by every re-run of its
forward: stalled_training's (its first batch, at step 0's boundary and every
``every`` steps), and the eval-mode look at a module drawing random numbers,
each on its own; a NaN replay too. The losses differed from the step after
the first re-run. Only torch's, Python's and numpy's global generators were
forked around a re-run.

Planted: a ``torch.Generator`` held by the model, a numpy ``Generator`` held
by the model, a ``random.Random`` in a list the model holds, a
``torch.Generator`` handed to ``forward(x, generator=g)`` and a numpy
``RandomState`` in a tuple handed to it; each trained with and without
trainwatch under ``tw.watch`` (every re-run on, and each kind alone), a
GradScaler overflow replayed, ``trainwatch run`` of an unmodified script and
a Lightning Trainer with the callback. Losses, weights and the generators'
states after training are the same. Control: the same model drawing from
torch's global generator, forked as before.
"""

from __future__ import annotations

import io
import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from tests.same_training import plain_and_under_run
from trainwatch.lightning import TrainWatchCallback

OFTEN = {"every": 2, "warmup": 1}  # the reference, then a re-run at every other step
STEPS = 12


def _internal(alerts) -> list[tw.Alert]:
    return [a for a in alerts if a.rule == "internal_error"]


# -- models ------------------------------------------------------------------------------------
class VAE(nn.Module):
    """Reparameterisation noise from the model's own torch generator (or the global one)."""

    def __init__(self, own: bool = True) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 16))
        self.dec = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 20))
        self.gen = torch.Generator().manual_seed(1234) if own else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        eps = torch.randn(mu.shape, generator=self.gen)
        return self.dec(mu + eps * (0.5 * logvar).exp()), mu, logvar

    def generators(self) -> list[Any]:
        return [self.gen] if self.gen is not None else []


class MaskedAE(nn.Module):
    """Random feature masking drawn from the model's own numpy Generator."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 16))
        self.dec = nn.Linear(16, 20)
        self.rng = np.random.default_rng(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.from_numpy(self.rng.random(x.shape[1]) > 0.25).float()
        return self.dec(self.enc(x * keep))

    def generators(self) -> list[Any]:
        return [self.rng]


class CoinDepth(nn.Module):
    """A residual block's branch scaled on a coin from a ``random.Random`` kept in a list."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(20, 32)
        self.block = nn.Linear(32, 32)
        self.out = nn.Linear(32, 20)
        self.coins = [random.Random(3)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        scale = 2.0 if self.coins[0].random() < 0.5 else 0.5
        return self.out(h + scale * torch.tanh(self.block(h)))

    def generators(self) -> list[Any]:
        return self.coins


class GivenGenerators(nn.Module):
    """Noise from a torch generator passed by keyword, or from a numpy RandomState
    passed in a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 20))

    def forward(
        self, x: torch.Tensor, given: tuple[Any, ...] = (), generator: Any = None
    ) -> torch.Tensor:
        noise = torch.randn(x.shape, generator=generator)
        if given:
            noise = noise + torch.from_numpy(given[0].standard_normal(x.shape)).float()
        return self.net(x + 0.1 * noise)


def _call(name: str, model: nn.Module, x: torch.Tensor, passed: list[Any]) -> torch.Tensor:
    if name == "keyword_generator":
        return model(x, generator=passed[0])
    if name == "random_state_in_tuple":
        return model(x, (passed[0],))
    return model(x)


def _make(name: str) -> tuple[nn.Module, list[Any]]:
    """The model and the generators handed to its calls."""
    if name == "own_torch_generator":
        return VAE(), []
    if name == "global_generator":  # the control
        return VAE(own=False), []
    if name == "own_numpy_generator":
        return MaskedAE(), []
    if name == "random_in_a_list":
        return CoinDepth(), []
    if name == "keyword_generator":
        return GivenGenerators(), [torch.Generator().manual_seed(7)]
    if name == "random_state_in_tuple":
        return GivenGenerators(), [np.random.RandomState(5)]
    raise ValueError(name)


SHAPES = [
    "own_torch_generator",
    "own_numpy_generator",
    "random_in_a_list",
    "keyword_generator",
    "random_state_in_tuple",
    "global_generator",
]


def _loss(output: Any, x: torch.Tensor) -> torch.Tensor:
    if isinstance(output, tuple):
        rec, mu, logvar = output
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1).mean()
        return F.mse_loss(rec, x, reduction="none").sum(1).mean() + kl
    return F.mse_loss(output, x)


def _states(generators: list[Any]) -> list[Any]:
    """The generators' states, comparable with ``==``."""
    states = []
    for gen in generators:
        if isinstance(gen, torch.Generator):
            states.append(gen.get_state().tolist())
        elif isinstance(gen, random.Random):
            states.append(gen.getstate())
        elif isinstance(gen, np.random.Generator):
            states.append(repr(gen.bit_generator.state))
        else:
            states.append(repr(gen.get_state(legacy=False)))
    return states


def _data() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(512, 4, generator=gen) @ torch.randn(4, 20, generator=gen)


def _train(name: str, watch=None, steps: int = STEPS, **config):
    """Each step's loss, the final weights, the generators' states, the alerts."""
    torch.manual_seed(0)
    model, passed = _make(name)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = watch(model, opt, **config) if watch is not None else None
    data = _data()
    losses = []
    for _ in range(steps):
        x = data[torch.randint(0, len(data), (32,))]
        loss = _loss(_call(name, model, x, passed), x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    alerts = []
    if monitor is not None:
        monitor.close()
        alerts = monitor.alerts
    held = model.generators() if hasattr(model, "generators") else []
    return losses, model.state_dict(), _states(held + passed), alerts


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- tw.watch ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SHAPES)
def test_a_model_drawing_from_its_own_generator_trains_as_without_trainwatch(quiet_watch, name):
    plain, plain_weights, plain_states, _ = _train(name)
    losses, weights, states, alerts = _train(name, quiet_watch, stalled_training=OFTEN)
    assert losses == plain
    assert _same_weights(weights, plain_weights)
    assert states == plain_states
    assert alerts == []


# Each re-run on its own: stalled_training's alone, the eval-mode look alone.
ALONE = {
    "stalled_training": {
        "stalled_training": OFTEN,
        "train_in_eval_mode": False,
        "eval_in_train_mode": False,
    },
    "eval_mode_look": {"stalled_training": False},
}


@pytest.mark.parametrize("rerun", list(ALONE))
@pytest.mark.parametrize("name", ["own_torch_generator", "keyword_generator"])
def test_each_re_run_alone_leaves_the_generator_as_it_was(quiet_watch, rerun, name):
    plain, _, plain_states, _ = _train(name)
    losses, _, states, alerts = _train(name, quiet_watch, **ALONE[rerun])
    assert losses == plain
    assert states == plain_states
    assert _internal(alerts) == []


# -- a NaN replay --------------------------------------------------------------------------------
def _train_overflow(watch=None) -> tuple[list[str], list[Any], list[tw.Alert]]:
    """fp16 autocast under a GradScaler; one batch overflows fp16 and its step is
    skipped: trainwatch replays that pass, which draws from the VAE's generator."""
    torch.manual_seed(0)
    model = VAE()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    monitor = None
    if watch is not None:
        monitor = watch(model, opt, scaler=scaler, stalled_training=False)
    data = _data()
    losses = []
    for step in range(16):
        x = data[torch.randint(0, len(data), (32,))].clone()
        if step == 10:
            x[:, 0] = 1e30  # a corrupt sample: inf in fp16
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model(x), x.clamp(-1e4, 1e4))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(repr(loss.item()))
    if monitor is None:
        return losses, _states([model.gen]), []
    monitor.close()
    return losses, _states([model.gen]), monitor.alerts


def test_the_replay_of_an_overflow_leaves_the_models_generator_alone(quiet_watch):
    plain, plain_states, _ = _train_overflow()
    losses, states, alerts = _train_overflow(quiet_watch)
    assert losses == plain
    assert states == plain_states
    assert "nonfinite_forward" in [a.rule for a in alerts]  # located: the replay ran
    assert _internal(alerts) == []


# -- trainwatch run ------------------------------------------------------------------------------
SCRIPT = """
import json, sys
import numpy as np
import torch, torch.nn as nn, torch.nn.functional as F

torch.manual_seed(0)


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(20, 16)
        self.dec = nn.Linear(8, 20)
        self.gen = torch.Generator().manual_seed(1234)
        self.rng = np.random.default_rng(0)

    def forward(self, x, generator=None):
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        z = mu + torch.randn(mu.shape, generator=self.gen) * (0.5 * logvar).exp()
        z = z + 0.01 * torch.randn(z.shape, generator=generator)
        return self.dec(z * float(self.rng.uniform(0.9, 1.1))), mu, logvar


X = torch.randn(2048, 4) @ torch.randn(4, 20)
model = VAE()
g = torch.Generator().manual_seed(7)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
losses = []
for step in range(12):
    x = X[torch.randint(0, 2048, (64,))]
    rec, mu, logvar = model(x, generator=g)
    kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1).mean()
    loss = F.mse_loss(rec, x, reduction="none").sum(1).mean() + kl
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
json.dump(losses, open(sys.argv[1], "w"))
"""


@pytest.mark.slow
def test_trainwatch_run_of_a_vae_with_its_own_generators_trains_as_without(tmp_path):
    plain, watched, rules = plain_and_under_run(tmp_path, SCRIPT, every=2)
    assert "internal_error" not in rules
    assert watched == plain


# -- Lightning ---------------------------------------------------------------------------------
class LitVAE(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.vae = VAE()
        self.gen = torch.Generator().manual_seed(99)  # the LightningModule's own too
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rec, mu, logvar = self.vae(x)
        return rec + 0.01 * torch.randn(rec.shape, generator=self.gen), mu, logvar

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = _loss(self(x), x)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(_data()),
            batch_size=32,
            shuffle=True,
            generator=torch.Generator().manual_seed(2),
        )


@pytest.mark.slow
def test_a_lightning_vae_with_its_own_generators_trains_as_without(tmp_path):
    callback = TrainWatchCallback(console=io.StringIO(), stalled_training=OFTEN)
    runs = []
    for callbacks in ([], [callback]):
        torch.manual_seed(0)
        module = LitVAE()
        quiet_trainer(tmp_path, callbacks, max_steps=10).fit(module)
        runs.append((module.losses, _states([module.vae.gen, module.gen]), module.state_dict()))
    (plain, plain_states, plain_weights), (watched, states, weights) = runs
    assert len(watched) == 10 and watched == plain
    assert states == plain_states
    assert _same_weights(weights, plain_weights)
    assert _internal(callback.alerts) == []
