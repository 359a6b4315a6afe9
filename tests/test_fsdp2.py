"""FSDP2 (``fully_shard``) on two gloo CPU processes: gradients are DTensor shards.

Each rank's norms are of its own shards, and a small tensor FSDP2 put wholly
on the other rank is neither a zero gradient nor a failure here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp2_run.py"
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def _ranks(tmp_path: Path, mode: str) -> list[dict]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), mode],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_a_clean_fully_sharded_run_is_silent_on_both_ranks(tmp_path):
    zero, one = _ranks(tmp_path, "clean")
    assert zero["alerts"] == [] and one["alerts"] == []
    # The last layer's (1, 32) weight and (1,) bias sit wholly on rank zero.
    assert sorted(zero["norms"]) == ["0", "2", "4"]
    assert sorted(one["norms"]) == ["0", "2"]


@pytest.mark.slow
def test_a_missing_zero_grad_is_caught_on_each_rank_with_its_rank(tmp_path):
    zero, one = _ranks(tmp_path, "no_zero_grad")
    for rank, found in enumerate((zero, one)):
        assert [(a["rule"], a["step"], a["data"]["rank"]) for a in found["alerts"]] == [
            ("accumulated_gradient", 3, rank)
        ]


@pytest.mark.slow
def test_a_layer_left_frozen_in_the_optimizer_is_named_on_each_rank(tmp_path):
    zero, one = _ranks(tmp_path, "frozen")
    for rank, found in enumerate((zero, one)):
        assert [(a["rule"], a["module"], a["data"]["rank"]) for a in found["alerts"]] == [
            ("frozen_in_optimizer", "2", rank)
        ]
