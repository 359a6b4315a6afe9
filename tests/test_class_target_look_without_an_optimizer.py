"""A loop that updates its weights by hand (no optimizer: ``monitor.step()`` after
each update, or ``trainwatch run``, whose steps end at backward) gets the class
target look as an optimizer's loop does: label-sorted batches are told, shuffled
ones are not, and the look's function mode comes off at each step boundary.

The step boundary of such a loop is counted before it is gathered; the look
used to turn to the next step first, so the sampled step's targets were never
taken and its mode stayed on over every later step, every torch call of the
loop (the hand-written update's included) passing through it.
"""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack

import trainwatch as tw
from tests.test_run import alerts as run_alerts
from tests.test_run import cli

RULE = "unshuffled_data"
CLASSES = 10
PER_CLASS = 64
BATCH = 8


def labelled(sort: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(CLASSES).repeat_interleave(PER_CLASS)
    x = torch.randn(len(y), 12, generator=gen) + y[:, None].float() * 0.1
    if not sort:
        order = torch.randperm(len(y), generator=gen)
        x, y = x[order], y[order]
    return x, y


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def hand_sgd(model: nn.Module, lr: float = 0.05) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    model.zero_grad(set_to_none=True)


def fit_by_hand(sort: bool, steps: int = 60) -> tuple[list, list[int]]:
    """Alerts, and the function modes found on at the start of each step."""
    x, y = labelled(sort)
    model = mlp()
    monitor = tw.watch(model, console=io.StringIO())
    left_on = []
    for i in range(steps):
        left_on.append(len(_get_current_function_mode_stack()))
        start = (i * BATCH) % len(y)
        xb, yb = x[start : start + BATCH], y[start : start + BATCH]
        nn.functional.cross_entropy(model(xb), yb).backward()
        hand_sgd(model)
        monitor.step()
    monitor.close()
    return [a for a in monitor.alerts if a.rule == RULE], left_on


def test_label_sorted_batches_updated_by_hand_are_told():
    told, _ = fit_by_hand(sort=True)
    assert len(told) == 1
    assert told[0].severity == "warning"


def test_shuffled_batches_updated_by_hand_stay_silent():
    told, _ = fit_by_hand(sort=False)
    assert told == []


def test_no_function_mode_is_left_on_between_steps_updated_by_hand():
    # Sampled steps (every 5th) enter the look's mode after the training pass;
    # the boundary takes it off, so every step begins without one.
    _, left_on = fit_by_hand(sort=False, steps=80)
    assert left_on == [0] * 80


def test_the_same_loop_with_an_optimizer_is_told_alike():
    x, y = labelled(sort=True)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = tw.watch(model, opt, console=io.StringIO())
    for i in range(60):
        start = (i * BATCH) % len(y)
        opt.zero_grad()
        nn.functional.cross_entropy(
            model(x[start : start + BATCH]), y[start : start + BATCH]
        ).backward()
        opt.step()
    monitor.close()
    assert [a.rule for a in monitor.alerts if a.rule == RULE] == [RULE]


SCRIPT = """
import torch
from torch import nn

SORT = {sort}
torch.manual_seed(0)
y = torch.arange(10).repeat_interleave(64)
x = torch.randn(len(y), 12) + y[:, None].float() * 0.1
if not SORT:
    order = torch.randperm(len(y))
    x, y = x[order], y[order]
model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 10))
for i in range(60):
    start = (i * 8) % len(y)
    loss = nn.functional.cross_entropy(model(x[start : start + 8]), y[start : start + 8])
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.05 * p.grad
            p.grad = None
"""


def _run(tmp_path: Path, sort: bool) -> list[dict]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(sort=sort)))
    logs = tmp_path / "logs"
    done = cli("run", "--log-dir", str(logs), str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return [a for a in run_alerts(logs) if a["rule"] == RULE]


def test_run_of_a_script_updating_by_hand_tells_sorted_batches(tmp_path):
    assert [a["severity"] for a in _run(tmp_path, sort=True)] == ["warning"]


def test_run_of_a_script_updating_by_hand_with_shuffled_batches_stays_silent(tmp_path):
    assert _run(tmp_path, sort=False) == []
