"""A loop that trains with a torch optimizer but gave ``tw.watch`` none.

``monitor = tw.watch(model)`` beside ``opt = torch.optim.Adam(model.parameters())``,
and no ``monitor.step()``: trainwatch used to watch no step at all, and its
closing note said "no optimizer stepped and monitor.step() was never called",
false after 50 steps of an optimizer over exactly this model's parameters.

Now the optimizer is found at its steps (one global pre-step hook, held only
while such a monitor looks): at its second step with no ``monitor.step()``
since its first, it is watched as if passed, the step before counted, and one
console line says so. A loop that calls ``monitor.step()`` after each update
keeps its own marks (no note, no step counted twice); a hand-written update
keeps today's note; a GAN whose discriminator was watched without its
optimizer gets that optimizer watched, the generator's left alone. Plain
python and ``trainwatch run`` (where the script's own monitor holds the model),
real torch optimizers, no mocks.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_pre_hooks

import trainwatch
import trainwatch as tw

NOTE = "was not passed to tw.watch"
FALSE_CLAIM = "no optimizer stepped"
HAND_NOTE = (
    "the model ran 30 forward passes, but no optimizer stepped and monitor.step() was never "
    "called (a loop that updates the weights without a torch.optim optimizer calls "
    "monitor.step() after each update)"
)


class _DeadHead(nn.Module):
    """A classifier with a head built and handed to the optimizer, never called."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
        self.unused = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _classifier(dead_head: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if dead_head:
        return _DeadHead()  # zero_gradient on `unused`
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))


def _train(model, opt, monitor, steps: int, *, mark: bool = False) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if mark:
            monitor.step(loss)


def _watched(optimizer_given: bool, *, mark: bool = False, steps: int = 50, dead_head=False):
    model = _classifier(dead_head)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    out = io.StringIO()
    hooks = len(_global_optimizer_pre_hooks)
    monitor = tw.watch(model, opt if optimizer_given else None, console=out)
    _train(model, opt, monitor, steps, mark=mark)
    held = len(_global_optimizer_pre_hooks) - hooks
    found = (
        monitor.step_count,
        list(monitor.optimizers),
        [(a.rule, a.module) for a in monitor.alerts],
    )
    monitor.close()
    assert len(_global_optimizer_pre_hooks) == hooks  # nothing left on the process
    return found, out.getvalue(), held, opt


def test_a_forgotten_optimizer_is_watched_and_said_once():
    (steps, optimizers, alerts), text, held, opt = _watched(False)
    assert steps == 50
    assert optimizers == [opt]
    assert alerts == []
    assert text.count(NOTE) == 1, text
    assert "Adam steps the watched Sequential's parameters" in text
    assert "watching it from step 1 on" in text
    assert FALSE_CLAIM not in text and "no training step watched" not in text
    assert "50 steps watched" in text
    assert held == 0  # the look's hook came off once the optimizer was found


def test_the_optimizer_passed_is_the_healthy_twin():
    """The same loop with the optimizer passed: the same count and findings, no note,
    and no global hook ever held."""
    (steps, optimizers, alerts), text, held, opt = _watched(True)
    assert (steps, optimizers, alerts) == (50, [opt], [])
    assert NOTE not in text and "50 steps watched" in text
    assert held == 0


def test_a_bug_under_a_forgotten_optimizer_is_caught_as_under_a_passed_one():
    """The point of watching it: a head in the optimizer that never gets a gradient is
    told as it is with the optimizer passed (one step later at most)."""
    (steps, _, alerts), text, _, _ = _watched(False, dead_head=True)
    (steps_twin, _, alerts_twin), _, _, _ = _watched(True, dead_head=True)
    assert steps == steps_twin == 50
    assert ("zero_gradient", "unused") in alerts_twin
    assert ("zero_gradient", "unused") in alerts
    assert text.count(NOTE) == 1


def test_monitor_step_after_the_optimizer_keeps_its_own_marks():
    """The documented form without an optimizer: every monitor.step() is a step, none
    counted twice, no optimizer taken over, no note, and the hook gone."""
    (steps, optimizers, alerts), text, held, _ = _watched(False, mark=True)
    assert steps == 50
    assert optimizers == []
    assert alerts == []
    assert NOTE not in text and FALSE_CLAIM not in text
    assert "50 steps watched" in text
    assert held == 0


def test_a_hand_written_update_keeps_todays_note():
    model = _classifier()
    out = io.StringIO()
    hooks = len(_global_optimizer_pre_hooks)
    with tw.watch(model, console=out) as monitor:
        torch.manual_seed(1)
        for _ in range(30):
            model.zero_grad()
            x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
            nn.functional.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
    assert monitor.step_count == 0
    assert HAND_NOTE in out.getvalue()
    assert NOTE not in out.getvalue()
    assert len(_global_optimizer_pre_hooks) == hooks


def test_a_single_step_is_named_at_close_not_denied():
    """Too few steps to tell a forgotten optimizer from a loop that marks its own: the
    closing note names the optimizer that stepped, never that none did."""
    (steps, optimizers, _), text, _, _ = _watched(False, steps=1)
    assert (steps, optimizers) == (0, [])
    assert FALSE_CLAIM not in text
    assert "Adam stepped the model's parameters once" in text
    assert "tw.watch(model, optimizer)" in text


