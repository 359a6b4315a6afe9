"""A script run under ``trainwatch run``, then resumed from its checkpoint in a new process."""

from __future__ import annotations

import json
from pathlib import Path

from trainwatch.runner import run_script


def _warned(log_dir: Path) -> list[tuple[str, int]]:
    alerts = [json.loads(line) for line in (log_dir / "alerts.jsonl").open()]
    return [(a["rule"], a["step"]) for a in alerts if a["severity"] != "info"]


def warnings_of_both_runs(
    tmp_path: Path, source: str, bug: str
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(rule, step) of each warning and error of the first run and of the resumed one.

    The script takes ``first|resumed``, the bug's name and its checkpoint folder.
    """
    script = tmp_path / "resume.py"
    script.write_text(source)
    checkpoints = str(tmp_path / "checkpoints")
    run_script(script, ["first", bug, checkpoints], log_dir=tmp_path / "first", console=False)
    run_script(script, ["resumed", bug, checkpoints], log_dir=tmp_path / "resumed", console=False)
    return _warned(tmp_path / "first"), _warned(tmp_path / "resumed")
