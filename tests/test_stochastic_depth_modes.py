"""Stochastic depth (timm's ``DropPath``) as a mode-dependent module.

A ``DropPath`` draws a Bernoulli mask per sample in training mode and returns
its input untouched in eval mode: a model whose only mode-dependent part it
is (GroupNorm / LayerNorm, no ``Dropout``, no ``BatchNorm``) gives two
different answers to the same validation batch when ``model.eval()`` is
forgotten, and trains with whole residual branches never dropped when
``model.train()`` is. No module type says so, and it calls no dropout
function: the first passes show the module drawing random numbers in
training mode, and the module run once more in eval mode draws none. Noise
drawn in both modes (a VAE's reparameterisation, noise injection, an
augmentation inside the model, a diffusion model's timesteps) is no mode
difference: silent, as is Monte-Carlo evaluation with ``mc_dropout``.
"""

from __future__ import annotations

import io
import json

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import rules_of
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

EPOCH = 6  # training steps an epoch
SEVERE = ("warning", "error")


class DropPath(nn.Module):
    """timm's: a Bernoulli mask per sample, gated on ``self.training``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.drop_prob = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """The older form: ``keep + torch.rand(shape)`` floored, in a function the module calls."""
    if p == 0.0 or not training:
        return x
    keep = 1 - p
    mask = keep + torch.rand((x.shape[0],) + (1,) * (x.ndim - 1), dtype=x.dtype)
    mask.floor_()
    return x.div(keep) * mask


class FloorDropPath(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.p, self.training)


class ConvBlock(nn.Module):
    def __init__(self, c: int, drop: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.norm = nn.GroupNorm(4, c)
        self.drop_path = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.drop_path(self.norm(self.conv(x))))


class ConvNet(nn.Module):
    """A residual conv net: GroupNorm only, stochastic depth in each block."""

    def __init__(self, drop=DropPath) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(ConvBlock(8, drop(0.3)), ConvBlock(8, drop(0.3)))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class MlpBlock(nn.Module):
    """A transformer's MLP half: pre-LayerNorm, a residual branch dropped per sample."""

    def __init__(self, d: int, drop: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.drop_path = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop_path(self.fc(F.gelu(self.norm(x))))


class TokenNet(nn.Module):
    def __init__(self, drop=DropPath) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.layers = nn.ModuleList([MlpBlock(16, drop(0.2)), MlpBlock(16, drop(0.2))])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(1))


MODELS = {
    "conv_bernoulli": (ConvNet, "blocks.0.drop_path", (3, 6, 6)),
    "conv_rand_floor": (lambda: ConvNet(FloorDropPath), "blocks.0.drop_path", (3, 6, 6)),
    "tokens_bernoulli": (TokenNet, "layers.0.drop_path", (5, 6)),
}


# -- models drawing random numbers in both modes: no mode difference ----------------


class VAE(nn.Module):
    """Samples its latent with ``randn_like`` whatever the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.dec = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, logvar = self.norm(self.enc(x.mean(1))).chunk(2, dim=1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return self.dec(z)


class Noisy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.randn_like(x)


class NoiseNet(nn.Module):
    """Noise injected into each hidden layer, in both modes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.noise = Noisy()
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.noise(self.embed(x))).mean(1))


class Flip(nn.Module):
    """A random flip of each sample's tokens, in both modes (test-time augmentation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flip = torch.rand(x.shape[0]) < 0.5
        return torch.where(flip[:, None, None], x.flip(1), x)


class AugmentedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.augment = Flip()
        self.body = TokenNet(lambda p: nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.augment(x))


class Denoiser(nn.Module):
    """A diffusion model drawing its timestep and noise inside its forward, in both modes."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(7, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.randint(0, 10, (x.shape[0], 1)).float() / 10
        noisy = x.mean(1) + torch.randn_like(x.mean(1)) * t
        return self.net(torch.cat([noisy, t], 1))


CONTROLS = {
    "vae": VAE,
    "noise_injection": NoiseNet,
    "augmentation": AugmentedNet,
    "diffusion": Denoiser,
}


def _data(n: int, shape: tuple[int, ...], seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=gen)
    return x, x.flatten(1)[:, :4].argmax(1)


def _fit(model, opt, shape, epochs: int, evaluate: str) -> list[float]:
    """Epochs of training, each followed by a no-grad validation.

    ``evaluate``: "forgotten" (no ``model.eval()``), "switched" (``eval()`` then
    ``train()`` back) or "eval_kept" (``eval()`` and never ``train()`` again).
    Returns the largest difference between two passes over the validation batch.
    """
    x, y = _data(EPOCH * 8, shape, 0)
    xv, _ = _data(16, shape, 1)
    diffs = []
    model.train()
    for _ in range(epochs):
        if evaluate == "switched":
            model.train()
        for i in range(0, EPOCH * 8, 8):
            opt.zero_grad()
            F.cross_entropy(model(x[i : i + 8]), y[i : i + 8]).backward()
            opt.step()
        if evaluate != "forgotten":
            model.eval()
        with torch.no_grad():
            diffs.append((model(xv) - model(xv)).abs().max().item())
    return diffs


