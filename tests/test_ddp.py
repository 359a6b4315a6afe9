"""DDP on CPU with two real processes: every rank collects, rank zero alone reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ddp_fit.py"


@pytest.mark.slow
def test_alert_raised_on_rank_one_reaches_rank_zero_which_alone_reports(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    zero = json.loads((tmp_path / "rank0.json").read_text())
    one = json.loads((tmp_path / "rank1.json").read_text())
    assert zero["steps"] == one["steps"] == 4
    # The planted bug (rank 1 forgot zero_grad) fired on rank 1 only ...
    assert [(a["rule"], a["data"]["rank"], a["step"]) for a in one["alerts"]] == [
        ("accumulated_gradient", 1, 1)
    ]
    # ... and reached rank zero at the first gather (every 2 batches), not only at the end.
    assert [(a["rule"], a["data"]["rank"]) for a in zero["alerts"]] == [("accumulated_gradient", 1)]
    assert zero["seen_after_batch"][:2] == [[], [1]]
    # Rank zero alone prints and writes: one console line, one alerts.jsonl.
    assert done.stderr.count("ERROR accumulated_gradient") == 1
    assert "(rank 1)" in done.stderr
    (jsonl,) = tmp_path.glob("ddp/version_*/alerts.jsonl")
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(r["rule"], r["data"]["rank"]) for r in records] == [("accumulated_gradient", 1)]
    assert len(list(tmp_path.glob("ddp/version_*/events.out.tfevents*"))) == 1