def test_two_forgotten_optimizers_count_as_a_list_passed():
    def run(given: bool) -> tuple[int, list[str], str]:
        model = _classifier()
        body = torch.optim.SGD(model[0].parameters(), 1e-2)
        head = torch.optim.Adam(model[2].parameters(), 1e-3)
        out = io.StringIO()
        monitor = tw.watch(model, [body, head] if given else None, console=out)
        torch.manual_seed(1)
        for _ in range(20):
            body.zero_grad()
            head.zero_grad()
            x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
            nn.functional.cross_entropy(model(x), y).backward()
            body.step()
            head.step()
        found = monitor.step_count, [type(o).__name__ for o in monitor.optimizers]
        monitor.close()
        return (*found, out.getvalue())

    steps, kinds, text = run(False)
    assert (steps, kinds) == run(True)[:2] == (40, ["SGD", "Adam"])
    assert "SGD and Adam step the watched Sequential's parameters" in text
    assert "watching them from step 2 on" in text


class _Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class _Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("d_given", [False, True], ids=["d_optimizer_forgotten", "both_given"])
def test_a_gan_with_one_models_optimizer_passed(d_given):
    """tw.watch(G, opt_g) and tw.watch(D) (opt_d forgotten): D's monitor watches opt_d
    from its second step, never opt_g; G's monitor is untouched. The twin passes both."""
    torch.manual_seed(0)
    gen, disc = _Generator(), _Discriminator()
    opt_g = torch.optim.Adam(gen.parameters(), 2e-4)
    opt_d = torch.optim.Adam(disc.parameters(), 2e-4)
    out_g, out_d = io.StringIO(), io.StringIO()
    mon_g = tw.watch(gen, opt_g, console=out_g)
    mon_d = tw.watch(disc, opt_d if d_given else None, console=out_d)
    bce = nn.functional.binary_cross_entropy_with_logits
    for _ in range(40):
        real, z = torch.randn(16, 8), torch.randn(16, 4)
        opt_d.zero_grad()
        fake = gen(z)
        loss_d = bce(disc(real), torch.ones(16, 1)) + bce(disc(fake.detach()), torch.zeros(16, 1))
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        bce(disc(fake), torch.ones(16, 1)).backward()
        opt_g.step()
    assert mon_g.step_count == mon_d.step_count == 40
    assert mon_g.optimizers == [opt_g]
    assert mon_d.optimizers == [opt_d]
    assert mon_g.alerts == [] and mon_d.alerts == []
    mon_g.close()
    mon_d.close()
    assert NOTE not in out_g.getvalue()
    if d_given:
        assert NOTE not in out_d.getvalue()
    else:
        assert out_d.getvalue().count(NOTE) == 1
        assert "Adam steps the watched _Discriminator's parameters" in out_d.getvalue()
    assert FALSE_CLAIM not in out_d.getvalue() + out_g.getvalue()


def test_watching_with_an_optimizer_holds_no_global_hook():
    """The usual loop's cost is unchanged: no global optimizer hook is installed."""
    model = _classifier()
    opt = torch.optim.SGD(model.parameters(), 1e-2)
    hooks = len(_global_optimizer_pre_hooks)
    with tw.watch(model, opt, console=False):
        assert len(_global_optimizer_pre_hooks) == hooks


# -- the same scripts, under plain python and `trainwatch run` ----------------

SCRIPT = """
import sys
import torch
from torch import nn
import trainwatch as tw

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
opt = torch.optim.Adam(model.parameters(), 1e-3)
monitor = tw.watch(model)          # optimizer not given
for step in range(50):
    x = torch.randn(16, 8); y = torch.randint(0, 2, (16,))
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    if "hand" in sys.argv:
        with torch.no_grad():
            for p in model.parameters():
                p -= 1e-3 * p.grad
    else:
        opt.step()
    if "step" in sys.argv:
        monitor.step(loss)
monitor.close()
"""


def _stderr(tmp_path: Path, *args: str, run: bool) -> str:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(Path(trainwatch.__file__).resolve().parents[1]))
    command = ["-m", "trainwatch", "run", "--log-dir", str(tmp_path / "run")] if run else []
    done = subprocess.run(
        [sys.executable, *command, str(script), *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("run", [False, True], ids=["python", "trainwatch_run"])
def test_scripts_forgotten_optimizer_is_watched(tmp_path, run):
    err = _stderr(tmp_path, run=run)
    assert err.count(NOTE) == 1, err
    assert FALSE_CLAIM not in err and "no training step watched" not in err
    assert "50 steps watched" in err
    if run:
        counts = json.loads((tmp_path / "run" / "alert_counts.json").read_text())
        assert counts == {"steps": 50, "counts": []}


@pytest.mark.slow
@pytest.mark.parametrize("run", [False, True], ids=["python", "trainwatch_run"])
def test_script_calling_monitor_step_is_watched_as_before(tmp_path, run):
    err = _stderr(tmp_path, "step", run=run)
    assert NOTE not in err and "no training step watched" not in err
    assert err.count("50 steps watched") == 1, err
    if run:
        counts = json.loads((tmp_path / "run" / "alert_counts.json").read_text())
        assert counts == {"steps": 50, "counts": []}


@pytest.mark.slow
@pytest.mark.parametrize("run", [False, True], ids=["python", "trainwatch_run"])
def test_script_updating_by_hand_keeps_todays_note(tmp_path, run):
    err = _stderr(tmp_path, "hand", run=run)
    assert NOTE not in err
    assert err.count("no training step watched") == 1, err
    assert "the model ran 50 forward passes, but no optimizer stepped" in err
