"""unshuffled_data: P x K identity batches stay silent even where no loader is seen;
data sorted by class still warns, at the same step as before.

Person re-identification and metric learning (an identity cross-entropy head
beside a triplet loss) draw each batch as P random identities with exactly K
samples each, new identities every batch: few of the run's classes a batch,
by design, and shuffling would break the triplet mining. The composition
shows in the targets alone (every class of a batch exactly K >= 2 times, the
classes scattered over the run's), so the sampler need not be visible: a
hand-written batch sampler iterated by the loop under ``tw.watch``, an
unmodified script under ``trainwatch run``, and a Lightning module whose
``train_dataloader`` composes P x K batches. Beside each, the same model fed
data sorted by identity, read in order, still warns; so do sorted blocks of
exactly K samples an identity, whose batches hold K of each of P classes too.
"""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.test_run import alerts as run_alerts
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

RULE = "unshuffled_data"
FEATURES = 32


def identities(count: int, per_identity: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples stored identity after identity, as a re-ID set's folders are."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(count, FEATURES, generator=gen)
    y = torch.arange(count).repeat_interleave(per_identity)
    return centres[y] + 0.5 * torch.randn(len(y), FEATURES, generator=gen), y


class PKBatchSampler:
    """P identities a batch, K samples of each: the identities shuffled every epoch
    and taken P at a time (the last batch of an epoch holds those left over).
    Not a ``torch.utils.data.Sampler``: a plain iterable of index lists."""

    def __init__(self, labels: torch.Tensor, p: int, k: int, seed: int = 0) -> None:
        self.by_identity = [
            torch.nonzero(labels == c).flatten() for c in range(int(labels.max()) + 1)
        ]
        self.p, self.k = p, k
        self.gen = torch.Generator().manual_seed(seed)

    def __iter__(self):
        order = torch.randperm(len(self.by_identity), generator=self.gen).tolist()
        for first in range(0, len(order), self.p):
            batch = []
            for c in order[first : first + self.p]:
                samples = self.by_identity[c]
                picked = torch.randperm(len(samples), generator=self.gen)[: self.k]
                batch += samples[picked].tolist()
            yield batch

    def __len__(self) -> int:
        return -(-len(self.by_identity) // self.p)


class IdentityBatches:
    """P x K batches of ``(x, y)`` as a plain iterable, no DataLoader at all."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, p: int, k: int) -> None:
        self.x, self.y = x, y
        self.sampler = PKBatchSampler(y, p, k, seed=1)

    def __iter__(self):
        for index in self.sampler:
            yield self.x[index], self.y[index]

    def __len__(self) -> int:
        return len(self.sampler)


def in_order(count: int, batch: int) -> list[list[int]]:
    """The stored order's batches: data sorted by identity read with shuffle=False."""
    return [list(range(start, min(start + batch, count))) for start in range(0, count, batch)]


def model_for(classes: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, classes))


def fit_by_hand(x: torch.Tensor, y: torch.Tensor, batches, epochs: int) -> tw.Monitor:
    """A plain loop indexing the tensors with each batch's indices, under ``tw.watch``
    handed no loader."""
    model = model_for(int(y.max()) + 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for _ in range(epochs):
            for index in batches:
                opt.zero_grad()
                nn.functional.cross_entropy(model(x[index]), y[index]).backward()
                opt.step()
    return monitor


def found(alerts: list) -> list:
    return [a for a in alerts if a.rule == RULE]


# -- plain loop, tw.watch without data= ------------------------------------------------


@pytest.mark.parametrize(
    ("count", "p", "k"),
    [(60, 8, 4), (30, 2, 8), (20, 4, 4), (100, 6, 3)],
    ids=["P8xK4", "P2xK8", "P4xK4", "P6xK3"],
)
def test_p_by_k_batches_from_a_hand_written_batch_sampler_are_silent(count, p, k):
    x, y = identities(count, per_identity=12)
    monitor = fit_by_hand(x, y, PKBatchSampler(y, p, k), epochs=10)
    assert monitor.step_count >= 50
    assert found(monitor.alerts) == []


def test_p_by_k_batches_drawn_with_replacement_every_step_are_silent():
    """The identities drawn anew at every step, no epochs (the repro's shape)."""
    x, y = identities(60, per_identity=12)
    gen = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(60):
        chosen = torch.randperm(60, generator=gen)[:8]
        batches.append(
            [12 * int(c) + int(i) for c in chosen for i in torch.randperm(12, generator=gen)[:4]]
        )
    assert found(fit_by_hand(x, y, batches, epochs=1).alerts) == []


def test_the_same_identities_sorted_and_read_in_order_warn_at_step_15():
    x, y = identities(60, per_identity=12)
    (alert,) = found(fit_by_hand(x, y, in_order(len(y), 32), epochs=2).alerts)
    assert alert.severity == "warning" and alert.step == 15
    assert alert.data["classes_per_batch"] < 4.0


def test_sorted_blocks_of_exactly_k_read_in_order_warn_at_step_15():
    """K samples an identity, stored sorted: every batch holds exactly K of each of
    P identities, as a P x K batch does, but neighbouring ones in runs."""
    x, y = identities(160, per_identity=4)
    (alert,) = found(fit_by_hand(x, y, in_order(len(y), 32), epochs=2).alerts)
    assert alert.severity == "warning" and alert.step == 15
    assert alert.data["classes_per_batch"] == 8.0


def test_p_by_k_batches_through_a_dataloader_not_handed_over_are_silent():
    x, y = identities(40, per_identity=12)
    loader = DataLoader(TensorDataset(x, y), batch_sampler=PKBatchSampler(y, 4, 4))
    model = model_for(40)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for _ in range(5):
            for xb, yb in loader:
                opt.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
                opt.step()
    assert monitor.step_count >= 40
    assert found(monitor.alerts) == []


# -- trainwatch run on an unmodified script ----------------------------------------------

SCRIPT = """
import sys
import torch
import torch.nn.functional as F
from torch import nn


class RandomIdentityBatchSampler:
    def __init__(self, labels, p, k):
        self.by_id = [torch.nonzero(labels == c).flatten() for c in range(int(labels.max()) + 1)]
        self.p, self.k = p, k

    def __iter__(self):
        order = torch.randperm(len(self.by_id)).tolist()
        for first in range(0, len(order) - self.p + 1, self.p):
            yield [int(i) for c in order[first:first + self.p]
                   for i in self.by_id[c][torch.randperm(len(self.by_id[c]))[:self.k]]]

    def __len__(self):
        return len(self.by_id) // self.p


torch.manual_seed(0)
ids, per_id = 50, 10
centres = torch.randn(ids, 32)
Y = torch.arange(ids).repeat_interleave(per_id)
X = centres[Y] + 0.5 * torch.randn(len(Y), 32)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, ids))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
if sys.argv[1] == "pk":
    batches = RandomIdentityBatchSampler(Y, 6, 4)
else:
    batches = [list(range(s, s + 24)) for s in range(0, len(Y) - 23, 24)]
for epoch in range(6):
    for index in batches:
        opt.zero_grad()
        F.cross_entropy(model(X[index]), Y[index]).backward()
        opt.step()
"""


def _run(tmp_path: Path, mode: str) -> list[dict]:
    script = tmp_path / "train_reid.py"
    script.write_text(textwrap.dedent(SCRIPT))
    log = tmp_path / "log"
    assert run_script(script, [mode], log_dir=log, console=False) == 0
    return [a for a in run_alerts(log) if a["rule"] == RULE]


def test_trainwatch_run_on_a_script_with_a_p_by_k_batch_sampler_class_is_silent(tmp_path):
    assert _run(tmp_path, "pk") == []


def test_trainwatch_run_on_the_same_script_reading_identities_in_order_warns(tmp_path):
    (alert,) = _run(tmp_path, "sorted")
    assert alert["severity"] == "warning" and alert["step"] == 15


# -- Lightning ---------------------------------------------------------------------------


class ReIdentifier(pl.LightningModule):
    """An identity classifier; ``train_dataloader`` composes P x K batches (through a
    DataLoader's ``batch_sampler``, or as a plain iterable of batches) or reads the
    identity-sorted set in order."""

    def __init__(self, feed: str) -> None:
        super().__init__()
        self.feed = feed
        self.x, self.y = identities(40, per_identity=12)
        self.net = model_for(40)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def train_dataloader(self):
        data = TensorDataset(self.x, self.y)
        if self.feed == "batch_sampler":
            return DataLoader(data, batch_sampler=PKBatchSampler(self.y, 4, 4))
        if self.feed == "iterable":
            return IdentityBatches(self.x, self.y, 4, 4)
        return DataLoader(data, batch_size=16, shuffle=False)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _fit_lightning(tmp_path: Path, feed: str) -> TrainWatchCallback:
    torch.manual_seed(0)
    callback = TrainWatchCallback(console=io.StringIO())
    trainer = pl.Trainer(
        callbacks=[callback],
        accelerator="cpu",
        max_steps=60,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=tmp_path,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(ReIdentifier(feed))
    assert trainer.global_step == 60
    return callback


@pytest.mark.parametrize("feed", ["batch_sampler", "iterable"])
def test_lightning_p_by_k_training_batches_are_silent(tmp_path, feed):
    assert found(_fit_lightning(tmp_path, feed).alerts) == []


def test_lightning_the_same_identities_read_in_order_warn_at_step_15(tmp_path):
    (alert,) = found(_fit_lightning(tmp_path, "sorted").alerts)
    assert alert.severity == "warning" and alert.step == 15
    assert "SequentialSampler" in alert.data["sampler"]
