"""zero_gradient: a layer's gradient dropped by the loop between backward and the step.

SwAV keeps its prototypes out of the first updates (``p.grad = None`` for
``freeze_prototypes_niters`` iterations) and DINO its last layer during the first
epoch (``cancel_gradients_last_layer``): backward reaches the layer at every step
and the loop drops what it made, on purpose, while the rest of the model keeps
its gradients. That is no layer cut off by a ``.detach()``, no branch used on some
steps and no dead layer: nothing is told of it, before, during or after the
freeze, whether the drop comes before a clip or after it, sets the gradient to
None or zeroes it, in a plain loop, under ``trainwatch run`` or in a
LightningModule's hooks. Beside each: the same loop without the drop (silent),
and what is still told: a real ``.detach()``, a frozen layer left in the
optimizer, every gradient wiped between backward and the step.
"""

from __future__ import annotations

import json
import textwrap

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script


class SwAVLike(nn.Module):
    """A backbone, its L2-normalised output scored against learned prototypes.
    ``cut``: ``"backbone"`` detaches its output; ``"prototypes"`` detaches the
    prototypes' scores, the loss reaching the backbone through a second head."""

    def __init__(self, cut: str | None = None) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.prototypes = nn.Linear(16, 10, bias=False)
        self.cut = cut
        if cut == "prototypes":
            self.second_head = nn.Linear(16, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.normalize(self.backbone(x), dim=1)
        if self.cut == "backbone":
            return self.prototypes(z.detach())
        if self.cut == "prototypes":
            return self.prototypes(z).detach() + self.second_head(z)
        return self.prototypes(z)


class DINOLike(nn.Module):
    """A projection head and a weight-normalised last layer whose norm is frozen
    (DINO's ``norm_last_layer=True``): only its direction trains."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32))
        self.head = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))
        self.last_layer = nn.utils.parametrizations.weight_norm(nn.Linear(8, 12, bias=False))
        self.last_layer.parametrizations.weight.original0.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last_layer(F.normalize(self.head(self.backbone(x)), dim=1))


def _self_distillation_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The student's cross-entropy against sharpened targets from a second view
    (a stand-in for Sinkhorn codes or the teacher)."""
    student = model(x) / 0.1
    with torch.no_grad():
        targets = F.softmax(model(x + 0.1 * torch.randn_like(x)) / 0.05, dim=1)
    return -(targets * F.log_softmax(student, dim=1)).sum(1).mean()


def _drop(model: nn.Module, layer: str, how: str) -> None:
    for name, param in model.named_parameters():
        if name.startswith(layer) and param.grad is not None:
            if how == "none":
                param.grad = None
            else:
                param.grad.zero_()


def _dino_clip(model: nn.Module, clip: float) -> None:
    """DINO's own clip (utils.clip_gradients): each gradient rescaled through .data."""
    for param in model.parameters():
        if param.grad is not None:
            norm = param.grad.data.norm(2)
            coef = clip / (norm + 1e-6)
            if coef < 1:
                param.grad.data.mul_(coef)


def _train(
    model: nn.Module,
    monitor_of,
    *,
    layer: str,
    how: str | None,
    freeze: int,
    steps: int,
    clip: str | None = None,
    wipe_all: bool = False,
) -> list:
    torch.manual_seed(1)
    params = [p for p in model.parameters() if p.requires_grad or layer == "frozen"]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu") if clip == "scaler" else None
    monitor = monitor_of(model, opt)
    for step in range(steps):
        x = torch.randn(64, 16)
        opt.zero_grad()
        loss = _self_distillation_loss(model, x)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        if clip in ("norm", "scaler"):
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
        elif clip == "dino":
            _dino_clip(model, 3.0)
        if how is not None and step < freeze:
            _drop(model, layer, how)
        if wipe_all:
            opt.zero_grad()  # the bug: every gradient wiped before the step
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    monitor.close()
    return monitor.alerts


def _told(alerts) -> list[tuple[str, str | None, int, str | None]]:
    return [(a.rule, a.module, a.step, a.data.get("kind")) for a in alerts]


# A drop to None is told (wrongly) at once; one by zeroing after 50 steps of it.
_STEPS = {"none": (20, 30), "zero": (55, 60)}


@pytest.mark.parametrize("how", ["none", "zero"])
def test_swav_prototypes_frozen_for_the_first_iterations_are_silent(quiet_watch, how):
    torch.manual_seed(0)
    freeze, steps = _STEPS[how]
    alerts = _train(
        SwAVLike(), quiet_watch, layer="prototypes", how=how, freeze=freeze, steps=steps
    )
    assert _told(alerts) == []


def test_the_same_loop_without_the_freeze_is_silent(quiet_watch):
    torch.manual_seed(0)
    alerts = _train(SwAVLike(), quiet_watch, layer="prototypes", how=None, freeze=0, steps=30)
    assert _told(alerts) == []


@pytest.mark.parametrize("clip", [None, "norm", "dino", "scaler"])
@pytest.mark.parametrize("how", ["none", "zero"])
def test_dino_last_layer_cancelled_in_the_first_epoch_is_silent(quiet_watch, how, clip):
    """Cancelled without a clip, after clip_grad_norm_, after DINO's own clip through
    .data, and after a GradScaler's unscale_ and a clip."""
    torch.manual_seed(0)
    freeze, steps = _STEPS[how]
    alerts = _train(
        DINOLike(), quiet_watch, layer="last_layer", how=how, freeze=freeze, steps=steps, clip=clip
    )
    assert _told(alerts) == []


def test_a_freeze_begun_mid_run_draws_no_zero_gradient_finding(quiet_watch):
    """Its first step alone cannot be told from a layer backward missed (what
    backward left is not noted on the usual step); the steps after it can."""
    torch.manual_seed(0)
    model = SwAVLike()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = quiet_watch(model, opt)
    for step in range(40):
        opt.zero_grad()
        _self_distillation_loss(model, torch.randn(64, 16)).backward()
        if 7 <= step < 30:
            _drop(model, "prototypes", "none")
        opt.step()
    monitor.close()
    assert [a for a in monitor.alerts if a.rule == "zero_gradient"] == []


# The backbone's output detached before the prototypes: its layers get no gradient.
_BACKBONE_CUT = [
    ("zero_gradient", "backbone.0", 0, "none"),
    ("zero_gradient", "backbone.2", 0, "none"),
]


def test_a_layer_cut_off_by_detach_is_still_told(quiet_watch):
    torch.manual_seed(0)
    alerts = _train(
        SwAVLike(cut="backbone"), quiet_watch, layer="prototypes", how=None, freeze=0, steps=10
    )
    assert _told(alerts) == _BACKBONE_CUT


@pytest.mark.parametrize("how", [None, "none"])
def test_prototypes_cut_off_by_detach_are_told_whether_dropped_or_not(quiet_watch, how):
    """Backward never reaches them: there is nothing for the loop to drop."""
    torch.manual_seed(0)
    alerts = _train(
        SwAVLike(cut="prototypes"), quiet_watch, layer="prototypes", how=how, freeze=20, steps=10
    )
    assert _told(alerts) == [("zero_gradient", "prototypes", 0, "none")]


def test_a_frozen_layer_left_in_the_optimizer_is_still_told(quiet_watch):
    torch.manual_seed(0)
    model = SwAVLike()
    model.prototypes.requires_grad_(False)
    alerts = _train(model, quiet_watch, layer="frozen", how=None, freeze=0, steps=10)
    assert [(rule, module) for rule, module, *_ in _told(alerts)] == [
        ("frozen_in_optimizer", "prototypes")
    ]


@pytest.mark.parametrize("model_class", [SwAVLike, DINOLike])
def test_every_gradient_dropped_before_the_step_is_still_a_reset(quiet_watch, model_class):
    """The freeze's drop beside a zero_grad() wiping the rest: nothing is applied."""
    torch.manual_seed(0)
    layer = "prototypes" if model_class is SwAVLike else "last_layer"
    alerts = _train(
        model_class(), quiet_watch, layer=layer, how="none", freeze=20, steps=10, wipe_all=True
    )
    assert _told(alerts) == [("zero_gradient", "", 0, "reset_before_step")]


SCRIPT = """
import sys
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class SwAVLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.prototypes = nn.Linear(16, 10, bias=False)

    def forward(self, x):
        z = F.normalize(self.backbone(x), dim=1)
        return self.prototypes(z.detach() if sys.argv[1] == "cut" else z)


model = SwAVLike()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
freeze_prototypes_niters = 20
for iteration in range(30):
    x = torch.randn(64, 16)
    out = model(x) / 0.1
    with torch.no_grad():
        q = F.softmax(model(x + 0.1 * torch.randn_like(x)) / 0.05, dim=1)
    loss = -(q * F.log_softmax(out, dim=1)).sum(1).mean()
    opt.zero_grad()
    loss.backward()
    if sys.argv[1] == "freeze" and iteration < freeze_prototypes_niters:
        for name, p in model.named_parameters():
            if "prototypes" in name:
                p.grad = None
    opt.step()
"""


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["freeze", "cut"])
def test_trainwatch_run_of_an_unmodified_swav_script(tmp_path, variant):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "run"
    assert run_script(script, [variant], log_dir=out, console=False) == 0
    alerts = [json.loads(line) for line in (out / "alerts.jsonl").read_text().splitlines()]
    told = [(a["rule"], a["module"], a["step"], a["data"].get("kind")) for a in alerts]
    if variant == "freeze":
        assert told == []
    else:
        assert told == _BACKBONE_CUT


