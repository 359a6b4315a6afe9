"""``trainwatch run`` under ``torchrun --nproc_per_node 2`` (2 gloo processes, CPU): each
rank watched, one alerts.jsonl and one console (rank zero's), ``--fail-on`` gives
every rank exit 3 (over what still stands at the end: not a freeze undone),
``--max-steps`` stops every rank at the same step.

The training script knows nothing of trainwatch. Each run has a hard timeout,
so a rank left waiting fails the test instead of blocking CI.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ranks import aborted_on_the_way_out, empty, python

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ddp_torchrun_train.py"
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def _torchrun(out: Path, mode: str, *run_args: str) -> subprocess.CompletedProcess[str]:
    return python(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "trainwatch",
        "run",
        "--log-dir",
        str(out / "tw"),
        *run_args,
        str(SCRIPT),
        str(out),
        mode,
        out=out,
        cwd=out,
    )


def _written(out: Path) -> list[tuple]:
    lines = (out / "tw" / "alerts.jsonl").read_text().splitlines()
    return [(a["rule"], a["module"], a["data"]["rank"]) for a in map(json.loads, lines)]


def _steps(out: Path) -> list[int]:
    return [int((out / f"steps{r}.txt").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_a_clean_ddp_script_under_torchrun_is_silent_and_exits_zero(tmp_path):
    done = _torchrun(tmp_path, "clean", "--fail-on", "warning")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _written(tmp_path) == []
    assert _steps(tmp_path) == [12, 12]
    # One console: rank zero's note and setup table, once; no alert line.
    assert done.stderr.count("trainwatch run: watching") == 1
    assert done.stdout.count("trainwatch setup") + done.stderr.count("trainwatch setup") == 1
    assert "trainwatch step" not in done.stderr + done.stdout
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("tw")] == ["tw"]


@pytest.mark.slow
def test_a_missing_zero_grad_on_rank_one_is_written_by_rank_zero_and_fails_every_rank(tmp_path):
    done = _torchrun(tmp_path, "no_zero_grad", "--fail-on", "warning")
    written = _written(tmp_path)
    assert written[0][:2] == ("accumulated_gradient", None)
    assert {rank for _, _, rank in written} == {1}  # rank zero's own gradients were reset
    assert done.stderr.count("ERROR accumulated_gradient") == 1  # one console
    # torchrun reports its workers' status and exits non-zero itself. The first
    # worker to exit (3) makes torchrun stop the other, which may be reported as
    # -15 (SIGTERM) though it was exiting with 3 (see the two-rank test below).
    assert done.returncode != 0
    statuses = re.findall(r"exitcode\s*:\s*(-?\d+)", done.stderr)
    assert "3" in statuses and set(statuses) <= {"3", "-15"}
    root = done.stderr.split("Root Cause")[1]
    assert re.search(r"exitcode\s*:\s*3", root)
    assert _steps(tmp_path) == [12, 12]


@pytest.mark.slow
def test_max_steps_stops_both_ranks_at_the_same_step(tmp_path):
    done = _torchrun(tmp_path, "clean", "--max-steps", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _steps(tmp_path) == [4, 4]
    assert done.stderr.count("stopped after 4 steps (--max-steps)") == 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_ranks(out: Path, mode: str) -> list[subprocess.CompletedProcess[str]]:
    """Two ``trainwatch run`` processes with the environment torchrun gives its workers,
    so that each rank's own exit status can be read; run once more, as
    ``tests.ranks.python`` does, if PyTorch aborted a rank on the way out."""
    done = _two_ranks_once(out, mode)
    if any(map(aborted_on_the_way_out, done)):
        empty(out)
        done = _two_ranks_once(out, mode)
    return done


def _two_ranks_once(out: Path, mode: str) -> list[subprocess.CompletedProcess[str]]:
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = {
            **ENV,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        command = [sys.executable, "-m", "trainwatch", "run", "--log-dir", str(out / "tw")]
        command += ["--fail-on", "warning", str(SCRIPT), str(out), mode]
        procs.append(
            subprocess.Popen(
                command, env=env, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=240)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "status"), [("clean", 0), ("no_zero_grad", 3), ("nan", 3)])
def test_fail_on_gives_every_rank_the_same_exit_status(tmp_path, mode, status):
    """The bug is on rank 1 only; rank zero's status says so too, and rank one
    printed nothing of trainwatch's own."""
    zero, one = _two_ranks(tmp_path, mode)
    assert (zero.returncode, one.returncode) == (status, status), zero.stderr[-2000:]
    assert "trainwatch" not in one.stderr + one.stdout
    if status:
        assert "failing (exit 3)" in zero.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "status"), [("unfrozen", 0), ("unfrozen_on_zero", 3)])
def test_fail_on_passes_a_freeze_undone_on_every_rank(tmp_path, mode, status):
    """A staged fine-tune's step-0 warning, taken back at step 4 on every rank, fails no
    rank; left standing on rank 1 alone (it never unfreezes), it fails every rank."""
    zero, one = _two_ranks(tmp_path, mode)
    assert (zero.returncode, one.returncode) == (status, status), zero.stderr[-2000:]
    assert [(r, m) for r, m, _ in _written(tmp_path)] == [
        ("frozen_in_optimizer", "module.0"),
        ("frozen_in_optimizer", "module.0"),
    ]
    assert ("failing (exit 3)" in zero.stderr) == bool(status)


@pytest.mark.slow
def test_a_layer_frozen_when_ddp_wrapped_it_and_unfrozen_later_is_told_not_synced(tmp_path):
    """DDP's reducer, built while the layer was frozen, never all-reduces it: each rank
    trains its own copy. Told at the unfreeze by every rank, written once, and it
    fails the gate (a freeze undone in the same script, wrapped while trainable,
    stays silent: test_fail_on_passes_a_freeze_undone_on_every_rank)."""
    done = _torchrun(tmp_path, "unfrozen_unsynced", "--fail-on", "warning")
    assert done.returncode != 0
    lines = (tmp_path / "tw" / "alerts.jsonl").read_text().splitlines()
    told = [a for a in map(json.loads, lines) if a["rule"] == "trainable_parameters"]
    assert [(a["module"], a["step"], a["data"]["finding"]) for a in told] == [
        ("module.0", 4, "not synced by DDP")
    ]
    assert told[0]["data"]["parameters"] == ["module.0.weight", "module.0.bias"]
    zero, one = (json.loads((tmp_path / f"weight{r}.txt").read_text()) for r in (0, 1))
    assert max(abs(a - b) for a, b in zip(zero, one)) > 1e-4  # the ranks' copies drifted


@pytest.mark.slow
def test_a_layer_frozen_after_ddp_was_built_is_written_before_ddps_error(tmp_path):
    """DDP's reducer waits for the frozen layer's gradients: the forward of step 1 fails
    on every rank. The warning naming the layer is on disk, once; DDP's error, which
    lists reducer indices, gets a note naming them."""
    done = _torchrun(tmp_path, "frozen_after")
    assert done.returncode != 0
    assert _steps(tmp_path) == [1, 1]
    lines = (tmp_path / "tw" / "alerts.jsonl").read_text().splitlines()
    told = [a for a in map(json.loads, lines)]
    assert [(a["rule"], a["module"], a["step"], a["data"]["finding"]) for a in told] == [
        ("trainable_parameters", "module.0", 0, "frozen after DDP")
    ]
    assert told[0]["data"]["parameters"] == ["module.0.weight", "module.0.bias"]
    assert "Expected to have finished reduction" in done.stderr
    assert "DDP's parameter indices 0 1 (rank 0) are module.0.weight, module.0.bias" in done.stderr
