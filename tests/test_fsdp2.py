"""FSDP2 (``fully_shard``) on two gloo CPU processes: gradients are DTensor shards.

Each rank's rules judge its own shards, and a small tensor FSDP2 put wholly on
the other rank is neither a zero gradient nor a failure here; what is
reported is the whole layers' norms, summed across ranks at a cadence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainwatch.tensorboard_plugin import metadata

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp2_run.py"
NORMS_EVERY = 4  # the script's distributed.gather_every in its ``norms`` mode
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
    # 12 steps, whole-layer norms every 50 (the default): none yet, and a
    # shard's norm is never reported as its layer's.
    assert zero["norms"] == {} and one["norms"] == {}


@pytest.mark.slow
def test_whole_layer_norms_equal_the_full_gradients_norms_on_each_rank_at_their_cadence(tmp_path):
    ranks = _ranks(tmp_path, "norms")
    for rank, found in enumerate(ranks):
        assert found["alerts"] == []
        steps = found["steps"]
        for step, seen in enumerate(steps):
            reduced = step - (step + 1) % NORMS_EVERY  # the latest step reduced by now
            if reduced < 0:
                assert seen["reported"] == {} and seen["total"] is None
                continue
            full = steps[reduced]["full"]
            # The last layer's (1, 32) weight and bias sit wholly on rank zero:
            # rank one reports that layer too.
            assert sorted(seen["reported"]) == sorted(full) == ["0", "2", "4"]
            for layer, norm in full.items():
                assert seen["reported"][layer] == pytest.approx(norm, rel=1e-5)
            total = sum(norm**2 for norm in full.values()) ** 0.5
            assert seen["total"] == pytest.approx(total, rel=1e-5)
        # TensorBoard has the whole layers' norms at the reduced steps, and no others.
        events = EventAccumulator(str(tmp_path / f"tb{rank}"), size_guidance={"scalars": 0})
        events.Reload()
        for layer in ("0", "2", "4"):
            written = {e.step: e.value for e in events.Scalars(metadata.norm_tag(layer))}
            assert sorted(written) == [3, 7, 11]
            for step, value in written.items():
                assert value == pytest.approx(steps[step]["full"][layer], rel=1e-5)


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
