"""A loop without ``torch.optim`` pays no import of ``torch._dynamo`` for being watched.

A script that builds a ``torch.optim`` optimizer imports dynamo (and sympy)
anyway; one with a hand-written update never does, and its first
``monitor.step()`` used to spend a second or two importing it: trainwatch's
re-runs of the forward (stalled_training's first batch, a NaN located) run
under a ``TorchDispatchMode``, whose method PyTorch wraps in a function that
imports dynamo at its first call. Each check runs in a fresh interpreter,
since dynamo, once imported by anything, stays imported.

The scripts run long enough for the first-batch reference, a sampled re-run
(every 100 steps) and ``close()``; one of them makes a NaN, so the op trace
re-runs its forward too. The twin with an optimizer shows the check notices
dynamo when it is there, and that trainwatch's dispatch modes are still kept
out of dynamo's graphs once it is.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

STEPS = 110

# Each script is plain (``trainwatch run`` watches it as it is) or, given
# ``watch``, watched with ``tw.watch`` and ``monitor.step()``.
HEAD = """
import sys
import torch
from torch import nn

WATCH = sys.argv[1:] == ["watch"]
if WATCH:
    import trainwatch as tw


def watched(model):
    return tw.watch(model, console=False) if WATCH else None
"""

REGRESSION = """
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
monitor = watched(model)
for step in range(STEPS):
    x = torch.randn(16, 8)
    loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
            p.grad = None
    if monitor is not None:
        monitor.step(loss=loss)
if monitor is not None:
    monitor.close()
"""

REINFORCE = """
torch.manual_seed(0)
policy = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
monitor = watched(policy)
for episode in range(STEPS):
    log_probs, rewards = [], []
    for _ in range(4):
        actions = torch.distributions.Categorical(logits=policy(torch.randn(4)))
        action = actions.sample()
        log_probs.append(actions.log_prob(action))
        rewards.append(float(action) - 0.5)
    loss = -(torch.stack(log_probs) * torch.tensor(rewards)).sum()
    loss.backward()
    with torch.no_grad():
        for p in policy.parameters():
            p -= 0.005 * p.grad
            p.grad.zero_()
    if monitor is not None:
        monitor.step(loss=loss)
if monitor is not None:
    monitor.close()
"""

# A square root of negative values from step 60: nonfinite_forward re-runs the
# forward op by op to name the op that made the NaN.
NAN = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 1)
        self.broken = False

    def forward(self, x):
        h = self.a(x)
        if self.broken:
            h = torch.sqrt(h - 100.0)
        return self.b(h)


torch.manual_seed(0)
model = Net()
monitor = watched(model)
for step in range(STEPS):
    model.broken = step >= 60
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
            p.grad = None
    if monitor is not None:
        monitor.step(loss=loss)
if monitor is not None:
    monitor.close()
"""

WITH_OPTIMIZER = """
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
monitor = watched(model)
for step in range(STEPS):
    x = torch.randn(16, 8)
    loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if monitor is not None:
        monitor.step(loss=loss)
if monitor is not None:
    monitor.close()
"""

# Runs the script (watched in itself, or under ``trainwatch run``), then says
# what got imported and whether trainwatch's re-runs did run under their
# dispatch mode (the ops it passed on), so the check cannot pass by running none.
PROBE = """
import json, runpy, sys
script, how, log_dir = sys.argv[1:4]
if how == "watch":
    sys.argv = [script, "watch"]
    runpy.run_path(script, run_name="__main__")
else:
    from trainwatch.cli import main
    main(["run", "--no-console", "--log-dir", log_dir, script])
from trainwatch.collect import rerun_effects
dispatch = rerun_effects._CopyBeforeWrite.__dict__["__torch_dispatch__"]
# Out of dynamo's graphs: dynamo's own ``disable`` wrapper, or PyTorch's lazy one
# around the method once it made that wrapper (at the method's first call).
raw = getattr(dispatch, "__wrapped__", None)
disabled = getattr(dispatch, "_torchdynamo_disable", False) or (
    getattr(raw, "__dynamo_disable", None) is not None
)
print(json.dumps({
    "dynamo": "torch._dynamo" in sys.modules,
    "sympy": "sympy" in sys.modules,
    "re_run_ops": len(rerun_effects._READS),
    "out_of_graph": bool(disabled),
}))
"""


def _imports(tmp_path: Path, body: str, how: str) -> dict:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(HEAD) + f"\nSTEPS = {STEPS}\n" + textwrap.dedent(body))
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(script), how, str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _alerts(tmp_path: Path) -> list[dict]:
    path = tmp_path / "logs" / "alerts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize(
    ("body", "how"),
    [(REGRESSION, "watch"), (REINFORCE, "watch"), (REGRESSION, "run")],
    ids=["regression-watch", "reinforce-watch", "regression-run"],
)
def test_a_loop_without_an_optimizer_never_imports_dynamo(
    tmp_path: Path, body: str, how: str
) -> None:
    found = _imports(tmp_path, body, how)
    assert found["re_run_ops"] > 0  # the first batch's reference was taken
    assert not found["dynamo"]
    assert not found["sympy"]


def test_a_nan_is_still_located_op_by_op_without_dynamo(tmp_path: Path) -> None:
    found = _imports(tmp_path, NAN, "run")
    assert found["re_run_ops"] > 0
    assert not found["dynamo"]
    assert not found["sympy"]
    nonfinite = [a for a in _alerts(tmp_path) if a["rule"] == "nonfinite_forward"]
    assert nonfinite and nonfinite[0]["data"]["op"] == "aten::sqrt"


def test_with_an_optimizer_dynamo_is_there_and_re_runs_stay_out_of_its_graphs(
    tmp_path: Path,
) -> None:
    found = _imports(tmp_path, WITH_OPTIMIZER, "watch")
    assert found["dynamo"]  # torch.optim imports it: the check sees it when it is there
    assert found["re_run_ops"] > 0
    assert found["out_of_graph"]
