"""broadcast: soft targets that already pair every sample with every other.

Mixup for images draws a coefficient per sample shaped ``(N, 1, 1, 1)``;
reused on the ``(N, C)`` one-hot targets, ``lam * y1 + (1 - lam) * y2`` makes
them ``(N, 1, N, C)`` (``(N, N, C)`` from an ``(N, 1, 1)`` coefficient) before
the model's output is involved. The soft-target loss
``torch.sum(-target * F.log_softmax(out, -1), -1).mean()`` then scores each
sample's output against every sample's mixed target. The op that touches the
output meets it axis for axis: the second batch axis is the target's own.
Healthy twins: the coefficient viewed as ``(N, 1)``; pairings meant on purpose
(an ``(N, N)`` similarity of outputs, ``cdist``), per-class and per-sample
weights, several teachers' targets stacked, a batch of one, and a batch as
large as the number of classes.
"""

from __future__ import annotations

import inspect
import json
import textwrap
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import rules_of
from tests.lightning_models import quiet_trainer
from trainwatch.collect.broadcast import batch_broadcast
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

N, C = 16, 5


@pytest.mark.parametrize(
    ("first", "second", "batch", "output_lower", "result"),
    [
        ((N, 1, N, C), (N, C), N, True, (N, 1, N, C)),
        ((N, N, C), (N, C), N, True, (N, N, C)),
        ((N, C), (N, N, C), N, True, (N, N, C)),
        ((N, N), (N,), N, True, (N, N)),  # a regression's (N,) output, mixed targets (N, N)
        ((C, 1, C, C), (C, C), C, True, (C, 1, C, C)),  # a batch as large as the classes
        ((N, N, C), (N, C), N, False, None),  # the pairwise side is the model's own
        ((N, N, C), (N, C), None, True, None),  # not one side from the model
        ((3, N, C), (N, C), N, True, None),  # three teachers' targets, stacked
        ((2, 1, N, C), (N, C), N, True, None),  # two crops' targets: the batch once
        ((1, 1, 1, C), (1, C), 1, True, None),  # a batch of one
    ],
)
def test_a_target_side_holding_the_batch_twice_is_the_pattern(
    first, second, batch, output_lower, result
):
    assert batch_broadcast(first, second, batch, frozenset(), output_lower) == result


def _images(n: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=gen), torch.randint(0, classes, (n,), generator=gen)


def _net(classes: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, classes),
    )


def _mixup(x, y, classes: int, target_lam: str, seed: int):
    """Images mixed with a per-sample coefficient; the targets mixed with it reshaped
    as ``target_lam`` says: "4d" (the images' own), "3d", or "2d" (the right one)."""
    gen = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    lam = torch.distributions.Beta(0.4, 0.4).sample((n,)).view(-1, 1, 1, 1)
    perm = torch.randperm(n, generator=gen)
    x = lam * x + (1 - lam) * x[perm]
    y1 = F.one_hot(y, classes).float()
    shaped = {"4d": lam, "3d": lam.view(-1, 1, 1), "2d": lam.view(-1, 1)}[target_lam]
    return x, shaped * y1 + (1 - shaped) * y1[perm]


def _soft_target_loss(out, target):
    return torch.sum(-target * F.log_softmax(out, dim=-1), dim=-1).mean()


def _watched_mixup(quiet_watch, target_lam: str, n: int = N, classes: int = C):
    model = _net(classes)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    for step in range(4):
        x, y = _images(n, classes, step)
        x, target = _mixup(x, y, classes, target_lam, step)
        loss = _soft_target_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    return monitor


@pytest.mark.parametrize(
    ("target_lam", "n", "classes", "target"),
    [
        ("4d", N, C, [N, 1, N, C]),
        ("3d", N, C, [N, N, C]),
        ("4d", 10, 10, [10, 1, 10, 10]),  # a batch as large as the classes
    ],
)
def test_targets_mixed_with_the_images_coefficient_are_caught_at_step_0(
    quiet_watch, target_lam, n, classes, target
):
    monitor = _watched_mixup(quiet_watch, target_lam, n, classes)
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    assert alert.step == 0 and alert.severity == "error"
    assert alert.data["op"] == "mul"
    assert sorted(alert.data["shapes"], key=len) == [[n, classes], target]
    assert alert.data["result"] == target
    loss_line = inspect.getsourcelines(_soft_target_loss)[1] + 1
    assert alert.data["source"].endswith(f"{Path(__file__).name}:{loss_line}")
    assert "lam.view(-1, 1)" in alert.hint


