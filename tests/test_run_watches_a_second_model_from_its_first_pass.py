"""A model built after the first one settled is watched from its first pass.

Under ``trainwatch run`` the global forward hooks that find models come off once
the models found train with their optimizers. A second model built after that
(a student distilled from the teacher trained first, the next fold's model) was
found only at its optimizer's first step, after that step's forward had run
unseen: a bug in its forward or loss (a ``broadcast`` of an ``(N, 1)`` output
against an ``(N,)`` target, a softmax given to ``kl_div``) was told at step 1.
Scripts build the optimizer before the model's first call, so an optimizer built
over parameters no model of ours holds turns the hooks on; they go off again
once the new model has stepped. An optimizer rebuilt over a watched model's
parameters (per epoch, by an LR finder, with new param groups) turns nothing on.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from torch.nn.modules import module as module_hooks
from torch.optim import Optimizer
from torch.optim import optimizer as optimizer_hooks

from trainwatch.runner import run_script

OPTIMIZER_INIT = Optimizer.__init__

# Prints the number of global forward hooks at a point of the script.
HOOKED = """
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules import module as hooks


def hooked(where):
    print(where, len(hooks._global_forward_hooks) + len(hooks._global_forward_pre_hooks))


def net():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


torch.manual_seed(0)
X = torch.randn(256, 8)
Y = X.sum(1)
"""

TWO_MODELS = (
    HOOKED
    + """
import sys

a = net()
opt_a = torch.optim.SGD(a.parameters(), lr=1e-2)
for _ in range(30):
    opt_a.zero_grad()
    F.mse_loss(a(X).squeeze(1), Y).backward()
    opt_a.step()
hooked("settled")
b = net()
opt_b = torch.optim.SGD(b.parameters(), lr=1e-2)
for step in range(20):
    opt_b.zero_grad()
    out = b(X)
    target = Y if sys.argv[1] == "bug" else Y.unsqueeze(1)  # (256,) against (256, 1)
    F.mse_loss(out, target).backward()
    opt_b.step()
    if step == 2:
        hooked("second trains")
"""
)

DISTILL = (
    HOOKED
    + """
import sys

labels = X[:, :5].argmax(1)
teacher = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 5))
student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
opt_t = torch.optim.Adam(teacher.parameters(), lr=1e-2)
for _ in range(30):
    opt_t.zero_grad()
    F.cross_entropy(teacher(X), labels).backward()
    opt_t.step()
teacher.eval()
opt = torch.optim.Adam(student.parameters(), lr=1e-2)
T = 2.0
for step in range(20):
    with torch.no_grad():
        soft = F.softmax(teacher(X) / T, dim=1)
    s = student(X)
    given = F.softmax(s / T, dim=1) if sys.argv[1] == "bug" else F.log_softmax(s / T, dim=1)
    loss = F.kl_div(given, soft, reduction="batchmean") * T * T
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 2:
        hooked("second trains")
"""
)

K_FOLD = (
    HOOKED
    + """
import sys

BUG_FOLD = int(sys.argv[1])
for fold in range(4):
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(6):
        opt.zero_grad()
        out = model(X)
        F.mse_loss(out if fold == BUG_FOLD else out.squeeze(1), Y).backward()
        opt.step()
    hooked(f"fold {fold} trained")
"""
)

REBUILT_OVER_THE_WATCHED_MODEL = (
    HOOKED
    + """
model = net()


def train(opt, steps):
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(X).squeeze(1), Y).backward()
        opt.step()


train(torch.optim.SGD(model.parameters(), lr=1e-2), 5)
hooked("settled")
for lr in (1e-4, 1e-3, 1e-2):  # an LR finder's loop
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    hooked("rebuilt")
    train(opt, 1)
opt = torch.optim.Adam(
    [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 1e-3}]
)
hooked("two groups")
opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
hooked("group added")
train(opt, 3)
"""
)

BUILT_BEFORE_ITS_MODULE = (
    HOOKED
    + """
import sys

a = net()
opt_a = torch.optim.SGD(a.parameters(), lr=1e-2)
for _ in range(5):
    opt_a.zero_grad()
    F.mse_loss(a(X).squeeze(1), Y).backward()
    opt_a.step()
w1 = nn.Parameter(torch.randn(16, 8) * 0.1)
w2 = nn.Parameter(torch.randn(1, 16) * 0.1)
opt = torch.optim.SGD([w1, w2], lr=1e-2)  # no module holds them yet


class Late(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = w1, w2

    def forward(self, x):
        return torch.relu(x @ self.w1.T) @ self.w2.T


late = Late()
for _ in range(6):
    opt.zero_grad()
    out = late(X)
    F.mse_loss(out if sys.argv[1] == "bug" else out.squeeze(1), Y).backward()
    opt.step()
hooked("late trained")
"""
)


@pytest.fixture(autouse=True)
def _no_hook_leaks():
    yield
    assert not module_hooks._global_forward_pre_hooks
    assert not module_hooks._global_forward_hooks
    assert not optimizer_hooks._global_optimizer_pre_hooks
    assert not optimizer_hooks._global_optimizer_post_hooks
    assert Optimizer.__init__ is OPTIMIZER_INIT


def _run(tmp_path: Path, body: str, *args: str) -> list[tuple[str, int, str]]:
    """The run's warnings and errors: (rule, step, model)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    assert run_script(script, args, log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [json.loads(line) for line in lines]
    told = [(a["rule"], a["step"], a["data"].get("model", "")) for a in found]
    return [t for t, a in zip(told, found) if a["severity"] in ("warning", "error")]


def test_a_second_models_broadcast_is_told_at_its_first_step(tmp_path, capsys):
    told = _run(tmp_path, TWO_MODELS, "bug")
    assert told == [("broadcast", 0, "Sequential#2")]
    out = capsys.readouterr().out
    assert "settled 0" in out
    assert "second trains 0" in out  # the hooks are off again once it steps


def test_two_healthy_models_in_sequence_are_silent_and_the_hooks_come_off(tmp_path, capsys):
    told = _run(tmp_path, TWO_MODELS, "clean")
    assert told == []
    out = capsys.readouterr().out
    assert "settled 0" in out
    assert "second trains 0" in out


def test_a_student_given_probabilities_by_kl_div_is_told_at_its_first_step(tmp_path, capsys):
    told = _run(tmp_path, DISTILL, "bug")
    assert told == [("loss_input", 0, "Sequential#2")]
    assert "second trains 0" in capsys.readouterr().out


def test_a_student_given_log_probabilities_by_kl_div_is_silent(tmp_path, capsys):
    told = _run(tmp_path, DISTILL, "clean")
    assert told == []
    assert "second trains 0" in capsys.readouterr().out


@pytest.mark.parametrize("bug_fold", [1, 3])
def test_a_later_folds_broadcast_is_told_at_its_first_step(tmp_path, capsys, bug_fold):
    told = _run(tmp_path, K_FOLD, str(bug_fold))
    assert [(rule, step) for rule, step, _ in told] == [("broadcast", 0)]
    out = capsys.readouterr().out
    assert all(f"fold {fold} trained 0" in out for fold in range(4))


def test_healthy_folds_are_silent_and_the_hooks_come_off_after_each(tmp_path, capsys):
    told = _run(tmp_path, K_FOLD, "-1")
    assert told == []
    out = capsys.readouterr().out
    assert all(f"fold {fold} trained 0" in out for fold in range(4))


def test_an_optimizer_rebuilt_over_the_watched_model_turns_no_hooks_on(tmp_path, capsys):
    told = _run(tmp_path, REBUILT_OVER_THE_WATCHED_MODEL)
    assert told == []
    out = capsys.readouterr().out
    for where in ("settled", "rebuilt", "two groups", "group added"):
        assert f"{where} 0" in out


@pytest.mark.parametrize("kind", ["bug", "clean"])
def test_an_optimizer_built_before_its_parameters_are_in_a_module_finds_its_model(
    tmp_path, capsys, kind
):
    """Its parameters are bare at the optimizer's building: the hooks go on, the
    module put around them later is found at its first call and watched."""
    told = _run(tmp_path, BUILT_BEFORE_ITS_MODULE, kind)
    assert told == ([("broadcast", 0, "Late")] if kind == "bug" else [])
    assert "late trained 0" in capsys.readouterr().out
