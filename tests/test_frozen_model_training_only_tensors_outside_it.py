"""A model frozen whole by mistake, its optimizer training only a tensor outside its layers.

A "freeze the backbone" loop that froze every parameter, with the optimizer built
the common way from the trainable parameters alone, leaves it a learnable
temperature (``log_t = nn.Parameter(...)``) beside the model or on the
LightningModule itself: the optimizer steps, the loss moves a little, and nothing
of the model trains. ``trainable_parameters`` tells it at step 0, at the model.

Silent: a frozen backbone with a trainable head inside the model; a linear probe
whose head is a module of its own (watched or not); a frozen feature extractor run
in eval mode or under ``no_grad`` with a bare-tensor head; a soft prompt outside
the model feeding the frozen model (prompt tuning).
"""

from __future__ import annotations

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

SCRIPT = """
import sys
import torch, torch.nn as nn, torch.nn.functional as F

how = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
part = model if how == "all" else model[0]
for p in part.parameters():          # "all": meant model[0].parameters()
    p.requires_grad_(False)
log_t = nn.Parameter(torch.zeros(()))
opt = torch.optim.Adam([p for p in [*model.parameters(), log_t] if p.requires_grad], lr=1e-3)
X = torch.randn(512, 16); Y = X[:, :4].argmax(1)
for step in range(20):
    idx = torch.randint(0, 512, (32,))
    opt.zero_grad()
    loss = F.cross_entropy(model(X[idx]) / log_t.exp(), Y[idx])
    loss.backward()
    opt.step()
"""

PROBE_SCRIPT = """
import torch, torch.nn as nn, torch.nn.functional as F

torch.manual_seed(0)
backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
backbone.requires_grad_(False)
head = nn.Linear(32, 4)
opt = torch.optim.Adam(head.parameters(), lr=1e-3)
X = torch.randn(512, 16); Y = X[:, :4].argmax(1)
for step in range(20):
    idx = torch.randint(0, 512, (32,))
    opt.zero_grad()
    F.cross_entropy(head(backbone(X[idx])), Y[idx]).backward()
    opt.step()
"""

NO_GRAD_PROBE = """
import torch, torch.nn as nn, torch.nn.functional as F

torch.manual_seed(0)
backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
backbone.requires_grad_(False)
w = nn.Parameter(torch.zeros(8))
opt = torch.optim.Adam([w], lr=1e-2)
X = torch.randn(512, 16); Y = (X[:, 0] > 0).float()
for step in range(20):
    idx = torch.randint(0, 512, (32,))
    with torch.no_grad():
        features = backbone(X[idx])
    opt.zero_grad()
    F.binary_cross_entropy_with_logits(features @ w, Y[idx]).backward()
    opt.step()
"""


def _setup_warnings(alerts) -> list:
    return [a for a in alerts if a.rule == "trainable_parameters" and a.severity != "info"]


