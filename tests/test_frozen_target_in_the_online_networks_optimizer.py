"""A frozen EMA target kept in the optimizer beside the online network it follows.

A BYOL or mean-teacher target kept as a separate module, frozen and moved by EMA,
sometimes lands in the online network's optimizer too: harmless, its frozen
parameters get no gradient and the optimizer trains the online network. Under
``trainwatch run`` (or with each model watched) the target's monitor sees a
model whose every parameter is frozen, and used to warn (trainable_parameters)
that its optimizer "can change nothing", with advice about ``get_peft_model``;
the closing summary also ranked the online network's gradients as the target's
``<outside the model>``. The optimizer trains another model: nothing is told,
and the summary names each model's gradients once, under its own name. A model
entirely frozen whose optimizer holds nothing trainable is still told.
"""

from __future__ import annotations

import copy
import io
import json

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

EMA_TARGET = """
import copy
import sys
import torch
from torch import nn
from torch.nn import functional as F

how = sys.argv[1]
torch.manual_seed(0)
online = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
predictor = nn.Linear(8, 8)
target = copy.deepcopy(online)
target.requires_grad_(False)
if how == "all-frozen":
    # Nothing trains: every model frozen, and the optimizer holds only them.
    online.requires_grad_(False)
    predictor.requires_grad_(False)
params = [*online.parameters(), *predictor.parameters(), *target.parameters()]
opt = torch.optim.SGD(params, lr=0.05)
for step in range(12):
    x = torch.randn(32, 16)
    p = predictor(online(x + 0.1 * torch.randn_like(x)))
    with torch.no_grad():
        z = target(x + 0.1 * torch.randn_like(x))
    loss = 2 - 2 * F.cosine_similarity(p, z).mean()
    opt.zero_grad()
    if loss.requires_grad:
        loss.backward()
    opt.step()
    with torch.no_grad():
        for po, pt in zip(online.parameters(), target.parameters()):
            pt.mul_(0.99).add_(po, alpha=0.01)
"""


def _run(tmp_path, how: str, console: bool = False) -> list[dict]:
    script = tmp_path / "ema.py"
    script.write_text(EMA_TARGET)
    assert run_script(script, [how], log_dir=tmp_path / "log", console=console) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["severity"] in ("warning", "error")]


def test_run_frozen_ema_target_in_the_online_optimizer_is_silent(tmp_path, capsys):
    assert _run(tmp_path, "ema", console=True) == []
    err = capsys.readouterr().err
    # The online network's gradients are its own, not the target's (or the
    # predictor's) "<outside the model>".
    assert "<outside the model>" not in err, err
    assert "grad norm by layer" in err and "Sequential:0" in err, err


def test_run_every_model_frozen_with_nothing_to_train_is_still_told(tmp_path):
    found = _run(tmp_path, "all-frozen")
    told = [a for a in found if a["rule"] == "trainable_parameters"]
    assert told and all("can change nothing" in a["message"] for a in told)


def _pair(how: str) -> tuple[list[tw.Alert], list[tw.Alert]]:
    """The online network and its frozen EMA target, each watched with the one
    optimizer that holds both (``how``: "ema"), or a frozen model watched with an
    optimizer over its parameters alone ("alone")."""
    torch.manual_seed(0)
    online = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    target = copy.deepcopy(online).requires_grad_(False)
    params = list(target.parameters())
    if how == "ema":
        params = [*online.parameters(), *params]
    opt = torch.optim.SGD(params, lr=0.05)
    watched = tw.watch(online, opt if how == "ema" else None, console=io.StringIO())
    target_watch = tw.watch(target, opt, console=io.StringIO())
    try:
        for _ in range(4):
            x = torch.randn(32, 16)
            with torch.no_grad():
                z = target(x)
            opt.zero_grad()
            (2 - 2 * F.cosine_similarity(online(x), z).mean()).backward()
            opt.step()
            if how != "ema":
                watched.step()
            with torch.no_grad():
                for po, pt in zip(online.parameters(), target.parameters()):
                    pt.lerp_(po, 0.01)
        return watched.alerts, target_watch.alerts
    finally:
        target_watch.close()
        watched.close()


def _setup_warnings(alerts: list[tw.Alert]) -> list[tw.Alert]:
    return [a for a in alerts if a.rule == "trainable_parameters" and a.severity != "info"]


def test_watched_frozen_target_in_the_online_optimizer_is_silent():
    online, target = _pair("ema")
    assert _setup_warnings(online) == [] and _setup_warnings(target) == []


def test_watched_frozen_model_whose_only_optimizer_holds_nothing_trainable_is_told():
    _, target = _pair("alone")
    (alert,) = _setup_warnings(target)
    assert "can change nothing" in alert.message and alert.module == ""


@pytest.mark.parametrize("frozen_online", [False, True])
def test_one_watched_model_holding_a_frozen_target_part(quiet_watch, frozen_online):
    # The target inside the watched model (MoCo's recipe): silent while the online
    # part trains; with everything frozen, told.
    torch.manual_seed(0)
    model = nn.ModuleDict({"online": nn.Linear(8, 8), "target": nn.Linear(8, 8)})
    model["target"].requires_grad_(False)
    if frozen_online:
        model["online"].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = quiet_watch(model, opt)
    for _ in range(3):
        opt.zero_grad()
        out = model["online"](torch.randn(4, 8)) + model["target"](torch.randn(4, 8))
        if out.requires_grad:
            out.pow(2).mean().backward()
        opt.step()
    assert bool(_setup_warnings(monitor.alerts)) is frozen_online


class EmaModule(L.LightningModule):
    """A frozen EMA target as an attribute of the LightningModule, its optimizer built
    over every parameter (the target's frozen ones too)."""

    def __init__(self) -> None:
        super().__init__()
        self.online = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.predictor = nn.Linear(8, 8)
        self.target = copy.deepcopy(self.online).requires_grad_(False)

    def training_step(self, batch, _):
        (x,) = batch
        with torch.no_grad():
            z = self.target(x + 0.1 * torch.randn_like(x))
        p = self.predictor(self.online(x + 0.1 * torch.randn_like(x)))
        return 2 - 2 * F.cosine_similarity(p, z).mean()

    def on_train_batch_end(self, *_):
        with torch.no_grad():
            for po, pt in zip(self.online.parameters(), self.target.parameters()):
                pt.lerp_(po, 0.01)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_lightning_frozen_ema_target_attribute_in_the_optimizer_is_silent(tmp_path):
    torch.manual_seed(0)
    callback = TrainWatchCallback(console=False)
    data = DataLoader(TensorDataset(torch.randn(192, 16)), batch_size=32)
    quiet_trainer(tmp_path, [callback], max_steps=6).fit(EmaModule(), data)
    assert [a for a in callback.alerts if a.severity in ("warning", "error")] == []
