"""vanishing_gradient: a layer at the output end whose gradient is tiny because it is at
its optimum is converged, not starved; a gradient that dies on its way back from the
loss (the first layers of a deep sigmoid stack, a block gated to nothing in the middle)
is still told, at its step and layer."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import batches
from trainwatch.config import VanishingGradientConfig
from trainwatch.record import StepRecord
from trainwatch.rules.gradient_scale import VanishingGradientRule

D = 4


class MaskedLinear(nn.Linear):
    def __init__(self, i: int, o: int, mask: torch.Tensor) -> None:
        super().__init__(i, o)
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.mask, self.bias)


class MADE(nn.Module):
    """An autoregressive layer of a masked autoregressive flow; ``gate`` scales its
    shift and log-scale (1: as usual; tiny: a layer the signal barely reaches)."""

    def __init__(self, d: int, h: int = 32, gate: float = 1.0) -> None:
        super().__init__()
        di, dh = torch.arange(1, d + 1), torch.arange(h) % (d - 1) + 1
        self.l1 = MaskedLinear(d, h, (dh[:, None] >= di[None]).float())
        self.l2 = MaskedLinear(h, h, (dh[:, None] >= dh[None]).float())
        self.out = MaskedLinear(h, 2 * d, (di[:, None] > dh[None]).float().repeat(2, 1))
        self.gate = gate

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = F.relu(self.l2(F.relu(self.l1(x))))
        mu, a = (self.gate * self.out(hidden)).chunk(2, 1)
        a = a.clamp(-5, 5)
        return (x - mu) * torch.exp(-a), -a.sum(1)


class BatchNormFlow(nn.Module):
    """Normalise with the batch's statistics, then exp(log_gamma) * y + beta: for a
    standard-normal base its optimum is beta = 0, gamma = 1, where it starts."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.log_gamma = nn.Parameter(torch.zeros(d))
        self.beta = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, v = x.mean(0), x.var(0) + 1e-5
        y = (x - m) / v.sqrt() * self.log_gamma.exp() + self.beta
        return y, (self.log_gamma - 0.5 * v.log()).sum().expand(x.shape[0])


