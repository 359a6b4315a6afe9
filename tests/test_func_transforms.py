"""Per-sample gradients with torch.func (DP-SGD's shape): the model runs inside vmap/grad.

Inside a torch.func transform a call of the model is functorch's trace: its
outputs are wrapped tensors without storage, ``functional_call`` stands other
tensors in for the parameters, and the backward it makes is its own. Those
calls are not the loop's training passes: trainwatch steps aside for them
(the NaN probe used to fail on the wrapped output and switch itself off, and
``trainwatch run`` took the stand-ins for the model's parameters). The loop's
own calls and the gradients it writes into ``.grad`` are still watched.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, stack_module_state, vmap

import trainwatch as tw
from trainwatch.runner import run_script


def _per_sample_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int, nan_at=None):
    def loss_of_one(params, x, y):
        return F.cross_entropy(functional_call(model, params, (x[None],)), y[None])

    per_sample = vmap(grad(loss_of_one), in_dims=(None, 0, 0))
    for step in range(steps):
        x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
        if step == nan_at:
            x[0, 0] = float("nan")
        grads = per_sample({k: v.detach() for k, v in model.named_parameters()}, x, y)
        opt.zero_grad()
        for name, param in model.named_parameters():
            clipped = grads[name].clamp(-1.0, 1.0)  # per-sample clipping, DP-SGD style
            param.grad = clipped.mean(0) + 0.01 * torch.randn_like(param)
        opt.step()
        with torch.no_grad():  # the loop's own call: training accuracy
            (model(x).argmax(1) == y).float().mean()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def test_per_sample_gradients_under_vmap_leave_the_nan_probe_on_and_raise_nothing(quiet_watch):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = quiet_watch(model, opt)
    _per_sample_steps(model, opt, 8)
    assert [(a.rule, a.severity) for a in monitor.alerts if a.severity != "info"] == []


def test_a_nan_in_per_sample_gradients_is_still_caught(quiet_watch):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = quiet_watch(model, opt)
    _per_sample_steps(model, opt, 8, nan_at=5)
    found = {(a.rule, a.step) for a in monitor.alerts if a.rule.startswith("nonfinite")}
    assert found and min(step for _, step in found) == 5


SCRIPT = """
import sys
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def loss(params, x, y):
    return F.cross_entropy(functional_call(model, params, (x,)), y)


for step in range(8):
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    if sys.argv[1] == "nan" and step == 5:
        x[0, 0] = float("nan")
    grads = grad(loss)({k: v.detach() for k, v in model.named_parameters()}, x, y)
    opt.zero_grad()
    for name, param in model.named_parameters():
        param.grad = grads[name]
    opt.step()
    if sys.argv[2] == "logged":
        with torch.no_grad():
            accuracy = (model(x).argmax(1) == y).float().mean()
"""


def _alerts_under_run(
    tmp_path, how: str, logged: str, source: str = SCRIPT
) -> list[tuple[str, int]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "script.py"
    script.write_text(source)
    run_script(script, [how, logged], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [(a["rule"], a["step"]) for a in map(json.loads, lines) if a["severity"] != "info"]


def test_torch_func_gradients_under_trainwatch_run_are_no_missing_gradients(tmp_path):
    assert _alerts_under_run(tmp_path, "healthy", "logged") == []
    assert _alerts_under_run(tmp_path / "unlogged", "healthy", "unlogged") == []


def test_a_nan_in_torch_func_gradients_under_trainwatch_run_is_caught(tmp_path):
    found = _alerts_under_run(tmp_path, "nan", "logged")
    assert found and all(rule.startswith("nonfinite") for rule, _ in found)


def test_a_nan_made_by_per_sample_clipping_under_vmap_says_where_it_can_come_from():
    """DP-SGD by hand: per-sample gradients under vmap(grad), each scaled by
    min(1, C / norm). A sample whose gradient is exactly zero makes 0/0 at step 5:
    no hook saw the model run, and the message says why, without blaming a
    compiled graph that is not there."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def sample_loss(params, x, y):
        out = functional_call(model, params, (x[None],))
        return ((out - y) ** 2).mean()

    with tw.watch(model, opt, console=False) as monitor:
        for step in range(10):
            x, y = torch.randn(8, 4), torch.randn(8, 1)
            if step == 5:
                x[0], y[0] = 0.0, model.bias.detach()  # this sample's gradient is all zero
            params = {k: v.detach() for k, v in model.named_parameters()}
            grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
            norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))
            scale = norms.clamp(max=1.0) / norms  # 0/0 for the zero gradient
            for name, p in model.named_parameters():
                g = grads[name]
                p.grad = (g * scale.view(-1, *[1] * (g.dim() - 1))).mean(0)
            opt.step()
    (alert,) = [a for a in monitor.alerts if a.severity != "info"]
    assert (alert.rule, alert.step, alert.data["cause"]) == ("nonfinite_backward", 5, "unlocated")
    assert "torch.func" in alert.message and "compiled in place" in alert.message


