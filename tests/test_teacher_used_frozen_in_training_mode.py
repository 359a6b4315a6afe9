"""A teacher trained first, then distilled from in training mode, is told within a
few student steps, dated at the student's first step, with its own advice.

Knowledge distillation trains the teacher (its own optimizer), then calls it
under ``no_grad`` at every student step. Left in training mode, its dropout
makes the targets noisy. Its passes look like a GAN generator's sampled once per
critic step (another optimizer steps between two of them, none of its own); what
tells the teacher is that it trained alone (no other optimizer stepped during its
training) and its weights stay unchanged while the student steps. A mean
teacher moved by EMA, a teacher kept in eval mode and a generator (pretrained
alone first, or not) sampled between its critic's steps stay silent.
"""

from __future__ import annotations

import json
import sys

import pytest

import trainwatch as tw
from trainwatch.collect.eval_passes import FROZEN_AFTER
from trainwatch.runner import run_script

DISTIL = """
import sys
import torch
from torch import nn

teacher_in, student_steps = sys.argv[1], int(sys.argv[2])  # teacher_in: train, eval, ema
torch.manual_seed(0)


def net(width):
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Dropout(0.3), nn.Linear(width, 4))


teacher = net(64)
opt_t = torch.optim.Adam(teacher.parameters(), 1e-3)
for step in range(30):  # the teacher's own training
    x = torch.randn(32, 16)
    loss = nn.functional.cross_entropy(teacher(x), x[:, :4].argmax(1))
    opt_t.zero_grad()
    loss.backward()
    opt_t.step()
if teacher_in == "ema":  # a mean teacher: the student starts from it, it follows the student
    student = net(64)
    student.load_state_dict(teacher.state_dict())
else:
    student = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    teacher.requires_grad_(False)
if teacher_in == "eval":
    teacher.eval()
opt_s = torch.optim.Adam(student.parameters(), 1e-3)
for step in range(student_steps):
    x = torch.randn(32, 16)
    with torch.no_grad():
        target = teacher(x).softmax(-1)
    loss = nn.functional.kl_div(student(x).log_softmax(-1), target, reduction="batchmean")
    opt_s.zero_grad()
    loss.backward()
    opt_s.step()
    if teacher_in == "ema":
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), student.parameters()):
                t.mul_(0.99).add_(s, alpha=0.01)
"""


def _run(tmp_path, script: str, args: list[str]) -> list[dict]:
    path = tmp_path / "script.py"
    path.write_text(script)
    run_script(path, args, log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["rule"] == "eval_in_train_mode"]


def test_under_trainwatch_run_a_teacher_trained_then_distilled_from_in_training_mode(tmp_path):
    """Twelve student steps, far fewer than the passes an idle model is otherwise
    given: told as a frozen teacher, dated at the student's first step (not the
    teacher's own step count, 30), advising teacher.eval() for good."""
    (alert,) = _run(tmp_path, DISTIL, ["train", "12"])
    assert alert["step"] == 0 and alert["module"] == "2"
    assert alert["data"]["finding"] == "frozen model used in training mode"
    assert alert["data"]["trained_first"] is True
    assert "as a teacher or target" in alert["message"] and "noisy" in alert["message"]
    assert "teacher.eval()" in alert["hint"] and "no teacher.train() after" in alert["hint"]
    assert "evaluating" not in alert["hint"]


@pytest.mark.parametrize("teacher_in", ["eval", "ema"])
def test_under_trainwatch_run_a_teacher_in_eval_or_a_mean_teacher_is_silent(tmp_path, teacher_in):
    """Controls: the teacher kept in eval mode; a mean teacher in training mode on
    purpose, its weights following the student's by EMA at every step."""
    assert _run(tmp_path, DISTIL, [teacher_in, "12"]) == []