class MAF(nn.Module):
    def __init__(self, first_gate: float = 1.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [MADE(D, gate=first_gate), BatchNormFlow(D), MADE(D), BatchNormFlow(D)]
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logdet = torch.zeros(())
        for layer in self.layers:
            x, step_logdet = layer(x)
            logdet = logdet + step_logdet
            x = x.flip(1)
        return x, logdet


def _train_flow(quiet_watch, model: MAF, steps: int):
    torch.manual_seed(0)
    mix = torch.randn(D, D) * 0.7
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(steps):
        z = torch.randn(256, D)
        x = torch.tanh(z @ mix) * 2 + 0.1 * z
        u, logdet = model(x)
        nll = (0.5 * u.pow(2).sum(1) + 0.5 * D * math.log(2 * math.pi) - logdet).mean()
        opt.zero_grad()
        nll.backward()
        opt.step()
    return [a for a in monitor.alerts if a.rule == "vanishing_gradient"]


def test_flow_whose_last_batch_norm_layer_sits_at_its_optimum_is_not_vanishing(quiet_watch):
    torch.manual_seed(0)
    model = MAF()
    assert _train_flow(quiet_watch, model, 160) == []
    # The last layer's gradient is ~0 by design (it stays at its closed-form optimum).
    assert model.layers[3].beta.abs().max() < 1e-5


def test_flow_whose_first_layer_the_signal_barely_reaches_is_vanishing(quiet_watch):
    torch.manual_seed(0)
    (alert,) = _train_flow(quiet_watch, MAF(first_gate=1e-7), 80)
    assert alert.module.startswith("layers.0.")
    assert alert.step == 0
    assert {"layers.0.l1", "layers.0.l2", "layers.0.out"} <= set(alert.data["layers"])
    assert "layers.3" not in alert.data["layers"]


class Intercept(nn.Module):
    """The fit's intercept: the features centred over the data, then a learned offset
    (initialised at the targets' mean, its optimum)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h - h.mean(0) + self.offset


class Gated(nn.Module):
    """A residual block whose branch is scaled by ``gate``."""

    def __init__(self, width: int, gate: float) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.gate = gate

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.gate * torch.tanh(self.fc(h))


def _curve_fit(quiet_watch, middle_gate: float, steps: int = 80):
    """A full-batch regression of a curve by a residual tanh MLP ending in an
    intercept that starts at its optimum."""
    torch.manual_seed(0)
    x = torch.linspace(-3, 3, 256)[:, None]
    y = torch.sin(2 * x) + 0.5
    model = nn.Sequential(
        nn.Linear(1, 16),
        nn.Tanh(),
        Gated(16, 1.0),
        Gated(16, middle_gate),
        Gated(16, 1.0),
        nn.Linear(16, 1),
        Intercept(1),
    )
    with torch.no_grad():
        model[-1].offset.fill_(y.mean())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = quiet_watch(model, opt)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    assert model[-1].offset.grad.abs().max() < 1e-6  # converged by design
    return [a for a in monitor.alerts if a.rule == "vanishing_gradient"]


def test_regression_whose_output_offset_sits_at_its_optimum_is_not_vanishing(quiet_watch):
    assert _curve_fit(quiet_watch, middle_gate=1.0) == []


def test_block_gated_to_nothing_in_the_middle_is_vanishing_beside_a_converged_offset(
    quiet_watch,
):
    (alert,) = _curve_fit(quiet_watch, middle_gate=1e-7)
    assert alert.module == "3.fc"
    assert alert.step == 0
    assert alert.data["layers"] == ["3.fc"]  # not the converged offset, "6"


def test_deep_sigmoid_stack_still_vanishes_at_its_first_layers(quiet_watch):
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 16), nn.Sigmoid()]
    for _ in range(20):
        layers += [nn.Linear(16, 16), nn.Sigmoid()]
    model = nn.Sequential(*layers, nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt)
    for x, y in batches(75, batch=32, inputs=8):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    (alert,) = [a for a in monitor.alerts if a.rule == "vanishing_gradient"]
    assert alert.module == "0" and alert.step == 0
    assert str(len(layers)) not in alert.data["layers"]  # the output layer is not starved


def _run_rule(norms_at):
    rule = VanishingGradientRule(VanishingGradientConfig(warmup=0, patience=3))
    found = []
    for step in range(10):
        found += rule.evaluate(StepRecord(step=step, layer_norms=norms_at(step)))
    return found


def test_the_layers_order_decides_whether_a_tiny_gradient_is_starved_or_converged():
    """The step's layers in the model's order (no model known: the records' order)."""
    usual = {"embed": 0.2, "fc1": 0.5, "fc2": 0.4, "norm": 0.3, "head": 0.6}

    def tiny(*layers: str):
        return lambda step: {k: (1e-9 if k in layers else v) for k, v in usual.items()}

    assert _run_rule(tiny("head")) == []  # the output end, converged
    assert _run_rule(tiny("norm", "head")) == []  # nothing nearer the loss outgrows them
    (first,) = _run_rule(tiny("embed"))
    assert (first.module, first.step, first.data["layers"]) == ("embed", 0, ["embed"])
    (middle,) = _run_rule(tiny("fc2", "head"))
    assert (middle.module, middle.data["layers"]) == ("fc2", ["fc2"])

    def tail_then_head_back(step: int):
        norms = tiny("norm", "head")(step)
        if step >= 5:
            norms["head"] = 0.6  # a layer nearer the loss gets the usual gradient again
        return norms

    (woke,) = _run_rule(tail_then_head_back)
    assert (woke.module, woke.step, woke.data["layers"]) == ("norm", 0, ["norm"])
