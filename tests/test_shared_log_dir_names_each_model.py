"""Models of one process writing into the same log dir are told apart there.

Two models trained one after the other, each under its own ``tw.watch(...,
log_dir=same)`` (a baseline, then a bigger model), or a Lightning callback with
one ``log_dir`` handed a new module for each fit: once a second model opens the
dir, each line of ``alerts.jsonl`` names its model in ``data.model`` (the class
name, ``Sequential#2`` for a second model of the same class, as under
``trainwatch run``), the first model's earlier lines included;
``alert_counts.json`` keeps every model's counts, and ``trainwatch report``
gives each model's finding a row of its own instead of merging them.

A dir that one model writes keeps the single-monitor format (no ``data.model``):
one monitor, the same model watched again (``trainer.test()`` after its fit),
and two models each in a log dir of its own.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import trainwatch as tw
from tests.lightning_models import BoringNet, quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.report import build_report


def _baseline() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 2))


def _bigger() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2)
    )


def _fit(model: nn.Module, log_dir: Path, *, forget_train: bool, steps: int = 30) -> None:
    """The sweep's helper: model.train() once, a validation at step 10 leaves eval on
    (unless ``forget_train`` is False: the loop calls model.train() after it)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    with tw.watch(model, opt, log_dir=log_dir, console=False):
        for step in range(steps):
            if step == 10:
                model.eval()
                with torch.no_grad():
                    model(torch.randn(64, 8))
                if not forget_train:
                    model.train()
            x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()


def _lines(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "alerts.jsonl").read_text().splitlines()]


def _counts(log_dir: Path) -> dict:
    return json.loads((log_dir / "alert_counts.json").read_text())


def _rows(log_dir: Path) -> list[tuple]:
    return [
        (r.model, r.rule, r.module, r.first_step, r.last_step, r.count)
        for r in build_report(log_dir).rows
    ]


def test_two_models_in_turn_are_each_named_counted_and_reported(tmp_path):
    torch.manual_seed(0)
    log_dir = tmp_path / "shared"
    _fit(_baseline(), log_dir, forget_train=True)
    _fit(_bigger(), log_dir, forget_train=True)
    lines = _lines(log_dir)
    assert [(a["rule"], a["module"], a["data"]["model"]) for a in lines] == [
        ("train_in_eval_mode", "1", "Sequential"),
        ("train_in_eval_mode", "1", "Sequential#2"),
    ]
    counts = _counts(log_dir)
    assert counts["steps"] == 30
    assert sorted((c["model"], c["module"], c["count"]) for c in counts["counts"]) == [
        ("Sequential", "1", 20),
        ("Sequential#2", "1", 20),
    ]
    assert sorted(_rows(log_dir)) == [
        ("Sequential", "train_in_eval_mode", "1", 10, 29, 20),
        ("Sequential#2", "train_in_eval_mode", "1", 10, 29, 20),
    ]


def test_models_of_different_classes_go_by_their_class_names(tmp_path):
    class Baseline(nn.Sequential):
        pass

    class Bigger(nn.Sequential):
        pass

    torch.manual_seed(0)
    log_dir = tmp_path / "shared"
    _fit(Baseline(*_baseline()), log_dir, forget_train=True)
    _fit(Bigger(*_bigger()), log_dir, forget_train=False)  # the clean one
    assert [a["data"]["model"] for a in _lines(log_dir)] == ["Baseline"]
    assert [(c["model"], c["count"]) for c in _counts(log_dir)["counts"]] == [("Baseline", 20)]
    assert [row[0] for row in _rows(log_dir)] == ["Baseline"]


def test_two_clean_models_in_turn_stay_silent(tmp_path):
    torch.manual_seed(0)
    log_dir = tmp_path / "shared"
    _fit(_baseline(), log_dir, forget_train=False)
    _fit(_bigger(), log_dir, forget_train=False)
    assert _lines(log_dir) == []
    assert _counts(log_dir) == {"steps": 30, "counts": []}
    assert _rows(log_dir) == []


def test_two_models_watched_at_once_name_the_lines_written_before_the_second(tmp_path):
    """A GAN-like pair, each with its own tw.watch on one log dir: the first one's
    finding, written while it was alone, gets its name when the second opens."""
    torch.manual_seed(0)
    log_dir = tmp_path / "shared"
    first, second = _baseline(), _bigger()
    opt1 = torch.optim.SGD(first.parameters(), lr=0.01)
    opt2 = torch.optim.SGD(second.parameters(), lr=0.01)
    first.eval()  # trains in eval mode from its first step
    one = tw.watch(first, opt1, log_dir=log_dir, console=False)
    for _ in range(3):
        opt1.zero_grad()
        first(torch.randn(32, 8)).square().mean().backward()
        opt1.step()
    two = tw.watch(second, opt2, log_dir=log_dir, console=False)
    second.eval()
    for _ in range(3):
        for model, opt in ((first, opt1), (second, opt2)):
            opt.zero_grad()
            model(torch.randn(32, 8)).square().mean().backward()
            opt.step()
    one.close()
    two.close()
    assert [(a["data"]["model"], a["step"]) for a in _lines(log_dir)] == [
        ("Sequential", 0),
        ("Sequential#2", 0),
    ]
    assert sorted((c["model"], c["count"]) for c in _counts(log_dir)["counts"]) == [
        ("Sequential", 6),
        ("Sequential#2", 3),
    ]
    assert sorted((row[0], row[5]) for row in _rows(log_dir)) == [
        ("Sequential", 6),
        ("Sequential#2", 3),
    ]


