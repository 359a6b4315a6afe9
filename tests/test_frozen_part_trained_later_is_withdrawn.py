"""A frozen part told as running in training mode, trained later: the note withdrawn.

A staged fine-tune freezes the encoder while the head warms up, then unfreezes
it and hands it to the optimizer (``optimizer.add_param_group``, Lightning's
``BackboneFinetuning``). At step 0 the encoder is a frozen part in training
mode, and ``eval_in_train_mode`` says so, advising ``encoder.eval()``. Once
the encoder trains, that advice is wrong, yet the note stood to the end: the
closing summary listed it with no undone mark. Now the rule withdraws it, as
``frozen_in_optimizer`` withdraws a freeze undone, in a note dated at the step
the part first trains; a part frozen for the whole run, or unfrozen in some of
its modules only, keeps its note.
"""

from __future__ import annotations

import json
import textwrap

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from trainwatch.alert import undone_at, withdrawals
from trainwatch.lightning import TrainWatchCallback
from trainwatch.report import build_report
from trainwatch.runner import run_script

_TOLD = "frozen part in training mode"
_TRAINS = "frozen part trains"


def _frozen_part_lines(alerts: list) -> list[tuple[int, str | None, str, bool]]:
    """(step, module, finding, withdraws) of eval_in_train_mode's frozen-part lines."""
    return [
        (a.step, a.module, a.data["finding"], bool(a.data.get("withdraws")))
        for a in alerts
        if a.rule == "eval_in_train_mode" and a.data.get("finding") in (_TOLD, _TRAINS)
    ]


def _undone_steps(alerts: list) -> list[int | None]:
    """Each told note's undone step as the summaries compute it (None: standing)."""
    told = [(a, a.step) for a in alerts]
    withdrawn = withdrawals(told)
    return [undone_at(a, step, withdrawn) for a, step in told if a.data.get("finding") == _TOLD]


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block1 = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2))
        self.block2 = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block2(self.block1(x))


