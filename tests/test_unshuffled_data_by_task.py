"""unshuffled_data: a run trained task by task, each task from a shuffled loader of its
own, stays silent; data sorted by class still warns, however it is fed.

Class-incremental continual learning (Split-MNIST, Split-CIFAR) trains five
tasks of two classes one after another: every batch holds only its task's
classes, few of the run's, by design. A curriculum that narrows to a few
classes after a stage on all of them (fine-tuning a specialist) does the
same. What separates them from data sorted by class is how the classes
change: a task's batches draw from one class set for a long stretch, and the
set changes at a few boundaries; sorted data's class drifts through the
epoch. The clean shapes run under ``tw.watch`` (no loader handed over),
``trainwatch run`` and a Lightning ``Trainer``; the sorted controls beside
them must still warn.
"""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.test_run import alerts as run_alerts
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

RULE = "unshuffled_data"
CLASSES = 10
PER_CLASS = 240
FEATURES = 16


def clustered(classes: int = CLASSES, per_class: int = PER_CLASS, seed: int = 0):
    """One feature cluster a class, the classes' samples one block after another
    (built with ``torch.cat`` of per-class tensors, as a split benchmark is)."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, FEATURES, generator=gen) * 0.5
    x = torch.cat(
        [centres[c] + torch.randn(per_class, FEATURES, generator=gen) for c in range(classes)]
    )
    y = torch.arange(classes).repeat_interleave(per_class)
    return x, y


def mlp(classes: int = CLASSES) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, classes))


def train(model: nn.Module, loaders: list[DataLoader], epochs: int = 2) -> tw.Monitor:
    """Each loader in turn, ``epochs`` times over, under ``tw.watch`` with no loader
    handed over (a continual-learning loop builds one a task)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for loader in loaders:
            for _ in range(epochs):
                for xb, yb in loader:
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(xb), yb).backward()
                    opt.step()
    return monitor


def found(alerts: list) -> list:
    return [a for a in alerts if a.rule == RULE]


def task_loaders(
    per_task: int, batch: int, shuffle: bool, classes: int = CLASSES, per_class: int = PER_CLASS
) -> list[DataLoader]:
    """Split-MNIST style: the classes in tasks of ``per_task``, a loader each."""
    x, y = clustered(classes, per_class)
    tasks = []
    for first in range(0, classes, per_task):
        chosen = (y >= first) & (y < first + per_task)
        task = TensorDataset(x[chosen], y[chosen])
        tasks.append(DataLoader(task, batch_size=batch, shuffle=shuffle))
    return tasks


# -- class-incremental: a shuffled loader a task -------------------------------------------


def test_five_tasks_of_two_classes_each_from_a_shuffled_loader_are_silent():
    """Split-MNIST: each batch holds its task's two classes, of the ten."""
    monitor = train(mlp(), task_loaders(2, 32, shuffle=True))
    assert monitor.step_count > 100
    assert found(monitor.alerts) == []


def test_twenty_classes_in_tasks_of_four_from_shuffled_loaders_are_silent():
    """Split-CIFAR style, smaller batches: a batch of 16 holds about all four of its
    task's classes, where one drawn from the whole run would hold eleven."""
    monitor = train(mlp(20), task_loaders(4, 16, shuffle=True, classes=20, per_class=80))
    assert monitor.step_count > 100
    assert found(monitor.alerts) == []


def test_the_same_tasks_each_read_in_class_order_warn():
    """Each task's loader reads its classes' blocks in order: one class a batch."""
    monitor = train(mlp(), task_loaders(2, 32, shuffle=False))
    (alert,) = found(monitor.alerts)
    assert alert.severity == "warning"
    assert alert.data["classes_per_batch"] < 1.5


def test_the_whole_set_of_concatenated_class_blocks_read_in_order_warns():
    """The tasks' data as one set, built by ``torch.cat`` of per-class blocks and read
    with ``shuffle=False``: the class drifts on through the epoch."""
    x, y = clustered()
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False)
    monitor = train(mlp(), [loader])
    (alert,) = found(monitor.alerts)
    assert alert.data["classes_per_batch"] < 1.5


def test_the_whole_set_shuffled_is_silent():
    x, y = clustered()
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    assert found(train(mlp(), [loader]).alerts) == []


def test_small_class_blocks_read_in_order_warn():
    """Blocks shorter than a few batches: each batch holds one class or two, and
    successive sampled batches hold other classes."""
    x, y = clustered(per_class=24)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)
    monitor = train(mlp(), [loader], epochs=6)
    (alert,) = found(monitor.alerts)
    assert alert.data["classes_per_batch"] < 2.0


