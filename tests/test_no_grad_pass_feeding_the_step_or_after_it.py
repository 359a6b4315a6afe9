"""Where a no-grad pass in training mode sits tells part of training from an evaluation.

Diffusion self-conditioning makes a first estimate under ``no_grad``, the model in
training mode on purpose, on a random half of the steps, and feeds it to the
training pass on the same noisy input: part of the step, though it does not
recur at every step (it was told as an evaluation). Full-batch training (one
optimizer step an epoch) validated every epoch without ``model.eval()`` runs its
validation pass at every step, after the optimizer step and before the next
training pass, on other data (another batch size): an evaluation, though it
recurs (it went untold). Rollouts under ``no_grad`` before each update, and
pseudo-labels switched on after a warm-up, stay silent; so does the same
full-batch loop with ``model.eval()``.
"""

from __future__ import annotations

import json
import sys

import pytest

from trainwatch.collect.eval_passes import EvalPassJudge
from trainwatch.record import StepRecord
from trainwatch.runner import run_script

SCRIPT = """
import random
import sys
import torch
from torch import nn
import torch.nn.functional as F

case = sys.argv[1]
torch.manual_seed(0)
random.seed(0)
monitors = []


def watch(model, opt):
    if len(sys.argv) > 2:
        import trainwatch as tw

        monitors.append(tw.watch(model, opt, console=False))


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 64)
        self.mid = nn.Sequential(nn.SiLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.SiLU())
        self.out = nn.Linear(64, 2)

    def forward(self, x, t, x_self_cond=None):
        if x_self_cond is None:
            x_self_cond = torch.zeros_like(x)
        return self.out(self.mid(self.inp(torch.cat([x, x_self_cond, t[:, None]], 1))))


class ConvDenoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.SiLU(),
            nn.Conv2d(16, 1, 3, padding=1),
        )

    def forward(self, x, t, self_cond=None):
        if self_cond is None:
            self_cond = torch.zeros_like(x)
        level = t[:, None, None, None].expand_as(x)
        return self.net(torch.cat([x, self_cond, level], 1))


if case.startswith("selfcond"):
    conv = case == "selfcond_conv"
    model = ConvDenoiser() if conv else Denoiser()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    watch(model, opt)
    x_val = torch.randn(50, 1, 8, 8) if conv else torch.randn(50, 2)
    for step in range(30):
        x0 = torch.randn(16, 1, 8, 8) if conv else torch.randn(64, 2)
        t = torch.rand(len(x0))
        noise = torch.randn_like(x0)
        level = t.view(-1, *[1] * (x0.dim() - 1))
        xt = (1 - level) * x0 + level * noise
        x_sc = None
        if random.random() < 0.5:
            with torch.no_grad():  # in training mode on purpose
                if case == "selfcond_val":  # a validation batch instead, fed to nothing
                    model(x_val, torch.rand(50))
                else:
                    x_sc = model(xt, t).detach()
        out = model(xt, t, self_cond=x_sc) if conv else model(xt, t, x_sc)
        loss = F.mse_loss(out, x0)
        opt.zero_grad()
        loss.backward()
        opt.step()

elif case.startswith("fullbatch"):
    # One optimizer step an epoch; a validation pass after each.
    X = torch.randn(500, 16)
    if case.startswith("fullbatch_bn"):
        y = X[:, :4].sum(1, keepdim=True)
        model = nn.Sequential(
            nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1)
        )
        loss_of = F.mse_loss
    else:
        y = X[:, :3].argmax(1)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 3))
        loss_of = F.cross_entropy
        with torch.no_grad():  # a shape check, before training
            assert model(torch.zeros(2, 16)).shape == (2, 3)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    watch(model, opt)
    for epoch in range(40):
        model.train()
        opt.zero_grad()
        loss_of(model(X[:400]), y[:400]).backward()
        opt.step()
        if case.endswith("_eval"):
            model.eval()
        with torch.no_grad():
            val = loss_of(model(X[400:]), y[400:]).item()

elif case.startswith("rollout"):
    # On-policy updates: a few actions under no_grad (dropout left on), then an update.
    envs = 8 if case == "rollout_vec" else 1
    policy = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 2))
    opt = torch.optim.Adam(policy.parameters(), 1e-3)
    watch(policy, opt)
    for update in range(30):
        observations, actions = [], []
        obs = torch.randn(envs, 4)
        for _ in range(4):
            with torch.no_grad():
                logits = policy(obs)
            actions.append(torch.distributions.Categorical(logits=logits).sample())
            observations.append(obs)
            obs = 0.9 * obs + 0.1 * torch.randn(envs, 4)
        log_probs = policy(torch.cat(observations)).log_softmax(-1)
        chosen = log_probs.gather(1, torch.cat(actions)[:, None])
        opt.zero_grad()
        (-chosen.mean()).backward()
        opt.step()

elif case == "pseudo_warmup":
    # Pseudo-labels of the weak view, made under no_grad before the training passes,
    # switched on after a warm-up of supervised steps (batch norm on purpose).
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    watch(model, opt)
    for step in range(30):
        labelled, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        unlabelled = torch.randn(64, 16)
        loss = 0.0
        if step >= 8:
            with torch.no_grad():
                pseudo = model(unlabelled).argmax(-1)
        loss = F.cross_entropy(model(labelled), y)
        if step >= 8:
            strong = model(unlabelled + 0.5 * torch.randn_like(unlabelled))
            loss = loss + F.cross_entropy(strong, pseudo)
        opt.zero_grad()
        loss.backward()
        opt.step()

for m in monitors:
    m.close()
"""

