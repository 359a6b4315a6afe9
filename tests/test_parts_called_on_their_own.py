"""A model used through its parts (``self.net(x)``) has its modes and activations checked.

Many LightningModules have no ``forward`` of their own, or one their steps
never call: ``training_step`` and ``validation_step`` call ``self.net(x)``.
Such a pass of a part was followed by the broadcast audit only, so an
evaluation run with dropout on, a training step in eval mode and dead
units went unreported. A part's pass is now checked like the model's, over
the modules inside that part.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import rules_of
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback


class Holder(nn.Module):
    """A wrapper whose loop calls ``holder.net`` and never the holder itself."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.3), nn.Linear(64, 4))


def _train(holder: Holder, opt: torch.optim.Optimizer, steps: int, evaluate) -> None:
    for step in range(steps):
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        opt.zero_grad()
        F.cross_entropy(holder.net(x), y).backward()
        opt.step()
        if step % 5 == 4:
            evaluate(holder, x)


def _validate_in_training_mode(holder: Holder, x: torch.Tensor) -> None:
    with torch.no_grad():
        for _ in range(4):
            holder.net(x)


def _validate_in_eval_mode(holder: Holder, x: torch.Tensor) -> None:
    holder.net.eval()
    _validate_in_training_mode(holder, x)
    holder.net.train()


def _validate_and_forget_train(holder: Holder, x: torch.Tensor) -> None:
    holder.net.eval()
    _validate_in_training_mode(holder, x)


@pytest.mark.parametrize(
    "evaluate, expected",
    [
        (_validate_in_training_mode, ["eval_in_train_mode"]),
        (_validate_in_eval_mode, []),
        (_validate_and_forget_train, ["train_in_eval_mode"]),
    ],
    ids=["eval_without_eval", "healthy", "train_forgotten"],
)
def test_a_part_called_on_its_own_has_its_modes_checked(quiet_watch, evaluate, expected):
    holder = Holder()
    opt = torch.optim.SGD(holder.parameters(), lr=0.05)
    monitor = quiet_watch(holder, opt)
    _train(holder, opt, 20, evaluate)
    assert rules_of(monitor) == expected
    if expected:
        alert = next(a for a in monitor.alerts if a.rule == expected[0])
        assert alert.module == "net.1"
        assert alert.step == 5  # the first evaluation follows step 4's update


class _NoForward(L.LightningModule):
    """Lightning's usual shape without a forward: every step calls ``self.net``."""

    def __init__(self, train_in_validation: bool = False, dead: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 64), nn.ReLU()
        )
        self.head = nn.Linear(64, 4)
        self.train_in_validation = train_in_validation
        if dead:
            with torch.no_grad():
                self.net[3].bias.fill_(-100.0)  # every unit of net.4 dead

    def training_step(self, batch, index):
        x, y = batch
        return F.cross_entropy(self.head(self.net(x)), y)

    def validation_step(self, batch, index):
        x, y = batch
        if self.train_in_validation:
            self.net.train()  # the bug: dropout on while evaluating
        self.log("val_loss", F.cross_entropy(self.head(self.net(x)), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _loader() -> DataLoader:
    x = torch.randn(256, 16)
    return DataLoader(TensorDataset(x, torch.randint(0, 4, (256,))), batch_size=32, shuffle=True)


def _trainer(tmp_path, callback, **kwargs) -> L.Trainer:
    return quiet_trainer(tmp_path, [callback], **kwargs)


@pytest.mark.parametrize("bug", [True, False], ids=["train_in_validation", "healthy"])
def test_validate_before_fit_checks_a_module_without_forward(tmp_path, bug):
    callback = TrainWatchCallback(console=False)
    _trainer(tmp_path, callback).validate(_NoForward(bug), _loader(), verbose=False)
    found = [(a.rule, a.module, a.step) for a in callback.alerts if a.severity != "info"]
    assert found == ([("eval_in_train_mode", "net.2", 0)] if bug else [])


@pytest.mark.parametrize("dead", [True, False], ids=["dead_units", "healthy"])
def test_fit_samples_the_activations_of_a_module_without_forward(tmp_path, dead):
    callback = TrainWatchCallback(console=False)
    trainer = _trainer(tmp_path, callback, max_steps=30, limit_val_batches=2)
    trainer.fit(_NoForward(dead=dead), _loader(), _loader())
    found = {(a.rule, a.module) for a in callback.alerts if a.severity != "info"}
    if not dead:
        assert found == set()
        return
    assert ("dead_units", "net.4") in found
    assert {rule for rule, _ in found} <= {"dead_units", "zero_gradient", "constant_output"}


class _Distilled(L.LightningModule):
    """A frozen teacher called under no_grad every step, kept in training mode on purpose
    (BYOL's target network keeps batch norm training): not an evaluation."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4))
        self.teacher = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.Linear(64, 4))
        self.teacher.requires_grad_(False)

    def training_step(self, batch, index):
        x, _ = batch
        with torch.no_grad():
            target = self.teacher(x).softmax(-1)
        return F.cross_entropy(self.student(x), target)

    def configure_optimizers(self):
        return torch.optim.SGD(self.student.parameters(), lr=1e-2)


def test_a_teacher_part_called_under_no_grad_every_step_is_no_evaluation(tmp_path):
    callback = TrainWatchCallback(console=False)
    _trainer(tmp_path, callback, max_steps=30).fit(_Distilled(), _loader())
    assert rules_of(callback.monitor) == []


class _TwoTowers(nn.Module):
    """CLIP's shape: the loop calls each tower on its own, never the model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image = nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8)
        )
        self.text = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.1), nn.Linear(16, 8))


