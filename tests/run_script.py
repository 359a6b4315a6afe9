"""A training script run under ``trainwatch run`` in a fresh interpreter, importing
the trainwatch under test: for tests of what a run says as it closes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import trainwatch


def stderr_under_run(tmp_path: Path, source: str, *args: str) -> str:
    """``source`` written to ``tmp_path/train.py`` and run as ``trainwatch run
    --log-dir tmp_path/run train.py *args``: its stderr (the run must succeed)."""
    script = tmp_path / "train.py"
    script.write_text(source)
    env = dict(os.environ, PYTHONPATH=str(Path(trainwatch.__file__).resolve().parents[1]))
    done = subprocess.run(
        [sys.executable, "-m", "trainwatch", "run", "--log-dir", str(tmp_path / "run")]
        + [str(script), *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr
