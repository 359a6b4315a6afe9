"""``trainwatch run`` finds a model called only inside a ``torch.func`` transform.

MAML written with ``torch.func`` adapts through ``functional_call`` under
``vmap`` and ``grad``, which the forward hooks that find models leave alone
(a transform's calls stand other tensors in for the parameters). The model
was never watched: its meta-optimizer stepped on parameters no monitor held,
the global forward hooks stayed on for good, and a missing ``zero_grad`` went
unreported. After two steps of such an optimizer its model is looked for by
its parameters instead.
"""

from __future__ import annotations

import json

import pytest

from trainwatch.runner import run_script

MAML = """
import sys
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.modules import module as module_hooks

reset = sys.argv[1] == "reset"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1, 32), nn.ReLU(), nn.Linear(32, 1))
meta_opt = torch.optim.Adam(model.parameters(), 1e-3)


def loss_of(params, x, y):
    return nn.functional.mse_loss(functional_call(model, params, (x,)), y)


def adapted_loss(params, xs, ys, xq, yq):
    g = grad(loss_of)(params, xs, ys)
    return loss_of({k: params[k] - 0.01 * g[k] for k in params}, xq, yq)


for it in range(20):
    amp = torch.rand(4, 1, 1) * 4 + 0.5
    xs, xq = torch.rand(4, 10, 1) * 10 - 5, torch.rand(4, 10, 1) * 10 - 5
    ys, yq = amp * torch.sin(xs), amp * torch.sin(xq)
    params = dict(model.named_parameters())
    loss = vmap(adapted_loss, in_dims=(None, 0, 0, 0, 0))(params, xs, ys, xq, yq).mean()
    if reset:
        meta_opt.zero_grad()
    loss.backward()
    meta_opt.step()
print("global forward hooks left:", len(module_hooks._global_forward_pre_hooks))
"""


@pytest.mark.parametrize("how", ["reset", "forgot"])
def test_a_model_called_only_in_torch_func_is_found_by_its_parameters(tmp_path, capsys, how):
    script = tmp_path / "maml.py"
    script.write_text(MAML)
    run_script(script, [how], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [(a["rule"], a["step"]) for a in map(json.loads, lines) if a["severity"] != "info"]
    # Watched from its third step (the search): the count goes on from the
    # script's own steps, and the first backward onto used gradients seen is at 3.
    assert found == ([] if how == "reset" else [("accumulated_gradient", 3)])
    assert (tmp_path / "log" / "setup.json").exists()  # a model was watched
    assert "global forward hooks left: 0" in capsys.readouterr().out
