"""dead_units: a ReLU layer whose outputs are zero for nearly every unit and sample."""

from __future__ import annotations

import json

import torch
from torch import nn

from tests.conftest import batches, rules_of
from trainwatch.runner import run_script


class ReluNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(32, 32)
        self.act2 = nn.ReLU()
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act2(self.fc2(self.act1(self.fc1(x)))))


def _train(model, opt, steps: int, plant=None) -> None:
    for step, (x, y) in enumerate(batches(steps)):
        if plant is not None:
            plant(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _kill(model: ReluNet) -> None:
    with torch.no_grad():
        model.fc2.bias.fill_(-100.0)  # what one huge update does to a layer


def test_layer_killed_mid_training_is_named_at_the_first_sampled_step(quiet_watch):
    torch.manual_seed(0)
    model = ReluNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, dead_units={"every": 10})
    _train(model, opt, 45, plant=lambda step: step == 12 and _kill(model))
    (alert,) = [a for a in monitor.alerts if a.rule == "dead_units"]
    assert (alert.step, alert.module) == (20, "act2")  # sampled: steps 0-4, 10, 20, 30...
    assert alert.data["zero_fraction"] == 1.0 and alert.data["dead_fraction"] == 1.0
    assert "100.0%" in alert.message


def test_dead_from_the_start_is_caught_at_step_0(quiet_watch):
    torch.manual_seed(0)
    model = ReluNet()
    _kill(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _train(model, opt, 3)
    (alert,) = [a for a in monitor.alerts if a.rule == "dead_units"]
    assert (alert.step, alert.module) == (0, "act2")


def test_healthy_relu_network_is_silent(quiet_watch):
    torch.manual_seed(0)
    model = ReluNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt, dead_units={"every": 5})
    _train(model, opt, 60)
    assert rules_of(monitor) == []


def _kill_half(model: ReluNet) -> None:
    with torch.no_grad():
        model.fc2.bias[:16].fill_(-100.0)  # half of act2's units never fire again


def test_threshold_is_the_share_of_units_zero_for_every_sampled_row(quiet_watch):
    torch.manual_seed(0)
    model = ReluNet()
    _kill_half(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, dead_units={"threshold": 0.4, "every": 1})
    _train(model, opt, 3)
    (alert,) = [a for a in monitor.alerts if a.rule == "dead_units"]
    assert alert.module == "act2" and 0.4 <= alert.data["dead_fraction"] < 0.6


def test_half_dead_layer_is_silent_at_the_default_threshold(quiet_watch):
    torch.manual_seed(0)
    model = ReluNet()
    _kill_half(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, dead_units={"every": 1})
    _train(model, opt, 3)
    assert "dead_units" not in rules_of(monitor)


class SparseAutoencoder(nn.Module):
    """Dictionary learning's shape: ReLU latents at well under 1% density, each sample
    its own few units (most outputs zero by design)."""

    def __init__(self, inputs: int = 32, latents: int = 512) -> None:
        super().__init__()
        self.enc = nn.Linear(inputs, latents)
        self.act = nn.ReLU()
        self.dec = nn.Linear(latents, inputs, bias=False)
        with torch.no_grad():
            self.dec.weight.copy_(nn.functional.normalize(torch.randn(inputs, latents), dim=0))
            self.enc.weight.copy_(self.dec.weight.t())
            self.enc.bias.fill_(-1.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        latents = self.act(self.enc(x))
        return self.dec(latents), latents


def _train_sparse(model: SparseAutoencoder, opt, steps: int, plant=None) -> list[float]:
    dictionary = nn.functional.normalize(torch.randn(200, 32), dim=1)
    density = []
    for step in range(steps):
        if plant is not None:
            plant(step)
        codes = (torch.rand(64, 200) < 0.01).float() * torch.rand(64, 200) * 3
        x = codes @ dictionary + 0.01 * torch.randn(64, 32)
        rec, latents = model(x)
        loss = nn.functional.mse_loss(rec, x) + 1e-2 * latents.abs().sum(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        density.append((latents > 0).float().mean().item())
    return density


def test_sparse_code_with_different_units_per_sample_is_silent(quiet_watch):
    torch.manual_seed(0)
    model = SparseAutoencoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt, dead_units={"every": 2})
    density = _train_sparse(model, opt, 40)
    assert max(density) < 0.01  # sparse all along: over 99% of outputs are zero
    assert "dead_units" not in rules_of(monitor)


def test_sparse_code_whose_latents_all_die_is_named(quiet_watch):
    torch.manual_seed(0)
    model = SparseAutoencoder()

    def plant(step: int) -> None:
        if step == 20:
            with torch.no_grad():
                model.enc.bias.fill_(-100.0)

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt, dead_units={"every": 2})
    _train_sparse(model, opt, 40, plant)
    (alert,) = [a for a in monitor.alerts if a.rule == "dead_units"]
    assert (alert.step, alert.module) == (20, "act")


SAE_SCRIPT = """
import sys
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
dictionary = F.normalize(torch.randn(200, 32), dim=1)
b_dec = nn.Parameter(torch.zeros(32))
enc, dec = nn.Linear(32, 1024), nn.Linear(1024, 32, bias=False)
with torch.no_grad():
    dec.weight.copy_(F.normalize(torch.randn(32, 1024), dim=0))
    enc.weight.copy_(dec.weight.t())
    enc.bias.fill_(-1.5)
model = nn.Sequential(enc, nn.ReLU())
opt = torch.optim.Adam([b_dec, *model.parameters(), *dec.parameters()], lr=1e-3)
for step in range(55):
    if sys.argv[1] == "killed" and step == 10:
        with torch.no_grad():
            enc.bias.fill_(-100.0)
    codes = (torch.rand(256, 200) < 0.01).float() * torch.rand(256, 200) * 3
    x = codes @ dictionary + 0.01 * torch.randn(256, 32)
    f = model(x - b_dec)
    rec = dec(f) + b_dec
    loss = F.mse_loss(rec, x) + 1e-2 * f.abs().sum(1).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        dec.weight.div_(dec.weight.norm(dim=0, keepdim=True))
"""


def _dead_units_under_run(tmp_path, how: str) -> list[tuple[int, str | None]]:
    script = tmp_path / "sae.py"
    script.write_text(SAE_SCRIPT)
    run_script(script, [how], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [(a["step"], a["module"]) for a in map(json.loads, lines) if a["rule"] == "dead_units"]


def test_sparse_autoencoder_under_trainwatch_run_is_silent(tmp_path):
    assert _dead_units_under_run(tmp_path, "healthy") == []


def test_sparse_autoencoder_whose_latents_die_under_trainwatch_run_is_named(tmp_path):
    # The watched model's output is its ReLU's: named as the model's ("").
    assert _dead_units_under_run(tmp_path, "killed") == [(25, "")]
