"""A GAN in one container, watched with one half's optimizer only.

``model = nn.ModuleDict({"G": G, "D": D})`` (or a module holding ``self.G``
and ``self.D``) watched as ``tw.watch(model, opt_g)`` while the loop builds
and steps ``opt_d`` itself: the discriminator's parameters get gradients (the
generator's loss runs through it) and no watched optimizer holds them. They
were told as never updated (``not_optimized``) at the first step, though
``opt_d`` moves them every iteration. Now one console note says an optimizer
not given trains them, and nothing is told: alternating D then G steps, a
WGAN's five critic steps per generator step, the generator first, either
half's optimizer given, and ``tw.watch(model)`` with none. ``opt_d`` built
but never stepped, and D in no optimizer at all, are still told, dated at
the step they are told at without that optimizer: step 0.
"""

from __future__ import annotations

import io
import json
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import trainwatch as tw
from trainwatch.runner import run_script

Z, X = 8, 16
ITERATIONS = 12


class GAN(nn.Module):
    """A LightningModule-like container: both halves as attributes."""

    def __init__(self, generator: nn.Module, discriminator: nn.Module) -> None:
        super().__init__()
        self.G = generator
        self.D = discriminator


def _gan(container: str) -> nn.Module:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(Z, 32), nn.ReLU(), nn.Linear(32, X))
    discriminator = nn.Sequential(nn.Linear(X, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    if container == "dict":
        return nn.ModuleDict({"G": generator, "D": discriminator})
    return GAN(generator, discriminator)


def _halves(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    if isinstance(model, nn.ModuleDict):
        return model["G"], model["D"]
    return model.G, model.D


def _optimizers(model: nn.Module, loop: str) -> tuple[torch.optim.Optimizer, ...]:
    generator, discriminator = _halves(model)
    if loop == "wgan":
        return (
            torch.optim.RMSprop(generator.parameters(), lr=5e-5),
            torch.optim.RMSprop(discriminator.parameters(), lr=5e-5),
        )
    return (
        torch.optim.Adam(generator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
        torch.optim.Adam(discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
    )


def _train(model, opt_g, opt_d, loop: str, d_steps: bool = True) -> None:
    """``loop``: "dcgan" (D then G each iteration), "wgan" (five clipped critic steps,
    then G), "g_first" (G then D). ``d_steps=False``: ``opt_d.step()`` forgotten."""
    generator, discriminator = _halves(model)
    bce = nn.BCEWithLogitsLoss()
    data = torch.Generator().manual_seed(1)
    ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)

    def step_d(real: torch.Tensor, fake: torch.Tensor) -> None:
        opt_d.zero_grad()
        if loop == "wgan":
            loss = discriminator(fake.detach()).mean() - discriminator(real).mean()
        else:
            loss = bce(discriminator(real), ones) + bce(discriminator(fake.detach()), zeros)
        loss.backward()
        if d_steps:
            opt_d.step()
        if loop == "wgan":
            for p in discriminator.parameters():
                p.data.clamp_(-0.01, 0.01)

    def step_g(fake: torch.Tensor) -> None:
        opt_g.zero_grad()
        out = discriminator(fake)
        (-out.mean() if loop == "wgan" else bce(out, ones)).backward()
        opt_g.step()

    for _ in range(ITERATIONS):
        real = torch.randn(32, X, generator=data) * 0.5 + 1.0
        if loop == "wgan":
            for _ in range(5):
                step_d(real, generator(torch.randn(32, Z, generator=data)))
            step_g(generator(torch.randn(32, Z, generator=data)))
        elif loop == "g_first":
            fake = generator(torch.randn(32, Z, generator=data))
            step_g(fake)
            step_d(real, fake)
        else:
            fake = generator(torch.randn(32, Z, generator=data))
            step_d(real, fake)
            step_g(fake)


def _told(monitor: tw.Monitor) -> list[tuple[str, int, str]]:
    return [(a.rule, a.step, a.module) for a in monitor.alerts if a.severity != "info"]


@pytest.mark.parametrize(
    ("container", "loop", "given"),
    [
        ("dict", "dcgan", "opt_g"),
        ("attr", "dcgan", "opt_g"),
        ("dict", "dcgan", "opt_d"),
        ("attr", "wgan", "opt_g"),
        ("dict", "wgan", "opt_d"),
        ("attr", "g_first", "opt_g"),
    ],
)
def test_a_half_stepped_by_the_loops_own_optimizer_is_noted_not_told(container, loop, given):
    model = _gan(container)
    opt_g, opt_d = _optimizers(model, loop)
    console = io.StringIO()
    monitor = tw.watch(model, opt_g if given == "opt_g" else opt_d, console=console)
    _train(model, opt_g, opt_d, loop)
    monitor.close()
    assert _told(monitor) == []
    other = "D" if given == "opt_g" else "G"
    kind = "RMSprop" if loop == "wgan" else "Adam"
    notes = [line for line in console.getvalue().splitlines() if "not passed to tw.watch" in line]
    assert len(notes) == 1
    assert f"in {other})" in notes[0] and f"updated by {kind}" in notes[0]


@pytest.mark.parametrize("loop", ["dcgan", "wgan", "g_first"])
@pytest.mark.parametrize("bug", ["step_forgotten", "in_no_optimizer"])
def test_a_discriminator_never_stepped_is_still_told_at_step_0(loop, bug):
    model = _gan("dict")
    opt_g, opt_d = _optimizers(model, loop)
    if bug == "in_no_optimizer":  # "opt_d" built over some other tensor
        opt_d = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    console = io.StringIO()
    monitor = tw.watch(model, opt_g, console=console)
    _train(model, opt_g, opt_d, loop, d_steps=bug == "in_no_optimizer")
    # Told while the run goes on, dated at the step it was told at before.
    assert _told(monitor) == [("not_optimized", 0, "D.0"), ("not_optimized", 0, "D.2")]
    monitor.close()
    assert "not passed to tw.watch" not in console.getvalue()


@pytest.mark.parametrize("loop", ["dcgan", "wgan"])
def test_watched_without_an_optimizer_the_gan_stays_silent(loop):
    model = _gan("attr")
    opt_g, opt_d = _optimizers(model, loop)
    monitor = tw.watch(model, console=io.StringIO())
    _train(model, opt_g, opt_d, loop)
    monitor.close()
    assert _told(monitor) == []
    assert any(opt is opt_d for opt in monitor.optimizers)


def test_watched_without_an_optimizer_a_forgotten_discriminator_step_is_told():
    model = _gan("attr")
    opt_g, opt_d = _optimizers(model, "dcgan")
    monitor = tw.watch(model, console=io.StringIO())
    _train(model, opt_g, opt_d, "dcgan", d_steps=False)
    monitor.close()
    # opt_g adopted at its second step (step 1), where D's gradients were thrown away
    # since its first: opt_d watched from there too, and told as with it passed.
    assert _told(monitor) == [("not_optimized", 1, "D")]
    assert "opt_d (optimizer 1, Adam) has not stepped once" in monitor.alerts[0].message


def test_training_is_the_same_with_and_without_the_monitor():
    def final(watched: bool) -> list[torch.Tensor]:
        model = _gan("dict")
        opt_g, opt_d = _optimizers(model, "dcgan")
        monitor = tw.watch(model, opt_g, console=False) if watched else None
        _train(model, opt_g, opt_d, "dcgan")
        if monitor is not None:
            monitor.close()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(final(False), final(True)))


SCRIPT = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.ModuleDict({
    "G": nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16)),
    "D": nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1)),
})
opt_g = torch.optim.Adam(model["G"].parameters(), lr=2e-4, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(model["D"].parameters(), lr=2e-4, betas=(0.5, 0.999))
bce = nn.BCEWithLogitsLoss()
for it in range(12):
    real = torch.randn(32, 16) * 0.5 + 1.0
    fake = model["G"](torch.randn(32, 8))
    opt_d.zero_grad()
    loss_d = bce(model["D"](real), torch.ones(32, 1))
    loss_d = loss_d + bce(model["D"](fake.detach()), torch.zeros(32, 1))
    loss_d.backward()
    opt_d.step()
    opt_g.zero_grad()
    bce(model["D"](fake), torch.ones(32, 1)).backward()
    opt_g.step()
"""


def test_trainwatch_run_of_an_unchanged_gan_script_stays_silent(tmp_path: Path):
    script = tmp_path / "gan.py"
    script.write_text(textwrap.dedent(SCRIPT))
    log = tmp_path / "log"
    assert run_script(script, log_dir=log, console=False) == 0
    alerts = log / "alerts.jsonl"
    lines = alerts.read_text().splitlines() if alerts.exists() else []
    found = [json.loads(line) for line in lines]
    assert [a["rule"] for a in found if a["severity"] in ("warning", "error")] == []
