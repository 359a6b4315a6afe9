"""One TrainWatchCallback handed to several fits (k-fold cross-validation), and to
the evaluation runs after a fit: each fit is a run of its own, an evaluation goes on
from the run before it."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.lightning_models import BoringNet, quiet_trainer
from trainwatch.lightning import TrainWatchCallback

WARNED = "WARNING frozen_in_optimizer [fc1]"
SUMMARY_ROW = re.compile(r"frozen_in_optimizer\s*│\s*fc1\s*│\s*warning\s*│\s*0\s*│\s*(\d+)\s*│")


def _fit(tmp_path, callback, model) -> None:
    """A new Trainer, as each fold of a k-fold loop makes; no validation in the fit."""
    trainer = quiet_trainer(tmp_path, [callback], max_steps=4, num_sanity_val_steps=0)
    trainer.fit(model)


def _folds(tmp_path, frozen: set[int], *, shared: bool) -> list[dict]:
    """Three folds; what each one printed, kept and wrote when its fit ended."""
    console = io.StringIO()
    shared_callback = TrainWatchCallback(console=console, log_dir=tmp_path / "log")
    seen = []
    for fold in range(3):
        log_dir = tmp_path / ("log" if shared else f"log{fold}")
        callback = (
            shared_callback if shared else TrainWatchCallback(console=console, log_dir=log_dir)
        )
        start = len(console.getvalue())
        _fit(tmp_path, callback, BoringNet(freeze_fc1=fold in frozen))
        counts = json.loads((log_dir / "alert_counts.json").read_text())
        # A shared log_dir keeps every fold's counts, each under its fold's model
        # from the second fold on (the first fold's alone until then).
        model = f"BoringNet#{fold + 1}" if shared and fold else None
        seen.append(
            {
                "printed": console.getvalue()[start:],
                "alerts": [(a.rule, a.module, a.step) for a in callback.alerts],
                "counts": [
                    (c["rule"], c["module"], c["count"])
                    for c in counts["counts"]
                    if c["model"] == model
                ],
                "steps": counts["steps"],
            }
        )
    return seen


@pytest.mark.parametrize("shared", [True, False], ids=["shared_callback", "callback_per_fold"])
def test_a_finding_in_two_folds_is_told_in_each_and_only_there(tmp_path, shared):
    folds = _folds(tmp_path, {0, 2}, shared=shared)
    for fold in (0, 2):
        assert folds[fold]["printed"].count(WARNED) == 1
        assert [int(n) for n in SUMMARY_ROW.findall(folds[fold]["printed"])] == [1]
        assert folds[fold]["alerts"] == [("frozen_in_optimizer", "fc1", 0)]
        assert folds[fold]["counts"] == [("frozen_in_optimizer", "fc1", 1)]
    # The healthy fold between them: nothing of fold 0's in its summary or counts.
    assert "frozen_in_optimizer" not in folds[1]["printed"]
    assert "4 steps watched" in folds[1]["printed"] and "no alerts" in folds[1]["printed"]
    assert folds[1]["alerts"] == [] and folds[1]["counts"] == []
    assert [fold["steps"] for fold in folds] == [4, 4, 4]


def test_healthy_folds_with_a_shared_callback_stay_silent(tmp_path):
    for fold in _folds(tmp_path, set(), shared=True):
        assert "WARNING" not in fold["printed"] and "no alerts" in fold["printed"]
        assert fold["alerts"] == [] and fold["counts"] == []


def test_a_shared_callbacks_alerts_are_the_latest_fits(tmp_path):
    callback = TrainWatchCallback(console=False, log_dir=tmp_path / "log")
    _fit(tmp_path, callback, BoringNet(freeze_fc1=True))
    assert [a.rule for a in callback.alerts] == ["frozen_in_optimizer"]
    _fit(tmp_path, callback, BoringNet())
    assert callback.alerts == []
    _fit(tmp_path, callback, BoringNet(freeze_fc1=True))
    assert [(a.rule, a.step) for a in callback.alerts] == [("frozen_in_optimizer", 0)]
    # Every fit's alerts stay on disk, one after another.
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    assert [json.loads(line)["rule"] for line in lines] == ["frozen_in_optimizer"] * 2


def _loader() -> DataLoader:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(x, x[:, :1]), batch_size=8)


@pytest.mark.parametrize("after", ["validate", "test"])
@pytest.mark.parametrize("frozen", [True, False], ids=["fit_with_a_finding", "clean_fit"])
def test_an_evaluation_after_the_fit_prints_no_second_summary(tmp_path, after, frozen):
    console = io.StringIO()
    callback = TrainWatchCallback(console=console, log_dir=tmp_path / "log")
    trainer = quiet_trainer(tmp_path, [callback], max_steps=4, num_sanity_val_steps=0)
    model = BoringNet(freeze_fc1=frozen)
    trainer.fit(model)
    fitted = [(a.rule, a.module) for a in callback.alerts]
    assert console.getvalue().count("4 steps watched") == 1
    start = len(console.getvalue())
    getattr(trainer, after)(model, _loader(), verbose=False)
    assert console.getvalue()[start:] == ""
    # The fit's findings outlive it, in callback.alerts and alert_counts.json.
    assert [(a.rule, a.module) for a in callback.alerts] == fitted
    counts = json.loads((tmp_path / "log" / "alert_counts.json").read_text())
    assert [(c["rule"], c["module"]) for c in counts["counts"]] == fitted
    assert counts["steps"] == 4


class _ValidatedRegressor(BoringNet):
    """Its validation step pairs an ``(N, 1)`` output with ``(N,)`` targets."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", ((self(x) - y.squeeze(-1)) ** 2).mean())


def test_an_evaluation_that_finds_something_sums_up_again(tmp_path):
    console = io.StringIO()
    callback = TrainWatchCallback(console=console, log_dir=tmp_path / "log")
    trainer = quiet_trainer(tmp_path, [callback], max_steps=4, num_sanity_val_steps=0)
    model = _ValidatedRegressor(freeze_fc1=True)
    trainer.fit(model)
    start = len(console.getvalue())
    trainer.validate(model, _loader(), verbose=False)
    printed = console.getvalue()[start:]
    assert "ERROR broadcast" in printed and "4 steps watched" in printed
    assert [a.rule for a in callback.alerts] == ["frozen_in_optimizer", "broadcast"]