def test_hand_made_batches_sliced_off_sorted_tensors_warn_without_a_loader():
    x, y = clustered()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for start in range(0, len(y), 32):
            opt.zero_grad()
            nn.functional.cross_entropy(
                model(x[start : start + 32]), y[start : start + 32]
            ).backward()
            opt.step()
    assert len(found(monitor.alerts)) == 1


# -- a curriculum that narrows to a few classes ----------------------------------------------


def stage_loaders(shuffle_last: bool) -> list[DataLoader]:
    """A stage on all classes, then one that specialises on three of them."""
    x, y = clustered()
    everything = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    chosen = y < 3
    narrow = TensorDataset(x[chosen], y[chosen])
    return [everything, DataLoader(narrow, batch_size=16, shuffle=shuffle_last)]


def test_a_curriculum_stage_on_three_classes_from_a_shuffled_loader_is_silent():
    monitor = train(mlp(), stage_loaders(shuffle_last=True), epochs=1)
    assert found(monitor.alerts) == []


def test_the_same_stage_read_in_class_order_warns():
    monitor = train(mlp(), stage_loaders(shuffle_last=False), epochs=1)
    (alert,) = found(monitor.alerts)
    assert alert.severity == "warning"
    assert alert.step > len(stage_loaders(True)[0])  # in the narrow stage


# -- Lightning: the task's loader reloaded every epoch ---------------------------------------


class TaskByTaskClassifier(pl.LightningModule):
    """Two epochs a task: ``train_dataloader`` serves the current task's classes, reloaded
    every epoch (``reload_dataloaders_every_n_epochs=1``)."""

    def __init__(self, shuffle: bool) -> None:
        super().__init__()
        self.net = mlp()
        self.shuffle = shuffle
        self.x, self.y = clustered()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def train_dataloader(self):
        first = 2 * (self.current_epoch // 2)
        chosen = (self.y >= first) & (self.y < first + 2)
        task = TensorDataset(self.x[chosen], self.y[chosen])
        return DataLoader(task, batch_size=32, shuffle=self.shuffle)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _fit_task_by_task(tmp_path: Path, shuffle: bool) -> TrainWatchCallback:
    torch.manual_seed(0)
    callback = TrainWatchCallback(console=io.StringIO())
    trainer = pl.Trainer(
        callbacks=[callback],
        accelerator="cpu",
        max_epochs=CLASSES,
        reload_dataloaders_every_n_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=tmp_path,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(TaskByTaskClassifier(shuffle))
    assert trainer.global_step > 100
    return callback


def test_lightning_task_by_task_from_shuffled_loaders_is_silent(tmp_path):
    assert found(_fit_task_by_task(tmp_path, shuffle=True).alerts) == []


def test_lightning_task_by_task_from_class_ordered_loaders_warns(tmp_path):
    (alert,) = found(_fit_task_by_task(tmp_path, shuffle=False).alerts)
    assert "SequentialSampler" in alert.data["sampler"]


# -- trainwatch run on an unmodified script --------------------------------------------------

SCRIPT = """
import sys
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
shuffle = sys.argv[1] == "shuffle"
centres = torch.randn(10, 32) * 0.5
X = torch.cat([centres[c] + torch.randn(600, 32) for c in range(10)])
Y = torch.arange(10).repeat_interleave(600)
model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for task in range(5):
    sel = (Y // 2) == task
    loader = DataLoader(TensorDataset(X[sel], Y[sel]), batch_size=32, shuffle=shuffle)
    for epoch in range(2):
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
"""


def _run(tmp_path: Path, mode: str) -> list[dict]:
    script = tmp_path / "split_mnist.py"
    script.write_text(textwrap.dedent(SCRIPT))
    log = tmp_path / "log"
    assert run_script(script, [mode], log_dir=log, console=False) == 0
    return [a for a in run_alerts(log) if a["rule"] == RULE]


def test_trainwatch_run_on_a_split_mnist_script_with_shuffled_task_loaders_is_silent(tmp_path):
    assert _run(tmp_path, "shuffle") == []


def test_trainwatch_run_on_the_same_script_with_task_loaders_in_class_order_warns(tmp_path):
    (alert,) = _run(tmp_path, "in-order")
    assert alert["severity"] == "warning"
    assert "SequentialSampler" in alert["data"]["sampler"]
