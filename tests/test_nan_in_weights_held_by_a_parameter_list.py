"""Weights held in an ``nn.ParameterList`` / ``nn.ParameterDict`` are the holding
module's own weights.

Such a container is never called: the module holding it uses its weights in its
own forward (a vmap ensemble's stacked weights run through ``functional_call``,
per-layer matrices used as ``x @ self.ws[i]``). Its weights were not counted as
the calling module's, so a NaN written into one was reported as born in the
forward "from finite inputs", with a hint about log/sqrt, where the same write
into a direct ``nn.Parameter`` is told as written by the training code.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, stack_module_state

# "auto": judged on the spot (CPU); "step": the path a GPU takes (one read at
# the step boundary, then a replay); "deferred": the no-sync path (no replay).
CHECKS = ["auto", "step", "deferred"]
SHAPES = ["list", "dict", "ensemble"]
_AT = 10
_STEPS = 14


class _ListBlock(nn.Module):
    """Per-layer weights in a ParameterList, applied by hand."""

    def __init__(self, log_from_negative: bool = False) -> None:
        super().__init__()
        self.ws = nn.ParameterList(
            [nn.Parameter(torch.randn(8, 16) / 3), nn.Parameter(torch.randn(16, 16) / 4)]
        )
        self.log_from_negative = log_from_negative

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.ws:
            x = torch.tanh(x @ w)
        return torch.log(x) if self.log_from_negative else x

    def poisoned(self) -> torch.Tensor:
        return self.ws[1]


class _DictBlock(nn.Module):
    """Named weights in a ParameterDict, applied by hand."""

    def __init__(self, log_from_negative: bool = False) -> None:
        super().__init__()
        self.ws = nn.ParameterDict(
            {
                "inner": nn.Parameter(torch.randn(8, 16) / 3),
                "outer": nn.Parameter(torch.randn(16, 16) / 4),
            }
        )
        self.log_from_negative = log_from_negative

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(torch.tanh(x @ self.ws["inner"]) @ self.ws["outer"])
        return torch.log(x) if self.log_from_negative else x

    def poisoned(self) -> torch.Tensor:
        return self.ws["outer"]


class _LogOrTanh(nn.Module):
    def __init__(self, log_from_negative: bool) -> None:
        super().__init__()
        self.log_from_negative = log_from_negative

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log(h) if self.log_from_negative else torch.tanh(h)


class _Ensemble(nn.Module):
    """Five MLPs stacked by ``stack_module_state``, kept as this module's
    nn.Parameters in a ParameterList, run with ``functional_call`` under vmap."""

    def __init__(self, log_from_negative: bool = False) -> None:
        super().__init__()
        members = [
            nn.Sequential(nn.Linear(8, 16), _LogOrTanh(log_from_negative), nn.Linear(16, 2))
            for _ in range(5)
        ]
        params, _ = stack_module_state(members)
        self.names = list(params)
        self.flat = nn.ParameterList([nn.Parameter(params[n]) for n in self.names])
        self.__dict__["base"] = copy.deepcopy(members[0]).to("meta")  # a template, unregistered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = dict(zip(self.names, self.flat))

        def member(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return functional_call(self.base, p, (x,))

        return torch.vmap(member, in_dims=(0, None))(params, x).mean(0)

    def poisoned(self) -> torch.Tensor:
        return self.flat[0]


def _model(shape: str, log_from_negative: bool = False) -> tuple[nn.Module, nn.Module]:
    """The watched model, and the module holding the container."""
    torch.manual_seed(0)
    if shape == "ensemble":
        model = _Ensemble(log_from_negative)
        return model, model
    block = (_ListBlock if shape == "list" else _DictBlock)(log_from_negative)
    return nn.Sequential(nn.Linear(8, 8), block, nn.Linear(16, 2)), block


_HOLDER = {"list": "1", "dict": "1", "ensemble": ""}
_CONTAINER = {"list": "1.ws", "dict": "1.ws", "ensemble": "flat"}
_POISONED = {"list": "1.ws.1", "dict": "1.ws.outer", "ensemble": "flat.0"}


def _train(quiet_watch, model, check, before_forward=None, before_step=None, opt=None):
    opt = opt or torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt, nonfinite_forward={"check": check})
    generator = torch.Generator().manual_seed(1)
    for step in range(_STEPS):
        if before_forward is not None:
            before_forward(step)
        x = torch.randn(16, 8, generator=generator)
        loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
        opt.zero_grad()
        loss.backward()
        if before_step is not None:
            before_step(step)
        opt.step()
    monitor.close()
    return [a for a in monitor.alerts if a.severity != "info"]


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_nan_written_into_a_parameter_containers_weight_is_told_as_written(
    quiet_watch, shape, check
):
    model, holder = _model(shape)

    def write(step: int) -> None:
        if step == _AT:
            with torch.no_grad():
                holder.poisoned()[0, 0] = float("nan")

    alerts = _train(quiet_watch, model, check, before_forward=write)
    first = alerts[0]
    if check == "deferred":
        # No replay on this path: as for a direct nn.Parameter, both stories
        # are told, the module whose weights are non-finite named.
        assert (first.rule, first.step, first.module) == ("nonfinite_forward", _AT, _HOLDER[shape])
        assert first.data["cause"] == "module_or_parameter"
        return
    assert (first.rule, first.step, first.module) == ("nonfinite_parameter", _AT, _CONTAINER[shape])
    assert first.data["cause"] == "written"
    assert first.data["parameters"] == [_POISONED[shape]]
    assert not any(a.rule == "nonfinite_forward" for a in alerts)


@pytest.mark.parametrize("shape", ["list", "dict"])
def test_a_parameter_containers_weight_an_update_made_non_finite_is_told_at_that_update(
    quiet_watch, shape
):
    model, holder = _model(shape)
    poisoned = holder.poisoned()
    rest = [p for p in model.parameters() if p is not poisoned]
    opt = torch.optim.SGD([{"params": rest}, {"params": [poisoned], "lr": 1e30}], lr=1e-2)

    def blow_up(step: int) -> None:
        if step == _AT:
            poisoned.grad.fill_(1e10)  # finite gradient, an update past fp32's range

    alerts = _train(quiet_watch, model, "auto", before_step=blow_up, opt=opt)
    # A gradient written 1e11x its usual norm is an explosion too, told at that step.
    exploding = [(a.step, a.module) for a in alerts if a.rule == "exploding_gradient"]
    assert exploding[:1] == [(_AT, _CONTAINER[shape])]
    first = next(a for a in alerts if a.rule != "exploding_gradient")
    assert (first.rule, first.step, first.module) == ("nonfinite_parameter", _AT, _CONTAINER[shape])
    assert first.data["parameters"] == [_POISONED[shape]]
    assert "cause" not in first.data


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_healthy_module_with_a_parameter_container_is_silent(quiet_watch, shape, check):
    model, _ = _model(shape)
    assert _train(quiet_watch, model, check) == []


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_nan_born_in_the_forward_of_a_module_with_a_parameter_container_is_still_the_forwards(
    quiet_watch, shape, check
):
    """The log of a negative activation, every weight finite: born in the forward.
    (With no replay the weights are judged after this step's NaN update: both
    stories are told, as for weights held directly.)"""
    model, _ = _model(shape, log_from_negative=True)
    first = _train(quiet_watch, model, check)[0]
    assert (first.rule, first.step) == ("nonfinite_forward", 0)
    if check == "deferred":
        assert first.data["cause"] == "module_or_parameter"
        return
    assert first.data["cause"] == "module"
    assert first.data["op"] == "aten::log"
