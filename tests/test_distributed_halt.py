"""A halt on one DDP rank stops every rank at the same step, with no hang (2 gloo processes).

Each run has a hard timeout, so a rank left waiting in a collective fails the
test instead of blocking CI.
"""

from __future__ import annotations

import json

import pytest

from tests.ranks import SCRIPTS, records, run


@pytest.mark.slow
@pytest.mark.parametrize(("check_every", "stops_at"), [(1, 5), (4, 7)])
def test_a_halt_on_rank_one_stops_both_ranks_at_the_same_step(tmp_path, check_every, stops_at):
    """Rank 1's NaN at step 5; with a check every 4 steps, the rank that fired keeps
    stepping to the next check (step 7) so that both stop there."""
    run(str(SCRIPTS / "ddp_halt.py"), str(tmp_path), str(check_every), out=tmp_path)
    zero, one = records(tmp_path)
    assert zero["stopped_at"] == one["stopped_at"] == stops_at
    for rank in (zero, one):
        raised = rank["raised"]
        assert (raised["rule"], raised["step"], raised["data"]["rank"]) == (
            "nonfinite_forward",
            5,
            1,
        )
    # Rank zero wrote rank one's alert, stamped with its rank, before stopping;
    # the NaN reached rank zero's gradients through the all-reduce, which is
    # one info line there, not an origin of its own.
    lines = (tmp_path / "tw0" / "alerts.jsonl").read_text().splitlines()
    written = [json.loads(line) for line in lines]
    assert [(a["rule"], a["severity"], a["step"], a["data"]["rank"]) for a in written] == [
        ("nonfinite_backward", "info", 5, 0),
        ("nonfinite_forward", "error", 5, 1),
    ]
    assert "arrived non-finite from another rank" in written[0]["message"]
    # Rank one reported the origin itself, stamped with its rank.
    assert [(a["rule"], a["module"], a["data"]["rank"]) for a in one["alerts"]] == [
        ("nonfinite_forward", "module.0", 1)
    ]


@pytest.mark.slow
def test_a_halt_under_lightning_ddp_stops_both_ranks_after_rank_zero_wrote_it(tmp_path):
    run(str(SCRIPTS / "ddp_fit.py"), str(tmp_path), "halt", out=tmp_path)
    zero, one = records(tmp_path)
    for rank in (zero, one):
        raised = rank["raised"]
        assert (raised["rule"], raised["step"], raised["data"]["rank"]) == (
            "accumulated_gradient",
            1,
            1,
        )
        assert rank["batches"] == 1  # both stopped in the same batch
    (jsonl,) = tmp_path.glob("ddp/version_*/alerts.jsonl")
    written = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(r["rule"], r["data"]["rank"]) for r in written] == [("accumulated_gradient", 1)]


@pytest.mark.slow
def test_the_halt_check_returns_or_raises_only_once_gloos_workers_dropped_its_tensors(tmp_path):
    """A worker still holding a check's tensor when the script ends asks for the GIL
    while the interpreter finalizes, and the process aborts ("terminate called
    without an active exception"). After every check, clean or halting, none is held."""
    run(str(SCRIPTS / "halt_sync_let_go.py"), str(tmp_path), out=tmp_path)
    for found in records(tmp_path):
        assert found["still_held"] == [0] * 60
        assert found["halts"] == [{"step": s, "at": s, "rank": 1} for s in range(9, 60, 10)]
