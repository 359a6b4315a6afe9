"""Two-rank runs for the distributed tests: real processes under a hard timeout.

A rank left waiting in a collective must fail its test, not block CI: every
run here is killed after ``TIMEOUT`` seconds. Each script writes
``OUT/rank<r>.json`` for the test to read back.

A run that PyTorch itself aborts on the way out is run once more. Right after
the last collective, gloo's worker threads may still be letting go of their
tensors while the rank tears its group down or exits; about one rank in a few
hundred then dies by SIGABRT, with glibc's or the C++ runtime's last words
(``terminate called without an active exception``, ``malloc(): unaligned
tcache chunk detected``) and nothing of Python's. The scripts meet at a
barrier and leave without the interpreter's shutdown where they can
(``scripts/rank_exit.py``), which makes it rarer but not impossible. A crash
of trainwatch's own shows a Python traceback or happens again, so it still
fails the test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent / "scripts"
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
TIMEOUT = 240
# torchrun, as ``python -m``, so the test's own interpreter runs every rank.
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")


# What a native abort leaves on stderr; either is PyTorch's exit race above
# when no Python traceback comes with it.
NATIVE_ABORTS = ("terminate called without an active exception", "malloc(): ", "free(): ")


def aborted_on_the_way_out(done: subprocess.CompletedProcess[str]) -> bool:
    """Whether a rank of ``done`` died by a native abort, not by a Python error."""
    return (
        done.returncode != 0
        and any(words in done.stderr for words in NATIVE_ABORTS)
        and "Traceback (most recent call last)" not in done.stderr
    )


def python(
    *args: str, out: Path | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python *args`` under the timeout, whatever its exit status; run once more,
    on an emptied ``out`` (a rendezvous file, the records, the logs), if PyTorch
    aborted it on the way out."""
    for attempt in range(2):
        if attempt and out is not None:
            empty(out)
        done = subprocess.run(
            [sys.executable, *args],
            capture_output=True,
            text=True,
            env=ENV,
            cwd=cwd,
            timeout=TIMEOUT,
        )
        if not aborted_on_the_way_out(done):
            break
    return done


def empty(folder: Path) -> None:
    """What a run left in ``folder`` gone, so that its rerun starts as it did."""
    for path in folder.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def run(
    *args: str, out: Path | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python *args``, writing into ``out``; asserts that it exited 0."""
    done = python(*args, out=out, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def records(out: Path, ranks: tuple[int, ...] = (0, 1)) -> list[dict]:
    """What each rank's script wrote."""
    return [json.loads((out / f"rank{r}.json").read_text()) for r in ranks]


def ranks_of(script: str, out: Path, *args: str) -> list[dict]:
    """Run ``tests/scripts/<script> OUT *args`` (it starts its own ranks) and read them."""
    run(str(SCRIPTS / script), str(out), *args, out=out)
    return records(out)
