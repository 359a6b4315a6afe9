"""A BYOL target fed gradients: a copy of only part of the online network.

BYOL's target network copies the online network's backbone and projector, not
its predictor; no optimizer holds it and the loop moves it by EMA. Computed
without ``torch.no_grad()``, backward writes gradients into it, where nothing
resets them. Its parameters match no trained model shape for shape in full,
only a run of the online network's, so it used to be told as a hand-written
update missing ``zero_grad()`` (a separate target) or as parts left out of the
optimizer (a target held in a LightningModule): both wrong, the fix is
``torch.no_grad()``. It is now told as a target receiving gradients
(``data.kind: target_receives_gradients``, ``data.copied_parts``), whether it
keeps the online network's names or wraps the copies in a container of its own.
A model of its own initialization that merely shares some layer shapes is no
copy: it keeps the usual message.
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

BYOL_SCRIPT = """
import copy
import sys
import torch
from torch import nn
from torch.nn import functional as F

how, target_kind = sys.argv[1], sys.argv[2]


def mlp(i, h, o):
    return nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, o))


class Online(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = mlp(16, 32, 32)
        self.projector = mlp(32, 32, 8)
        self.predictor = mlp(8, 16, 8)

    def forward(self, x):
        return self.predictor(self.projector(self.backbone(x)))


class Target(nn.Module):
    def __init__(self, online, full):
        super().__init__()
        self.backbone = copy.deepcopy(online.backbone)
        self.projector = copy.deepcopy(online.projector)
        if full:
            self.predictor = copy.deepcopy(online.predictor)  # unused

    def forward(self, x):
        return self.projector(self.backbone(x))


torch.manual_seed(0)
online = Online()
if target_kind == "sequential":
    target = nn.Sequential(copy.deepcopy(online.backbone), copy.deepcopy(online.projector))
else:
    target = Target(online, full=target_kind == "full")
opt = torch.optim.SGD(online.parameters(), lr=0.05, momentum=0.9)
followed = [*online.backbone.parameters(), *online.projector.parameters()]
for step in range(8):
    x = torch.randn(32, 16)
    v1, v2 = x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)
    p1, p2 = online(v1), online(v2)
    if how == "bug":
        z1, z2 = target(v1), target(v2)
    else:
        with torch.no_grad():
            z1, z2 = target(v1), target(v2)
    loss = 4 - 2 * F.cosine_similarity(p1, z2).mean() - 2 * F.cosine_similarity(p2, z1).mean()
    if how != "no-reset" or step < 2:
        opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        for po, pt in zip(followed, target.parameters()):
            pt.mul_(0.99).add_(po, alpha=0.01)
