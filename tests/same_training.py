"""A training script run twice, plain and under ``trainwatch run`` with its re-runs
made often: what each run wrote and which rules the watched one told.

Re-run tests compare the two: trainwatch's own re-runs of a forward must leave
the script's training bit for bit as it is without trainwatch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

_ROOT = str(Path(__file__).resolve().parent.parent)


def _python(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        env={"PYTHONPATH": _ROOT, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def plain_and_under_run(tmp_path: Path, script: str, every: int = 2) -> tuple[Any, Any, list[str]]:
    """``script`` (which writes its losses, as JSON, to the file named by its first
    argument) run plain and under ``trainwatch run`` with stalled_training's re-run
    every ``every`` steps: the losses each wrote, and the rules the watched run told."""
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(script))
    config = tmp_path / "often.yaml"
    config.write_text(f"stalled_training: {{every: {every}, warmup: 1}}\n")
    plain = _python(str(path), str(tmp_path / "plain.json"), cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    options = ["--config", str(config), "--log-dir", str(tmp_path / "out"), "--no-console"]
    watched = _python(
        "-m", "trainwatch", "run", *options, str(path), str(tmp_path / "watched.json"), cwd=tmp_path
    )
    assert watched.returncode == 0, watched.stdout + watched.stderr
    alerts = tmp_path / "out" / "alerts.jsonl"
    lines = alerts.read_text().splitlines() if alerts.exists() else []
    return (
        json.loads((tmp_path / "plain.json").read_text()),
        json.loads((tmp_path / "watched.json").read_text()),
        [json.loads(line)["rule"] for line in lines],
    )
