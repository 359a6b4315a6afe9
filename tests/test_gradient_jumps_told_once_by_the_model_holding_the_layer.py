"""A gradient jump is told once per layer, by the monitor of the model holding it.

The usual metric-learning layout: a backbone and a margin head, separate modules
called one after the other, one SGD over both as param groups. ``trainwatch run``
watches each as a model of its own (a script may call ``tw.watch`` once for
each). Each monitor saw the other's parameters in the shared optimizer, outside
its model, and lumped them as one layer: a corrupt batch made the backbone's
monitor tell ``module='<outside the model>'`` (the head's weight, no module of
the backbone's) with its own layers as "other layers", and the head's monitor
tell the backbone's layers again. Now each monitor leaves out what another
monitor holding the optimizer tells, as ``frozen_in_optimizer`` does: the
backbone's alert names its own layers, the head's its own, and a bare tensor
beside them (a learned temperature) is told by one of them only.

Watched alone with an optimizer over both, the backbone's monitor still names the
head's weight ``<outside the model>`` (no monitor watches it), but among its own
layers, never in place of them. Clean twins stay silent.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import trainwatch as tw
from trainwatch.layers import EXTERNAL
from trainwatch.runner import run_script

CORRUPT_AT = 150
STEPS = 200


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 16) * 0.1)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return F.linear(feats, self.weight)


def _train(
    watch: str, corrupt: bool, temperature: bool = False, close_head_at: int | None = None
) -> dict[str, tw.Monitor]:
    """Backbone and head under one SGD; ``watch``: "both" or "backbone"."""
    torch.manual_seed(0)
    centers = torch.randn(8, 32) * 1.5
    backbone, head = Backbone(), Head()
    groups = [{"params": backbone.parameters()}, {"params": head.parameters()}]
    scale = nn.Parameter(torch.ones(()))  # a bare tensor beside them: no module holds it
    if temperature:
        groups.append({"params": [scale]})
    opt = torch.optim.SGD(groups, lr=0.01, momentum=0.9)
    monitors = {"Backbone": tw.watch(backbone, opt, console=False)}
    if watch == "both":
        monitors["Head"] = tw.watch(head, opt, console=False)
    for step in range(STEPS):
        if step == close_head_at:
            monitors["Head"].close()
        y = torch.randint(0, 8, (64,))
        x = centers[y] + torch.randn(64, 32)
        if corrupt and step == CORRUPT_AT:  # rescaled features, shuffled labels
            x, y = x * 30.0, y[torch.randperm(64)]
        logits = head(backbone(x))
        if temperature:
            logits = logits * scale
        loss = F.cross_entropy(logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for monitor in monitors.values():
        monitor.close()
    return monitors


def _jumps(alerts) -> list:
    return [a for a in alerts if a.rule == "exploding_gradient"]


def test_each_model_tells_its_own_layers_once_under_two_watches():
    monitors = _train("both", corrupt=True)
    backbone = _jumps(monitors["Backbone"].alerts)
    head = _jumps(monitors["Head"].alerts)
    assert [a.step for a in backbone] == [CORRUPT_AT]
    assert [a.step for a in head] == [CORRUPT_AT]
    assert backbone[0].module in dict(Backbone().named_modules())
    assert sorted(backbone[0].data["layers"]) == ["net.0", "net.2"]
    assert head[0].module == ""
    assert head[0].data["layers"] == [""]
    assert "other layers" not in head[0].message


def test_each_monitors_norms_are_its_own_models_layers():
    monitors = _train("both", corrupt=False)
    assert sorted(monitors["Backbone"].grad_norms()) == ["net.0", "net.2"]
    assert sorted(monitors["Head"].grad_norms()) == [""]


def test_two_watched_models_stay_silent_on_clean_data():
    monitors = _train("both", corrupt=False)
    assert [a for m in monitors.values() for a in m.alerts if a.severity != "info"] == []


def test_a_bare_tensor_beside_two_models_is_told_by_one_of_them():
    monitors = _train("both", corrupt=True, temperature=True)
    assert EXTERNAL in monitors["Backbone"].grad_norms()  # the first model in the optimizer
    assert EXTERNAL not in monitors["Head"].grad_norms()
    head_layers = {layer for a in _jumps(monitors["Head"].alerts) for layer in a.data["layers"]}
    assert head_layers == {""}
    jumps = _jumps(monitors["Backbone"].alerts)
    assert jumps[0].step == CORRUPT_AT
    assert jumps[0].module in ("net.0", "net.2")


def test_a_model_watched_alone_keeps_the_heads_weight_outside_among_its_own_layers():
    # No monitor watches the head: its weight is honestly outside the model, told
    # with the backbone's layers but never in their place.
    monitors = _train("backbone", corrupt=True)
    assert EXTERNAL in monitors["Backbone"].grad_norms()
    jumps = _jumps(monitors["Backbone"].alerts)
    assert [a.step for a in jumps] == [CORRUPT_AT]
    assert jumps[0].module in ("net.0", "net.2")
    assert EXTERNAL in jumps[0].data["layers"]


def test_a_model_watched_alone_is_silent_on_clean_data():
    monitors = _train("backbone", corrupt=False)
    assert [a for a in monitors["Backbone"].alerts if a.severity != "info"] == []


def test_the_heads_weight_is_told_again_once_its_monitor_closed():
    monitors = _train("both", corrupt=True, close_head_at=100)
    jumps = _jumps(monitors["Backbone"].alerts)
    assert [a.step for a in jumps] == [CORRUPT_AT]
    assert EXTERNAL in jumps[0].data["layers"]


SCRIPT = """
import sys
import torch, torch.nn as nn, torch.nn.functional as F


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))

    def forward(self, x):
        return self.net(x)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 16) * 0.1)

    def forward(self, feats, labels):
        return F.linear(feats, self.weight)


torch.manual_seed(0)
corrupt = sys.argv[1] == "corrupt"
centers = torch.randn(8, 32) * 1.5
backbone, head = Backbone(), Head()
opt = torch.optim.SGD(
    [{"params": backbone.parameters()}, {"params": head.parameters()}], lr=0.01, momentum=0.9
)
for step in range(200):
    y = torch.randint(0, 8, (64,))
    x = centers[y] + torch.randn(64, 32)
    if corrupt and step == 150:
        x, y = x * 30.0, y[torch.randperm(64)]
    loss = F.cross_entropy(head(backbone(x), y), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _run(tmp_path: Path, variant: str) -> list[dict]:
    script = tmp_path / "metric_learning.py"
    script.write_text(SCRIPT)
    log = tmp_path / variant
    assert run_script(script, [variant], log_dir=log, console=False) == 0
    return [json.loads(line) for line in (log / "alerts.jsonl").read_text().splitlines()]


def test_trainwatch_run_tells_each_layer_once_by_its_own_models_monitor(tmp_path):
    jumps = [a for a in _run(tmp_path, "corrupt") if a["rule"] == "exploding_gradient"]
    by_model = {a["data"]["model"]: a for a in jumps}
    assert sorted(by_model) == ["Backbone", "Head"] and len(jumps) == 2
    backbone, head = by_model["Backbone"], by_model["Head"]
    assert backbone["step"] == head["step"] == CORRUPT_AT
    assert backbone["module"] in ("net.0", "net.2")
    assert sorted(backbone["data"]["layers"]) == ["net.0", "net.2"]
    assert head["module"] == "" and head["data"]["layers"] == [""]


def test_trainwatch_run_of_the_clean_script_is_silent(tmp_path):
    assert [a for a in _run(tmp_path, "clean") if a["severity"] != "info"] == []
