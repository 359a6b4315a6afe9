"""The command line: ``trainwatch demo`` shows its planted bug live."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainwatch.cli import main
from trainwatch.demo import BUGS, run_demo


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_demo_catches_each_planted_bug(bug, tmp_path):
    monitor = run_demo(bug, steps=30, delay=0, log_dir=tmp_path, monitor_console=False)
    rules = {a.rule for a in monitor.alerts}
    assert BUGS[bug].expected_rule in rules
    lines = (tmp_path / "alerts.jsonl").read_text().splitlines()
    assert BUGS[bug].expected_rule in {json.loads(line)["rule"] for line in lines}


def test_demo_without_a_bug_is_clean():
    monitor = run_demo(None, steps=30, delay=0, monitor_console=False)
    assert [a for a in monitor.alerts if a.severity != "info"] == []


def test_demo_default_goes_wrong_part_way(capsys):
    assert main(["demo", "--steps", "30", "--delay", "0"]) == 0
    err = capsys.readouterr().err
    assert "step 10 ERROR accumulated_gradient" in err
    assert "steps watched" in err


@pytest.mark.slow
def test_python_dash_m_trainwatch_demo_runs_in_a_fresh_process():
    done = subprocess.run(
        [sys.executable, "-m", "trainwatch", "demo", "--steps", "20", "--delay", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "accumulated_gradient" in done.stderr
