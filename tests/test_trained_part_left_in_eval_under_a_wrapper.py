"""A trained part left in eval mode under a wrapper in training mode: the warning.

``self.net.eval()`` in a LightningModule's epoch-end metrics helper, never undone,
leaves every module of ``net`` in eval while the LightningModule around it (run
as ``self(x)``) stays in training mode. With batch norm and no dropout, the modes
alone looked like the fine-tuning idiom (frozen batch-norm statistics) and were
told as one info line; yet ``net``'s layers train. What trains decides: a part
whose layers train, put in eval as a whole, is the forgotten ``.train()``; norm
layers put in eval alone (convolutions trained), or a frozen part in eval, stay
the idiom's info line.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.ao.quantization as tq
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback


def _cnn() -> nn.Sequential:
    """Batch norm, no dropout: only its norms behave differently in eval mode."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 4),
    )


def _images(n: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 12, 12, generator=gen)
    return x, (x[:, 0, :6].mean((1, 2)) > 0).long()


def _mode_alerts(alerts: list) -> list[tuple[str, int, str | None]]:
    return [(a.severity, a.step, a.module) for a in alerts if a.rule == "train_in_eval_mode"]


class Classifier(L.LightningModule):
    """``training_step`` runs ``self(x)``; an epoch-end helper measures the training
    accuracy in eval mode and puts ``net`` back in training mode, or forgets to."""

    def __init__(self, forget_train: bool) -> None:
        super().__init__()
        self.net = _cnn()
        self.forget_train = forget_train

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_train_epoch_end(self) -> None:
        self.net.eval()
        x, _ = _images(32)
        with torch.no_grad():
            self(x)
        if not self.forget_train:
            self.net.train()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(tmp_path, forget_train: bool) -> list:
    L.seed_everything(0, verbose=False)
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=3)
    trainer.fit(Classifier(forget_train), DataLoader(TensorDataset(*_images()), batch_size=32))
    return callback.alerts


def test_lightning_inner_net_left_in_eval_warns_at_the_first_step_it_trains_so(tmp_path):
    alerts = _fit(tmp_path, forget_train=True)
    assert _mode_alerts(alerts) == [("warning", 4, "net.1")]  # epoch 1's first step
    (alert,) = [a for a in alerts if a.rule == "train_in_eval_mode"]
    assert alert.data["parts_in_eval"] == ["net"] and alert.data["whole_model"] is False
    assert "net in eval mode" in alert.message and "net.train()" not in alert.message
    assert "Call .train() on net" in alert.hint


def test_lightning_inner_net_put_back_in_training_mode_is_silent(tmp_path):
    alerts = _fit(tmp_path, forget_train=False)
    assert _mode_alerts(alerts) == []
    assert [a.rule for a in alerts if a.severity != "info"] == []


