"""A network frozen all but its head, the optimizer built over ``model.parameters()``,
is one ``frozen_in_optimizer`` warning, at the root.

The transfer-learning tutorial's fixed feature extractor freezes every parameter of
a torchvision ResNet and replaces ``fc``; written with ``SGD(model.parameters())``
it used to be told as six warnings, one per top-level part of the frozen backbone
(``conv1``, ``bn1``, ``layer1`` … ``layer4``), since its stem and stages sit directly
on the root beside the trained ``fc`` and no one module below the root holds them
all. The same one decision made them all: now frozen subtrees one after the other
in the model's order, nothing trained or held between them, are one part, told at
the module holding them all (the root here), ``data.parts`` naming the subtrees and
``data.rest`` what that module holds besides (``fc``). Fine-tuning's "freeze the
embeddings and the first encoder layers" is one part too, at ``bert``.

It stays a warning, as the frozen ``bert`` beside its trained classifier always was:
at step 0 a fixed feature extractor cannot be told from a warm-up freeze never undone,
which is what the rule is for; an unfreeze withdraws it, and the optimizer built over
the trainable parameters only says the freeze is meant (the healthy twins below).
Frozen parts apart (a frozen encoder and a frozen decoder, the middle trained between
them) stay two alerts, and a layer frozen by mistake inside a trained model one alert
at that layer.
"""

from __future__ import annotations

import io
import json
import textwrap

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.hf_models import batch_for, model_of
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import EXIT_ALERTS, run_script

RULE = "frozen_in_optimizer"
STAGES = ["conv1", "bn1", "layer1", "layer2", "layer3", "layer4"]


def _block(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
    )


class ResNetLike(nn.Module):
    """torchvision's ResNet layout: stem and stages on the root, beside ``fc``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.layer1, self.layer2 = _block(8, 8, 1), _block(8, 16, 2)
        self.layer3, self.layer4 = _block(16, 16, 1), _block(16, 32, 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _feature_extractor() -> ResNetLike:
    """The tutorial's fixed feature extractor: all frozen, then a fresh head."""
    torch.manual_seed(0)
    model = ResNetLike()
    for p in model.parameters():
        p.requires_grad = False
    model.fc = nn.Linear(model.fc.in_features, 2)
    return model


def _images(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(step))
    return x, (x[:, 0].mean((1, 2)) > 0).long()


def _watched(model, params, tmp_path, *, steps=8, unfreeze=()):
    """Train under ``tw.watch`` with SGD over ``params``; ``unfreeze``: (step, module)."""
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    with tw.watch(model, opt, log_dir=tmp_path, console=io.StringIO()):
        for step in range(steps):
            for at, module in unfreeze:
                if at == step:
                    module.requires_grad_(True)
            x, y = _images(step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return _found(tmp_path)


def _found(log_dir) -> list[dict]:
    lines = (log_dir / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["rule"] == RULE]


def _told(found):
    return [(a["severity"], a["step"], a["module"], a["data"].get("withdraws")) for a in found]


# -- the tutorial's fixed feature extractor ----------------------------------------------


def test_a_resnet_frozen_all_but_its_head_is_one_warning_at_the_root(tmp_path):
    model = _feature_extractor()
    found = _watched(model, model.parameters(), tmp_path)
    assert _told(found) == [("warning", 0, "", None)]
    (alert,) = found
    assert alert["data"]["parts"] == STAGES
    assert alert["data"]["rest"] == ["fc"]
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    assert sorted(alert["data"]["parameters"]) == sorted(frozen)
    assert "all of the model but fc" in alert["message"]
    assert "skip a parameter without a gradient" in alert["hint"]
    assert "requires_grad" in alert["hint"]


def test_control_the_optimizer_over_the_head_only_is_silent(tmp_path):
    model = _feature_extractor()
    assert _watched(model, model.fc.parameters(), tmp_path) == []


def test_its_unfreeze_in_stages_withdraws_the_warning_once_all_of_it_trains(tmp_path):
    model = _feature_extractor()
    found = _watched(
        model,
        model.parameters(),
        tmp_path,
        unfreeze=[(3, model.layer4), (5, model)],
    )
    assert _told(found) == [
        ("warning", 0, "", None),
        ("info", 3, "layer4", False),
        ("info", 5, "", True),
    ]


FEATURE_EXTRACTOR_SCRIPT = """
import torch
from torch import nn

from tests.test_frozen_backbone_all_but_the_head_one_alert import ResNetLike, _images

torch.manual_seed(0)
model = ResNetLike()
for p in model.parameters():
    p.requires_grad = False
model.fc = nn.Linear(model.fc.in_features, 2)
params = model.parameters() if HEAD_ONLY == "no" else model.fc.parameters()
optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9)
model.train()
for step in range(8):
    x, y = _images(step)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
"""


def _run(tmp_path, head_only: str) -> tuple[int, list[dict]]:
    script = tmp_path / "feature_extractor.py"
    source = textwrap.dedent(FEATURE_EXTRACTOR_SCRIPT).replace("HEAD_ONLY", repr(head_only))
    script.write_text(source)
    code = run_script(script, [], log_dir=tmp_path / "log", fail_on="warning", console=False)
    return code, _found(tmp_path / "log")


def test_under_trainwatch_run_it_is_one_warning_too(tmp_path):
    code, found = _run(tmp_path, "no")
    assert _told(found) == [("warning", 0, "", None)]
    assert found[0]["data"]["parts"] == STAGES
    assert code == EXIT_ALERTS  # a freeze nothing undid: the gate still holds it


def test_control_under_trainwatch_run_the_head_only_optimizer_is_silent(tmp_path):
    code, found = _run(tmp_path, "yes")
    assert found == []
    assert code == 0


# -- a LightningModule with a frozen backbone ------------------------------------------


class FrozenBackboneModule(pl.LightningModule):
    """Backbone and stem frozen, Adam over ``self.parameters()`` (or the trainable ones)."""

    def __init__(self, trainable_only: bool) -> None:
        super().__init__()
        self.trainable_only = trainable_only
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, 1)
        self.stem.requires_grad_(False)
        self.blocks.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        params = self.parameters()
        if self.trainable_only:
            params = [p for p in params if p.requires_grad]
        return torch.optim.Adam(params, lr=1e-3)


