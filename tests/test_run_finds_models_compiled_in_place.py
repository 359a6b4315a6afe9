"""``trainwatch run`` finds a model compiled in place with ``model.compile()``.

``model.compile()`` routes every call of the model through a compiled
``_call_impl``: the module calls happen inside the traced graph, where the
forward hooks that find models step aside, so the model was never found. Its
optimizer stepped on parameters no monitor held, the run watched no step and
a missing ``zero_grad`` or a NaN gradient went unreported. After two steps of
such an optimizer its model is looked for by its parameters, and the step
count goes on from the script's own steps.
"""

from __future__ import annotations

import json

import pytest
import torch._dynamo

from trainwatch.runner import run_script

SCRIPT = """
import sys
import torch
from torch import nn
from torch.nn.modules import module as module_hooks

bug = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
model.compile(backend="aot_eager")
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 16), torch.randn(64, 1)
for step in range(40):
    if bug != "no_zero_grad":
        opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    if bug == "nan" and step == 30:
        with torch.no_grad():
            model[0].weight.grad[0, 0] = float("nan")
    opt.step()
print("global forward hooks left:", len(module_hooks._global_forward_pre_hooks))
"""


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(tmp_path, bug: str) -> tuple[list[tuple[str, int, str | None]], dict]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_script(script, [bug], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    alerts = [a for a in map(json.loads, lines) if a["severity"] != "info"]
    found = [(a["rule"], a["step"], a["module"]) for a in alerts]
    counts = json.loads((tmp_path / "log" / "alert_counts.json").read_text())
    return found, counts


def test_a_healthy_model_compiled_in_place_is_watched_and_quiet(tmp_path, capsys):
    found, counts = _run(tmp_path, "none")
    assert found == []
    assert counts["steps"] == 40  # counted from the script's first step
    # A graph was traced with the finding hooks in the global tables: taking them
    # off would recompile it (dynamo guards on those tables). They stay while the
    # script runs, one each, and come off with the run.
    assert "global forward hooks left: 1" in capsys.readouterr().out
    from torch.nn.modules import module as module_hooks

    assert not module_hooks._global_forward_pre_hooks
    assert not module_hooks._global_forward_hooks


def test_a_nan_gradient_of_a_model_compiled_in_place_names_its_step_and_layer(tmp_path):
    found, _ = _run(tmp_path, "nan")
    assert found == [("nonfinite_backward", 30, "0")]