def test_one_model_alone_keeps_the_single_monitor_format(tmp_path):
    torch.manual_seed(0)
    log_dir = tmp_path / "alone"
    _fit(_baseline(), log_dir, forget_train=True)
    [line] = _lines(log_dir)
    assert "model" not in line["data"]
    assert [(c["model"], c["count"]) for c in _counts(log_dir)["counts"]] == [(None, 20)]


def test_the_same_model_watched_again_is_no_second_model(tmp_path):
    """A second phase of the same model (a fine-tune after a warm-up) in the same dir."""
    torch.manual_seed(0)
    log_dir = tmp_path / "phases"
    model = _baseline()
    _fit(model, log_dir, forget_train=True)
    _fit(model, log_dir, forget_train=True)
    assert all("model" not in line["data"] for line in _lines(log_dir))
    assert {c["model"] for c in _counts(log_dir)["counts"]} == {None}


def test_two_models_each_in_a_log_dir_of_its_own_keep_the_single_monitor_format(tmp_path):
    torch.manual_seed(0)
    _fit(_baseline(), tmp_path / "a", forget_train=True)
    _fit(_bigger(), tmp_path / "b", forget_train=True)
    for log_dir in (tmp_path / "a", tmp_path / "b"):
        [line] = _lines(log_dir)
        assert "model" not in line["data"]
        assert [c["model"] for c in _counts(log_dir)["counts"]] == [None]


def test_a_dir_whose_lines_name_their_models_gets_named_lines(tmp_path):
    """An earlier process's shared dir (or trainwatch run's): a model joining it later
    names its own lines, so the report does not put them under no model at all."""
    log_dir = tmp_path / "earlier"
    log_dir.mkdir()
    earlier = {
        "rule": "train_in_eval_mode",
        "severity": "warning",
        "step": 3,
        "module": "1",
        "message": "m",
        "hint": "h",
        "data": {"model": "Net"},
        "time": 0.0,
    }
    (log_dir / "alerts.jsonl").write_text(json.dumps(earlier) + "\n")
    torch.manual_seed(0)
    _fit(_baseline(), log_dir, forget_train=True)
    assert [a["data"]["model"] for a in _lines(log_dir)] == ["Net", "Sequential"]
    assert [c["model"] for c in _counts(log_dir)["counts"]] == ["Sequential"]


# -- Lightning: a callback with one log_dir, a new module for each fit ----------------


def _lightning_fit(tmp_path: Path, callback: TrainWatchCallback, module: BoringNet) -> None:
    trainer = quiet_trainer(tmp_path, [callback], max_steps=4, num_sanity_val_steps=0)
    trainer.fit(module)


@pytest.mark.parametrize("shared", [True, False], ids=["one_callback", "callback_per_fit"])
def test_lightning_fits_of_two_modules_in_one_log_dir_are_told_apart(tmp_path, shared):
    log_dir = tmp_path / "log"
    callback = TrainWatchCallback(console=io.StringIO(), log_dir=log_dir)
    _lightning_fit(tmp_path, callback, BoringNet(freeze_fc1=True))
    if not shared:
        callback = TrainWatchCallback(console=io.StringIO(), log_dir=log_dir)
    _lightning_fit(tmp_path, callback, BoringNet(freeze_fc1=True))
    assert [(a["rule"], a["module"], a["data"]["model"]) for a in _lines(log_dir)] == [
        ("frozen_in_optimizer", "fc1", "BoringNet"),
        ("frozen_in_optimizer", "fc1", "BoringNet#2"),
    ]
    assert [(c["model"], c["count"]) for c in _counts(log_dir)["counts"]] == [
        ("BoringNet", 1),
        ("BoringNet#2", 1),
    ]
    assert [(row[0], row[1]) for row in _rows(log_dir)] == [
        ("BoringNet", "frozen_in_optimizer"),
        ("BoringNet#2", "frozen_in_optimizer"),
    ]


def test_lightning_test_after_fit_is_the_same_model(tmp_path):
    log_dir = tmp_path / "log"
    callback = TrainWatchCallback(console=io.StringIO(), log_dir=log_dir)
    module = BoringNet(freeze_fc1=True)
    trainer = quiet_trainer(tmp_path, [callback], max_steps=4, num_sanity_val_steps=0)
    trainer.fit(module)
    trainer.test(module, dataloaders=module.train_dataloader())
    [line] = _lines(log_dir)
    assert "model" not in line["data"]
    assert [(c["model"], c["count"]) for c in _counts(log_dir)["counts"]] == [(None, 1)]


def test_lightning_clean_fits_of_two_modules_stay_silent(tmp_path):
    log_dir = tmp_path / "log"
    callback = TrainWatchCallback(console=io.StringIO(), log_dir=log_dir)
    _lightning_fit(tmp_path, callback, BoringNet())
    _lightning_fit(tmp_path, callback, BoringNet())
    assert _lines(log_dir) == []
    assert _counts(log_dir) == {"steps": 4, "counts": []}