def _loop(how: str) -> list[tw.Alert]:
    """A custom loop under ``tw.watch`` of the model: ``how`` plants the bug ("all"),
    or freezes the backbone alone on purpose ("backbone")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    (model if how == "all" else model[0]).requires_grad_(False)
    log_t = nn.Parameter(torch.zeros(()))
    opt = torch.optim.Adam([p for p in [*model.parameters(), log_t] if p.requires_grad], lr=1e-3)
    x, y = torch.randn(128, 16), torch.randint(0, 4, (128,))
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for step in range(8):
            idx = torch.arange(step * 16, step * 16 + 16)
            opt.zero_grad()
            F.cross_entropy(model(x[idx]) / log_t.exp(), y[idx]).backward()
            opt.step()
    return monitor.alerts


def test_watched_model_frozen_whole_with_only_a_temperature_in_the_optimizer_is_told():
    (alert,) = _setup_warnings(_loop("all"))
    assert alert.severity == "warning" and alert.step == 0 and alert.module == ""
    assert "no trainable parameter" in alert.hint and "outside it" in alert.hint
    assert alert.data["finding"] == "only tensors outside the model train"
    assert alert.data["outside"] == 1


def test_watched_backbone_frozen_with_the_head_training_is_silent():
    assert _setup_warnings(_loop("backbone")) == []


def _run(tmp_path, script: str, args: list[str]) -> list[dict]:
    path = tmp_path / "train.py"
    path.write_text(script)
    assert run_script(path, args, log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["severity"] in ("warning", "error")]


def test_run_unmodified_script_model_frozen_whole_is_told(tmp_path):
    told = [a for a in _run(tmp_path, SCRIPT, ["all"]) if a["rule"] == "trainable_parameters"]
    assert len(told) == 1, told
    assert told[0]["step"] == 0 and told[0]["module"] == ""
    assert "no trainable parameter" in told[0]["hint"]


@pytest.mark.parametrize(
    "script,args", [(SCRIPT, ["backbone"]), (PROBE_SCRIPT, []), (NO_GRAD_PROBE, [])]
)
def test_run_backbone_frozen_on_purpose_is_silent(tmp_path, script, args):
    assert _run(tmp_path, script, args) == []


def _probe(how: str) -> list[tw.Alert]:
    """A frozen backbone watched alone, fed to what trains outside it.

    "module": a linear probe, the head an ``nn.Linear`` of its own watched with its
    optimizer, the backbone watched without one, in training mode with gradients
    on; "eval" / "no_grad": a learned-scalar head (a bare tensor of 8 weights) in
    the backbone's optimizer, the backbone run as a fixed feature extractor;
    "prompt": a soft prompt outside the model added to its input (prompt tuning).
    """
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    backbone.requires_grad_(False)
    head = nn.Linear(8, 1)
    weight = nn.Parameter(torch.randn(8) * 0.1)
    prompt = nn.Parameter(torch.zeros(16))
    params = {"module": list(head.parameters()), "prompt": [prompt]}.get(how, [weight])
    opt = torch.optim.Adam(params, lr=1e-3)
    if how == "eval":
        backbone.eval()
    x = torch.randn(128, 16)
    y = (x[:, 0] > 0).float()
    monitor = tw.watch(backbone, None if how == "module" else opt, console=io.StringIO())
    head_monitor = tw.watch(head, opt, console=io.StringIO()) if how == "module" else None
    try:
        for step in range(8):
            batch = x[step * 16 : step * 16 + 16]
            opt.zero_grad()
            if how == "no_grad":
                with torch.no_grad():
                    features = backbone(batch)
            else:
                features = backbone(batch + prompt if how == "prompt" else batch)
            logits = head(features).squeeze(1) if how == "module" else features @ weight
            F.binary_cross_entropy_with_logits(logits, y[step * 16 : step * 16 + 16]).backward()
            opt.step()
            if how == "module":
                monitor.step()
    finally:
        monitor.close()
        if head_monitor is not None:
            head_monitor.close()
    return monitor.alerts + (head_monitor.alerts if head_monitor is not None else [])


@pytest.mark.parametrize("how", ["module", "eval", "no_grad", "prompt"])
def test_watched_frozen_backbone_fixed_on_purpose_is_silent(how):
    assert _setup_warnings(_probe(how)) == []


def test_watched_frozen_backbone_with_a_learned_scalar_head_in_training_mode_is_told():
    # The same bare-tensor head as "eval" and "no_grad" above, the backbone run in
    # training mode with gradients on: no different from a model frozen by mistake.
    (alert,) = _setup_warnings(_probe("train"))
    assert alert.step == 0 and alert.module == "" and alert.data["outside"] == 1


class Classifier(L.LightningModule):
    """A backbone and head; ``frozen``: "all" (the bug) or "backbone" (on purpose).

    The learned temperature is the LightningModule's own parameter; the optimizer is
    built from the trainable parameters, as configure_optimizers usually does.
    """

    def __init__(self, frozen: str) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)
        self.log_t = nn.Parameter(torch.zeros(()))
        (self if frozen == "all" else self.backbone).requires_grad_(False)
        self.log_t.requires_grad_(True)

    def training_step(self, batch, _):
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)) / self.log_t.exp(), y)

    def configure_optimizers(self):
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-3)


@pytest.mark.parametrize("frozen", ["all", "backbone"])
def test_lightning_module_frozen_whole_but_its_temperature(tmp_path, frozen):
    torch.manual_seed(0)
    callback = TrainWatchCallback(console=False)
    x = torch.randn(128, 16)
    data = DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=16)
    quiet_trainer(tmp_path, [callback], max_steps=6).fit(Classifier(frozen), data)
    told = _setup_warnings(callback.alerts)
    if frozen == "backbone":
        assert told == []
        return
    (alert,) = told
    assert alert.step == 0 and alert.module == "" and alert.severity == "warning"
    assert alert.data["parameters"] == ["log_t"] and alert.data["outside"] == 0


class Prototypes(nn.Module):
    """A frozen encoder and class prototypes of the model's own, compared by cosine
    similarity: the prototypes alone train, on purpose (the encoder left in training
    mode, with gradients on)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.encoder.requires_grad_(False)
        self.prototypes = nn.Parameter(torch.randn(size, 8))

    def forward(self, x):
        return F.normalize(self.encoder(x), dim=1) @ F.normalize(self.prototypes, dim=1).T


@pytest.mark.parametrize("classes,told", [(4, False), (1, True)])
def test_watched_model_training_its_own_parameters_beside_frozen_layers(classes, told):
    # Four prototypes (32 elements) are a classifier trained on purpose; one row of
    # 8 is no more than a learned scalar or two, told as the frozen model.
    torch.manual_seed(0)
    model = Prototypes(classes)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x, y = torch.randn(64, 16), torch.randint(0, classes, (64,))
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for step in range(4):
            opt.zero_grad()
            logits = model(x[step * 16 : step * 16 + 16])
            target = y[step * 16 : step * 16 + 16]
            loss = F.cross_entropy(logits, target) if classes > 1 else logits.pow(2).mean()
            loss.backward()
            opt.step()
    found = _setup_warnings(monitor.alerts)
    assert bool(found) is told, found
    if told:
        assert found[0].data["parameters"] == ["prototypes"] and found[0].module == ""
