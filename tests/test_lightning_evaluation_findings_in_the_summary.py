"""A broadcast in a loss helper that Lightning's training, validation and test steps
share: the fit's summary tells the evaluation's row from the training's, and a
``trainer.test()`` that meets the fit's finding again prints no second summary."""

from __future__ import annotations

import io
import json
import re
import warnings

import pytest
from torch.utils.data import DataLoader

from tests.lightning_models import BoringNet, _data, quiet_trainer
from trainwatch.lightning import TrainWatchCallback

ROW = re.compile(r"│ broadcast\s*│ ([^│]*?)\s*│ error\s*│\s*\d+\s*│\s*(\d+)\s*│")


class _SharedLoss(BoringNet):
    """One loss helper for every step; ``bug`` names where it pairs the ``(N, 1)``
    output with ``(N,)`` targets: every step, training only, or none. ``test_bug``
    plants a broadcast of the test step's own."""

    def __init__(self, bug: str = "none", test_bug: bool = False) -> None:
        super().__init__()
        self.bug = bug
        self.test_bug = test_bug

    def _loss(self, batch, training: bool):
        x, y = batch
        out, target = self(x), y.squeeze(-1)
        buggy = self.bug == "everywhere" or (self.bug == "training" and training)
        return ((out if buggy else out.squeeze(-1)) - target).pow(2).mean()

    def training_step(self, batch, batch_idx):
        return self._loss(batch, True)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch, False))

    def test_step(self, batch, batch_idx):
        loss = self._loss(batch, False)
        if self.test_bug:
            x, y = batch
            loss = loss + (self(x) - y.squeeze(-1)).abs().mean()
        self.log("test_loss", loss)


def _fit(tmp_path, model) -> tuple[TrainWatchCallback, io.StringIO, object]:
    """A fit whose sanity check and validations read the validation set."""
    console = io.StringIO()
    callback = TrainWatchCallback(console=console, log_dir=tmp_path / "log")
    trainer = quiet_trainer(tmp_path, [callback], max_steps=8, limit_val_batches=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes on a tiny run
        trainer.fit(model)
    return callback, console, trainer


def _test(trainer, model, console: io.StringIO) -> str:
    """What ``trainer.test()`` printed after the fit."""
    start = len(console.getvalue())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.test(model, DataLoader(_data(16, seed=2), batch_size=8), verbose=False)
    return console.getvalue()[start:]


def _counts(tmp_path) -> list[int]:
    """The broadcast findings' counts in alert_counts.json, the evaluation's first."""
    counts = json.loads((tmp_path / "log" / "alert_counts.json").read_text())["counts"]
    return [c["count"] for c in counts if c["rule"] == "broadcast"]


# -- the test after the fit ----------------------------------------------------


def test_a_test_meeting_the_fits_broadcast_again_prints_no_second_summary(tmp_path):
    """``test()`` audits its first passes afresh and finds the shared helper's line
    again: counted (alert_counts.json), but told in the fit, so not summed up again."""
    model = _SharedLoss(bug="everywhere")
    callback, console, trainer = _fit(tmp_path, model)
    assert console.getvalue().count("8 steps watched") == 1
    assert _counts(tmp_path) == [1, 1]
    assert _test(trainer, model, console) == ""
    assert _counts(tmp_path) == [2, 1]
    assert [a.data["phase"] for a in callback.alerts] == ["evaluation", "training"]


def test_a_test_with_a_broadcast_of_its_own_sums_up_again(tmp_path):
    """The control: a finding the fit did not tell is news, with its summary."""
    model = _SharedLoss(bug="training", test_bug=True)
    callback, console, trainer = _fit(tmp_path, model)
    printed = _test(trainer, model, console)
    assert "ERROR broadcast" in printed and "in an evaluation pass" in printed
    assert "8 steps watched" in printed
    assert [a.data["phase"] for a in callback.alerts] == ["training", "evaluation"]


def test_a_test_after_a_clean_fit_stays_silent(tmp_path):
    model = _SharedLoss()
    callback, console, trainer = _fit(tmp_path, model)
    assert "8 steps watched" in console.getvalue() and "no alerts" in console.getvalue()
    assert _test(trainer, model, console) == ""
    assert callback.alerts == []


# -- the fit's summary -----------------------------------------------------------


@pytest.mark.parametrize(
    ("bug", "rows"),
    [
        # The sanity check finds it first, then training: two findings, two hints.
        ("everywhere", [("- (evaluation)", "1"), ("-", "1")]),
        ("training", [("-", "1")]),
        ("none", []),
    ],
)
def test_the_summary_tells_the_evaluation_row_from_the_training_row(tmp_path, bug, rows):
    _, console, _ = _fit(tmp_path, _SharedLoss(bug=bug))
    assert ROW.findall(console.getvalue()) == rows