def test_the_teacher_is_told_within_a_few_student_steps():
    """Both models watched in this process: told at the student step whose teacher
    pass comes after FROZEN_AFTER student steps, dated at the first."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    student = nn.Sequential(nn.Linear(8, 4))
    opt_t = torch.optim.SGD(teacher.parameters(), 0.01)
    opt_s = torch.optim.SGD(student.parameters(), 0.01)
    monitors = [tw.watch(teacher, opt_t, console=False), tw.watch(student, opt_s, console=False)]
    try:
        for _ in range(25):
            x = torch.randn(16, 8)
            nn.functional.cross_entropy(teacher(x), x[:, :4].argmax(1)).backward()
            opt_t.step()
            opt_t.zero_grad()
        told_at = None
        for step in range(3 * FROZEN_AFTER):
            x = torch.randn(16, 8)
            with torch.no_grad():
                target = teacher(x)
            nn.functional.mse_loss(student(x), target).backward()
            opt_s.step()
            opt_s.zero_grad()
            if told_at is None and monitors[0].alerts:
                told_at = step
    finally:
        for monitor in monitors:
            monitor.close()
    assert told_at == FROZEN_AFTER
    (alert,) = [a for a in monitors[0].alerts if a.rule == "eval_in_train_mode"]
    assert alert.step == 0 and alert.data["finding"] == "frozen model used in training mode"


PRETRAINED_GAN = """
import torch
from torch import nn

torch.manual_seed(0)
G = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))
D = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
opt_g = torch.optim.Adam(G.parameters(), 1e-4, betas=(0.5, 0.9))
opt_d = torch.optim.Adam(D.parameters(), 1e-4, betas=(0.5, 0.9))
for step in range(30):  # the generator pretrained alone (a content loss), as SRGAN's is
    z = torch.randn(16, 8)
    loss = nn.functional.mse_loss(G(z), z[:, :2])
    opt_g.zero_grad()
    loss.backward()
    opt_g.step()
for it in range(6):
    for _ in range(5):  # WGAN's five critic steps, each on fakes drawn under no_grad
        with torch.no_grad():
            fake = G(torch.randn(16, 8))
        loss_d = D(fake).mean() - D(torch.randn(16, 2) + 1).mean()
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
    opt_g.zero_grad()
    (-D(G(torch.randn(16, 8))).mean()).backward()
    opt_g.step()
"""


def test_under_trainwatch_run_a_generator_pretrained_alone_then_sampled_by_its_critic_is_silent(
    tmp_path,
):
    """Control: trained alone first like a teacher, then sampled under no_grad in
    training mode for each of its critic's five steps: its own step comes before
    the critic's sixth, so its passes are training."""
    assert _run(tmp_path, PRETRAINED_GAN, []) == []


LOADED = """
import torch
from torch import nn

torch.manual_seed(0)
teacher = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 4))
teacher.load_state_dict({k: v.clone() for k, v in teacher.state_dict().items()})
teacher.requires_grad_(False)
student = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
opt_s = torch.optim.Adam(student.parameters(), 1e-3)
for step in range(12):
    x = torch.randn(32, 16)
    with torch.no_grad():
        target = teacher(x).softmax(-1)
    loss = nn.functional.kl_div(student(x).log_softmax(-1), target, reduction="batchmean")
    opt_s.zero_grad()
    loss.backward()
    opt_s.step()
"""


def test_under_trainwatch_run_a_loaded_teacher_in_training_mode_is_told_as_one(tmp_path):
    """Never trained here and with no optimizer: its passes in a row, one after each
    student step, are told at the third, as a frozen teacher's (not an evaluation's)."""
    (alert,) = _run(tmp_path, LOADED, [])
    assert alert["step"] == 0 and alert["module"] == "2"
    assert alert["data"]["finding"] == "frozen model used in training mode"
    assert alert["data"]["trained_first"] is False
    assert "teacher.eval()" in alert["hint"]


def test_three_evaluation_batches_of_a_loaded_model_are_still_an_evaluation(tmp_path):
    """Control: no optimizer steps between its passes: an evaluation loop."""
    script = LOADED.replace("for step in range(12):", "for step in range(0):") + (
        "\nwith torch.no_grad():\n    outs = [teacher(torch.randn(8, 16)) for _ in range(3)]\n"
    )
    (alert,) = _run(tmp_path, script, [])
    assert "finding" not in alert["data"] and "model.eval() before evaluating" in alert["hint"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
