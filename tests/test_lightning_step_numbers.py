"""Every alert's step is Lightning's ``global_step`` at the batch that made the bug.

One LightningModule plants one bug at a known ``global_step`` and records it;
the alert must carry that very number. Automatic optimisation with and
without ``accumulate_grad_batches``, and manual optimisation with and without
accumulation written by hand, under the callback and under ``trainwatch run``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

SCRIPT = Path(__file__).parent / "scripts" / "lightning_steps.py"
_spec = importlib.util.spec_from_file_location("lightning_steps", SCRIPT)
lightning_steps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lightning_steps)

OPTIMISATIONS = ["auto", "auto-accum", "manual", "manual-accum"]

# The rule each planted bug must raise (nothing else may be raised beside it).
EXPECTED = {
    "forward_nan": "nonfinite_forward",
    "loss_nan": "nonfinite_loss",
    "loss_inf": "nonfinite_loss",
    "no_zero_grad": "accumulated_gradient",
}


def _fit_with_callback(case: str, root: Path) -> tuple[list, int | None]:
    callback = TrainWatchCallback(console=False)
    model = lightning_steps.fit(case, callbacks=[callback], default_root_dir=root)
    return callback.alerts, model.planted_at


@pytest.mark.parametrize("optimisation", OPTIMISATIONS)
@pytest.mark.parametrize("bug", sorted(EXPECTED))
def test_callback_reports_each_bug_at_lightnings_global_step(optimisation, bug, tmp_path):
    alerts, planted_at = _fit_with_callback(f"{optimisation}:{bug}", tmp_path)
    assert planted_at == lightning_steps.PLANT_AT
    raised = [(a.rule, a.step) for a in alerts if a.severity != "info"]
    assert raised == [(EXPECTED[bug], planted_at)]


@pytest.mark.parametrize("optimisation", OPTIMISATIONS)
def test_callback_is_silent_on_the_clean_module(optimisation, tmp_path):
    alerts, _ = _fit_with_callback(f"{optimisation}:clean", tmp_path)
    assert [a for a in alerts if a.severity != "info"] == []


def test_a_nan_loss_explained_by_a_forward_nan_is_not_reported_beside_it(tmp_path):
    alerts, planted_at = _fit_with_callback("auto:forward_nan", tmp_path)
    assert [a.rule for a in alerts] == ["nonfinite_forward"]
    assert alerts[0].step == planted_at
    assert alerts[0].module == ""  # made in the root's own forward, after body


@pytest.mark.slow
def test_trainwatch_run_reports_each_bug_at_lightnings_global_step(tmp_path, capsys):
    # Every case in one script run: one model (and one monitor) per case, in order.
    # The loss is not visible from outside the script, so no loss-only case here.
    cases = [
        f"{optimisation}:{bug}"
        for optimisation in OPTIMISATIONS
        for bug in ("clean", "forward_nan", "no_zero_grad")
    ]
    code = run_script(SCRIPT, cases, log_dir=tmp_path / "log", console=False)
    assert code == 0
    planted = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [json.loads(line) for line in lines]
    names = ["PlantedStepNet"] + [f"PlantedStepNet#{n}" for n in range(2, len(cases) + 1)]
    for case, name in zip(cases, names):
        raised = [
            (a["rule"], a["step"])
            for a in found
            if a["data"].get("model") == name and a["severity"] != "info"
        ]
        bug = case.split(":")[1]
        if bug == "clean":
            assert raised == [], case
        else:
            assert planted[case] == lightning_steps.PLANT_AT, case
            assert raised == [(EXPECTED[bug], planted[case])], case


# -- runs that start past step 0: trainer.test() after fit(), a resumed fit --------------


class _Net(L.LightningModule):
    def __init__(self, frozen: bool = False, train_in_test: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(32, 4)
        if frozen:
            self.fc2.requires_grad_(False)  # frozen, yet in the optimizer below
        self.train_in_test = train_in_test

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))

    def training_step(self, batch, index):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def test_step(self, batch, index):
        if self.train_in_test:
            self.train()  # the bug: dropout on while testing
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _data() -> DataLoader:
    data = TensorDataset(torch.randn(320, 16), torch.randint(0, 4, (320,)))
    return DataLoader(data, batch_size=32, shuffle=True)


def _trainer(root: Path, callbacks: list, **kwargs) -> L.Trainer:
    return L.Trainer(
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=root,
        **kwargs,
    )


@pytest.mark.parametrize("bug", [True, False], ids=["train_in_test", "healthy"])
def test_a_test_after_fit_dates_its_alerts_by_the_global_step(tmp_path, bug):
    callback = TrainWatchCallback(console=False)
    trainer = _trainer(tmp_path, [callback], max_steps=20, enable_checkpointing=False)
    model = _Net(train_in_test=bug)
    trainer.fit(model, _data())
    trainer.test(model, _data(), verbose=False)
    raised = [(a.rule, a.step) for a in callback.alerts if a.severity != "info"]
    assert raised == ([("eval_in_train_mode", 20)] if bug else [])


def test_a_fit_resumed_from_a_checkpoint_saved_without_the_callback_keeps_its_steps(tmp_path):
    first = _trainer(
        tmp_path, [ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)], max_epochs=1
    )
    first.fit(_Net(frozen=True), _data())
    callback = TrainWatchCallback(console=False)
    resumed = _trainer(tmp_path, [callback], max_epochs=2, enable_checkpointing=False)
    resumed.fit(_Net(frozen=True), _data(), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    raised = [(a.rule, a.step) for a in callback.alerts if a.severity != "info"]
    assert raised == [("frozen_in_optimizer", 10)]  # one epoch of 10 batches before
