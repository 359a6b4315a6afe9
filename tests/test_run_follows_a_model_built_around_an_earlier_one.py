"""trainwatch run watches a second phase's model built around part of the first one.

A script that pretrains an autoencoder and then fine-tunes a classifier built
around its encoder met the classifier with the encoder's parameters already
watched, as the autoencoder's: it was left alone, and the whole fine-tuning
phase went unwatched. Once the earlier model has not run for two of the new
model's optimizer steps, its monitor gives way to the new model's. Two
models sharing a trunk and trained together keep theirs.
"""

from __future__ import annotations

import json

import pytest

from tests.test_run import write
from trainwatch.runner import run_script

PHASES = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
x = torch.randn(256, 8)
y = (x[:, 0] > 0).long()
autoencoder = nn.Sequential()
autoencoder.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
autoencoder.decoder = nn.Linear(4, 8)
opt = torch.optim.Adam(autoencoder.parameters(), 1e-3)
for _ in range(20):  # pretraining
    opt.zero_grad()
    F.mse_loss(autoencoder(x), x).backward()
    opt.step()


class Classifier(nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.encoder(x))


model = Classifier(autoencoder.encoder)  # the decoder dropped, a new head
if sys.argv[1] != "encoder_left_out":
    autoencoder.encoder.requires_grad_(False)
opt = torch.optim.Adam(model.head.parameters(), 1e-3)
for _ in range(30):  # fine-tuning
    if sys.argv[1] != "forgot_zero_grad":
        opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
"""

SHARED_TRUNK = """
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
task_a = nn.Sequential(trunk, nn.Linear(16, 1))
task_b = nn.Sequential(trunk, nn.Linear(16, 2))
opt_a = torch.optim.Adam(task_a.parameters(), 1e-3)
opt_b = torch.optim.Adam(task_b[1].parameters(), 1e-3)
for _ in range(40):
    x = torch.randn(32, 8)
    opt_a.zero_grad()
    opt_b.zero_grad()
    loss = F.mse_loss(task_a(x), x[:, :1]) + F.cross_entropy(task_b(x), (x[:, 0] > 0).long())
    loss.backward()
    opt_a.step()
    opt_b.step()
"""


def _run(tmp_path, body: str, *args: str) -> tuple[list[tuple], int]:
    script = write(tmp_path, "train.py", body)
    assert run_script(script, list(args), log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [
        (a["rule"], a["module"], a["step"], a["data"].get("model"))
        for a in map(json.loads, lines)
        if a["severity"] != "info"
    ]
    steps = json.loads((tmp_path / "log" / "alert_counts.json").read_text())["steps"]
    return found, steps


@pytest.mark.parametrize(
    "case, expected",
    [
        ("healthy", []),
        ("forgot_zero_grad", [("accumulated_gradient", None, 3, "Classifier")]),
        (
            "encoder_left_out",
            [
                ("not_optimized", "encoder.0", 2, "Classifier"),
                ("not_optimized", "encoder.2", 2, "Classifier"),
            ],
        ),
    ],
)
def test_a_classifier_around_a_pretrained_encoder_is_watched(tmp_path, case, expected):
    found, steps = _run(tmp_path, PHASES, case)
    assert found == expected
    assert steps == 30  # the fine-tuning's steps, counted from its own first one


def test_two_models_sharing_a_trunk_and_trained_together_keep_their_monitors(tmp_path):
    found, steps = _run(tmp_path, SHARED_TRUNK)
    assert found == []
    assert steps == 40