# case: the (step, module) of each eval_in_train_mode warning told.
CASES = [
    ("selfcond", []),
    ("selfcond_conv", []),
    ("selfcond_val", [(2, "mid.1")]),  # the first step drawing one
    ("fullbatch_bn", [(1, "1")]),
    ("fullbatch_bn_eval", []),
    ("fullbatch_dropout", [(1, "2")]),
    ("fullbatch_dropout_eval", []),
    ("rollout", []),
    ("rollout_vec", []),
    ("pseudo_warmup", []),
]


def _watched(case: str) -> list[tuple[int, str]]:
    argv = sys.argv
    sys.argv = ["loop.py", case, "watch"]
    try:
        namespace: dict = {"__name__": "__main__"}
        exec(compile(SCRIPT, "loop.py", "exec"), namespace)
    finally:
        sys.argv = argv
    return [
        (a.step, a.module) for m in namespace["monitors"] for a in m.alerts if a.severity != "info"
    ]


@pytest.mark.parametrize(("case", "expected"), CASES)
def test_under_watch(case, expected):
    told = _watched(case)
    assert told == [(step, module) for step, module in expected]


@pytest.mark.parametrize(("case", "expected"), [c for c in CASES if c[0] != "selfcond_conv"])
def test_under_trainwatch_run(tmp_path, case, expected):
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    run_script(script, [case], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    alerts = [json.loads(line) for line in lines]
    found = [(a["step"], a["module"]) for a in alerts if a["severity"] != "info"]
    assert found == expected


def _judged(pattern, steps: int = 20) -> list[int]:
    """A trained model's steps as the judge sees them: each a string of passes
    ('t': a training pass, 'n': a no-grad pass, 'f': a training pass fed by the
    no-grad pass before it), with each pass's batch size; the steps told."""
    judge = EvalPassJudge()
    told = []
    for step in range(steps):
        for kind, rows in pattern(step):
            if kind == "n":
                record = StepRecord(step=step, source="forward")
                told += [r.step for r in judge.nograd_pass(record, rows=rows)]
            else:
                judge.training_pass((step, step), kind == "f", rows)
        told += [r.step for r in judge.step_boundary()]
    return told


def test_a_pass_of_other_data_after_each_step_is_an_evaluation():
    # Full-batch training validated after each step: the first validation told,
    # with the step it followed.
    told = _judged(lambda step: [("t", 400)] if step == 0 else [("n", 100), ("t", 400)])
    assert told[0] == 1 and set(told) == set(range(1, 20))


def test_the_same_pass_in_the_model_s_first_step_is_the_loop_s_own():
    # Pseudo-labels or rollouts from the first step on: part of the iteration.
    assert _judged(lambda step: [("n", 100), ("t", 400)]) == []


def test_a_pass_of_a_training_pass_s_batch_size_is_not_told_so():
    # Pseudo-labels switched on after a warm-up, of the strong view's batch size.
    pattern = [("n", 64), ("t", 32), ("t", 64)]
    assert _judged(lambda step: [("t", 32)] if step < 5 else pattern) == []


def test_a_pass_after_the_step_s_training_passes_is_not_after_the_optimizer_step():
    # A double-DQN target's pass after the training pass, switched on later.
    assert _judged(lambda step: [("t", 32)] if step < 5 else [("t", 32), ("n", 100)]) == []


def test_a_pass_feeding_the_training_pass_on_random_steps_is_training():
    # Self-conditioning: on some steps only, its estimate fed to the training pass.
    assert _judged(lambda step: [("n", 64), ("f", 64)] if step % 3 else [("t", 64)]) == []


def test_a_validation_pass_before_a_feeding_pass_is_still_told():
    told = _judged(lambda step: [("n", 50), ("n", 64), ("f", 64)] if step == 7 else [("t", 64)])
    assert told == [7]
