"""broadcast between two parts of one output: a reward model scoring a pair in one pass.

A pairwise reward model (as TRL's concatenated forward does) scores the chosen
and the rejected answers in one pass, ``r = model(torch.cat([chosen, rejected]))``
of shape ``(2N, 1)``, and splits it: ``r_c, r_r = r.chunk(2)``. Then
``r_c - r_r.view(-1)`` is ``(N, 1)`` minus ``(N,)``: an ``(N, N)`` matrix, every
chosen answer against every rejected one. Both operands are views of one
output's storage, like the pairwise idiom ``s - s.view(-1)`` that compares every
score with every other on purpose; but they cover different rows, so they are
two tensors and the bug is told. Views of the same elements (``s.view(-1)``,
``s.squeeze(1)``, ``s.t()``) stay silent, as do a Siamese loss's explicit
``s[:, None] - s[None, :]`` and a SimCLR loss on ``z.chunk(2)`` halves paired by
a matrix product. Each script runs buggy and clean, under ``tw.watch``, under
``trainwatch run`` and in a Lightning module with ``TrainWatchCallback``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings
from pathlib import Path
from types import ModuleType

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import rules_of
from tests.lightning_models import quiet_trainer
from trainwatch.collect.broadcast import _one_tensor
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

N = 16

REWARD = '''
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

N = 16


class RewardModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.body = nn.GRU(16, 16, batch_first=True)
        self.v_head = nn.Linear(16, 1)

    def forward(self, ids):
        h, _ = self.body(self.emb(ids))
        return self.v_head(h[:, -1])  # (batch, 1)


def rewards(model, chosen, rejected, form):
    """The chosen and rejected rewards, (N, 1) and whatever ``form`` makes the other."""
    if form == "two_passes":
        return model(chosen), model(rejected).view(-1)
    r = model(torch.cat([chosen, rejected]))  # (2N, 1)
    if form == "sliced":
        return r[:N], r[N:].squeeze(-1)
    r_c, r_r = r.chunk(2)
    if form == "chunked":
        return r_c, r_r.view(-1)
    return r_c, r_r  # the healthy twin: (N, 1) against (N, 1)


def train(model, opt, steps=4, form="clean"):
    torch.manual_seed(0)
    for _ in range(steps):
        chosen = torch.randint(0, 50, (N, 6))
        rejected = torch.randint(50, 100, (N, 6))
        r_c, r_r = rewards(model, chosen, rejected, form)
        loss = -F.logsigmoid(r_c - r_r).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    torch.manual_seed(0)
    model = RewardModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, form=sys.argv[1] if len(sys.argv) > 1 else "clean")
    print("trained")
'''

# The form of the reward pair, and whether it broadcasts chosen against rejected.
FORMS = {"chunked": True, "sliced": True, "two_passes": True, "clean": False}
LINE = "loss = -F.logsigmoid(r_c - r_r).mean()"


def _load(tmp_path: Path) -> tuple[ModuleType, Path]:
    path = tmp_path / "reward_pairs.py"
    path.write_text(REWARD)
    spec = importlib.util.spec_from_file_location("reward_pairs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.mark.parametrize("form", list(FORMS))
def test_a_reward_pair_split_from_one_pass_is_told_under_watch(tmp_path, quiet_watch, form):
    reward, path = _load(tmp_path)
    torch.manual_seed(0)
    model = reward.RewardModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    reward.train(model, opt, form=form)
    found = [
        (a.step, a.data["op"], a.data["shapes"], a.data["result"], a.data["source"])
        for a in monitor.alerts
        if a.rule == "broadcast"
    ]
    source = f"{path}:{_line_of(path, LINE)}"
    expected = [(0, "sub", [[N, 1], [N]], [N, N], source)] if FORMS[form] else []
    assert found == expected
    assert rules_of(monitor) == (["broadcast"] if FORMS[form] else [])


@pytest.mark.parametrize("form", ["chunked", "clean"])
def test_a_reward_pair_split_from_one_pass_is_told_under_run(tmp_path, capsys, form):
    _, path = _load(tmp_path)
    log = tmp_path / "log"
    code = run_script(path, [form], log_dir=log, console=False)
    assert code == 0
    found = [json.loads(line) for line in (log / "alerts.jsonl").read_text().splitlines()]
    told = [(a["rule"], a["step"], a["data"]["op"], a["data"]["result"]) for a in found]
    assert told == ([("broadcast", 0, "sub", [N, N])] if FORMS[form] else [])
    assert "trained" in capsys.readouterr().out
    sys.modules.pop("reward_pairs", None)


def _siamese_step(model, opt, pairing: str) -> None:
    """A margin ranking loss over every pair of one batch's scores, written on purpose."""
    x = torch.randn(N, 8)
    relevance = x[:, 0]
    s = model(x)  # (N, 1)
    if pairing == "indexed":
        pairs = s[:, None, 0] - s[None, :, 0]  # (N, N)
    elif pairing == "squeezed":
        pairs = s - s.squeeze(1)
    else:
        pairs = s - s.t().reshape(-1)
    order = torch.sign(relevance[:, None] - relevance[None, :])
    loss = F.relu(1.0 - order * pairs).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.mark.parametrize("pairing", ["indexed", "squeezed", "transposed"])
