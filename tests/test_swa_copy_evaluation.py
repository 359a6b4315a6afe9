"""An SWA (or EMA) copy evaluated without ``.eval()``: dropout on, batch norm moved by
validation data.

Two shapes went unseen. Under ``trainwatch run``, one ``evaluate(m)`` helper
with its ``no_grad`` on one line evaluated the model every epoch and the copy
from epoch 6 on: the copy's first evaluation was the 7th entry into that line,
and the lookout that finds late models looks at the 1st, 2nd, 4th, 8th...
entry only. And a copy watched (or found) that never trains, evaluated once at
the end, had its one pass taken for a target network's last one at close.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn

import trainwatch as tw
from trainwatch.runner import run_script

# Eight batches an epoch, the copy evaluated from epoch 6 on by the helper that
# evaluates the model every epoch; nothing evaluated at the end.
SHARED_HELPER = """
import sys
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.swa_utils import AveragedModel

forgot_eval = sys.argv[1] == "forgot_eval"
torch.manual_seed(0)
x, w = torch.randn(256, 20), torch.randn(20, 3)
y = (x @ w).argmax(1)
x_val = torch.randn(64, 20)
y_val = (x_val @ w).argmax(1)
model = nn.Sequential(
    nn.Linear(20, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3)
)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
swa_model = AveragedModel(model)


def evaluate(m):
    with torch.no_grad():
        return (m(x_val).argmax(1) == y_val).float().mean().item()


for epoch in range(9):
    model.train()
    for i in range(0, 256, 32):
        loss = F.cross_entropy(model(x[i : i + 32]), y[i : i + 32])
        opt.zero_grad()
        loss.backward()
        opt.step()
    if epoch >= 6:
        swa_model.update_parameters(model)
        if not forgot_eval:
            swa_model.eval()
        print("swa", evaluate(swa_model))
        swa_model.train()
    model.eval()
    print("model", evaluate(model))
"""


def _run_alerts(tmp_path, source: str, args: list[str]) -> list[tuple[str, int, str | None]]:
    script = tmp_path / "swa.py"
    script.write_text(source)
    run_script(script, args, log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [(a["rule"], a["step"], a["module"]) for a in map(json.loads, lines)]


def test_a_copy_first_evaluated_late_by_a_shared_helper_warns_under_run(tmp_path):
    alerts = _run_alerts(tmp_path, SHARED_HELPER, ["forgot_eval"])
    # Found at its first evaluation (the end of epoch 6: 7 epochs of 8 steps),
    # told at its second, dated by the first; module.1 is its batch norm.
    assert [a for a in alerts if a[0] == "eval_in_train_mode"][:1] == [
        ("eval_in_train_mode", 56, "module.1")
    ]


def test_a_copy_evaluated_in_eval_mode_by_a_shared_helper_is_silent_under_run(tmp_path):
    assert _run_alerts(tmp_path, SHARED_HELPER, ["eval"]) == []


def _train_then_evaluate_the_copy_once(forgot_eval: bool, recompute_bn: bool) -> list:
    """tw.watch on the model and on its SWA copy (no optimizer); the copy evaluated
    once, at the end, in one no_grad pass. The copy monitor's alerts."""
    torch.manual_seed(0)
    x, w = torch.randn(256, 20), torch.randn(20, 3)
    y = (x @ w).argmax(1)
    model = nn.Sequential(
        nn.Linear(20, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    swa_model = AveragedModel(model)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    with (
        tw.watch(model, opt, console=False),
        tw.watch(swa_model, console=False) as swa_monitor,
    ):
        for epoch in range(6):
            for xb, yb in loader:
                loss = nn.functional.cross_entropy(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
            if epoch >= 3:
                swa_model.update_parameters(model)
        if recompute_bn:
            update_bn(loader, swa_model)  # training mode under no_grad, on purpose
        if not forgot_eval:
            swa_model.eval()
        with torch.no_grad():
            swa_model(torch.randn(64, 20))
    return [(a.rule, a.module) for a in swa_monitor.alerts if a.severity != "info"]


@pytest.mark.parametrize("recompute_bn", [True, False])
def test_a_copy_never_trained_evaluated_once_in_training_mode_warns_at_close(recompute_bn):
    found = _train_then_evaluate_the_copy_once(forgot_eval=True, recompute_bn=recompute_bn)
    assert found == [("eval_in_train_mode", "module.1")]


@pytest.mark.parametrize("recompute_bn", [True, False])
def test_a_copy_never_trained_evaluated_once_in_eval_mode_is_silent(recompute_bn):
    assert _train_then_evaluate_the_copy_once(forgot_eval=False, recompute_bn=recompute_bn) == []


# The same under trainwatch run: the copy is found at update_bn's no_grad (or at
# its one evaluation) and judged at close.
EVALUATED_ONCE = """
import sys
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.swa_utils import AveragedModel, update_bn

forgot_eval = sys.argv[1] == "forgot_eval"
torch.manual_seed(0)
x, w = torch.randn(256, 20), torch.randn(20, 3)
y = (x @ w).argmax(1)
model = nn.Sequential(
    nn.Linear(20, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3)
)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
swa_model = AveragedModel(model)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
for epoch in range(6):
    for xb, yb in loader:
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if epoch >= 3:
        swa_model.update_parameters(model)
update_bn(loader, swa_model)
if not forgot_eval:
    swa_model.eval()
with torch.no_grad():
    swa_model(torch.randn(64, 20))
"""


def test_a_copy_evaluated_once_at_the_end_in_training_mode_warns_under_run(tmp_path):
    alerts = _run_alerts(tmp_path, EVALUATED_ONCE, ["forgot_eval"])
    assert [(rule, module) for rule, _, module in alerts] == [("eval_in_train_mode", "module.1")]


def test_a_copy_evaluated_once_at_the_end_in_eval_mode_is_silent_under_run(tmp_path):
    assert _run_alerts(tmp_path, EVALUATED_ONCE, ["eval"]) == []