def _staged_fine_tune(unfreeze: list[tuple[int, str]], steps: int = 16) -> list:
    """A custom loop under ``tw.watch``: the backbone frozen, the optimizer over the
    head; at each (step, block) of ``unfreeze`` that block trains and joins the
    optimizer in a param group of its own."""
    torch.manual_seed(0)
    backbone = Backbone()
    model = nn.Sequential(backbone, nn.Linear(64, 3))
    backbone.requires_grad_(False)
    opt = torch.optim.AdamW(model[1].parameters(), lr=1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(steps):
            for at, name in unfreeze:
                if step == at:
                    block = getattr(backbone, name)
                    block.requires_grad_(True)
                    opt.add_param_group({"params": list(block.parameters()), "lr": 1e-4})
            model.train()
            x = torch.randn(32, 16)
            loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
            opt.zero_grad()
            loss.backward()
            opt.step()
    return monitor.alerts


def test_a_backbone_unfrozen_after_a_warm_up_has_its_note_withdrawn():
    alerts = _staged_fine_tune([(6, "block1"), (6, "block2")])
    assert _frozen_part_lines(alerts) == [
        (0, "0.block1.2", _TOLD, False),
        (6, "0.block1.2", _TRAINS, True),
    ]
    (note,) = [a for a in alerts if a.data.get("finding") == _TRAINS]
    assert note.severity == "info" and note.data["told_at"] == 0
    assert "no longer stands" in note.message and ".eval()" in note.hint
    assert _undone_steps(alerts) == [6]


def test_control_a_backbone_frozen_for_the_whole_run_keeps_its_note():
    alerts = _staged_fine_tune([])
    assert _frozen_part_lines(alerts) == [(0, "0.block1.2", _TOLD, False)]
    assert _undone_steps(alerts) == [None]


def test_control_a_backbone_unfrozen_in_one_of_its_blocks_keeps_its_note_until_all_train():
    """Gradual unfreezing, top block first: the bottom block, still frozen, runs
    its dropout in training mode; the note is withdrawn when it trains too."""
    partial = _staged_fine_tune([(5, "block2")])
    assert _frozen_part_lines(partial) == [(0, "0.block1.2", _TOLD, False)]
    assert _undone_steps(partial) == [None]
    gradual = _staged_fine_tune([(5, "block2"), (10, "block1")])
    assert _frozen_part_lines(gradual) == [
        (0, "0.block1.2", _TOLD, False),
        (10, "0.block1.2", _TRAINS, True),
    ]


def test_the_step_0_hint_says_a_staged_freeze_is_withdrawn_later():
    (told,) = [a for a in _staged_fine_tune([]) if a.data.get("finding") == _TOLD]
    assert "call 0.eval() after every model.train()" in told.hint
    assert "a staged fine-tune" in told.hint and "withdrawn once it trains" in told.hint


# A staged fine-tune that trainwatch run watches unmodified: an encoder frozen (head
# only) for 50 steps, then unfrozen and added with add_param_group; ``never`` keeps
# it frozen to the end.
SCRIPT = """
import sys
import torch, torch.nn as nn
torch.set_num_threads(1); torch.manual_seed(0)
class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, 0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 3)
    def forward(self, ids): return self.head(self.encoder(self.emb(ids)).mean(1))
model = Classifier()
model.emb.requires_grad_(False); model.encoder.requires_grad_(False)
opt = torch.optim.AdamW(model.head.parameters(), lr=1e-3)
for step in range(80):
    if step == 50 and sys.argv[1] == "staged":
        model.emb.requires_grad_(True); model.encoder.requires_grad_(True)
        params = list(model.emb.parameters()) + list(model.encoder.parameters())
        opt.add_param_group({"params": params, "lr": 2e-4})
    ids = torch.randint(0, 100, (16, 12))
    opt.zero_grad(); nn.functional.cross_entropy(model(ids), ids[:, 0] % 3).backward(); opt.step()
"""


@pytest.mark.parametrize("how", ["staged", "never"])
def test_trainwatch_run_withdraws_the_note_of_an_encoder_unfrozen_at_step_50(tmp_path, capsys, how):
    script = tmp_path / "finetune.py"
    script.write_text(textwrap.dedent(SCRIPT))
    code = run_script(script, [how], log_dir=tmp_path / "log", console=True)
    assert code == 0
    lines = [
        json.loads(line) for line in (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    ]
    found = [
        (a["step"], a["module"], a["data"]["finding"], bool(a["data"].get("withdraws")))
        for a in lines
        if a["rule"] == "eval_in_train_mode"
    ]
    told = (0, "encoder.layers.0.self_attn", _TOLD, False)
    rows = build_report(tmp_path / "log").rows
    err = capsys.readouterr().err
    if how == "staged":
        assert found == [told, (50, "encoder.layers.0.self_attn", _TRAINS, True)]
        assert "info (undone 50)" in err
        assert [(r.rule, r.undone_step) for r in rows] == [("eval_in_train_mode", 50)]
    else:
        assert found == [told]
        assert "(undone" not in err
        assert [(r.rule, r.undone_step) for r in rows] == [("eval_in_train_mode", None)]


class _LitFineTune(L.LightningModule):
    """A backbone with dropout under a head; ``BackboneFinetuning`` freezes it before
    training and unfreezes it, in a param group of its own, at its epoch's start."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(16, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 64), nn.ReLU()
        )
        self.head = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch, index):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


@pytest.mark.parametrize("unfreeze_at", [1, 10], ids=["epoch_1", "never"])
def test_lightning_backbone_finetuning_withdraws_the_note_at_its_unfreeze(tmp_path, unfreeze_at):
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    loader = DataLoader(TensorDataset(x, torch.randint(0, 3, (256,))), batch_size=32)
    callback = TrainWatchCallback(console=False)
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=unfreeze_at)
    quiet_trainer(tmp_path, [callback, finetuning], max_epochs=3).fit(_LitFineTune(), loader)
    told = (0, "backbone.2", _TOLD, False)
    if unfreeze_at == 1:  # 8 batches an epoch: epoch 1 starts at step 8
        assert _frozen_part_lines(callback.alerts) == [told, (8, "backbone.2", _TRAINS, True)]
        assert _undone_steps(callback.alerts) == [8]
    else:
        assert _frozen_part_lines(callback.alerts) == [told]
        assert _undone_steps(callback.alerts) == [None]
