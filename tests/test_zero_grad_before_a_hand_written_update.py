"""Gradients zeroed between backward and a hand-written update are told as such, early.

Without an optimizer, ``model.zero_grad(set_to_none=False)`` or
``p.grad.zero_()`` placed before ``p -= lr * p.grad`` makes every update
apply zeros. With an optimizer the same bug is ``zero_gradient``'s
``reset_before_step`` at step 0; here it is told the same way, within
``patience`` updates, under ``tw.watch`` with ``monitor.step()`` after each
update and under ``trainwatch run`` of the unmodified script: the update
writes every weight (its version counter moves) and leaves every value as
it was. Beside each planted bug, its clean twin: the gradients zeroed after
the update, set to None after it, summed over 2 or 4 micro-batches, or
computed per sample with ``torch.func`` and applied by hand.
"""

from __future__ import annotations

import json
import runpy
import sys

import pytest

from trainwatch.runner import run_script

LOOP = """
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

kind, updates, shape = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
X = torch.randn(2000, 8)
Y = X @ torch.randn(8, 1)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
monitor = None
if shape == "watch":
    import trainwatch as tw

    monitor = tw.watch(model, console=False, log_dir=sys.argv[4])
micro = {"accum2": 2, "accum4": 4, "accum2-zero-before": 2}.get(kind, 1)
lr = 0.0 if kind == "lr-zero" else 0.05
for update in range(updates):
    if kind == "func":
        from torch.func import functional_call, grad, vmap

        idx = torch.randint(0, 2000, (16,))
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss_of(p, x, y):
            return F.mse_loss(functional_call(model, p, (x[None],)), y[None])

        grads = vmap(grad(loss_of), in_dims=(None, 0, 0))(params, X[idx], Y[idx])
        with torch.no_grad():
            for name, p in model.named_parameters():
                p -= lr * grads[name].mean(0)
        if monitor is not None:
            monitor.step()
        continue
    if kind == "lr-zero":
        model.zero_grad(set_to_none=False)  # reset before backward: the update has them
    for _ in range(micro):
        idx = torch.randint(0, 2000, (32,))
        (F.mse_loss(model(X[idx]), Y[idx]) / micro).backward()
    if kind in ("zero-grad-before", "accum2-zero-before"):
        model.zero_grad(set_to_none=False)  # the planted bug: before the update
    if kind == "grad-zero-before":
        for p in model.parameters():
            p.grad.zero_()  # the planted bug: before the update
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    if kind in ("zero-grad-after", "accum2", "accum4"):
        model.zero_grad(set_to_none=False)
    if kind == "none-after":
        for p in model.parameters():
            p.grad = None
    if monitor is not None:
        monitor.step()
if monitor is not None:
    monitor.close()
"""

BUGS = ["zero-grad-before", "grad-zero-before", "accum2-zero-before"]
CLEAN = ["zero-grad-after", "none-after", "accum2", "accum4", "func"]


def _alerts(tmp_path, monkeypatch, kind: str, updates: int, shape: str) -> list[dict]:
    """The loop's warnings: under ``trainwatch run`` (unmodified), or run here under
    its own ``tw.watch`` with ``monitor.step()`` after each update."""
    script = tmp_path / "hand_written_loop.py"
    script.write_text(LOOP)
    log = tmp_path / "log"
    if shape == "run":
        assert run_script(script, [kind, str(updates), shape], log_dir=log, console=False) == 0
    else:
        monkeypatch.setattr(sys, "argv", [str(script), kind, str(updates), shape, str(log)])
        runpy.run_path(str(script), run_name="__main__")
    alerts = [json.loads(line) for line in (log / "alerts.jsonl").read_text().splitlines()]
    return [a for a in alerts if a["severity"] != "info"]


@pytest.mark.parametrize("shape", ["watch", "run"])
@pytest.mark.parametrize("kind", BUGS)
def test_zeroing_before_a_hand_written_update_is_told_within_patience(
    tmp_path, monkeypatch, kind, shape
):
    micro = 2 if kind.startswith("accum2") else 1
    # patience (3) updates, and under trainwatch run the boundary after them
    updates = 3 if shape == "watch" else 4
    alerts = _alerts(tmp_path, monkeypatch, kind, updates, shape)
    (alert,) = alerts
    assert alert["rule"] == "zero_gradient" and alert["module"] == ""
    assert alert["step"] == (micro - 1 if shape == "run" else 0)
    data = alert["data"]
    assert data["kind"] == "reset_before_step" and data["cause"] == "zeroed_in_place"
    assert data["optimizer"] is None and data["count"] == 4 and data["steps"] == 3
    assert "left them exactly as they were" in alert["message"]
    assert "Zero the gradients after the update" in alert["hint"]
    assert "learning rate" not in alert["message"]


# (torch.func's gradients reach no backward hook: trainwatch run sees no step there.)
@pytest.mark.parametrize(
    ("kind", "shape"),
    [
        (kind, shape)
        for kind in CLEAN
        for shape in ("watch", "run")
        if (kind, shape) != ("func", "run")
    ],
)
def test_control_hand_written_updates_that_apply_their_gradients_stay_silent(
    tmp_path, monkeypatch, kind, shape
):
    assert _alerts(tmp_path, monkeypatch, kind, 30, shape) == []


def test_control_live_gradients_applied_at_a_learning_rate_of_zero_are_no_reset(
    tmp_path, monkeypatch
):
    """Under monitor.step() the update's gradients are there to see: live ones applied
    at lr 0 leave the weights the same way, but nothing zeroed them (a stall's story,
    told later by stalled_training)."""
    assert [a["rule"] for a in _alerts(tmp_path, monkeypatch, "lr-zero", 30, "watch")] == []
