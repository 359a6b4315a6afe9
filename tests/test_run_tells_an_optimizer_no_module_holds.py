"""``trainwatch run`` tells an optimizer whose tensors no module holds: nothing of it is watched.

An ensemble trained through ``torch.func.stack_module_state`` steps stacked
copies of its members' weights, leaves no module holds, under
``functional_call`` and ``vmap``. Models are found by their modules, so the
run watched nothing: no step, no alert, a NaN loss unreported, and said
nothing of it. One ``info`` line now says so, at the optimizer's second step.
Tensors stepped beside a model that is watched (a learned loss weight) are
part of a watched training and stay silent, as do ordinary scripts.
"""

from __future__ import annotations

import json

import pytest

from trainwatch.runner import run_script

ENSEMBLE = """
import copy
import sys
import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

as_module = sys.argv[1] == "module"
torch.manual_seed(0)
members = [nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3)) for _ in range(4)]
params, buffers = stack_module_state(members)
base = copy.deepcopy(members[0]).to("meta")


class Ensemble(nn.Module):
    # The stacked tensors held as parameters, the vmap in forward.
    def __init__(self):
        super().__init__()
        self.names = list(params)
        self.stacked = nn.ParameterList(nn.Parameter(params[n]) for n in self.names)

    def forward(self, x):
        held = dict(zip(self.names, self.stacked))
        return vmap(lambda p, x: functional_call(base, p, (x,)))(held, x)


if as_module:
    ensemble = Ensemble()
    run = ensemble
    opt = torch.optim.Adam(ensemble.parameters(), lr=1e-3)
else:
    stacked = vmap(lambda p, x: functional_call(base, p, (x,)))
    run = lambda x: stacked(params, x)
    opt = torch.optim.Adam(params.values(), lr=1e-3)
for step in range(8):
    x, y = torch.randn(4, 16, 8), torch.randint(0, 3, (4, 16))
    if step == 5:
        x[2, 0, 0] = float("nan")
    loss = nn.functional.cross_entropy(run(x).reshape(-1, 3), y.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

BARE_TENSORS = """
import torch

torch.manual_seed(0)
w = torch.zeros(8, requires_grad=True)
b = torch.zeros(1, requires_grad=True)
opt = torch.optim.SGD([w, b], lr=0.1)
for step in range(6):
    x = torch.randn(32, 8)
    y = (x[:, 0] > 0).float()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

STYLE_TRANSFER = """
import torch
from torch import nn

torch.manual_seed(0)
features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
features.eval().requires_grad_(False)
with torch.no_grad():
    target = features(torch.rand(1, 3, 16, 16))
image = torch.rand(1, 3, 16, 16, requires_grad=True)
opt = torch.optim.Adam([image], lr=0.05)
for step in range(6):
    loss = nn.functional.mse_loss(features(image), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

LOSS_WEIGHTS = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
log_var = torch.zeros(2, requires_grad=True)  # learned task weights (uncertainty weighting)
if sys.argv[1] == "same":
    opts = [torch.optim.Adam([*model.parameters(), log_var], lr=1e-3)]
else:
    opts = [torch.optim.Adam(model.parameters(), lr=1e-3), torch.optim.Adam([log_var], lr=1e-2)]
for step in range(6):
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    losses = ((model(x) - y) ** 2).mean(0)
    loss = (losses * torch.exp(-log_var) + log_var).sum()
    for opt in opts:
        opt.zero_grad()
    loss.backward()
    for opt in opts:
        opt.step()
"""


def _run(
    tmp_path, source: str, args: list[str], console: bool = False
) -> tuple[int, list[dict], int]:
    script = tmp_path / "train.py"
    script.write_text(source)
    code = run_script(script, args, log_dir=tmp_path / "log", console=console, fail_on="warning")
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    counts = json.loads((tmp_path / "log" / "alert_counts.json").read_text())
    return code, [json.loads(line) for line in lines], counts["steps"]


def _held_by_no_module(alerts: list[dict]) -> list[tuple[str, int, str | None]]:
    return [
        (a["severity"], a["step"], a["module"])
        for a in alerts
        if a["rule"] == "trainable_parameters" and a["data"].get("finding") == "held by no module"
    ]


def test_a_stacked_ensemble_stepped_through_vmap_is_told_unwatched_once(tmp_path, capsys):
    code, alerts, steps = _run(tmp_path, ENSEMBLE, ["stacked"], console=True)
    assert _held_by_no_module(alerts) == [("info", 1, None)]
    assert capsys.readouterr().err.count("INFO trainable_parameters") == 1
    (alert,) = alerts
    assert alert["data"]["tensors"] == 4 and "stack_module_state" in alert["message"]
    assert "nn.Parameters of a module" in alert["hint"]
    assert (code, steps) == (0, 0)  # an info line: no gate fails on it


def test_the_ensemble_held_as_parameters_of_a_module_is_watched_and_not_told(tmp_path):
    _, alerts, steps = _run(tmp_path, ENSEMBLE, ["module"])
    assert _held_by_no_module(alerts) == []
    assert steps == 8
    assert ("nonfinite_forward", 5) in [(a["rule"], a["step"]) for a in alerts]


def test_bare_tensors_stepped_by_an_optimizer_are_told_unwatched(tmp_path):
    _, alerts, steps = _run(tmp_path, BARE_TENSORS, [])
    assert _held_by_no_module(alerts) == [("info", 1, None)]
    assert steps == 0


@pytest.mark.parametrize("optimizer", ["same", "separate"])
def test_a_learned_loss_weight_beside_a_watched_model_is_not_told(tmp_path, optimizer):
    code, alerts, steps = _run(tmp_path, LOSS_WEIGHTS, [optimizer])
    assert alerts == []
    assert (code, steps) == (0, 6)


def test_an_image_optimized_through_a_watched_frozen_network_is_not_told(tmp_path):
    """Style transfer: the optimizer steps the image; the network it flows through
    is watched, and its backward passes are the steps."""
    code, alerts, steps = _run(tmp_path, STYLE_TRANSFER, [])
    assert _held_by_no_module(alerts) == []
    assert (code, steps) == (0, 6)


def test_loose_tensors_beside_the_scripts_own_watched_model_are_not_told(tmp_path):
    """The script watches its model itself; its loss weights' optimizer is its own."""
    source = (
        LOSS_WEIGHTS.replace(
            "for step in range(6):",
            "import trainwatch as tw\nmonitor = tw.watch(model, opts[0], console=False)\n"
            "for step in range(6):",
        )
        + "monitor.close()\n"
    )
    code, alerts, steps = _run(tmp_path, source, ["separate"])
    assert _held_by_no_module(alerts) == []
    assert (code, steps) == (0, 6)
