"""A parametrization's own parameters belong to the layer it parametrises: a LoRA
adapter registered with ``parametrize.register_parametrization`` (minLoRA style)
holds ``lora_A``/``lora_B`` in ``fc.parametrizations.weight.0``, and they are
``fc``'s in every finding and norm, as the parametrised weight itself is. So
``frozen_in_optimizer`` counts them among the layer's trainable parameters
beside its frozen base, instead of saying the layer has none."""

from __future__ import annotations

import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn
from torch.nn import functional as F

from tests.conftest import rules_of
from trainwatch.layers import LayerMap


class LoRA(nn.Module):
    """``W + B @ A``, B initialised to zero."""

    def __init__(self, out_features: int, in_features: int, rank: int = 4) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.randn(rank, in_features) * 0.1)
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + (self.lora_B @ self.lora_A).view_as(weight)


def _adapted(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
        model.requires_grad_(False)
        parametrize.register_parametrization(model[0], "weight", LoRA(32, 16))
    else:  # a conv net adapted at both convs (the weight flattened to out x rest)
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(8 * 8 * 8, 2),
        )
        model.requires_grad_(False)
        parametrize.register_parametrization(model[0], "weight", LoRA(8, 3 * 9))
        parametrize.register_parametrization(model[2], "weight", LoRA(8, 8 * 9))
        model[5].requires_grad_(True)  # the head trains whole
    return model


def _train(quiet_watch, kind: str, everything: bool):
    model = _adapted(kind)
    params = (
        model.parameters() if everything else [p for p in model.parameters() if p.requires_grad]
    )
    opt = torch.optim.AdamW(params, lr=1e-3)
    monitor = quiet_watch(model, opt)
    shape = (64, 16) if kind == "mlp" else (64, 3, 8, 8)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        x = torch.randn(*shape, generator=gen)
        y = (x.flatten(1)[:, 0] > 0).long()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return monitor


def test_lora_parameters_are_owned_by_the_layer_they_parametrise():
    layers = LayerMap(_adapted("mlp"))
    owners = {layers.info(p).name: layers.info(p).owner for p in layers.parameters()}
    assert owners["0.parametrizations.weight.0.lora_A"] == "0"
    assert owners["0.parametrizations.weight.0.lora_B"] == "0"
    assert owners["0.parametrizations.weight.original"] == "0"
    assert "0.parametrizations.weight.0" not in layers.layers


def test_frozen_base_in_the_optimizer_counts_the_layers_lora_parameters(quiet_watch):
    monitor = _train(quiet_watch, "mlp", everything=True)
    frozen = {a.module: a for a in monitor.alerts if a.rule == "frozen_in_optimizer"}
    assert set(frozen) == {"0", "2"}
    assert frozen["0"].data["trainable"] == 2
    assert "beside 2 trainable ones of this module" in frozen["0"].message
    assert frozen["2"].data["trainable"] == 0  # a layer frozen whole
    assert set(monitor.grad_norms()) == {"0"}  # the adapter's norm is its layer's


def test_frozen_convs_in_the_optimizer_count_their_lora_parameters(quiet_watch):
    monitor = _train(quiet_watch, "conv", everything=True)
    frozen = {a.module: a for a in monitor.alerts if a.rule == "frozen_in_optimizer"}
    assert set(frozen) == {"0", "2"}
    assert all(a.data["trainable"] == 2 for a in frozen.values())
    assert set(monitor.grad_norms()) == {"0", "2", "5"}


def test_control_an_optimizer_over_the_trainable_part_only_is_silent(quiet_watch):
    for kind in ("mlp", "conv"):
        monitor = _train(quiet_watch, kind, everything=False)
        assert rules_of(monitor) == [], kind