def test_a_siamese_ranking_loss_over_one_batchs_scores_is_silent(quiet_watch, pairing):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt)
    for _ in range(3):
        _siamese_step(model, opt, pairing)
    assert rules_of(monitor) == []


@pytest.mark.parametrize("normalize_first", [True, False])
def test_a_simclr_loss_on_the_halves_of_one_pass_is_silent(quiet_watch, normalize_first):
    """Two augmented views in one pass, ``z.chunk(2)``, paired by ``z1 @ z2.T``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt)
    for _ in range(3):
        x = torch.randn(N, 8)
        views = torch.cat([x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x)])
        z = model(views)  # (2N, 16)
        if normalize_first:
            z1, z2 = F.normalize(z, dim=1).chunk(2)
        else:
            z1, z2 = (F.normalize(half, dim=1) for half in z.chunk(2))
        logits = z1 @ z2.T / 0.1  # (N, N): each view against every other's
        labels = torch.arange(N)
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert rules_of(monitor) == []


class _RewardModule(pl.LightningModule):
    """The reward model in Lightning: chosen and rejected scored in one pass."""

    def __init__(self, buggy: bool) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.buggy = buggy

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, batch_idx):
        chosen, rejected = batch
        r_c, r_r = self(torch.cat([chosen, rejected])).chunk(2)  # (N, 1) each
        margin = r_c - (r_r.view(-1) if self.buggy else r_r)
        return -F.logsigmoid(margin).mean()

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        chosen, rejected = (
            torch.randn(4 * N, 8, generator=gen),
            torch.randn(4 * N, 8, generator=gen),
        )
        return DataLoader(TensorDataset(chosen + 1.0, rejected), batch_size=N)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("buggy", [True, False])
def test_a_lightning_reward_model_split_from_one_pass(tmp_path, buggy):
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(
        tmp_path, [callback], max_steps=3, limit_val_batches=0, num_sanity_val_steps=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's own notes on a tiny run
        trainer.fit(_RewardModule(buggy))
    found = [
        (a.rule, a.step, a.data.get("op"), a.data.get("result"))
        for a in callback.alerts
        if a.severity in ("warning", "error")
    ]
    assert found == ([("broadcast", 0, "sub", [N, N])] if buggy else [])


def test_one_tensor_means_the_same_elements_of_one_storage():
    """Views covering the same elements are one tensor; the halves of a chunk are two."""
    s = torch.randn(2 * N, 1)
    e = torch.randn(N, 4)
    first, second = s.chunk(2)
    assert _one_tensor(s, s.view(-1))
    assert _one_tensor(s, s.squeeze(1))
    assert _one_tensor(s, s.t())
    assert _one_tensor(s, s.unsqueeze(0))
    assert _one_tensor(e, e.view(-1))
    assert _one_tensor(e, e.t())
    assert _one_tensor(e, e.unsqueeze(1).expand(N, 3, 4))
    assert not _one_tensor(first, second.view(-1))
    assert not _one_tensor(s[:N], s[N:].squeeze(-1))
    assert not _one_tensor(s[::2], s[1::2].view(-1))
    assert not _one_tensor(s[:N], s.view(-1))
    assert not _one_tensor(e[:, :2], e[:, 2:])
    assert not _one_tensor(s, s.clone().view(-1))
