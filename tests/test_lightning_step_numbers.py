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

import pytest

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
