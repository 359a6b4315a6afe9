"""accumulated_gradient without an optimizer: hand-written updates that never reset
the gradients are caught at the first backward that adds onto used ones.

Both update styles (``p.data.add_(p.grad, alpha=-lr)``, which leaves the
parameter's version counter alone, and ``p -= lr * p.grad`` under
``no_grad``), under ``tw.watch(model)`` with ``monitor.step()`` and under
``trainwatch run`` on unmodified scripts (an MLP, a CNN, a batch-of-one
policy-gradient loop). Every way of resetting, and legitimate accumulation
(several backward passes, one update, then a reset), stays silent.
"""

from __future__ import annotations

import io
import sys

import pytest
import torch
from torch import nn

import trainwatch as tw
from tests.conftest import TinyNet, batches
from tests.test_run import alerts as run_alerts
from tests.test_run import write
from trainwatch.runner import run_script

STYLES = ["data_add", "no_grad_sub"]
RESETS = ["grad_none", "grad_zero_", "model_zero_grad"]


def _update(model: nn.Module, style: str, lr: float = 0.05) -> None:
    if style == "data_add":
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
    else:
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad


def _reset(model: nn.Module, how: str | None) -> None:
    if how == "grad_none":
        for p in model.parameters():
            p.grad = None
    elif how == "grad_zero_":
        for p in model.parameters():
            p.grad.zero_()
    elif how == "model_zero_grad":
        model.zero_grad()


def _watched_loop(
    style: str,
    reset: str | None,
    *,
    updates: int = 5,
    accumulate: int = 1,
    step_each_backward: bool = False,
) -> tw.Monitor:
    """tw.watch(model) with no optimizer; monitor.step() after each update (or backward)."""
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(updates * accumulate)
    with tw.watch(model, console=io.StringIO()) as monitor:
        for _ in range(updates):
            for _ in range(accumulate):
                x, y = next(data)
                loss = nn.functional.mse_loss(model(x), y) / accumulate
                loss.backward()
                if step_each_backward:
                    monitor.step(loss=loss)
            _update(model, style)
            _reset(model, reset)
            if not step_each_backward:
                monitor.step(loss=loss)
    return monitor


def _accumulated(alerts) -> list:
    return [a for a in alerts if a.rule == "accumulated_gradient"]


# -- tw.watch(model), monitor.step() --------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_watched_hand_written_update_without_reset_fires_at_the_first_reuse(style):
    monitor = _watched_loop(style, None)
    (alert,) = _accumulated(monitor.alerts)
    assert (alert.step, alert.severity, alert.module) == (1, "error", None)
    assert alert.data["modules"] == ["fc1", "fc2", "head"]
    assert "p.grad = None" in alert.hint and "weights changed" in alert.message


@pytest.mark.parametrize("reset", RESETS)
@pytest.mark.parametrize("style", STYLES)
def test_watched_hand_written_update_with_a_reset_is_clean(style, reset):
    assert _watched_loop(style, reset).alerts == []


@pytest.mark.parametrize("step_each_backward", [False, True], ids=["per_update", "per_backward"])
@pytest.mark.parametrize("style", STYLES)
def test_watched_accumulation_then_one_update_then_reset_is_clean(style, step_each_backward):
    monitor = _watched_loop(
        style, "model_zero_grad", accumulate=3, step_each_backward=step_each_backward
    )
    assert monitor.alerts == []


@pytest.mark.parametrize("style", STYLES)
def test_watched_accumulation_that_never_resets_fires_after_the_first_update(style):
    monitor = _watched_loop(style, None, accumulate=3, step_each_backward=True)
    (alert,) = _accumulated(monitor.alerts)
    assert alert.step == 3  # the first backward after the update that ended step 2


# -- trainwatch run: unmodified scripts ------------------------------------------------

