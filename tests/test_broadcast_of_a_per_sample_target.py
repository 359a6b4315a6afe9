"""broadcast: a per-sample target of shape (N, 1, 1) against an (N, K) prediction.

A dataset that yields each target as ``(1, 1)`` makes a batch ``(N, 1, 1)``;
``mu - y`` against a model's ``(N, K)`` output is ``(N, N, K)``: every
prediction against every sample's target, silently averaged. So is a target
``(N, 1)`` given its last axis in the loss, ``y.unsqueeze(-1) - mu``: the axis
that meets the batch is the data's own. An axis given in the loss to pair
each sample with every other (``keys.unsqueeze(1) - z``, a kernel between the
data and the model's samples) stays a pairing on purpose.
"""

from __future__ import annotations

import json
import textwrap
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from tests.conftest import rules_of
from tests.lightning_models import quiet_trainer
from trainwatch.collect.broadcast import batch_broadcast
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

N, K = 16, 3


@pytest.mark.parametrize(
    ("first", "second", "given", "result"),
    [
        ((N, K), (N, 1, 1), (), (N, N, K)),
        ((N, 1, 1), (N, K), (), (N, N, K)),
        ((N, 1, 1, 1), (N, K), (), (N, 1, N, K)),
        ((N, 1, 1), (N, K), (2,), (N, N, K)),  # y.unsqueeze(-1): the batch meets y's own axis
        ((N, 1, 1), (N, K), (1, 2), (N, N, K)),  # no features shared: not a pairing
        ((N, 1, K), (N, K), (2,), (N, N, K)),
        ((N, 1, K), (N, K), (1,), None),  # z.unsqueeze(1) against keys: on purpose
        ((N, 1, 1), (8, K), (), None),  # the other side is not the batch
        ((N, 1, 2), (N, K), (), None),  # sizes that do not broadcast
    ],
)
def test_a_value_per_sample_meeting_the_batch_before_the_features_is_the_pattern(
    first, second, given, result
):
    assert batch_broadcast(first, second, N, frozenset(given)) == result


class _Targets(Dataset):
    """Regression pairs; each target a (1, 1) or a (1,) tensor, as a dataset may yield it."""

    def __init__(self, target_shape: tuple[int, ...]) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 8, generator=gen)
        self.y = self.x[:, :1].sin() * 2
        self.target_shape = target_shape

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i].reshape(self.target_shape)


def _head(outputs: int = K) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, outputs))


def _squared(mu, y):
    return ((mu - y) ** 2).mean()


def _squared_reversed(mu, y):
    return ((y - mu) ** 2).mean()


def _mse_loss(mu, y):
    return F.mse_loss(mu, y)


def _gaussian_nll(out, y):
    mu, log_sigma = out.chunk(2, dim=-1)
    return (((y - mu) / log_sigma.exp()) ** 2 / 2 + log_sigma).mean()


LOSSES = {
    "squared": (_squared, K, "sub"),
    "squared_reversed": (_squared_reversed, K, "sub"),
    "mse_loss": (_mse_loss, K, "mse_loss"),
    "gaussian_nll": (_gaussian_nll, 2 * K, "sub"),
}


def _fit(quiet_watch, loss_fn, outputs: int, target_shape: tuple[int, ...]):
    model = _head(outputs)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's own, for a mismatched mse_loss
        for x, y in DataLoader(_Targets(target_shape), batch_size=N):
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    monitor.close()
    return monitor


@pytest.mark.parametrize("name", list(LOSSES))
def test_a_dataset_yielding_1x1_targets_against_k_outputs_is_caught_at_step_0(quiet_watch, name):
    loss_fn, outputs, op = LOSSES[name]
    monitor = _fit(quiet_watch, loss_fn, outputs, (1, 1))
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    assert alert.step == 0 and alert.severity == "error"
    assert alert.data["op"] == op
    assert sorted(alert.data["shapes"], key=len) == [[N, K], [N, 1, 1]]
    assert alert.data["result"] == [N, N, K]


@pytest.mark.parametrize("name", list(LOSSES))
def test_the_same_loss_on_targets_of_one_value_each_is_silent(quiet_watch, name):
    loss_fn, outputs, _ = LOSSES[name]
    assert rules_of(_fit(quiet_watch, loss_fn, outputs, (1,))) == []


def _given_in_the_loss(quiet_watch, loss_fn, outputs: int = K):
    """A loop whose targets come as (N, 1); the loss reshapes them."""
    model = _head(outputs)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(N, 8, generator=gen)
        y = x[:, :1].sin()  # (N, 1)
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    return monitor


