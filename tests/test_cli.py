"""The command line: ``trainwatch demo`` shows its planted bug live."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainwatch.cli import main
from trainwatch.demo import BUGS, run_demo
from trainwatch.rules import RULE_CLASSES

IMPLEMENTED = {cls.id for cls in RULE_CLASSES}


def _bug_case(name: str):
    """A demo bug whose rule has not landed yet is still planted; its test waits."""
    rule = BUGS[name].expected_rule
    marks = [] if rule in IMPLEMENTED else [pytest.mark.skip(reason=f"rule {rule} not built yet")]
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("bug", [_bug_case(name) for name in sorted(BUGS) if not BUGS[name].raises])
def test_demo_catches_each_planted_bug(bug, tmp_path):
    monitor = run_demo(bug, steps=30, delay=0, log_dir=tmp_path, monitor_console=False)
    expected = BUGS[bug]
    found = [a for a in monitor.alerts if a.rule == expected.expected_rule]
    assert found, [a.rule for a in monitor.alerts]
    if expected.module is not None:
        assert expected.module in {a.module for a in found}
    lines = (tmp_path / "alerts.jsonl").read_text().splitlines()
    assert expected.expected_rule in {json.loads(line)["rule"] for line in lines}


def test_demo_writes_a_tensorboard_log_dir_and_says_how_to_open_it(tmp_path, capsys):
    assert main(["demo", "--steps", "12", "--delay", "0", "--log-dir", str(tmp_path)]) == 0
    assert list(tmp_path.glob("events.out.tfevents.*"))
    assert f"tensorboard --logdir {tmp_path}" in capsys.readouterr().err


def test_demo_without_a_bug_is_clean():
    monitor = run_demo(None, steps=30, delay=0, monitor_console=False)
    assert [a for a in monitor.alerts if a.severity != "info"] == []


def test_demo_default_goes_wrong_part_way(capsys, tmp_path):
    assert main(["demo", "--steps", "30", "--delay", "0", "--log-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "step 10 ERROR accumulated_gradient" in err
    assert "steps watched" in err


@pytest.mark.slow
def test_python_dash_m_trainwatch_demo_runs_in_a_fresh_process(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "trainwatch", "demo", "--steps", "20", "--delay", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "accumulated_gradient" in done.stderr
    assert list((tmp_path / "runs" / "trainwatch").glob("demo-*/alerts.jsonl"))