def _watched(quiet_watch, build, **config):
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, quiet_watch(model, opt, **config)


@pytest.mark.parametrize("case", sorted(MODELS))
def test_validation_without_eval_is_told_at_the_first_drop_path(quiet_watch, case):
    build, first, shape = MODELS[case]
    model, opt, monitor = _watched(quiet_watch, build)
    diffs = _fit(model, opt, shape, epochs=2, evaluate="forgotten")
    assert diffs[0] > 0  # the planted bug is real: the same batch, two answers
    found = [(a.rule, a.step, a.module) for a in monitor.alerts if a.severity in SEVERE]
    assert found and found[0] == ("eval_in_train_mode", EPOCH, first), found
    assert {rule for rule, _, _ in found} == {"eval_in_train_mode"}
    alert = next(a for a in monitor.alerts if a.rule == "eval_in_train_mode")
    assert alert.data["modules"][0] == first
    assert len(alert.data["modules"]) == 2
    assert "random in training" in alert.data["kinds"][0]


@pytest.mark.parametrize("case", sorted(MODELS))
def test_eval_called_for_validation_is_silent(quiet_watch, case):
    build, _, shape = MODELS[case]
    model, opt, monitor = _watched(quiet_watch, build)
    diffs = _fit(model, opt, shape, epochs=2, evaluate="switched")
    assert diffs == [0.0, 0.0]
    assert rules_of(monitor, ("info", "warning", "error")) == []


@pytest.mark.parametrize("case", sorted(MODELS))
def test_training_on_in_eval_mode_is_told_at_the_next_epoch(quiet_watch, case):
    """``model.eval()`` in the validation, ``model.train()`` never called back:
    the next epoch trains with no branch ever dropped."""
    build, first, shape = MODELS[case]
    model, opt, monitor = _watched(quiet_watch, build)
    _fit(model, opt, shape, epochs=2, evaluate="eval_kept")
    found = [(a.rule, a.step, a.module) for a in monitor.alerts if a.severity in SEVERE]
    assert found and found[0] == ("train_in_eval_mode", EPOCH, first), found
    assert {rule for rule, _, _ in found} == {"train_in_eval_mode"}


@pytest.mark.parametrize("block", [torch.no_grad, torch.inference_mode])
def test_the_evaluation_alone_shows_it_without_training_looks(quiet_watch, block):
    """With ``train_in_eval_mode`` off no training pass is looked at: the sampled
    look at the evaluation itself (no_grad or inference_mode) finds the draws."""
    model, opt, monitor = _watched(quiet_watch, ConvNet, train_in_eval_mode={"enabled": False})
    x, y = _data(48, (3, 6, 6), 0)
    for _ in range(2):
        for i in range(0, 48, 8):
            opt.zero_grad()
            F.cross_entropy(model(x[i : i + 8]), y[i : i + 8]).backward()
            opt.step()
        with block():
            model(x[:16])
    found = [(a.rule, a.step, a.module) for a in monitor.alerts if a.severity in SEVERE]
    assert found and found[0] == ("eval_in_train_mode", EPOCH, "blocks.0.drop_path"), found


def test_mc_dropout_evaluation_on_purpose_is_silent(quiet_watch):
    """Monte-Carlo evaluation, stochastic depth left on as dropout would be."""
    model, opt, monitor = _watched(quiet_watch, ConvNet, eval_in_train_mode={"mc_dropout": True})
    _fit(model, opt, (3, 6, 6), epochs=2, evaluate="forgotten")
    assert rules_of(monitor, ("info", "warning", "error")) == []


@pytest.mark.parametrize("case", sorted(CONTROLS))
@pytest.mark.parametrize("evaluate", ["forgotten", "switched", "eval_kept"])
def test_random_draws_in_both_modes_are_silent(quiet_watch, case, evaluate):
    model, opt, monitor = _watched(quiet_watch, CONTROLS[case])
    diffs = _fit(model, opt, (5, 6), epochs=2, evaluate=evaluate)
    assert diffs[0] > 0  # random in eval mode too
    assert rules_of(monitor, ("info", "warning", "error")) == []


