"""A gradient jump on an epoch's short last batch through batch norm names that batch.

2498 samples in batches of 64 leave a last batch of 2 each epoch when the
DataLoader keeps ``drop_last=False`` (its default). Batch norm in training mode
normalises those 2 samples by their own mean and variance, and exactly those
steps' gradients jump 1,000-20,000x. The jump was told with "a learning rate too
high ... clip gradients": the cause is that step's tiny batch, and the fix
``drop_last=True``. Now the alert says so (``data.cause: small_batch``,
``data.batch_size``, ``data.usual_batch_size``, ``data.batch_norm``) where the
jumping step's batch through the model's first batch-norm layer, in training
mode, was a quarter of the usual one or less.

Controls: the same loop with ``drop_last=True`` is silent; a real explosion (a
loss scaled 1e4x for one step) on a full batch keeps the usual advice. Shapes: a
``tw.watch`` loop, a LightningModule with the callback (the DataLoader left at
its default), and ``trainwatch run`` of a metric-learning script whose head and
center loss are models of their own.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

sys.path.insert(0, str(Path(__file__).parent))
from lightning_models import quiet_trainer

SAMPLES, BATCH, EPOCHS = 2498, 64, 6
PER_EPOCH = -(-SAMPLES // BATCH)  # 40 steps, the last of 2 samples


def _data(seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(8, 32, generator=gen) * 1.5
    y = torch.randint(0, 8, (SAMPLES,), generator=gen)
    return TensorDataset(centers[y] + torch.randn(SAMPLES, 32, generator=gen), y)


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 8))


def _watched_loop(
    seed: int, drop_last: bool, loss_scaled_at: int | None = None, readback: str = "auto"
) -> list:
    torch.manual_seed(seed)
    loader = DataLoader(_data(seed), batch_size=BATCH, shuffle=True, drop_last=drop_last)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    with tw.watch(model, opt, console=False, readback=readback) as monitor:
        for _ in range(EPOCHS):
            for x, y in loader:
                scale = 1e4 if step == loss_scaled_at else 1.0
                opt.zero_grad()
                (scale * F.cross_entropy(model(x), y)).backward()
                opt.step()
                step += 1
    return [a for a in monitor.alerts if a.severity != "info"]


def _told_as_the_short_batch(alerts: list, model_layer: str = "1") -> None:
    jumps = [a for a in alerts if a.rule == "exploding_gradient"]
    assert jumps and len(jumps) == len(alerts)
    for alert in jumps:
        assert alert.step % PER_EPOCH == PER_EPOCH - 1  # an epoch's last step
        assert alert.data["cause"] == "small_batch"
        assert alert.data["batch_size"] == SAMPLES % BATCH
        assert alert.data["usual_batch_size"] == BATCH
        assert alert.data["batch_norm"] == model_layer
        assert "drop_last=True" in alert.hint
        assert "learning rate too high" not in alert.hint


@pytest.mark.parametrize("readback", ["auto", "lagged"])
def test_a_jump_on_the_epochs_two_sample_batch_names_it_and_drop_last(readback):
    # Lagged (a GPU's readback): the step is judged at the next one, after its pass.
    _told_as_the_short_batch(_watched_loop(seed=2, drop_last=False, readback=readback))


def test_the_same_loop_with_drop_last_is_silent():
    assert _watched_loop(seed=2, drop_last=True) == []


def test_a_real_explosion_on_a_full_batch_keeps_the_usual_advice():
    alerts = _watched_loop(seed=1, drop_last=True, loss_scaled_at=150)
    jumps = [a for a in alerts if a.rule == "exploding_gradient"]
    assert [a.step for a in jumps] == [150]
    assert "cause" not in jumps[0].data and "batch_size" not in jumps[0].data
    assert "drop_last" not in jumps[0].hint


class BatchNormNet(pl.LightningModule):
    def __init__(self, seed: int, drop_last: bool | None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = _net()
        self.seed, self.drop_last = seed, drop_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        options = {} if self.drop_last is None else {"drop_last": self.drop_last}
        order = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            _data(self.seed), batch_size=BATCH, shuffle=True, generator=order, **options
        )


def _fit(tmp_path: Path, drop_last: bool | None) -> list:
    callback = TrainWatchCallback(console=False)
    quiet_trainer(tmp_path, [callback], max_epochs=EPOCHS).fit(BatchNormNet(1, drop_last))
    return [a for a in callback.alerts if a.severity != "info"]


def test_lightning_with_the_loaders_default_names_the_short_batch(tmp_path):
    _told_as_the_short_batch(_fit(tmp_path, drop_last=None), model_layer="net.1")


def test_lightning_with_drop_last_is_silent(tmp_path):
    assert _fit(tmp_path, drop_last=True) == []


SCRIPT = """
import math, sys
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class ArcMargin(nn.Module):
    def __init__(self, d, classes, s=16.0, m=0.3):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(classes, d))
        nn.init.xavier_uniform_(self.weight)
        self.s, self.cos_m, self.sin_m = s, math.cos(m), math.sin(m)

    def forward(self, x, labels):
        cosine = F.linear(F.normalize(x), F.normalize(self.weight))
        sine = torch.sqrt((1.0 - cosine.pow(2)).clamp(0, 1))
        one_hot = F.one_hot(labels, cosine.shape[1]).float()
        phi = cosine * self.cos_m - sine * self.sin_m
        return self.s * (one_hot * phi + (1.0 - one_hot) * cosine)


