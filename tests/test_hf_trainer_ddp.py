"""trainwatch.hf.TrainWatchCallback with a ``transformers.Trainer`` on two gloo CPU ranks
(``torchrun --nproc_per_node 2``): rank zero alone writes and prints, and another
rank's alert reaches its alerts.jsonl through the process group's store.

Each run has a hard timeout, so a rank left waiting fails the test instead of
blocking CI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ranks import SCRIPTS, TORCHRUN, records, run

pytest.importorskip("transformers")


def _train(out: Path, mode: str) -> list[dict]:
    run(*TORCHRUN, str(SCRIPTS / "hf_ddp_train.py"), str(out), mode, out=out, cwd=out)
    return records(out)


def _written(out: Path) -> list[tuple]:
    lines = (out / "tw" / "alerts.jsonl").read_text().splitlines()
    return [(a["rule"], a["module"], a["step"], a["data"]["rank"]) for a in map(json.loads, lines)]


@pytest.mark.slow
def test_a_clean_trainer_on_two_ranks_is_silent_on_both(tmp_path):
    zero, one = _train(tmp_path, "clean")
    assert zero["alerts"] == one["alerts"] == []
    assert _written(tmp_path) == []
    assert one["console"] == ""


@pytest.mark.slow
def test_a_nan_born_on_rank_one_under_the_trainer_reaches_rank_zeros_alerts_file(tmp_path):
    zero, one = _train(tmp_path, "nan")
    origin = ("nonfinite_forward", "transformer.h.1.attn.c_attn", 2, 1)
    assert origin in _written(tmp_path)
    assert "(rank 1)" in zero["console"]
    assert [(a["rule"], a["data"]["rank"]) for a in one["alerts"]] == [("nonfinite_forward", 1)]
    # Rank zero's own gradients were read after DDP's all-reduce: the NaN that
    # reached them from rank 1 is one info line there, not an origin of its own.
    own = [(a["rule"], a["severity"]) for a in zero["alerts"] if a["data"]["rank"] == 0]
    assert own == [("nonfinite_backward", "info")], zero["alerts"]
    assert one["console"] == ""  # rank 1 printed nothing


@pytest.mark.slow
def test_a_halt_on_rank_one_under_the_trainer_stops_both_ranks_at_the_same_step(tmp_path):
    """halt_on under the Trainer: rank 1 fires at step 2, and both ranks end their loop
    at that step's end and raise with rank 1's alert (no rank left waiting)."""
    zero, one = _train(tmp_path, "nan+halt")
    for rank in (zero, one):
        assert rank["halted"] == {"rule": "nonfinite_forward", "rank": 1, "global_step": 3}
    assert ("nonfinite_forward", "transformer.h.1.attn.c_attn", 2, 1) in _written(tmp_path)
