"""FSDP2 (``fully_shard``) on two gloo CPU processes: gradients are DTensor shards.

Each rank's rules judge its own shards, and a small tensor FSDP2 put wholly on
the other rank is neither a zero gradient nor a failure here; what is
reported is the whole layers' norms, summed across ranks at a cadence.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.ranks import ranks_of
from trainwatch.tensorboard_plugin import metadata

NORMS_EVERY = 4  # the script's distributed.gather_every in its ``norms`` mode


def _ranks(tmp_path: Path, mode: str) -> list[dict]:
    return ranks_of("fsdp2_run.py", tmp_path, mode)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["clean", "clean+step", "clean+halt"])
def test_a_clean_fully_sharded_run_is_silent_on_both_ranks(tmp_path, mode):
    zero, one = _ranks(tmp_path, mode)
    assert zero["alerts"] == [] and one["alerts"] == []
    assert zero["halted"] is None and one["halted"] is None
    if mode == "clean+halt":
        # Whole-layer norms every step, inside the halt check's all-reduce.
        for found in (zero, one):
            for seen in found["steps"]:
                assert seen["reported"] == pytest.approx(seen["full"], rel=1e-5)
        return
    if mode != "clean":
        return
    # 12 steps, whole-layer norms every 50 (the default): none yet, and a
    # shard's norm is never reported as its layer's.
    assert zero["norms"] == {} and one["norms"] == {}


@pytest.mark.slow
def test_an_embedding_shard_no_batch_reached_is_not_a_zero_gradient(tmp_path):
    """Every token comes from the embedding's first half of rows: rank 1's shard of
    its gradient is exactly zero at every step while the layer's is not."""
    zero, one = _ranks(tmp_path, "embedding")
    assert zero["alerts"] == [] and one["alerts"] == []


@pytest.mark.slow
def test_whole_layer_norms_equal_the_full_gradients_norms_on_each_rank_at_their_cadence(tmp_path):
    ranks = _ranks(tmp_path, "norms")
    for found in ranks:
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
    # Rank zero alone writes: its TensorBoard has the whole layers' norms at the
    # reduced steps, and no others; rank one opened no files.
    assert not (tmp_path / "tb1").exists()
    events = EventAccumulator(str(tmp_path / "tb0"), size_guidance={"scalars": 0})
    events.Reload()
    steps = ranks[0]["steps"]
    for layer in ("0", "2", "4"):
        written = {e.step: e.value for e in events.Scalars(metadata.norm_tag(layer))}
        assert sorted(written) == [3, 7, 11]
        for step, value in written.items():
            assert value == pytest.approx(steps[step]["full"][layer], rel=1e-5)


@pytest.mark.slow
def test_a_missing_zero_grad_is_caught_on_each_rank_with_its_rank(tmp_path):
    zero, one = _ranks(tmp_path, "no_zero_grad")
    for rank, found in enumerate((zero, one)):
        own = [a for a in found["alerts"] if a["data"]["rank"] == rank]
        assert [(a["rule"], a["step"], a["data"]["rank"]) for a in own] == [
            ("accumulated_gradient", 3, rank)
        ]


@pytest.mark.slow
def test_a_layer_left_frozen_in_the_optimizer_is_named_on_each_rank(tmp_path):
    zero, one = _ranks(tmp_path, "frozen")
    for rank, found in enumerate((zero, one)):
        own = [a for a in found["alerts"] if a["data"]["rank"] == rank]
        assert [(a["rule"], a["module"], a["data"]["rank"]) for a in own] == [
            ("frozen_in_optimizer", "2", rank)
        ]


def _alerts(found: dict, rank: int | None = None) -> list[tuple]:
    """A rank's alerts (rank zero's hold the other ranks' too: ``rank`` picks one's)."""
    return [
        (a["rule"], a["module"], a["step"], a["severity"], a["data"]["cause"], a["data"]["rank"])
        for a in found["alerts"]
        if rank is None or a["data"]["rank"] == rank
    ]


FROM_RANK_ONE = ("nonfinite_backward", None, 5, "info", "other_rank", 0)