class FineTuned(L.LightningModule):
    """Lightning's BaseFinetuning recipe: ``backbone`` frozen (its batch norm kept
    trainable or frozen with it) and unfrozen at epoch 2, the head trained."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = _cnn()[:6]
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)


@pytest.mark.parametrize("train_bn", [True, False])
def test_lightning_backbone_finetuning_stays_silent(tmp_path, train_bn):
    L.seed_everything(0, verbose=False)
    callback = TrainWatchCallback(console=False)
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=2, train_bn=train_bn)
    trainer = quiet_trainer(tmp_path, [callback, finetuning], max_epochs=3)
    trainer.fit(FineTuned(), DataLoader(TensorDataset(*_images()), batch_size=32))
    assert _mode_alerts(callback.alerts) == []
    assert [a for a in callback.alerts if a.data.get("finding")] == []


class Wrapper(nn.Module):
    """A model around ``net`` (a loss or a preprocessing step beside it, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _cnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _loop(model: nn.Module, params, before_step, steps: int = 8) -> list:
    x, y = _images(steps * 16)
    opt = torch.optim.SGD(params, lr=0.05)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(steps):
            before_step(model, step)
            loss = F.cross_entropy(
                model(x[step * 16 : (step + 1) * 16]), y[step * 16 : (step + 1) * 16]
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    return monitor.alerts


def _net_in_eval_from_step_3(model: Wrapper, step: int) -> None:
    model.train()
    if step >= 3:
        model.net.eval()  # an evaluation helper's, with model.train() only on the wrapper


def test_a_watched_loop_with_the_inner_net_in_eval_under_model_train_warns():
    torch.manual_seed(0)
    model = Wrapper()
    alerts = _loop(model, model.parameters(), _net_in_eval_from_step_3)
    assert _mode_alerts(alerts) == [("warning", 3, "net.1")]


def test_a_watched_loop_with_model_train_alone_is_silent():
    torch.manual_seed(0)
    model = Wrapper()
    alerts = _loop(model, model.parameters(), lambda m, step: m.train())
    assert alerts == []


def _freeze_bn(model: nn.Module, step: int) -> None:
    """The detection and segmentation fine-tuning recipe: batch norm in eval (its
    statistics kept), every convolution trained."""
    model.train()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.eval()


def test_only_the_norm_layers_in_eval_while_everything_trains_stays_one_info_line():
    torch.manual_seed(0)
    model = Wrapper()
    alerts = _loop(model, model.parameters(), _freeze_bn)
    assert _mode_alerts(alerts) == [("info", 0, "net.1")]
    assert [a.rule for a in alerts if a.severity != "info"] == []


def test_a_frozen_feature_extractor_in_eval_under_a_trained_head_stays_one_info_line():
    torch.manual_seed(0)
    model = Wrapper()
    model.net[:6].requires_grad_(False)

    def features_in_eval(m: Wrapper, step: int) -> None:
        m.train()
        m.net[:6].eval()

    alerts = _loop(model, model.net[8].parameters(), features_in_eval)
    assert _mode_alerts(alerts) == [("info", 0, "net.1")]
    assert [a.rule for a in alerts if a.severity != "info"] == []


class BackboneAndHead(nn.Module):
    """Two stages of convolutions and batch norm, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        cnn = _cnn()
        self.backbone = nn.Sequential(nn.Sequential(*cnn[:3]), nn.Sequential(*cnn[3:6]))
        self.head = nn.Sequential(*cnn[6:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def test_a_backbone_in_eval_fine_tuned_in_its_last_stage_only_stays_one_info_line():
    """backbone.eval() on purpose: its batch-norm statistics kept while its first
    stage stays frozen and its last one trains (a partial fine-tune)."""
    torch.manual_seed(0)
    model = BackboneAndHead()
    model.backbone[0].requires_grad_(False)

    def backbone_in_eval(m: BackboneAndHead, step: int) -> None:
        m.train()
        m.backbone.eval()

    params = [p for p in model.parameters() if p.requires_grad]
    alerts = _loop(model, params, backbone_in_eval)
    assert [a.rule for a in alerts if a.severity != "info"] == []


def test_a_backbone_left_in_eval_with_every_layer_trained_warns():
    torch.manual_seed(0)
    model = BackboneAndHead()

    def backbone_in_eval(m: BackboneAndHead, step: int) -> None:
        m.train()
        if step >= 2:
            m.backbone.eval()  # an evaluation helper's, never set back

    alerts = _loop(model, model.parameters(), backbone_in_eval)
    assert _mode_alerts(alerts) == [("warning", 2, "backbone.0.1")]


class QuantNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn(self.conv(self.quant(x))))
        return self.dequant(self.fc(torch.flatten(self.pool(x), 1)))


class QATModel(nn.Module):
    """Quantization-aware training: the fused conv-bn-relu holds its batch norm."""

    def __init__(self) -> None:
        super().__init__()
        net = tq.fuse_modules_qat(QuantNet().train(), [["conv", "bn", "relu"]])
        net.qconfig = tq.get_default_qat_qconfig("fbgemm")
        self.net = tq.prepare_qat(net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _observers_off(from_step: int | None):
    def before_step(model: QATModel, step: int) -> None:
        model.train()
        if from_step is not None and step >= from_step:
            model.net.apply(tq.disable_observer)
            model.net.eval()  # meant to freeze the observers; trains the fused bn in eval

    return before_step


def test_quantization_aware_training_with_the_net_left_in_eval_warns():
    torch.manual_seed(0)
    model = QATModel()
    alerts = _loop(model, model.parameters(), _observers_off(from_step=2))
    assert _mode_alerts(alerts) == [("warning", 2, "net.conv.bn")]


def test_quantization_aware_training_in_training_mode_is_silent():
    torch.manual_seed(0)
    model = QATModel()
    alerts = _loop(model, model.parameters(), _observers_off(from_step=None))
    assert _mode_alerts(alerts) == []