def _maml_steps(quiet_watch, steps: int, bad_from: int | None):
    """MAML without vmap: the query pass runs the model through functional_call on
    fast weights made by an inner-loop update; from ``bad_from`` the inner loss takes
    the log of a negative number, so the fast weights are NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(10, 1)
        y = x.sin() + 2
        params = dict(model.named_parameters())
        pred = functional_call(model, params, (x,))
        shift = 10.0 if bad_from is not None and step >= bad_from else 0.0
        inner = F.mse_loss(pred, y) + 0.1 * F.mse_loss(pred, torch.log(y - shift))
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        fast = {n: p - 0.01 * g for (n, p), g in zip(params.items(), grads)}
        F.mse_loss(functional_call(model, fast, (x,)), y).backward()
        opt.step()
    monitor.close()
    return monitor


def test_a_maml_query_pass_on_nan_fast_weights_is_told_at_its_step_as_given_weights(
    quiet_watch,
):
    monitor = _maml_steps(quiet_watch, 35, bad_from=30)
    first = monitor.alerts[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 30, "0")
    assert first.data["cause"] == "given_weights"
    assert "functional_call" in first.message
    assert "outside the model" not in str(first.data.get("parameters", ""))


def test_the_same_maml_loop_with_finite_fast_weights_is_silent(quiet_watch):
    monitor = _maml_steps(quiet_watch, 35, bad_from=None)
    assert [a for a in monitor.alerts if a.severity != "info"] == []


class _Ensemble(nn.Module):
    """Members' weights stacked as the module's parameters; forward runs one template
    over them with vmap + functional_call. The template is registered as a
    submodule (a real copy, or one moved to ``meta``) or kept out of the registry."""

    def __init__(self, template: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        members = [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)) for _ in range(3)]
        params, buffers = stack_module_state(members)
        self.names = list(params)
        self.stacked = nn.ParameterList([nn.Parameter(params[n]) for n in self.names])
        self.members_buffers = buffers
        base = copy.deepcopy(members[0])
        if template == "meta":
            base = base.to("meta")
        if template == "unregistered":
            object.__setattr__(self, "template", base)
        else:
            self.template = base

    def forward(self, x):
        params = dict(zip(self.names, self.stacked))

        def one(p, b, xx):
            return functional_call(self.template, (p, b), (xx,))

        return vmap(one)(params, self.members_buffers, x)


def _ensemble_alerts(template: str, check: str, plant: str | None) -> list[tuple[str, int]]:
    ens = _Ensemble(template)
    opt = torch.optim.Adam(ens.stacked.parameters(), 1e-3)
    with tw.watch(ens, opt, console=False, nonfinite_forward={"check": check}) as monitor:
        for step in range(10):
            x = torch.randn(3, 32, 8)
            if step == 6 and plant == "input":
                x[1, 0, 0] = float("nan")
            if step == 6 and plant == "weight":
                with torch.no_grad():
                    ens.stacked[2][1, 0, 0] = float("nan")  # member 1's last layer
            loss = F.cross_entropy(ens(x).reshape(-1, 2), torch.randint(0, 2, (96,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return [(a.rule, a.step) for a in monitor.alerts if a.severity != "info"]


TEMPLATES = ["registered", "meta", "unregistered"]


@pytest.mark.parametrize("check", ["auto", "deferred"])
@pytest.mark.parametrize("template", TEMPLATES)
def test_a_vmap_ensemble_with_its_template_registered_is_silent(template, check):
    """The template's modules run only inside vmap: the sampled activation hooks
    and the per-module NaN checks see wrapped tensors there and step aside."""
    assert _ensemble_alerts(template, check, None) == []


@pytest.mark.parametrize("plant", ["input", "weight"])
@pytest.mark.parametrize("check", ["auto", "deferred"])
@pytest.mark.parametrize("template", TEMPLATES)
def test_a_nan_in_a_vmap_ensemble_is_told_at_its_step_whatever_the_template(template, check, plant):
    """A NaN written into the stacked weights (the ensemble's own, held in a
    ParameterList) is told as the weight's where the pass was replayed."""
    rule = "nonfinite_parameter" if (plant, check) == ("weight", "auto") else "nonfinite_forward"
    assert _ensemble_alerts(template, check, plant) == [(rule, 6)]


ENSEMBLE_SCRIPT = """
import copy
import sys
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

torch.manual_seed(0)
members = [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)) for _ in range(3)]


class Ensemble(nn.Module):
    def __init__(self):
        super().__init__()
        params, _ = stack_module_state(members)
        self.names = list(params)
        self.stacked = nn.ParameterList([nn.Parameter(params[n]) for n in self.names])
        self.base = copy.deepcopy(members[0])

    def forward(self, x):
        params = dict(zip(self.names, self.stacked))
        return vmap(lambda p, xx: functional_call(self.base, p, (xx,)))(params, x)


ens = Ensemble()
opt = torch.optim.Adam(ens.stacked.parameters(), 1e-3)
for step in range(10):
    x = torch.randn(3, 32, 8)
    if sys.argv[1] == "nan" and step == 6:
        x[1, 0, 0] = float("nan")
    loss = F.cross_entropy(ens(x).reshape(-1, 2), torch.randint(0, 2, (96,)))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_vmap_ensemble_under_trainwatch_run_is_silent_and_its_nan_is_told(tmp_path):
    assert _alerts_under_run(tmp_path / "clean", "healthy", "-", ENSEMBLE_SCRIPT) == []
    found = _alerts_under_run(tmp_path / "nan", "nan", "-", ENSEMBLE_SCRIPT)
    assert found == [("nonfinite_forward", 6)]