@pytest.mark.parametrize("forget_train", [True, False], ids=["train_forgotten", "healthy"])
def test_two_towers_left_in_eval_mode_are_both_named(quiet_watch, forget_train):
    model = _TwoTowers()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    for step in range(20):
        if step == 10:
            model.eval()  # a zero-shot evaluation
            with torch.no_grad():
                model.image(torch.randn(8, 8))
                model.text(torch.randn(8, 6))
            if not forget_train:
                model.train()
        image, text = model.image(torch.randn(16, 8)), model.text(torch.randn(16, 6))
        logits = F.normalize(image, dim=-1) @ F.normalize(text, dim=-1).t() * 10
        opt.zero_grad()
        F.cross_entropy(logits, torch.arange(16)).backward()
        opt.step()
    found = [a for a in monitor.alerts if a.severity != "info"]
    if not forget_train:
        assert found == []
        return
    (alert,) = found
    assert alert.rule == "train_in_eval_mode" and alert.step == 10
    assert set(alert.data["modules"]) == {"image.1", "text.1"}


class _MonteCarloValidation(L.LightningModule):
    """Validation sampling ``self.net`` several times with dropout on (MC dropout)."""

    def __init__(self, whole_net_in_training: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4)
        )
        self.whole_net_in_training = whole_net_in_training

    def training_step(self, batch, index):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_validation_start(self):
        if self.whole_net_in_training:
            self.net.train()  # the bug: batch norm normalises with the eval batches
            return
        for module in self.net.modules():  # Lightning put the module in eval
            if isinstance(module, nn.Dropout):
                module.train()

    def validation_step(self, batch, index):
        x, y = batch
        probs = torch.stack([self.net(x).softmax(-1) for _ in range(5)]).mean(0)
        self.log("val_nll", F.nll_loss(probs.log(), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("bug", [True, False], ids=["whole_net_in_training", "mc_dropout"])
def test_lightning_monte_carlo_validation_is_told_only_with_batch_norm_in_training(tmp_path, bug):
    callback = TrainWatchCallback(console=False)
    trainer = _trainer(tmp_path, callback, max_steps=16, val_check_interval=8, limit_val_batches=2)
    trainer.fit(_MonteCarloValidation(bug), _loader(), _loader())
    found = {(a.rule, a.module) for a in callback.alerts if a.severity != "info"}
    assert found == ({("eval_in_train_mode", "net.1")} if bug else set())
