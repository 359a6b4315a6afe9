"""Which no-grad passes in training mode of a model trained elsewhere are an evaluation.

The judge is fed what the behaviour checks see: a record per pass, the
weights' fingerprint and the process's step count. A target network runs at
every step (once per view, or once per iteration of a loop of several
optimizers); an EMA copy kept for evaluation is run every few hundred steps.
"""

from __future__ import annotations

from trainwatch.collect.eval_passes import SPARSE_GAP, EvalPassJudge
from trainwatch.record import StepRecord


def _passes(clocks: list[int], moves: bool = True) -> list[list[StepRecord]]:
    """The judge's verdict at each pass; the weights move with every step when ``moves``."""
    judge = EvalPassJudge()
    found = []
    for clock in clocks:
        weights = clock if moves else 0
        found.append(judge.nograd_pass(StepRecord(step=0, source="forward"), weights, clock))
    return found


def test_a_target_run_every_step_with_moving_weights_is_silent():
    assert not any(_passes(list(range(40))))


def test_a_target_run_on_two_views_a_step_is_silent():
    assert not any(_passes([step for step in range(40) for _ in range(2)]))


def test_a_target_beside_three_optimizers_stepping_each_iteration_is_silent():
    assert not any(_passes(list(range(0, 3 * 40, 3))))


def test_a_moving_copy_run_every_25_steps_is_an_evaluation():
    found = _passes([0, 25, 50])
    assert [len(due) for due in found] == [0, 2, 1]


def test_passes_just_under_the_gap_are_still_a_target():
    assert not any(_passes(list(range(0, 40 * (SPARSE_GAP - 1), SPARSE_GAP - 1))))


def test_a_copy_that_never_moves_is_an_evaluation_on_its_third_pass():
    found = _passes([0, 1, 2], moves=False)
    assert [len(due) for due in found] == [0, 0, 3]
