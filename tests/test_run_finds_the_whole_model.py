"""``trainwatch run``: a part of the model called on its own before training (a shape
check on the encoder, ``spectral_norm``'s parametrization run while a layer is
built) does not stand in for the model; the whole model is watched, names are
relative to it, and a planted bug in the part is still found. Each beside a
clean control."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from trainwatch.runner import run_script

SHAPE_CHECK_FIRST = """
import sys
import torch
from torch import nn

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        features = self.encoder(x)
        if sys.argv[1] == "detach":
            features = features.detach()  # planted: the encoder is cut out of the graph
        return self.head(features)


model = Net()
print("feature shape", tuple(model.encoder(torch.randn(2, 8)).shape))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(12):
    x = torch.randn(32, 8)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), x[:, :1]).backward()
    opt.step()
"""

PARAMETRIZED = """
import sys
import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

torch.manual_seed(0)


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = weight_norm(nn.Conv1d(1, 8, 5, padding=2))
        self.c2 = spectral_norm(nn.Conv1d(8, 8, 5, padding=2))  # runs while it is built
        self.fc = spectral_norm(nn.Linear(8, 8))
        self.out = nn.Conv1d(8, 1, 1)

    def forward(self, x):
        h = torch.relu(self.c1(x))
        if sys.argv[1] == "detach":
            h = h.detach()  # planted: c1 is cut out of the graph
        h = torch.relu(self.c2(h)) + h
        h = self.fc(h.transpose(1, 2)).transpose(1, 2) + h
        return self.out(h)


model = Denoiser()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(12):
    clean = torch.sin(torch.linspace(0, 6, 64) * (1 + torch.rand(16, 1))).unsqueeze(1)
    noisy = clean + 0.3 * torch.randn_like(clean)
    opt.zero_grad()
    nn.functional.mse_loss(model(noisy), clean).backward()
    opt.step()
"""


def _run(tmp_path: Path, body: str, mode: str, capsys) -> tuple[list[dict], str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    log = tmp_path / "log"
    assert run_script(script, [mode], log_dir=log, console=True) == 0
    found = [json.loads(line) for line in (log / "alerts.jsonl").read_text().splitlines()]
    captured = capsys.readouterr()
    return found, captured.out + captured.err


def test_a_shape_check_on_the_encoder_first_leaves_the_whole_model_watched(tmp_path, capsys):
    found, out = _run(tmp_path, SHAPE_CHECK_FIRST, "clean", capsys)
    assert found == []
    assert "setup of Net" in out and "Sequential" not in out
    assert "grad norm by layer, latest step: " in out and "encoder.0" in out


def test_a_detached_encoder_after_a_shape_check_is_named_in_the_whole_model(tmp_path, capsys):
    found, _ = _run(tmp_path, SHAPE_CHECK_FIRST, "detach", capsys)
    zero = [a for a in found if a["rule"] == "zero_gradient"]
    assert [(a["module"], a["step"], a["data"]["model"]) for a in zero] == [("encoder.0", 0, "Net")]


def test_spectral_norm_run_while_built_leaves_the_whole_model_watched(tmp_path, capsys):
    found, out = _run(tmp_path, PARAMETRIZED, "clean", capsys)
    assert found == []
    assert "setup of Denoiser" in out and "ParametrizationList" not in out


def test_a_detached_parametrized_layer_is_named_in_the_whole_model(tmp_path, capsys):
    found, _ = _run(tmp_path, PARAMETRIZED, "detach", capsys)
    zero = [a for a in found if a["rule"] == "zero_gradient"]
    assert [(a["module"], a["step"], a["data"]["model"]) for a in zero] == [("c1", 0, "Denoiser")]