CNN = """
import sys
import torch
from torch import nn

style, reset = sys.argv[1], sys.argv[2]
accumulate = int(sys.argv[3]) if len(sys.argv) > 3 else 1
clip = len(sys.argv) > 4 and sys.argv[4] == "clip"
torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
)
lr = 0.05
for update in range(4):
    for _ in range(accumulate):
        x = torch.randn(8, 1, 6, 6)
        y = torch.randint(0, 3, (8,))
        (nn.functional.cross_entropy(model(x), y) / accumulate).backward()
    if clip:  # rescales the gradients in place (word_language_model's loop)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    if style == "data_add":
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
    else:
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    if reset == "grad_none":
        for p in model.parameters():
            p.grad = None
    elif reset == "grad_zero_":
        for p in model.parameters():
            p.grad.zero_()
    elif reset == "model_zero_grad":
        model.zero_grad()
    elif reset == "zero_grad_in_place":
        model.zero_grad(set_to_none=False)
print("done")
"""

# REINFORCE on a two-armed bandit, one action per backward: the policy's
# gradients are summed over an episode, then applied by hand.
POLICY = """
import sys
import torch
from torch import nn

style, reset = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
policy = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
lr = 0.1
for episode in range(4):
    for t in range(3):  # batch of one, one backward per action
        state = torch.randn(1, 4)
        dist = torch.distributions.Categorical(logits=policy(state))
        action = dist.sample()
        reward = 1.0 if action.item() == 0 else -1.0
        (-dist.log_prob(action) * reward).sum().backward()
    if style == "data_add":
        for p in policy.parameters():
            p.data.add_(p.grad, alpha=-lr)
    else:
        with torch.no_grad():
            for p in policy.parameters():
                p -= lr * p.grad
    if reset == "grad_none":
        for p in policy.parameters():
            p.grad = None
    elif reset == "model_zero_grad":
        policy.zero_grad()
print("done")
"""


@pytest.fixture
def _forget_netdef():
    yield
    sys.modules.pop("netdef", None)


def _run(tmp_path, body: str, *args: str) -> list[dict]:
    script = write(tmp_path, "train.py", body)
    assert run_script(script, list(args), log_dir=tmp_path / "log", console=False) == 0
    return [a for a in run_alerts(tmp_path / "log") if a["severity"] != "info"]


@pytest.mark.parametrize("style", STYLES)
def test_run_cnn_hand_written_update_without_reset_fires(tmp_path, _forget_netdef, style):
    """Each backward's end is a step: step 1's backward adds onto the gradients the
    first update used; the second update re-applies them, and step 2's backward
    confirms it. The alert keeps step 1, as under tw.watch."""
    found = _run(tmp_path, CNN, style, "missing")
    assert [(a["rule"], a["step"]) for a in found] == [("accumulated_gradient", 1)]
    assert found[0]["data"]["modules"] == ["0", "3"]


@pytest.mark.parametrize("reset", RESETS)
@pytest.mark.parametrize("style", STYLES)
def test_run_cnn_hand_written_update_with_a_reset_is_clean(tmp_path, _forget_netdef, style, reset):
    assert _run(tmp_path, CNN, style, reset) == []


@pytest.mark.parametrize("style", STYLES)
def test_run_cnn_clipped_hand_written_update_without_reset_fires(tmp_path, _forget_netdef, style):
    """The clip rescales the used gradients in place after the step was marked at
    backward's end: a moved version counter, yet nothing was reset."""
    found = _run(tmp_path, CNN, style, "missing", "1", "clip")
    assert [(a["rule"], a["step"]) for a in found] == [("accumulated_gradient", 1)]


@pytest.mark.parametrize("reset", [*RESETS, "zero_grad_in_place"])
@pytest.mark.parametrize("style", STYLES)
def test_run_cnn_clipped_hand_written_update_with_a_reset_is_clean(
    tmp_path, _forget_netdef, style, reset
):
    assert _run(tmp_path, CNN, style, reset, "1", "clip") == []


@pytest.mark.parametrize("style", STYLES)
def test_run_cnn_accumulation_then_one_update_is_clean(tmp_path, _forget_netdef, style):
    """Each backward is a step under `trainwatch run`: three in a row add onto one another."""
    assert _run(tmp_path, CNN, style, "model_zero_grad", "3") == []