def test_diffusion_noise_drawn_outside_the_model_is_silent(quiet_watch):
    """Timesteps and noise drawn in the training step, the model deterministic."""
    model, opt, monitor = _watched(
        quiet_watch, lambda: nn.Sequential(nn.Linear(7, 16), nn.LayerNorm(16), nn.Linear(16, 6))
    )
    x, _ = _data(48, (6,), 0)
    for _ in range(2):
        for i in range(0, 48, 8):
            t = torch.rand(8, 1)
            noise = torch.randn(8, 6)
            pred = model(torch.cat([x[i : i + 8] + t * noise, t], 1))
            opt.zero_grad()
            F.mse_loss(pred, noise).backward()
            opt.step()
        with torch.no_grad():
            model(torch.cat([x[:8], torch.rand(8, 1)], 1))
    assert rules_of(monitor, ("info", "warning", "error")) == []


def test_the_look_leaves_training_as_it_was(quiet_watch):
    """The drop-path module run again in eval mode draws nothing from the training's
    generators: the watched run's losses are the unwatched run's, bit for bit."""

    def losses(watch: bool) -> list[float]:
        torch.manual_seed(0)
        model = ConvNet()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if watch:
            quiet_watch(model, opt)
        x, y = _data(48, (3, 6, 6), 0)
        out = []
        for i in range(0, 48, 8):
            loss = F.cross_entropy(model(x[i : i + 8]), y[i : i + 8])
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    assert losses(True) == losses(False)


# -- Lightning: validation_step fine, Lightning calls eval() ----------------------------


class LitTokens(pl.LightningModule):
    def __init__(self, train_in_validation: bool) -> None:
        super().__init__()
        self.net = TokenNet()
        self.train_in_validation = train_in_validation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_validation_epoch_start(self) -> None:
        if self.train_in_validation:
            self.train()  # the planted bug: validation runs in training mode

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*_data(EPOCH * 8, (5, 6), 0)), batch_size=8)

    def val_dataloader(self):
        return DataLoader(TensorDataset(*_data(16, (5, 6), 1)), batch_size=8)


@pytest.mark.slow
@pytest.mark.parametrize("bug", [False, True], ids=["lightning_eval", "train_in_validation"])
def test_lightning_validation(tmp_path, bug):
    torch.manual_seed(0)
    callback = TrainWatchCallback(console=io.StringIO())
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(LitTokens(bug))
    found = [(a.rule, a.module) for a in callback.alerts if a.severity in SEVERE]
    if bug:
        assert found and found[0] == ("eval_in_train_mode", "net.layers.0.drop_path"), found
        assert {rule for rule, _ in found} == {"eval_in_train_mode"}
    else:
        assert found == []


# -- trainwatch run on an unmodified script ---------------------------------------------

SCRIPT = """
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class DropPath(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        mask = x.new_empty(x.shape[0], 1, 1, 1).bernoulli_(1 - self.p)
        return x * mask / (1 - self.p)


class Block(nn.Module):
    def __init__(self, c, p):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.norm = nn.GroupNorm(4, c)
        self.drop_path = DropPath(p)

    def forward(self, x):
        return F.relu(x + self.drop_path(self.norm(self.conv(x))))


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(4, 10)

    def forward(self, x):
        mu, logvar = self.enc(x).mean((2, 3)).chunk(2, 1)
        return self.head(mu + torch.randn_like(mu) * (0.5 * logvar).exp())


if sys.argv[1] == "vae":
    model = VAE()
else:
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), Block(16, 0.3), Block(16, 0.3),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )
opt = torch.optim.AdamW(model.parameters(), 1e-3)
x, y = torch.randn(256, 3, 8, 8), torch.randint(0, 10, (256,))


def validate():
    if sys.argv[1] == "switched":
        model.eval()
    with torch.no_grad():
        out = model(x[160:])
    model.train()
    return out


for epoch in range(2):
    model.train()
    for i in range(10):
        loss = F.cross_entropy(model(x[i * 16 : (i + 1) * 16]), y[i * 16 : (i + 1) * 16])
        opt.zero_grad()
        loss.backward()
        opt.step()
    validate()
print("done")
"""


@pytest.mark.parametrize("mode", ["forgotten", "switched", "vae"])
def test_trainwatch_run_tells_validation_with_drop_path_on(tmp_path, capsys, mode):
    script = tmp_path / "droppath.py"
    script.write_text(SCRIPT)
    assert run_script(script, [mode], log_dir=tmp_path / "log") == 0
    alerts = tmp_path / "log" / "alerts.jsonl"
    lines = alerts.read_text().splitlines() if alerts.exists() else []
    found = [(a["rule"], a["step"], a["module"]) for a in map(json.loads, lines)]
    found = [f for f, a in zip(found, map(json.loads, lines)) if a["severity"] in SEVERE]
    if mode == "forgotten":
        assert found and found[0] == ("eval_in_train_mode", 10, "1.drop_path"), found
        assert {rule for rule, _, _ in found} == {"eval_in_train_mode"}
    else:
        assert found == []
    assert "done" in capsys.readouterr().out
