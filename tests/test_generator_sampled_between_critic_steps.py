"""A generator sampled under no_grad once per critic step is training, not evaluation.

WGAN-GP trains its critic five times per generator step, each time on fakes
drawn from the generator under ``no_grad`` with the generator in training
mode (its batch norm uses the batch's statistics, as in its own step). Those
passes come with no training pass of the generator between them, as a
validation loop's do; the critic's optimizer stepping between two of them is
what tells them apart, whether the critic is watched or not. A validation
loop of the same generator that forgot ``eval()`` steps no optimizer between
its batches and is still reported.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from tests.conftest import rules_of
from trainwatch.runner import run_script

SCRIPT = """
import sys
import torch
from torch import nn

n_critic, evaluate_every = int(sys.argv[1]), int(sys.argv[2])
watch = sys.argv[3] if len(sys.argv) > 3 else "none"  # none, generator, both
torch.manual_seed(0)
G = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 2))
D = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
opt_g = torch.optim.Adam(G.parameters(), 1e-4, betas=(0.5, 0.9))
opt_d = torch.optim.Adam(D.parameters(), 1e-4, betas=(0.5, 0.9))
monitors = []
if watch != "none":
    import trainwatch as tw

    monitors.append(tw.watch(G, opt_g, console=False))
    if watch == "both":
        monitors.append(tw.watch(D, opt_d, console=False))


def penalty(real, fake):
    mix = torch.rand(real.shape[0], 1)
    x = (mix * real + (1 - mix) * fake).requires_grad_(True)
    (grad,) = torch.autograd.grad(D(x).sum(), x, create_graph=True)
    return ((grad.norm(dim=1) - 1) ** 2).mean()


for it in range(12):
    for _ in range(n_critic):
        with torch.no_grad():
            fake = G(torch.randn(64, 16))
        real = torch.randn(64, 2) + 2
        loss_d = D(fake).mean() - D(real).mean() + 10 * penalty(real, fake)
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
    opt_g.zero_grad()
    (-D(G(torch.randn(64, 16))).mean()).backward()
    opt_g.step()
    if evaluate_every and it % evaluate_every == evaluate_every - 1:
        with torch.no_grad():  # forgot G.eval()
            samples = [G(torch.randn(64, 16)) for _ in range(4)]
for monitor in monitors:
    monitor.close()
"""


def _watched_generator(n_critic: int, evaluate_every: int, critic_too: bool):
    """The script's loop in this process with only the generator watched (or both)."""
    argv = sys.argv
    sys.argv = ["gan.py", str(n_critic), str(evaluate_every), "both" if critic_too else "generator"]
    try:
        namespace: dict = {"__name__": "__main__"}
        exec(compile(SCRIPT, "gan.py", "exec"), namespace)
    finally:
        sys.argv = argv
    return namespace["monitors"][0]


@pytest.mark.parametrize("critic_too", [False, True], ids=["generator_watched", "both_watched"])
@pytest.mark.parametrize("n_critic", [1, 5])
def test_fakes_drawn_under_no_grad_for_each_critic_step_are_silent(n_critic, critic_too):
    monitor = _watched_generator(n_critic, 0, critic_too)
    assert "eval_in_train_mode" not in rules_of(monitor)


def test_an_evaluation_loop_of_that_generator_without_eval_is_still_reported():
    monitor = _watched_generator(5, 5, critic_too=False)
    (alert,) = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert alert.step == 5 and alert.module == "1"  # after the generator's fifth step


@pytest.mark.parametrize(("evaluate_every", "expected"), [(0, []), (5, [(5, "1")])])
def test_under_trainwatch_run_wgan_gp_with_five_critic_steps(tmp_path, evaluate_every, expected):
    script = tmp_path / "wgan_gp.py"
    script.write_text(SCRIPT)
    run_script(script, ["5", str(evaluate_every)], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [
        (a["step"], a["module"])
        for a in map(json.loads, lines)
        if a["rule"] == "eval_in_train_mode" and a["data"].get("model") == "Sequential"
    ]
    assert found == expected


def test_the_process_wide_step_count_comes_off_with_the_last_monitor(quiet_watch):
    from torch.optim.optimizer import _global_optimizer_post_hooks

    before = len(_global_optimizer_post_hooks)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    first = quiet_watch(model, torch.optim.SGD(model.parameters(), 0.1))
    second = quiet_watch(nn.Linear(4, 1))
    assert len(_global_optimizer_post_hooks) == before + 1
    first.close()
    assert len(_global_optimizer_post_hooks) == before + 1
    second.close()
    assert len(_global_optimizer_post_hooks) == before


ACCUMULATING_CRITIC = """
import torch
from torch import nn

torch.manual_seed(0)
G = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 8))
D = nn.Sequential(nn.Linear(8, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
opt_g = torch.optim.Adam(G.parameters(), 1e-4, betas=(0.0, 0.9))
opt_d = torch.optim.Adam(D.parameters(), 1e-4, betas=(0.0, 0.9))
for it in range(10):
    for micro in range(4):  # the critic accumulates two micro-batches per step
        with torch.no_grad():
            fake = G(torch.randn(32, 16))
        if micro % 2 == 0:
            opt_d.zero_grad()
        (D(fake).mean() - D(torch.randn(32, 8) + 1).mean()).div(2).backward()
        if micro % 2 == 1:
            opt_d.step()
    opt_g.zero_grad()
    (-D(G(torch.randn(32, 16))).mean()).backward()
    opt_g.step()
"""


def test_a_critic_accumulating_micro_batches_between_samples_is_silent_under_run(tmp_path):
    """Between two samples of the generator the critic ran a backward but no step:
    a backward of a watched model counts as well as a step (every model is watched
    under trainwatch run; with only the generator watched, the critic's backward is
    not seen, and the two samples still read as an evaluation)."""
    script = tmp_path / "critic.py"
    script.write_text(ACCUMULATING_CRITIC)
    run_script(script, [], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    assert [a for a in map(json.loads, lines) if a["rule"] == "eval_in_train_mode"] == []