class CenterLoss(nn.Module):
    def __init__(self, classes, d):
        super().__init__()
        self.centers = nn.Parameter(torch.randn(classes, d))

    def forward(self, x, labels):
        return (x - self.centers[labels]).pow(2).sum(1).mean()


class Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        layers = [nn.Linear(32, 128), nn.BatchNorm1d(128), nn.PReLU(), nn.Linear(128, 16)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)
centers = torch.randn(8, 32, generator=gen) * 1.5
y = torch.randint(0, 8, (2498,), generator=gen)
X = centers[y] + torch.randn(2498, 32, generator=gen)
drop_last = sys.argv[1] == "drop_last"
loader = DataLoader(TensorDataset(X, y), batch_size=64, shuffle=True, drop_last=drop_last)
model, margin, center = Embedder(), ArcMargin(16, 8), CenterLoss(8, 16)
opt = torch.optim.SGD(
    [{"params": model.parameters()}, {"params": margin.parameters()}], lr=0.05, momentum=0.9
)
opt_center = torch.optim.SGD(center.parameters(), lr=0.5)
for epoch in range(8):
    model.train()
    for data, labels in loader:
        feature = model(data)
        loss = F.cross_entropy(margin(feature, labels), labels) + 0.01 * center(feature, labels)
        opt.zero_grad()
        opt_center.zero_grad()
        loss.backward()
        opt.step()
        opt_center.step()
"""


def _run(tmp_path: Path, variant: str) -> list[dict]:
    script = tmp_path / "arcface.py"
    script.write_text(SCRIPT)
    log = tmp_path / variant
    assert run_script(script, [variant], log_dir=log, console=False) == 0
    alerts = [json.loads(line) for line in (log / "alerts.jsonl").read_text().splitlines()]
    return [a for a in alerts if a["severity"] != "info"]


def test_trainwatch_run_tells_the_embedders_short_batch_once(tmp_path):
    alerts = _run(tmp_path, "keep_last")
    assert alerts
    for alert in alerts:
        assert alert["rule"] == "exploding_gradient"
        assert alert["data"]["model"] == "Embedder"  # not the head's monitor, too
        assert alert["module"].startswith("net.")
        assert alert["step"] % PER_EPOCH == PER_EPOCH - 1
        assert alert["data"]["cause"] == "small_batch"
        assert (alert["data"]["batch_size"], alert["data"]["usual_batch_size"]) == (2, 64)
        assert "drop_last=True" in alert["hint"]


def test_trainwatch_run_of_the_script_with_drop_last_is_silent(tmp_path):
    assert _run(tmp_path, "drop_last") == []