@pytest.mark.parametrize(("n", "classes"), [(N, C), (10, 10), (1, C)])
def test_targets_mixed_with_a_coefficient_per_sample_are_silent(quiet_watch, n, classes):
    assert rules_of(_watched_mixup(quiet_watch, "2d", n, classes)) == []


def test_a_batch_of_one_mixed_with_the_images_coefficient_is_silent(quiet_watch):
    assert rules_of(_watched_mixup(quiet_watch, "4d", 1, C)) == []


def _simclr(z, y, teachers):
    z = F.normalize(z, dim=-1)
    return F.cross_entropy(z @ z.T / 0.1, torch.arange(len(z)))


def _triplet(z, y, teachers):
    d = torch.cdist(z, z)
    return F.relu(d[:, :1] - d[:, 1:2] + 1.0).mean()


def _class_weights(z, y, teachers):
    weights = torch.linspace(0.5, 1.5, z.shape[1])
    return (-F.one_hot(y, z.shape[1]) * F.log_softmax(z, -1) * weights).sum(-1).mean()


def _sample_weights(z, y, teachers):
    per_class = -F.one_hot(y, z.shape[1]) * F.log_softmax(z, -1)
    return (per_class * torch.rand(len(z), 1)).sum(-1).mean()


def _stacked_teachers(z, y, teachers):
    return (-teachers.softmax(-1) * F.log_softmax(z, -1)).sum(-1).mean()


PAIRINGS = {
    "simclr": _simclr,
    "triplet_cdist": _triplet,
    "class_weights": _class_weights,
    "sample_weights": _sample_weights,
    "stacked_teachers": _stacked_teachers,
}


@pytest.mark.parametrize("name", list(PAIRINGS))
def test_other_losses_beside_the_batch_are_silent(quiet_watch, name):
    model = _net(C)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for step in range(4):
        x, y = _images(N, C, step)
        teachers = torch.randn(3, N, C)
        loss = PAIRINGS[name](model(x), y, teachers)
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    assert rules_of(monitor) == []


class _Mixup(pl.LightningModule):
    """Mixup done in ``training_step``, after the batch arrives."""

    def __init__(self, target_lam: str) -> None:
        super().__init__()
        self.net = _net(C)
        self.target_lam = target_lam

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        x, target = _mixup(x, y, C, self.target_lam, batch_idx)
        return _soft_target_loss(self(x), target)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*_images(4 * N, C, 0)), batch_size=N)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), 1e-3)


@pytest.mark.parametrize(("target_lam", "buggy"), [("4d", True), ("2d", False)])
def test_a_lightning_module_mixing_targets(tmp_path, target_lam, buggy):
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(
        tmp_path, [callback], max_steps=4, limit_val_batches=0, num_sanity_val_steps=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's own notes on a tiny run
        trainer.fit(_Mixup(target_lam))
    found = [
        (a.rule, a.step, a.data.get("result"))
        for a in callback.alerts
        if a.severity in ("warning", "error")
    ]
    assert found == ([("broadcast", 0, [N, 1, N, C])] if buggy else [])


SCRIPT = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)
)
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def soft_target_cross_entropy(out, target):
    return torch.sum(-target * F.log_softmax(out, dim=-1), dim=-1).mean()


for step in range(4):
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 5, (16,))
    lam = torch.distributions.Beta(0.4, 0.4).sample((16,)).view(-1, 1, 1)
    perm = torch.randperm(16)
    x = lam.unsqueeze(-1) * x + (1 - lam.unsqueeze(-1)) * x[perm]
    y1 = F.one_hot(y, 5).float()
    if "bug" not in sys.argv:
        lam = lam.view(-1, 1)
    target = lam * y1 + (1 - lam) * y1[perm]
    loss = soft_target_cross_entropy(model(x), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
print("trained")
"""


def test_under_trainwatch_run_the_unmodified_script_is_caught_and_its_clean_twin_is_silent(
    tmp_path, capsys
):
    script = tmp_path / "mixup.py"
    script.write_text(textwrap.dedent(SCRIPT))
    for buggy in (True, False):
        log = tmp_path / f"log-{buggy}"
        assert run_script(script, ["bug"] if buggy else [], log_dir=log, console=False) == 0
        found = [json.loads(line) for line in (log / "alerts.jsonl").read_text().splitlines()]
        rules = [(a["rule"], a["step"], a["data"].get("result")) for a in found]
        assert rules == ([("broadcast", 0, [N, N, C])] if buggy else []), (buggy, rules)
        if buggy:
            assert found[0]["data"]["source"].endswith("mixup.py:15")  # the loss's line
    assert "trained" in capsys.readouterr().out