@pytest.mark.slow
def test_a_nan_in_rank_ones_input_is_the_input_there_and_arrived_from_another_rank_on_rank_zero(
    tmp_path,
):
    zero, one = _ranks(tmp_path, "nan_input")
    # No replay under FSDP (it would gather weights on one rank alone): every
    # module's sums are kept instead, and the first module's input was already
    # non-finite.
    origin = ("nonfinite_forward", "0", 5, "error", "input", 1)
    assert _alerts(one) == [origin]
    # Rank zero's forward, loss and every module's gradient were finite: one
    # info line, no origin of its own, no cascade; rank one's origin reached it.
    assert _alerts(zero, 0) == [FROM_RANK_ONE]
    assert "arrived non-finite from another rank" in zero["alerts"][0]["message"]
    assert origin in _alerts(zero)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["nan_layer", "nan_layer+deferred"])
def test_a_nan_born_in_a_layer_on_rank_one_is_named_with_its_layer(tmp_path, mode):
    """By default (``auto``) and with ``deferred`` checks alike: no replay is possible
    under FSDP, so every module's output is summed as it runs and names the layer."""
    zero, one = _ranks(tmp_path, mode)
    assert [(a["rule"], a["module"], a["step"], a["data"]["rank"]) for a in one["alerts"]] == [
        ("nonfinite_forward", "2", 5, 1)
    ]
    assert _alerts(zero, 0) == [FROM_RANK_ONE]


@pytest.mark.slow
def test_with_step_checks_a_nan_born_in_a_layer_is_born_inside_the_model_module_not_located(
    tmp_path,
):
    """``check: step`` keeps only the model's output sum: without a replay the layer
    cannot be named, and the alert says how to have it named."""
    zero, one = _ranks(tmp_path, "nan_layer+step")
    assert _alerts(one) == [("nonfinite_forward", "", 5, "error", "unreplayed", 1)]
    message = one["alerts"][0]["message"]
    assert "although its inputs are finite" in message and "not located" in message
    assert "nonfinite_forward.check: deferred" in one["alerts"][0]["hint"]
    assert _alerts(zero, 0) == [FROM_RANK_ONE]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["nan_backward", "nan_backward+deferred"])
def test_a_nan_born_in_rank_ones_backward_is_named_there(tmp_path, mode):
    zero, one = _ranks(tmp_path, mode)
    assert _alerts(one) == [("nonfinite_backward", "2", 5, "error", "module", 1)]
    assert _alerts(zero, 0) == [FROM_RANK_ONE]


@pytest.mark.slow
def test_with_step_checks_a_nan_born_in_a_backward_gives_each_rank_the_info_line_saying_so(
    tmp_path,
):
    # The documented limit of ``check: step`` under FSDP: without a replay or
    # module sums, a rank cannot tell its own backward's NaN from one that came
    # through the reduce-scatter; each says so, and says how to have it named.
    for rank, found in enumerate(_ranks(tmp_path, "nan_backward+step")):
        assert _alerts(found, rank) == [("nonfinite_backward", None, 5, "info", "other_rank", rank)]
        alert = next(a for a in found["alerts"] if a["data"]["rank"] == rank)
        assert "born in this rank's own backward would look the same" in alert["message"]
        assert "nonfinite_forward.check: deferred" in alert["hint"]


@pytest.mark.slow
def test_a_halt_under_fully_shard_stops_both_ranks_at_the_nans_step_with_rank_ones_alert(tmp_path):
    zero, one = _ranks(tmp_path, "nan_input+halt")
    for found in (zero, one):
        assert found["halted"] == {"step": 5, "rule": "nonfinite_forward", "rank": 1}
        # The whole-layer norms of every step before rode in the same checks.
        assert len(found["steps"]) == 5
        for seen in found["steps"]:
            assert seen["reported"] == pytest.approx(seen["full"], rel=1e-5)
    # Rank zero writes rank one's halting alert beside its own info line.
    assert ("nonfinite_forward", "0", 5, "error", "input", 1) in _alerts(zero)
