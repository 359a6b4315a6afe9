"""Plain ``tw.watch`` DDP loops (2 gloo processes): rank zero alone writes and prints,
and the other ranks' alerts reach it through the process group's store, with no
collective on a healthy step and no rank left waiting.

Each run has a hard timeout, so a rank left waiting fails the test instead of
blocking CI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ranks import ranks_of

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def _ranks(out: Path, mode: str) -> list[dict]:
    return ranks_of("ddp_watch_relay.py", out, mode)


def _written(out: Path) -> list[tuple]:
    lines = (out / "tw0" / "alerts.jsonl").read_text().splitlines()
    return [
        (a["rule"], a["severity"], a["module"], a["step"], a["data"]["rank"])
        for a in map(json.loads, lines)
    ]


# Rank 1's NaN is born in its batch at step 5: rank 1 reports the origin, rank
# zero (whose gradients turned non-finite in the all-reduce) one info line.
ORIGIN_ON_RANK_ONE = [
    ("nonfinite_backward", "info", None, 5, 0),
    ("nonfinite_forward", "error", "module.0", 5, 1),
]


@pytest.mark.slow
def test_a_clean_ddp_run_is_silent_on_both_ranks_and_only_rank_zero_writes(tmp_path):
    zero, one = _ranks(tmp_path, "clean")
    assert zero["alerts"] == one["alerts"] == []
    assert _written(tmp_path) == []
    assert one["console"] == "" and one["wrote"] == []  # rank 1: no files, no console
    assert "alerts.jsonl" in zero["wrote"]


@pytest.mark.slow
def test_the_origin_of_a_nan_born_on_rank_one_reaches_rank_zeros_alerts_file(tmp_path):
    zero, one = _ranks(tmp_path, "nan")
    assert _written(tmp_path) == ORIGIN_ON_RANK_ONE
    # Delivered at the first delivery point after it (every 4 steps: step 7),
    # not only when the run ends.
    assert [(a["rule"], a["data"]["rank"]) for a in zero["on_disk_after_8"]] == [
        ("nonfinite_backward", 0),
        ("nonfinite_forward", 1),
    ]
    assert "(rank 1)" in zero["console"] and "nonfinite_forward" in zero["console"]
    # Rank zero's monitor holds every rank's alerts; rank one printed nothing.
    assert [(a["rule"], a["data"]["rank"]) for a in zero["alerts"]] == [
        ("nonfinite_backward", 0),
        ("nonfinite_forward", 1),
    ]
    assert [(a["rule"], a["data"]["rank"]) for a in one["alerts"]] == [("nonfinite_forward", 1)]
    assert one["console"] == "" and one["wrote"] == []


@pytest.mark.slow
def test_alerts_are_delivered_at_close_after_the_script_destroyed_its_process_group(tmp_path):
    """No delivery before the end, the group destroyed before the monitors close, and
    rank 1 closing a second after rank 0: rank zero waits (bounded) and writes it."""
    zero, one = _ranks(tmp_path, "destroy")
    assert [(a["rule"], a["data"]["rank"]) for a in zero["on_disk_after_8"]] == [
        ("nonfinite_backward", 0)
    ]
    assert _written(tmp_path) == ORIGIN_ON_RANK_ONE
    counts = json.loads((tmp_path / "tw0" / "alert_counts.json").read_text())
    assert {(c["rule"], c["count"]) for c in counts["counts"]} == {
        ("nonfinite_backward", 1),
        ("nonfinite_forward", 1),
    }
    assert one["console"] == ""


@pytest.mark.slow
def test_with_the_relay_off_each_rank_writes_its_own_alerts_file(tmp_path):
    zero, one = _ranks(tmp_path, "own")
    assert _written(tmp_path) == [("nonfinite_backward", "info", None, 5, 0)]
    lines = (tmp_path / "tw1" / "alerts.jsonl").read_text().splitlines()
    assert [(a["rule"], a["data"]["rank"]) for a in map(json.loads, lines)] == [
        ("nonfinite_forward", 1)
    ]
    assert "nonfinite_forward" in one["console"]
    assert [a["rule"] for a in zero["alerts"]] == ["nonfinite_backward"]  # its own only
