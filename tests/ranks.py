"""Two-rank runs for the distributed tests: real processes under a hard timeout.

A rank left waiting in a collective must fail its test, not block CI: every
run here is killed after ``TIMEOUT`` seconds. Each script writes
``OUT/rank<r>.json`` for the test to read back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent / "scripts"
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
TIMEOUT = 240
# torchrun, as ``python -m``, so the test's own interpreter runs every rank.
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python *args``; asserts that it exited 0."""
    done = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=cwd,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def records(out: Path, ranks: tuple[int, ...] = (0, 1)) -> list[dict]:
    """What each rank's script wrote."""
    return [json.loads((out / f"rank{r}.json").read_text()) for r in ranks]


def ranks_of(script: str, out: Path, *args: str) -> list[dict]:
    """Run ``tests/scripts/<script> OUT *args`` (it starts its own ranks) and read them."""
    run(str(SCRIPTS / script), str(out), *args)
    return records(out)