@pytest.mark.parametrize(
    ("loss_fn", "outputs"),
    [
        (lambda mu, y: ((y.unsqueeze(-1) - mu) ** 2).mean(), K),
        (lambda mu, y: ((y[..., None] - mu) ** 2).mean(), K),
        (lambda mu, y: ((mu.unsqueeze(-1) - y.expand(N, K)) ** 2).mean(), 1),
    ],
    ids=["target_unsqueezed", "target_indexed_with_none", "one_output_unsqueezed"],
)
def test_a_size_one_axis_given_after_the_one_meeting_the_batch_is_caught(
    quiet_watch, loss_fn, outputs
):
    monitor = _given_in_the_loss(quiet_watch, loss_fn, outputs)
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    assert alert.step == 0 and alert.data["result"] == [N, N, K]


def test_the_target_left_as_n_by_1_against_k_outputs_is_silent(quiet_watch):
    assert rules_of(_given_in_the_loss(quiet_watch, lambda mu, y: ((y - mu) ** 2).mean())) == []


def _kernel(a, b):
    return torch.exp(-(a - b).pow(2).sum(-1))


PAIRINGS = {
    # a kernel between the data's samples and the model's, the data given the axis
    "data_unsqueezed": lambda z, data, keys: _kernel(data.unsqueeze(1), z).mean(),
    "data_indexed": lambda z, data, keys: _kernel(data[:, None], z).mean(),
    "data_moved_after": lambda z, data, keys: _kernel(data.unsqueeze(1).to(z), z).mean(),
    "both_given": lambda z, data, keys: _kernel(z.unsqueeze(1), data.unsqueeze(0)).mean(),
    "momentum_keys": lambda z, data, keys: F.cross_entropy(
        -(z.unsqueeze(1) - keys).pow(2).sum(-1), torch.arange(N)
    ),
    "cdist": lambda z, data, keys: torch.cdist(z, data).mean(),
    "attention": lambda z, data, keys: (
        z.view(N, 1, K).unsqueeze(2) * data.view(N, 1, K).unsqueeze(1)
    ).mean(),
}


@pytest.mark.parametrize("name", list(PAIRINGS))
def test_pairings_given_their_axis_in_the_loss_are_silent(quiet_watch, name):
    model = _head()
    momentum = _head().requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(N, 8, generator=gen)
        data = torch.randn(N, K, generator=gen)
        z = model(x)
        with torch.no_grad():
            keys = momentum(x + 0.1)
        loss = PAIRINGS[name](z, data, keys)
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    assert rules_of(monitor) == []


class _MultiOutput(pl.LightningModule):
    def __init__(self, target_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.net = _head()
        self.target_shape = target_shape

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self(x) - y) ** 2).mean()

    def train_dataloader(self):
        return DataLoader(_Targets(self.target_shape), batch_size=N)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize(("target_shape", "buggy"), [((1, 1), True), ((1,), False)])
def test_a_lightning_module_on_1x1_targets(tmp_path, target_shape, buggy):
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(
        tmp_path, [callback], max_steps=4, limit_val_batches=0, num_sanity_val_steps=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's own notes on a tiny run
        trainer.fit(_MultiOutput(target_shape))
    found = [
        (a.rule, a.step, a.data.get("result"))
        for a in callback.alerts
        if a.severity in ("warning", "error")
    ]
    assert found == ([("broadcast", 0, [N, N, K])] if buggy else [])


SCRIPT = """
import sys
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

SHAPE = (1, 1) if "bug" in sys.argv else (1,)


class Targets(Dataset):
    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 8, generator=gen)

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return self.x[i], self.x[i, :1].sin().reshape(SHAPE)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x, y in DataLoader(Targets(), batch_size=16):
    mu = model(x)
    loss = ((mu - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("trained")
"""


def test_under_trainwatch_run_the_unmodified_script_is_caught_and_its_clean_twin_is_silent(
    tmp_path, capsys
):
    script = tmp_path / "multi_output.py"
    script.write_text(textwrap.dedent(SCRIPT))
    for buggy in (True, False):
        log = tmp_path / f"log-{buggy}"
        assert run_script(script, ["bug"] if buggy else [], log_dir=log, console=False) == 0
        found = [json.loads(line) for line in (log / "alerts.jsonl").read_text().splitlines()]
        rules = [(a["rule"], a["step"], a["data"].get("result")) for a in found]
        assert rules == ([("broadcast", 0, [N, N, K])] if buggy else []), (buggy, rules)
    assert "trained" in capsys.readouterr().out
