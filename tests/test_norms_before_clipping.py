"""A plain loop's ``clip_grad_norm_``: the gradients are read before it rescales them.

Read after clipping (in the optimizer's step pre-hook), a gradient that jumped
a thousandfold reads as the clip threshold, and exploding_gradient never
fires: the loop most in need of it (the one that clips) was the one it could
not see. Each planted bug has its clean control beside it.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import clip_grad

import trainwatch as tw
from tests.test_run import alerts as logged_alerts
from trainwatch import clip_hook
from trainwatch.runner import run_script


def _regression(step: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, 20, generator=g)
    return x, torch.sin(x[:, :1] * 2)


def _two_groups(model: nn.Sequential) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}],
        lr=0.02,
        momentum=0.9,
    )


def _clipped_loop(jump_at: int | None, steps: int = 90, max_norm: float = 1.0):
    """Plain SGD with clipping; from ``jump_at`` the head's learning rate is 100x."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = _two_groups(model)
    before_clip: list[float] = []
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for step in range(steps):
            if step == jump_at:
                opt.param_groups[1]["lr"] = 2.0
            x, y = _regression(step)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            before_clip.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
            opt.step()
            assert monitor.total_grad_norm == pytest.approx(before_clip[-1], rel=1e-4)
    return monitor, before_clip


def test_a_learning_rate_jump_is_caught_through_clip_grad_norm():
    monitor, before_clip = _clipped_loop(jump_at=60)
    assert max(before_clip[61:]) > 50 * max(before_clip[40:60])  # the jump clipping hid
    # At step 61 the first layer's norm is 37x its past (under the 50x bar),
    # at step 62 113x.
    exploding = [a for a in monitor.alerts if a.rule == "exploding_gradient"]
    assert exploding and (exploding[0].step, exploding[0].module) == (62, "0")


def test_a_clipped_healthy_run_is_silent_and_its_norms_are_the_unclipped_ones():
    monitor, before_clip = _clipped_loop(jump_at=None, max_norm=0.05)
    assert [a.key for a in monitor.alerts] == []
    assert min(before_clip) > 0.05  # every step was clipped; the norms read were not


def test_accumulated_micro_batches_are_read_once_before_the_clip():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for step in range(40):
            opt.zero_grad()
            for micro in range(4):
                x, y = _regression(step * 4 + micro, n=16)
                (F.mse_loss(model(x), y) / 4).backward()
            total = float(nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
            opt.step()
            assert monitor.total_grad_norm == pytest.approx(total, rel=1e-4)
    assert [a.key for a in monitor.alerts] == []
    assert monitor.step_count == 40


def test_with_a_grad_scaler_the_norms_are_read_unscaled_before_the_clip():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    with tw.watch(model, opt, scaler=scaler, console=io.StringIO()) as monitor:
        for step in range(20):
            x, y = _regression(step)
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y)).backward()
            scaler.unscale_(opt)
            total = float(nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
            scaler.step(opt)
            scaler.update()
            assert monitor.total_grad_norm == pytest.approx(total, rel=1e-4)
    assert [a.key for a in monitor.alerts] == []


def test_overflowing_scaled_steps_that_the_scaler_skips_stay_silent():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # A scale fp32 gradients overflow at: the first steps are skipped, halving it.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=1000)
    with tw.watch(model, opt, scaler=scaler, console=io.StringIO()) as monitor:
        for step in range(30):
            x, y = _regression(step)
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y) * 1e3).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() < 2.0**127  # steps were skipped
    assert monitor.step_count > 0
    assert [a.key for a in monitor.alerts if a.severity != "info"] == []


def test_clipping_one_of_two_optimizers_gathers_that_one_only():
    """A GAN-like loop: each half clipped before its own step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 1))
    body = torch.optim.SGD(model[0].parameters(), lr=0.01)
    head = torch.optim.SGD(model[2].parameters(), lr=0.01)
    with tw.watch(model, [body, head], console=io.StringIO()) as monitor:
        for step in range(20):
            x, y = _regression(step)
            body.zero_grad()
            head.zero_grad()
            F.mse_loss(model(x), y).backward()
            body_total = float(nn.utils.clip_grad_norm_(model[0].parameters(), 1e-4))
            body.step()
            head_total = float(nn.utils.clip_grad_norm_(model[2].parameters(), 1e-4))
            head.step()
            norms = monitor.grad_norms()
            assert norms["0"] == pytest.approx(body_total, rel=1e-4)
            assert norms["2"] == pytest.approx(head_total, rel=1e-4)
    assert [a.key for a in monitor.alerts] == []


def test_the_clip_wrapper_comes_off_when_the_last_monitor_closes():
    original = clip_grad._clip_grads_with_norm_
    model = nn.Linear(4, 1)
    first = tw.watch(model, torch.optim.SGD(model.parameters(), lr=0.1), console=False)
    other = nn.Linear(4, 1)
    second = tw.watch(other, torch.optim.SGD(other.parameters(), lr=0.1), console=False)
    assert clip_hook.installed() and clip_grad._clip_grads_with_norm_ is not original
    first.close()
    assert clip_hook.installed()
    second.close()
    assert not clip_hook.installed()
    assert clip_grad._clip_grads_with_norm_ is original


def test_clipping_an_unwatched_model_is_left_alone():
    watched, unwatched = nn.Linear(4, 1), nn.Linear(4, 1)
    opt = torch.optim.SGD(watched.parameters(), lr=0.1)
    with tw.watch(watched, opt, console=False) as monitor:
        unwatched(torch.randn(8, 4)).sum().backward()
        before = torch.cat([p.grad.flatten() for p in unwatched.parameters()]).norm().item()
        total = nn.utils.clip_grad_norm_(unwatched.parameters(), 1e-3)
        assert float(total) == pytest.approx(before, rel=1e-5)
        assert unwatched.weight.grad.norm().item() <= 1e-3 + 1e-6
    assert monitor.step_count == 0


CLIPPED_LOOP = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 1))
opt = torch.optim.SGD(
    [{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.02, momentum=0.9
)
for step in range(80):
    if step == 60:
        opt.param_groups[1]["lr"] = 2.0
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 20, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), torch.sin(x[:, :1] * 2)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
"""


def test_trainwatch_run_sees_an_unmodified_scripts_gradients_before_its_clip(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(CLIPPED_LOOP)
    run_script(script, [], log_dir=tmp_path / "log")
    found = [(a["rule"], a["step"]) for a in logged_alerts(tmp_path / "log")]
    assert found and found[0] == ("exploding_gradient", 62)


def test_trainwatch_run_on_the_clipped_script_without_the_jump_is_silent(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(CLIPPED_LOOP.replace("step == 60", "step == -1"))
    run_script(script, [], log_dir=tmp_path / "log", fail_on="warning")
    assert logged_alerts(tmp_path / "log") == []