@pytest.mark.parametrize("style", STYLES)
def test_run_cnn_accumulation_without_reset_fires_after_the_first_update(
    tmp_path, _forget_netdef, style
):
    found = _run(tmp_path, CNN, style, "missing", "3")
    # Backward passes 0-2, update, 3-5 (added onto used gradients), update, 6
    # (confirmed): dated at 3, the first backward onto used gradients.
    assert [(a["rule"], a["step"]) for a in found] == [("accumulated_gradient", 3)]


@pytest.mark.parametrize("style", STYLES)
def test_run_policy_gradient_episode_without_reset_fires(tmp_path, _forget_netdef, style):
    found = _run(tmp_path, POLICY, style, "missing")
    assert [(a["rule"], a["step"]) for a in found] == [("accumulated_gradient", 3)]


@pytest.mark.parametrize("reset", ["grad_none", "model_zero_grad"])
@pytest.mark.parametrize("style", STYLES)
def test_run_policy_gradient_episode_with_a_reset_is_clean(tmp_path, _forget_netdef, style, reset):
    assert _run(tmp_path, POLICY, style, reset) == []


# -- the resets above must not read as dead layers; a dead layer still does ------------


def test_watched_gradients_zeroed_before_monitor_step_are_no_zero_gradient():
    """p.grad.zero_() before monitor.step() leaves all-zero gradients: a reset."""
    monitor = _watched_loop("data_add", "grad_zero_")
    assert [a.rule for a in monitor.alerts] == []


def test_watched_dead_layer_with_clipping_before_monitor_step_is_still_reported():
    """Clipping rewrites every gradient in place, yet the live ones stay non-zero."""
    torch.manual_seed(0)
    model = TinyNet()
    model.zero_fc2 = True  # fc2's output is multiplied by zero: fc1 and fc2 get zeros
    with tw.watch(model, console=io.StringIO()) as monitor:
        for x, y in batches(4):
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            _update(model, "no_grad_sub")
            monitor.step()
    zeros = {a.module for a in monitor.alerts if a.rule == "zero_gradient"}
    assert {"fc1", "fc2"} <= zeros  # (head.weight too: its input is all zeros)


# A GAN trained by hand: the generator's loss adds onto the discriminator's
# gradients after the discriminator's update; they are reset before its next one.
GAN = """
import sys
import torch
from torch import nn

reset_d = sys.argv[1] == "reset"
torch.manual_seed(0)
G = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2))
D = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))
for it in range(5):
    real = torch.randn(16, 2) + 3.0
    fake = G(torch.randn(16, 2))
    if reset_d:
        for p in D.parameters():
            p.grad = None
    softplus = nn.functional.softplus
    d_loss = softplus(-D(real)).mean() + softplus(D(fake.detach())).mean()
    d_loss.backward()
    with torch.no_grad():
        for p in D.parameters():
            p -= 0.01 * p.grad
    G.zero_grad()
    nn.functional.softplus(-D(fake)).mean().backward()
    with torch.no_grad():
        for p in G.parameters():
            p -= 0.01 * p.grad
print("done")
"""


def test_run_hand_written_gan_resetting_before_each_update_is_clean(tmp_path, _forget_netdef):
    assert _run(tmp_path, GAN, "reset") == []


def test_run_hand_written_gan_never_resetting_the_discriminator_fires(tmp_path, _forget_netdef):
    found = _run(tmp_path, GAN, "missing")
    # D's steps end at its own backward (0), G's backward through it (1), its own
    # (2), G's (3): the update between 2 and 3 re-applied what step 0 had used. The
    # alert is dated at the first backward onto used gradients, G's at step 1 (one
    # a GAN that resets them before D's next update makes too: only step 3 tells).
    assert [(a["rule"], a["data"]["model"], a["step"]) for a in found] == [
        ("accumulated_gradient", "Sequential#2", 1)
    ]