def _fit(tmp_path, trainable_only: bool) -> list:
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    data = DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=16)
    callback = TrainWatchCallback(console=False, log_dir=tmp_path / "log")
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=2, limit_val_batches=0)
    trainer.fit(FrozenBackboneModule(trainable_only), data)
    return [a for a in callback.alerts if a.rule == RULE]


def test_a_lightning_module_frozen_all_but_its_head_is_one_warning(tmp_path):
    found = _fit(tmp_path, trainable_only=False)
    assert [(a.severity, a.step, a.module) for a in found] == [("warning", 0, "")]
    assert found[0].data["parts"] == ["stem", "blocks"]
    assert found[0].data["rest"] == ["head"]


def test_control_a_lightning_optimizer_over_the_trainable_parameters_is_silent(tmp_path):
    assert _fit(tmp_path, trainable_only=True) == []


# -- fine-tuning's bottom layers frozen -------------------------------------------------


def test_embeddings_and_first_encoder_layer_frozen_are_one_warning_at_bert(tmp_path):
    """One stretch of the model, from its input on, in modules of different depths."""
    model = model_of("bert")
    model.bert.embeddings.requires_grad_(False)
    model.bert.encoder.layer[0].requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, log_dir=tmp_path, console=io.StringIO()):
        for step in range(4):
            opt.zero_grad()
            model(**batch_for("bert", step)).loss.backward()
            opt.step()
    found = _found(tmp_path)
    assert _told(found) == [("warning", 0, "bert", None)]
    assert found[0]["data"]["parts"] == ["bert.embeddings", "bert.encoder.layer.0"]
    assert found[0]["data"]["rest"][0] == "bert.encoder.layer.1"


# -- what stays apart -------------------------------------------------------------------


class Sandwich(nn.Module):
    """An encoder and a decoder, each many layers, and a middle between them."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))
        self.middle = nn.Linear(16, 16)
        self.decoder = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.tanh(self.middle(self.encoder(x))))


def _sandwich(tmp_path, frozen) -> list[dict]:
    torch.manual_seed(0)
    model = Sandwich()
    for name in frozen:
        model.get_submodule(name).requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, log_dir=tmp_path, console=io.StringIO()):
        for _ in range(6):
            x = torch.randn(16, 8)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x).backward()
            opt.step()
    return _found(tmp_path)


def test_frozen_blocks_around_a_trained_middle_stay_two_warnings(tmp_path):
    found = _sandwich(tmp_path, ["encoder", "decoder"])
    assert _told(found) == [("warning", 0, "encoder", None), ("warning", 0, "decoder", None)]
    assert [a["data"]["parts"] for a in found] == [["encoder"], ["decoder"]]


def test_a_layer_frozen_by_mistake_in_the_middle_is_told_alone(tmp_path):
    found = _sandwich(tmp_path, ["middle"])
    assert _told(found) == [("warning", 0, "middle", None)]
    assert "parts" not in found[0]["data"]


def test_control_the_sandwich_trained_whole_is_silent(tmp_path):
    assert _sandwich(tmp_path, []) == []
