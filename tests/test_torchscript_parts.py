"""TorchScript: a scripted model is refused with a clear error; a scripted part of an
eager model is watched through the eager parts around it.

A ``ScriptModule`` takes no hooks (``register_forward_pre_hook is not supported
on ScriptModules``) and its submodules' parameter tables have no ``get``: an
eager model holding one failed inside trainwatch (an internal error that
switched the step collector off) once its optimizer came after the first
forward or a step looked wrong.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import trainwatch as tw
from trainwatch.runner import run_script

# TorchScript is deprecated in recent torch, and still in use.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")


class _WithScriptedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = torch.jit.script(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_watching_a_scripted_model_is_refused_naming_what_to_do():
    scripted = torch.jit.script(nn.Sequential(nn.Linear(8, 1)))
    with pytest.raises(tw.WatchError, match="TorchScript module, which takes no hooks"):
        tw.watch(scripted, console=False)


@pytest.mark.parametrize("reset", [True, False], ids=["healthy", "zero_grad_missing"])
def test_a_scripted_part_with_an_optimizer_built_after_the_first_forward(quiet_watch, reset):
    torch.manual_seed(0)
    model = _WithScriptedHead()
    monitor = quiet_watch(model)
    opt = None
    for _ in range(20):
        x = torch.randn(16, 8)
        out = model(x)
        if opt is None:
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            monitor.add_optimizer(opt)
        if reset:
            opt.zero_grad()
        nn.functional.mse_loss(out, x[:, :1]).backward()
        opt.step()
    found = [(a.rule, a.step) for a in monitor.alerts if a.severity != "info"]
    assert found == ([] if reset else [("accumulated_gradient", 1)])


SCRIPT = """
import torch
from torch import nn

torch.manual_seed(0)
model = torch.jit.script(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(20):
    x = torch.randn(16, 8)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), x[:, :1]).backward()
    opt.step()
print("trained")
"""


def test_trainwatch_run_leaves_a_scripted_model_alone(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert run_script(script, [], log_dir=tmp_path / "log", console=False) == 0
    assert "trained" in capsys.readouterr().out
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    assert [a["rule"] for a in map(json.loads, lines)] == []