class DINOModule(pl.LightningModule):
    """DINO's last-layer freeze in a LightningModule, in the hook ``where`` names;
    ``manual``: manual optimisation, the drop between manual_backward and the step."""

    def __init__(self, where: str, how: str, freeze: int, manual: bool = False) -> None:
        super().__init__()
        self.net = DINOLike()
        self.where, self.how, self.freeze = where, how, freeze
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        loss = _self_distillation_loss(self.net, batch[0])
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        self._cancel()
        opt.step()
        return loss

    def _cancel(self) -> None:
        if self.global_step < self.freeze:
            _drop(self.net, "last_layer", self.how)

    def on_after_backward(self) -> None:
        if self.where == "on_after_backward":
            self._cancel()

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.where == "on_before_optimizer_step":
            self._cancel()

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64 * 60, 16, generator=gen))
        return DataLoader(data, batch_size=64, shuffle=True, generator=gen)


@pytest.mark.slow
@pytest.mark.parametrize(
    "where,how,manual",
    [
        ("on_after_backward", "none", False),
        ("on_after_backward", "zero", False),
        ("on_before_optimizer_step", "none", False),
        ("training_step", "none", True),
    ],
)
def test_lightning_module_cancelling_its_last_layer_is_silent(tmp_path, where, how, manual):
    torch.manual_seed(0)
    freeze, steps = _STEPS[how]
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(
        tmp_path, [callback], max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0
    )
    trainer.fit(DINOModule(where, how, freeze, manual=manual))
    assert _told(callback.alerts) == []