"""


def _run(tmp_path, *args: str) -> list[dict]:
    script = tmp_path / "byol.py"
    script.write_text(BYOL_SCRIPT)
    assert run_script(script, list(args), log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["severity"] in ("warning", "error")]


def _told_as_target(message: str, hint: str, data: dict) -> bool:
    return (
        data.get("kind") == "target_receives_gradients"
        and "torch.no_grad()" in message
        and "torch.no_grad()" in hint
        and "zero_grad() is missing" not in message
        and "add_param_group" not in message
    )


# -- trainwatch run of an unmodified script ----------------------------------------------
@pytest.mark.parametrize("target_kind", ["named", "sequential"])
def test_run_byol_target_fed_gradients_is_told_as_a_target(tmp_path, target_kind):
    (alert,) = _run(tmp_path, "bug", target_kind)
    assert (alert["rule"], alert["step"]) == ("accumulated_gradient", 1)
    assert _told_as_target(alert["message"], alert["hint"], alert["data"])
    assert alert["data"]["copy_of"] == "Online"
    assert alert["data"]["copied_parts"] == ["backbone", "projector"]
    assert "the copy of Online's backbone and projector" in alert["message"]


@pytest.mark.parametrize("target_kind", ["named", "sequential"])
def test_run_byol_target_under_no_grad_is_silent(tmp_path, target_kind):
    assert _run(tmp_path, "clean", target_kind) == []


def test_run_a_full_copy_target_fed_gradients_is_still_told_as_the_copy_of_the_model(tmp_path):
    (alert,) = _run(tmp_path, "bug", "full")
    assert alert["rule"] == "accumulated_gradient"
    assert _told_as_target(alert["message"], alert["hint"], alert["data"])
    assert alert["data"]["copy_of"] == "Online" and "copied_parts" not in alert["data"]


def test_run_online_network_missing_its_reset_keeps_the_usual_message(tmp_path):
    (alert,) = _run(tmp_path, "no-reset", "named")
    assert (alert["rule"], alert["data"]["model"]) == ("accumulated_gradient", "Online")
    assert "zero_grad() is missing" in alert["message"] and "kind" not in alert["data"]


# -- tw.watch: the online network and its target, each watched ---------------------------
def _mlp(i: int, h: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, o))


class Online(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = _mlp(16, 32, 32)
        self.projector = _mlp(32, 32, 8)
        self.predictor = _mlp(8, 16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.predictor(self.projector(self.backbone(x)))


def _watched_byol(how: str) -> list[tw.Alert]:
    """The online network watched with its optimizer, the target (``how``: a copy of
    its backbone and projector, or a model of its own initialization and those
    shapes) watched on its own and stepped by hand after each update."""
    torch.manual_seed(0)
    online = Online()
    if how == "own-init":
        target = nn.Sequential(_mlp(16, 32, 32), _mlp(32, 32, 8))
    else:
        target = nn.Sequential(copy.deepcopy(online.backbone), copy.deepcopy(online.projector))
    opt = torch.optim.SGD(online.parameters(), lr=0.05, momentum=0.9)
    followed = [*online.backbone.parameters(), *online.projector.parameters()]
    watched = tw.watch(online, opt, console=io.StringIO())
    target_watch = tw.watch(target, console=io.StringIO())
    try:
        for _ in range(6):
            x = torch.randn(32, 16)
            p = online(x + 0.1 * torch.randn_like(x))
            with torch.no_grad() if how == "no_grad" else torch.enable_grad():
                z = target(x + 0.1 * torch.randn_like(x))
            opt.zero_grad()
            (2 - 2 * F.cosine_similarity(p, z).mean()).backward()
            opt.step()
            with torch.no_grad():
                for po, pt in zip(followed, target.parameters()):
                    pt.lerp_(po, 0.01)
            target_watch.step()
        alerts = [*watched.alerts, *target_watch.alerts]
        return [a for a in alerts if a.severity in ("warning", "error")]
    finally:
        target_watch.close()
        watched.close()


def test_watched_byol_target_fed_gradients_is_told_as_a_target():
    (alert,) = _watched_byol("deepcopy")
    assert (alert.rule, alert.step) == ("accumulated_gradient", 1)
    assert _told_as_target(alert.message, alert.hint, alert.data)
    assert alert.data["copy_of"] == "Online"
    assert alert.data["copied_parts"] == ["backbone", "projector"]


def test_watched_byol_target_under_no_grad_is_silent():
    assert _watched_byol("no_grad") == []


def test_a_model_of_its_own_init_sharing_layer_shapes_is_no_copy():
    # Hand-updated, its gradients never reset, and far from the online network's
    # weights: a hand-written update missing its reset, as before.
    (alert,) = _watched_byol("own-init")
    assert alert.rule == "accumulated_gradient"
    assert "zero_grad() is missing" in alert.message and "kind" not in alert.data


# -- Lightning: the target an attribute of the LightningModule ---------------------------
class BYOL(L.LightningModule):
    """``layout``: "nested" (``self.online`` and ``self.target``, a copy of its backbone
    and projector) or "flat" (backbone, projector and predictor on the module, the
    target an ``nn.Sequential`` of copies); ``how``: "bug" or "no_grad"."""

    def __init__(self, layout: str, how: str) -> None:
        super().__init__()
        self.how = how
        if layout == "nested":
            self.online = Online()
            self.target = nn.Module()
            self.target.backbone = copy.deepcopy(self.online.backbone)
            self.target.projector = copy.deepcopy(self.online.projector)
            parts = self.online
        else:
            self.backbone = _mlp(16, 32, 32)
            self.projector = _mlp(32, 32, 8)
            self.predictor = _mlp(8, 16, 8)
            self.target = nn.Sequential(copy.deepcopy(self.backbone), copy.deepcopy(self.projector))
            parts = self
        self.parts = [parts.backbone, parts.projector, parts.predictor]

    def _online(self, x: torch.Tensor) -> torch.Tensor:
        backbone, projector, predictor = self.parts
        return predictor(projector(backbone(x)))

    def _target(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.target.children():
            x = part(x)
        return x

    def training_step(self, batch, _):
        (x,) = batch
        v1, v2 = x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)
        p1, p2 = self._online(v1), self._online(v2)
        with torch.no_grad() if self.how == "no_grad" else torch.enable_grad():
            z1, z2 = self._target(v1), self._target(v2)
        return 4 - 2 * F.cosine_similarity(p1, z2).mean() - 2 * F.cosine_similarity(p2, z1).mean()

    def on_train_batch_end(self, *_):
        followed = [p for part in self.parts[:2] for p in part.parameters()]
        with torch.no_grad():
            for po, pt in zip(followed, self.target.parameters()):
                pt.mul_(0.99).add_(po, alpha=0.01)

    def configure_optimizers(self):
        return torch.optim.SGD([p for part in self.parts for p in part.parameters()], lr=0.05)


def _lightning(tmp_path, layout: str, how: str) -> list[tw.Alert]:
    torch.manual_seed(0)
    callback = TrainWatchCallback(console=False)
    data = DataLoader(TensorDataset(torch.randn(192, 16)), batch_size=32)
    quiet_trainer(tmp_path, [callback], max_steps=6).fit(BYOL(layout, how), data)
    return [a for a in callback.alerts if a.severity in ("warning", "error")]


@pytest.mark.parametrize(
    ("layout", "parts"),
    [
        ("nested", ["online.backbone", "online.projector"]),
        ("flat", ["backbone", "projector"]),
    ],
)
def test_lightning_byol_target_fed_gradients_is_told_as_a_target(tmp_path, layout, parts):
    (alert,) = _lightning(tmp_path, layout, "bug")
    assert (alert.rule, alert.module) == ("accumulated_gradient", "target")
    assert _told_as_target(alert.message, alert.hint, alert.data)
    assert alert.data["copy"] == "target" and alert.data["copied_parts"] == parts
    assert f"a copy of {parts[0]} and {parts[1]} inside this model" in alert.message


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_lightning_byol_target_under_no_grad_is_silent(tmp_path, layout):
    assert _lightning(tmp_path, layout, "no_grad") == []
