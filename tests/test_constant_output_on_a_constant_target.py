"""constant_output: a pass whose loss target is the same for every row is no collapse.

A physics-informed network (PINN) for ``-u'' = f`` on [0, 1] evaluates the
network at the Dirichlet boundary points, where ``u(0) = u(1) = 0`` asks the
same value of every point. When that boundary pass is the step's first with
gradients (the one the sampler measures), its output converging to 0 while
its input (0 and 1) differs is the boundary condition learned, not a
collapse: with the penalty written ``u_b.pow(2).mean()`` (no target tensor)
and as ``mse_loss(u_b, zeros)`` alike. A signed-distance network's surface
pass (``f(p).abs().mean()`` on points of the zero level set) is the same.

Each healthy loop has a twin with a real collapse planted, still told at the
model's output: a network saturated for good (its output exactly constant,
which a fit to a constant never is), a collapse while the boundary values
vary, and a classifier whose loss also penalises its logits' size.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import trainwatch as tw
from trainwatch.runner import run_script


def _told(monitor: tw.Monitor) -> dict[str, int]:
    return {a.module: a.step for a in monitor.alerts if a.rule == "constant_output"}


# -- a PINN whose boundary pass comes first ---------------------------------------------------


def _pinn(
    boundary: str,
    points: int = 2,
    steps: int = 200,
    seed: int = 0,
    plant: str | None = None,
    at: int = 100,
) -> tw.Monitor:
    """``boundary``: ``implicit`` (``u_b.pow(2).mean()``), ``explicit``
    (``mse_loss(u_b, zeros)``) or ``varying`` (``u(0) = 0, u(1) = 1``)."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    xb = torch.tensor([[0.0], [1.0]]) if points == 2 else torch.randint(0, 2, (points, 1)).float()
    monitor = tw.watch(model, opt, console=False)
    for step in range(steps):
        if step == at and plant == "saturated":
            with torch.no_grad():
                model[2].bias.fill_(1e3)  # every unit of the second layer saturated for good
        if step == at and plant == "collapsed":
            with torch.no_grad():
                model[2].weight.mul_(1e-6)
            model[2].weight.requires_grad_(False)
        u_b = model(xb)  # the boundary pass: the step's first
        if boundary == "implicit":
            loss_bc = u_b.pow(2).mean()
        elif boundary == "explicit":
            loss_bc = F.mse_loss(u_b, torch.zeros(len(xb), 1))
        else:
            loss_bc = (u_b - xb).pow(2).mean()  # u(0) = 0, u(1) = 1
        x = torch.rand(128, 1, requires_grad=True)  # collocation points
        u = model(x)
        (u_x,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        (u_xx,) = torch.autograd.grad(u_x.sum(), x, create_graph=True)
        residual = (-u_xx - math.pi**2 * torch.sin(math.pi * x)).pow(2).mean()
        loss = residual + 10 * loss_bc
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    return monitor


@pytest.mark.parametrize("boundary", ["implicit", "explicit"])
@pytest.mark.parametrize("points", [2, 64])
def test_a_pinn_whose_boundary_pass_is_sampled_is_no_collapse(boundary, points):
    assert _told(_pinn(boundary, points)) == {}


def test_a_pinn_is_no_collapse_at_other_seeds():
    assert _told(_pinn("implicit", seed=1)) == {}


@pytest.mark.parametrize("boundary", ["implicit", "explicit"])
def test_control_a_pinn_whose_network_saturated_is_told_at_its_output(boundary):
    """Its output is exactly the same for every point: no fit to a constant is that exact."""
    assert _told(_pinn(boundary, plant="saturated")).get("") == 100


def test_control_a_pinn_collapsed_while_its_boundary_values_vary_is_told_at_its_output():
    told = _told(_pinn("varying", plant="collapsed"))
    assert told.get("") == 100
    assert told.get("2") == 100  # and where the variation died


def test_control_a_pinn_collapsed_under_a_constant_boundary_is_told_where_it_died():
    assert _told(_pinn("implicit", plant="collapsed")).get("2") == 100


# -- a signed-distance network: its surface pass asks f = 0 of every surface point -----------


def _sdf(steps: int = 150, kill_at: int | None = None) -> tw.Monitor:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(2, 64), nn.Softplus(beta=10), nn.Linear(64, 64), nn.Softplus(beta=10),
        nn.Linear(64, 1),
    )  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = tw.watch(model, opt, console=False)
    for step in range(steps):
        if step == kill_at:
            with torch.no_grad():
                model[2].bias.fill_(-1e3)  # the second layer's units all off for good
        a = torch.rand(64) * 2 * math.pi
        surface = torch.stack([a.cos(), a.sin()], 1)  # the zero level set: the unit circle
        on_surface = model(surface).abs().mean()
        x = (torch.rand(128, 2) * 4 - 2).requires_grad_(True)
        (g,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
        eikonal = (g.norm(dim=1) - 1).pow(2).mean()  # |grad f| = 1
        loss = 10 * on_surface + eikonal
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    return monitor


def test_a_signed_distance_network_whose_surface_pass_is_sampled_is_no_collapse():
    assert _told(_sdf()) == {}


def test_control_a_signed_distance_network_killed_is_told_at_its_output():
    assert _told(_sdf(kill_at=100)).get("") == 100


# -- an output whose loss also has a target that is not constant --------------------------------


def test_control_a_classifier_whose_logits_are_also_penalised_is_told_when_its_head_collapses():
    """The penalty ``logits.pow(2)`` asks 0 of every row, but the cross-entropy asks the
    classes: the output's target on that pass is not constant."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
    model.append(nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    weights = torch.randn(8, 4)
    monitor = tw.watch(model, opt, console=False, constant_output={"every": 5})
    for step in range(60):
        if step == 32:
            with torch.no_grad():
                model[4].weight.mul_(1e-5)
            model[4].weight.requires_grad_(False)
        x = torch.randn(64, 8)
        logits = model(x)
        loss = 1e-3 * logits.pow(2).mean() + F.cross_entropy(logits, (x @ weights).argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    assert _told(monitor) == {"": 35}


def test_control_a_regression_collapsed_to_its_target_mean_is_told_at_its_output():
    """``(out - y).abs()``: the target is ``y``, which varies."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    weights = torch.randn(4, 1)
    monitor = tw.watch(model, opt, console=False)
    for step in range(160):
        if step == 60:
            with torch.no_grad():
                model[2].weight.mul_(1e-6)
            model[2].weight.requires_grad_(False)
        x = torch.randn(64, 4)
        loss = (model(x) - x @ weights).abs().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    assert "" in _told(monitor)


# -- the PINN under ``trainwatch run`` -----------------------------------------------------------

PINN_SCRIPT = """
import math
import sys

import torch
from torch import nn

SATURATE = sys.argv[1] == "saturated"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=2e-3)
xb = torch.tensor([[0.0], [1.0]])
for step in range(200):
    if SATURATE and step == 100:
        with torch.no_grad():
            model[2].bias.fill_(1e3)
    loss_bc = model(xb).pow(2).mean()
    x = torch.rand(128, 1, requires_grad=True)
    u = model(x)
    u_x = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
    u_xx = torch.autograd.grad(u_x.sum(), x, create_graph=True)[0]
    res = (-u_xx - math.pi ** 2 * torch.sin(math.pi * x)).pow(2).mean()
    loss = res + 10 * loss_bc
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _run_pinn(tmp_path: Path, plant: str) -> dict[str, int]:
    script, log_dir = tmp_path / "pinn.py", tmp_path / "log"
    script.write_text(PINN_SCRIPT)
    assert run_script(script, [plant], log_dir=log_dir, console=False) == 0
    alerts = [json.loads(line) for line in (log_dir / "alerts.jsonl").read_text().splitlines()]
    return {a["module"]: a["step"] for a in alerts if a["rule"] == "constant_output"}


def test_a_pinn_under_trainwatch_run_is_no_collapse(tmp_path):
    assert _run_pinn(tmp_path, "none") == {}


def test_control_a_saturated_pinn_under_trainwatch_run_is_told_at_its_output(tmp_path):
    assert _run_pinn(tmp_path, "saturated").get("") == 100
