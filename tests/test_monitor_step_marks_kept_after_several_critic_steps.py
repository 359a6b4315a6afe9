"""A GAN loop calling ``monitor.step()`` once an iteration keeps its own marks,
however many critic steps come before the first.

``tw.watch(gan)`` without an optimizer (the model holding G and D, or
``tw.watch(G)`` beside ``tw.watch(D)``), the loop stepping its own optimizers
and calling ``monitor.step(loss)`` after the generator's step. A WGAN's critic
steps five times before the first ``monitor.step()``, and its second step was
taken for the loop's second iteration with no ``monitor.step()`` in the first:
its optimizers were watched as if passed, each of their steps a step (72 for
12 iterations), the loop's own marks dropped, and the console said
"(nor is monitor.step() called)" of a loop calling it every iteration. A
DCGAN, one step of each before the first ``monitor.step()``, kept its marks.

Now a repeated step is the second iteration only where the steps show one (the
generator stepped between two critic steps, with no ``monitor.step()`` since):
the WGAN keeps its marks as the DCGAN does, no optimizer is taken, nothing is
said, and the look's global hook comes off. The same loops without
``monitor.step()`` are watched as with their optimizers passed, and say so.
Planted: ``opt_g.zero_grad()`` forgotten in the marking loop, told at the
loop's first iteration after the reset went missing, as in the DCGAN. WGAN
with weight clipping, WGAN-GP, DCGAN, on 2-D points and on small images;
``trainwatch run`` of a script holding its own monitor. Real torch, no mocks.
"""

from __future__ import annotations

import io
import json
import textwrap
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks

import trainwatch as tw
from tests.gan_loops import Loop
from trainwatch.runner import run_script

NOT_GIVEN = "not passed to tw.watch"
NO_MARK = "nor is monitor.step() called"
ITERATIONS = 12


def _watched(loop: Loop, how: str, *, mark: bool) -> tuple[list[tw.Monitor], str, int]:
    """``how``: "gan" (tw.watch of the module holding both), "halves" (tw.watch(G)
    and tw.watch(D)), "given" (each monitor given its optimizers: the twin).
    Returns the monitors (closed), the console and the global hooks held at the end."""
    gan, opt_g, opt_d = loop.build()
    console = io.StringIO()
    hooks = len(_global_optimizer_pre_hooks)
    if how == "gan":
        monitors = [tw.watch(gan, console=console)]
    elif how == "halves":
        monitors = [tw.watch(gan.G, console=console), tw.watch(gan.D, console=console)]
    else:
        monitors = [tw.watch(gan, [opt_g, opt_d], console=console)]

    def marks(loss: torch.Tensor) -> None:
        for monitor in monitors:
            monitor.step(loss)

    loop.train(gan, opt_g, opt_d, marks if mark else None)
    held = len(_global_optimizer_pre_hooks) - hooks
    for monitor in monitors:
        monitor.close()
    return monitors, console.getvalue(), held


def _found(monitors: list[tw.Monitor]) -> list[tuple[str, int, str | None]]:
    return [(a.rule, a.step, a.module) for m in monitors for a in m.alerts if a.severity != "info"]


@pytest.mark.parametrize("how", ["gan", "halves"])
@pytest.mark.parametrize(
    ("kind", "images"),
    [("wgan_clip", False), ("wgan_gp", False), ("wgan_gp", True), ("dcgan", False)],
)
def test_a_loop_calling_monitor_step_keeps_its_marks(kind, images, how):
    loop = Loop(kind, images, ITERATIONS)
    monitors, text, held = _watched(loop, how, mark=True)
    assert _found(monitors) == []
    assert [m.step_count for m in monitors] == [ITERATIONS] * len(monitors)
    assert all(m.optimizers == [] for m in monitors)
    assert NOT_GIVEN not in text and NO_MARK not in text, text
    assert held == 0  # the look's hook came off at the first monitor.step()


@pytest.mark.parametrize("how", ["gan", "halves"])
@pytest.mark.parametrize("kind", ["wgan_clip", "wgan_gp", "dcgan"])
def test_the_same_loop_without_monitor_step_is_watched_as_with_its_optimizers(kind, how):
    loop = Loop(kind, iterations=ITERATIONS)
    monitors, text, held = _watched(loop, how, mark=False)
    twin, _, _ = _watched(loop, "given", mark=False)
    assert _found(monitors) == _found(twin) == []
    steps = ITERATIONS * (loop.critic_steps + 1)
    assert twin[0].step_count == steps
    assert sum(m.step_count for m in monitors) == steps
    assert sum(len(m.optimizers) for m in monitors) == 2
    notes = [line for line in text.splitlines() if NOT_GIVEN in line]
    assert len(notes) == len(monitors), text
    assert all(NO_MARK in note for note in notes)
    assert held == 0


@pytest.mark.parametrize("how", ["gan", "halves"])
@pytest.mark.parametrize("kind", ["wgan_clip", "wgan_gp", "dcgan"])
def test_a_forgotten_generator_reset_in_the_marking_loop_is_told_at_its_iteration(kind, how):
    """The generator's gradients of iteration 0 are added onto at iteration 1 and
    applied there: told at step 1, the loop's own count, naming G's parameters."""
    monitors, _, _ = _watched(Loop(kind, iterations=6, g_reset=False), how, mark=True)
    found = _found(monitors)
    assert [(rule, step) for rule, step, _ in found] == [("accumulated_gradient", 1)]
    message = next(a.message for m in monitors for a in m.alerts if a.severity != "info")
    assert ("G.0.weight" if how == "gan" else "0.weight") in message
    assert all(m.step_count == 6 for m in monitors)


def test_training_is_the_same_with_and_without_the_monitor():
    def final(watched: bool) -> list[torch.Tensor]:
        loop = Loop("wgan_clip", iterations=6)
        gan, opt_g, opt_d = loop.build()
        monitor = tw.watch(gan, console=False) if watched else None
        loop.train(gan, opt_g, opt_d, monitor.step if monitor is not None else None)
        if monitor is not None:
            monitor.close()
        return [p.detach().clone() for p in gan.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(final(False), final(True)))


SCRIPT = """
import sys
import torch
from torch import nn
import trainwatch as tw

torch.set_num_threads(1)
torch.manual_seed(0)
G = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
D = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=1e-4, betas=(0.5, 0.9))
opt_d = torch.optim.Adam(D.parameters(), lr=1e-4, betas=(0.5, 0.9))
monitors = [tw.watch(G), tw.watch(D)]
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
        opt_d.step()
    if "bug" not in sys.argv:
        opt_g.zero_grad()
    loss_g = -D(G(torch.randn(32, 8))).mean()
    loss_g.backward()
    opt_g.step()
    for monitor in monitors:
        monitor.step(loss_g)
for monitor in monitors:
    monitor.close()
"""


@pytest.mark.parametrize("bug", [False, True], ids=["healthy", "g_reset_forgotten"])
def test_trainwatch_run_of_a_script_marking_its_own_steps(tmp_path: Path, bug):
    """The script's monitors hold G and D: the run counts their marks, and tells the
    forgotten reset at the loop's iteration 1."""
    script = tmp_path / "wgan_gp.py"
    script.write_text(textwrap.dedent(SCRIPT))
    log = tmp_path / "log"
    assert run_script(script, ["bug"] if bug else [], log_dir=log, console=False) == 0
    counts = json.loads((log / "alert_counts.json").read_text())
    assert counts["steps"] == ITERATIONS
    told = [(c["rule"], c["first_step"]) for c in counts["counts"]]
    assert told == ([("accumulated_gradient", 1)] if bug else [])
