"""A momentum or EMA target network in training mode under no_grad is part of training.

BYOL, MoCo and mean-teacher loops run a copy of the online network, updated from
it every step and never by backward, in training mode under ``no_grad`` on
purpose (its batch norm uses the batch's statistics). ``trainwatch run`` watches
that copy as a model of its own: its passes are not an evaluation that forgot
``model.eval()``. A frozen network that is never updated, run the same way (a
feature extractor for a perceptual loss left in training mode), still is.
"""

from __future__ import annotations

import json

import pytest
import torch

from trainwatch.collect.weights_moved import weights_fingerprint
from trainwatch.runner import run_script

SCRIPT = """
import copy
import sys
import torch
from torch import nn

how, views = sys.argv[1], int(sys.argv[2])


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, x):
        return self.net(x)


torch.manual_seed(0)
online = Encoder()
predictor = nn.Sequential(nn.Linear(8, 8))
target = copy.deepcopy(online)
target.requires_grad_(False)
opt = torch.optim.Adam([*online.parameters(), *predictor.parameters()], lr=1e-3)
for step in range(12):
    x = torch.randn(32, 16)
    view1, view2 = x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)
    with torch.no_grad():  # in training mode, on purpose
        aims = [target(view2)] + ([target(view1)] if views == 2 else [])
    similar = nn.functional.cosine_similarity
    loss = 2 - 2 * similar(predictor(online(view1)), aims[0]).mean()
    if views == 2:
        loss = loss + 2 - 2 * similar(predictor(online(view2)), aims[1]).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if how == "lerp":  # timm-style EMA
        with torch.no_grad():
            for t, o in zip(target.parameters(), online.parameters()):
                t.lerp_(o, 0.01)
    elif how == "data":  # MoCo's own code
        for t, o in zip(target.parameters(), online.parameters()):
            t.data = t.data * 0.99 + o.data * 0.01
    elif how == "data_in_place":  # DINO's own code
        with torch.no_grad():
            for t, o in zip(target.parameters(), online.parameters()):
                t.data.mul_(0.99).add_((1 - 0.99) * o.detach().data)
"""


def _eval_in_train(tmp_path, how: str, views: int) -> list[tuple[int, str | None]]:
    script = tmp_path / "byol.py"
    script.write_text(SCRIPT)
    run_script(script, [how, str(views)], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [
        (a["step"], a["module"])
        for a in map(json.loads, lines)
        if a["rule"] == "eval_in_train_mode"
    ]


@pytest.mark.parametrize("views", [1, 2])
@pytest.mark.parametrize("how", ["lerp", "data", "data_in_place"])
def test_an_ema_target_in_training_mode_under_no_grad_is_silent(tmp_path, how, views):
    assert _eval_in_train(tmp_path, how, views) == []


@pytest.mark.parametrize("views", [1, 2])
def test_a_frozen_network_never_updated_in_training_mode_under_no_grad_warns(tmp_path, views):
    assert _eval_in_train(tmp_path, "never", views) != []


def _fingerprint_devices() -> list:
    return ["cpu"] + (
        [pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else []
    )


@pytest.mark.parametrize("device", _fingerprint_devices())
def test_weights_written_into_data_in_place_are_a_move(device):
    layer = torch.nn.Linear(64, 64).to(device)
    before = weights_fingerprint(layer)
    layer.weight.data.mul_(0.99).add_(0.01)  # neither version counter nor storage changes
    assert weights_fingerprint(layer) != before


@pytest.mark.parametrize("device", _fingerprint_devices())
def test_weights_left_alone_are_no_move_even_with_a_nan(device):
    layer = torch.nn.Linear(64, 64).to(device)
    with torch.no_grad():
        layer.weight.fill_(float("nan"))
    assert weights_fingerprint(layer) == weights_fingerprint(layer)


EMA_EVALUATED = """
import copy
import sys
import torch
from torch import nn

forgot_eval = sys.argv[1] == "forgot_eval"
torch.manual_seed(0)
model = nn.Sequential(
    nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4)
)
ema = copy.deepcopy(model)
ema.requires_grad_(False)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x_val, y_val = torch.randn(1024, 16), torch.randint(0, 4, (1024,))
for step in range(60):
    if step % 25 == 0:  # the EMA copy's validation, one large batch
        if not forgot_eval:
            ema.eval()
        with torch.no_grad():
            accuracy = (ema(x_val).argmax(1) == y_val).float().mean().item()
        ema.train()
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(0.99).add_(p, alpha=0.01)
"""


def _ema_alerts(tmp_path, how: str) -> list[tuple[str, str | None]]:
    script = tmp_path / "ema.py"
    script.write_text(EMA_EVALUATED)
    run_script(script, [how], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [(a["rule"], a["module"]) for a in map(json.loads, lines)]


def test_an_ema_copy_evaluated_now_and_then_in_training_mode_warns(tmp_path):
    # Its weights move between its passes as a target's do, but a target runs at
    # every step: passes 25 steps apart are an evaluation that forgot ema.eval().
    assert ("eval_in_train_mode", "1") in _ema_alerts(tmp_path, "forgot_eval")


def test_an_ema_copy_evaluated_in_eval_mode_is_silent(tmp_path):
    assert _ema_alerts(tmp_path, "eval") == []


def test_a_target_network_lets_the_global_forward_hooks_come_off(tmp_path, capsys):
    # The hooks that find new models cost every module call in the process; a
    # target never trained by backward is no model still waiting for its optimizer.
    script = tmp_path / "byol.py"
    script.write_text(
        SCRIPT
        + "\nfrom torch.nn.modules import module as hooks\n"
        + "print('global forward hooks:', len(hooks._global_forward_pre_hooks))\n"
    )
    run_script(script, ["lerp", "2"], log_dir=tmp_path / "log", console=False)
    assert "global forward hooks: 0" in capsys.readouterr().out
    assert (tmp_path / "log" / "alerts.jsonl").read_text() == ""
