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


DISTILLATION = """
import sys
import torch
from torch import nn

steps, teacher_in = int(sys.argv[1]), sys.argv[2]  # teacher_in: train (the bug) or eval
watch = len(sys.argv) > 3 and sys.argv[3] == "watch"
pretrain = int(sys.argv[4]) if len(sys.argv) > 4 else 0  # teacher steps before distilling
# Another optimizer (not watched) steps beside each of the teacher's: not trained alone.
alongside = len(sys.argv) > 5 and sys.argv[5] == "alongside"
side = torch.zeros(4, requires_grad=True)
opt_side = torch.optim.SGD([side], 0.1)
torch.manual_seed(0)
teacher = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 4))
student = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
# Built over the teacher (as if to fine-tune it first, or loaded from a checkpoint
# with it), never stepped: the teacher never trains here.
opt_t = torch.optim.Adam(teacher.parameters(), 1e-3)
opt_s = torch.optim.Adam(student.parameters(), 1e-3)
monitors, told_before_close = [], []
if watch:
    import trainwatch as tw

    monitors = [tw.watch(teacher, opt_t, console=False), tw.watch(student, opt_s, console=False)]
for step in range(pretrain):
    x = torch.randn(32, 16)
    loss = nn.functional.cross_entropy(teacher(x), x[:, :4].argmax(1))
    opt_t.zero_grad()
    loss.backward()
    opt_t.step()
    if alongside:
        side.sum().backward()
        opt_side.step()
if teacher_in == "eval":
    teacher.eval()
for step in range(steps):
    x = torch.randn(32, 16)
    with torch.no_grad():
        target = teacher(x).softmax(-1)
    loss = nn.functional.kl_div(student(x).log_softmax(-1), target, reduction="batchmean")
    opt_s.zero_grad()
    loss.backward()
    opt_s.step()
told_before_close = [(a.step, a.module) for m in monitors for a in m.alerts]
for monitor in monitors:
    monitor.close()
"""


def _distil(
    steps: int, teacher_in: str, pretrain: int = 0, alongside: bool = False
) -> tuple[list, list]:
    """The distillation loop with teacher and student watched (the teacher trained
    ``pretrain`` steps first, ``alongside`` another optimizer's): what the teacher's
    monitor told of eval_in_train_mode before its close, and by the end."""
    argv = sys.argv
    sys.argv = ["distil.py", str(steps), teacher_in, "watch", str(pretrain)]
    sys.argv += ["alongside"] if alongside else []
    try:
        namespace: dict = {"__name__": "__main__"}
        exec(compile(DISTILLATION, "distil.py", "exec"), namespace)
    finally:
        sys.argv = argv
    teacher = namespace["monitors"][0]
    told = [(a.step, a.module) for a in teacher.alerts if a.rule == "eval_in_train_mode"]
    return namespace["told_before_close"], told


@pytest.mark.parametrize("teacher_in", ["train", "eval"])
def test_a_teacher_whose_own_optimizer_never_steps_is_told_at_close_with_its_first_step(
    teacher_in,
):
    """Sampled under no_grad once per student step, as a generator is per critic step,
    but never trained: the student's steps between its passes do not make them
    training. A short run is certain only at close; dated at the first pass."""
    before_close, told = _distil(40, teacher_in)
    assert before_close == []
    assert told == ([(0, "2")] if teacher_in == "train" else [])


@pytest.mark.parametrize("teacher_in", ["train", "eval"])
def test_a_teacher_whose_optimizer_stays_idle_is_told_during_a_long_run(teacher_in):
    """Once IDLE_PASSES of them have come with no training pass of its own, its
    optimizer is idle: told then, before the run ends, with the first pass's step."""
    from trainwatch.collect.eval_passes import IDLE_PASSES

    before_close, told = _distil(IDLE_PASSES + 5, teacher_in)
    assert before_close == told == ([(0, "2")] if teacher_in == "train" else [])


@pytest.mark.parametrize("alongside", [False, True], ids=["trained_alone", "beside_another"])
@pytest.mark.parametrize("teacher_in", ["train", "eval"])
def test_a_teacher_trained_then_left_idle_is_told_during_a_long_run(teacher_in, alongside):
    """Trained 40 steps, then sampled under no_grad once per student step with its
    optimizer idle: its own step boundaries stopped, so the passes it holds would
    wait for close, one record each. Trained alone, it is told within a few
    student steps; with another optimizer stepping beside its training (as a
    generator's critic does), once IDLE_PASSES of them have come. Either way
    before close, dated at the student's first step, not at its own 40."""
    from trainwatch.collect.eval_passes import IDLE_PASSES

    before_close, told = _distil(IDLE_PASSES + 5, teacher_in, pretrain=40, alongside=alongside)
    assert before_close == told == ([(0, "2")] if teacher_in == "train" else [])


@pytest.mark.parametrize(("teacher_in", "expected"), [("train", [(0, "2")]), ("eval", [])])
def test_under_trainwatch_run_the_teacher_with_an_idle_optimizer(tmp_path, teacher_in, expected):
    script = tmp_path / "distil.py"
    script.write_text(DISTILLATION)
    run_script(script, ["40", teacher_in], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [
        (a["step"], a["module"])
        for a in map(json.loads, lines)
        if a["rule"] == "eval_in_train_mode"
    ]
    assert found == expected


WGAN_WARM_UP = """
import torch
from torch import nn

torch.manual_seed(0)
G = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))
D = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
opt_g = torch.optim.RMSprop(G.parameters(), 5e-5)
opt_d = torch.optim.RMSprop(D.parameters(), 5e-5)
for it in range(3):
    for _ in range(100):  # the original WGAN's warm-up: a hundred critic steps each
        with torch.no_grad():
            fake = G(torch.randn(16, 8))
        loss_d = D(fake).mean() - D(torch.randn(16, 2) + 1).mean()
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        for p in D.parameters():
            p.data.clamp_(-0.01, 0.01)
    opt_g.zero_grad()
    (-D(G(torch.randn(16, 8))).mean()).backward()
    opt_g.step()
"""


def test_a_generator_sampled_a_hundred_critic_steps_before_its_first_step_is_silent(tmp_path):
    """Control beside the idle teacher: the generator's passes before its first
    training pass look the same, and its first training pass lets them go."""
    script = tmp_path / "wgan.py"
    script.write_text(WGAN_WARM_UP)
    run_script(script, [], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    assert [a for a in map(json.loads, lines) if a["rule"] == "eval_in_train_mode"] == []


@pytest.mark.parametrize("critic_steps", [1, 2, 5, 19])
def test_a_smoke_run_stopped_before_the_generators_first_step_is_silent(tmp_path, critic_steps):
    """Samples of a generator with an optimizer of its own, the run stopped before the
    generator's first step (``--max-steps``; WGAN-GP takes five critic steps a
    generator step): it may still train, so they are no evaluation at close, unlike
    an SWA copy's; twenty or more are an idle optimizer's (the teacher's above)."""
    script = tmp_path / "wgan.py"
    script.write_text(WGAN_WARM_UP.replace("range(100)", f"range({critic_steps})"))
    run_script(script, [], log_dir=tmp_path / "log", console=False, max_steps=critic_steps)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    assert [a for a in map(json.loads, lines) if a["rule"] == "eval_in_train_mode"] == []
