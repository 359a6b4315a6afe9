"""Which no-grad passes in training mode of a model trained elsewhere are an evaluation.

The judge is fed what the behaviour checks see: a record per pass, the
weights' fingerprint and the process's step count. A target network runs at
every step (once per view, or once per iteration of a loop of several
optimizers); an EMA copy kept for evaluation is run every few hundred steps.
"""

from __future__ import annotations

from trainwatch.collect.eval_passes import (
    FROZEN_AFTER,
    IDLE_PASSES,
    SHORT_RUN,
    SPARSE_GAP,
    EvalPassJudge,
    PartStreak,
)
from trainwatch.record import ModeReport, StepRecord


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


def _steps(pattern, steps: int) -> list[int]:
    """A trained model's steps, each its passes in order ('t': training, 'n': no-grad);
    the steps at which the judge reports an evaluation."""
    judge = EvalPassJudge()
    told = []
    for step in range(steps):
        for kind in pattern(step) if callable(pattern) else pattern:
            if kind == "t":
                judge.training_pass((0, step))
            else:
                told += [r.step for r in judge.nograd_pass(StepRecord(step=step, source="forward"))]
        told += [r.step for r in judge.step_boundary()]
    return told


def test_pseudo_labels_computed_after_the_training_passes_every_step_are_silent():
    # FixMatch-like: the supervised and the strong-view passes, then the weak
    # view's pseudo-labels under no_grad just before backward.
    assert _steps("ttn", 30) == []


def test_pseudo_labels_computed_before_the_training_passes_every_step_are_silent():
    assert _steps("ntt", 30) == []


def test_one_validation_pass_after_a_step_s_training_pass_is_still_an_evaluation():
    # Control: the same pass at step 10 only is reported, with its step.
    assert _steps(lambda step: "tn" if step == 10 else "t", 30) == [10]


def test_one_validation_pass_before_a_step_s_training_pass_is_still_an_evaluation():
    assert _steps(lambda step: "nt" if step == 10 else "t", 30) == [10]


def test_a_watched_pseudo_labelling_loop_with_its_no_grad_pass_last_is_silent():
    """The shape a user writes: a model with batch norm in training mode on purpose."""
    import torch
    from torch import nn

    import trainwatch as tw

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(40):
            labelled, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
            unlabelled = torch.randn(64, 16)
            supervised = nn.functional.cross_entropy(model(labelled), y)
            strong = model(unlabelled + 0.5 * torch.randn_like(unlabelled))
            with torch.no_grad():
                pseudo = model(unlabelled).argmax(-1)
            loss = supervised + nn.functional.cross_entropy(strong, pseudo)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [a.rule for a in monitor.alerts if a.severity != "info"] == []


def test_a_shape_check_before_the_first_training_pass_is_let_go():
    assert _steps(lambda step: "nt" if step == 0 else "t", 30) == []
    assert _steps(lambda step: "nnt" if step == 0 else "t", 30) == []


def test_a_baseline_evaluation_before_training_is_still_told_with_its_step():
    # Control: three passes or more are no shape check; not recurring, an evaluation.
    assert _steps(lambda step: "nnnt" if step == 0 else "t", 30) == [0, 0, 0]


def test_the_same_single_pass_later_in_training_is_still_an_evaluation():
    assert _steps(lambda step: "nt" if step in (0, 10) else "t", 30) == [10]


def test_a_watched_model_checked_under_no_grad_before_training_is_silent():
    """The check people write right after building a model with dropout."""
    import torch
    from torch import nn

    import trainwatch as tw

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        with torch.no_grad():
            assert model(torch.zeros(2, 10)).shape == (2, 3)
        for step in range(60):
            x = torch.randn(32, 10)
            loss = nn.functional.cross_entropy(model(x), x[:, :3].argmax(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 40:  # control: the same look mid-training, dropout still on
                with torch.no_grad():
                    model(torch.randn(8, 10))
    found = [(a.rule, a.step) for a in monitor.alerts if a.severity != "info"]
    assert found == [("eval_in_train_mode", 41)]


def _report(*modules: str) -> ModeReport:
    return ModeReport(list(modules), ["Dropout"] * len(modules), True, len(modules))


def test_parts_called_one_after_the_other_make_one_pass_for_the_judge():
    """decode(encode(x)): the decoder goes on with the encoder's pass; the encoder
    called again starts the next one, whose report names every part's modules."""
    streak = PartStreak()
    first = streak.joined("encoder", _report("encoder.1"), fresh=True)
    assert streak.joined("decoder", _report("decoder.2"), fresh=False) is None
    again = streak.joined("encoder", _report("encoder.1"), fresh=False)
    assert again is first  # the held record tells the decoder's modules too
    assert first.modules == ["encoder.1", "decoder.2"] and first.total == 2


def test_a_part_after_a_training_pass_starts_a_new_streak():
    streak = PartStreak()
    first = streak.joined("encoder", _report("encoder.1"), fresh=True)
    second = streak.joined("decoder", _report("decoder.2"), fresh=True)
    assert second is not None and second is not first
    assert first.modules == ["encoder.1"]


def test_labels_guessed_over_two_augmentations_every_step_are_silent():
    # MixMatch: two no-grad passes in a row before each step's training pass.
    assert _steps("nnt", 30) == []


def test_a_double_dqn_target_s_two_passes_after_the_training_pass_are_silent():
    assert _steps("tnn", 30) == []


def test_one_or_two_passes_a_step_as_a_loop_varies_are_silent():
    assert _steps(lambda step: "nnt" if step % 3 else "nt", 30) == []


def test_two_validation_passes_at_one_step_are_still_an_evaluation():
    # Control: the same two passes at step 10 only, told at the next step with theirs.
    assert _steps(lambda step: "nnt" if step == 10 else "t", 30) == [10, 10]


def test_a_validation_pass_next_to_two_label_guesses_is_told_at_once():
    assert _steps(lambda step: "nnnt" if step == 20 else "nnt", 30) == [20]


def test_a_validation_pass_next_to_one_pseudo_label_pass_is_still_told():
    assert _steps(lambda step: "nnt" if step == 20 else "nt", 30) == [20]


def _between_other_steps(passes: int) -> tuple[list, list]:
    """A model with an optimizer of its own, never trained nor moved, sampled once
    per step of another model: the steps told at each pass, and at close."""
    judge = EvalPassJudge()
    told = []
    for step in range(passes):
        record = StepRecord(step=step, source="forward")
        told += [r.step for r in judge.nograd_pass(record, 0, step, stepped_between=step > 0)]
    return told, [r.step for r in judge.flush()]


def test_passes_between_other_steps_of_a_model_that_never_trains_are_told_when_idle():
    # A teacher whose optimizer never steps: held, then told at IDLE_PASSES with
    # every held pass's step, then each pass at once.
    told, at_close = _between_other_steps(IDLE_PASSES + 3)
    assert told == list(range(IDLE_PASSES + 3)) and at_close == []
    # A shorter run: certain only at close, all of them still told.
    assert _between_other_steps(40) == ([], list(range(40)))
    # One or two, its weights never seen moving between passes: no target's last
    # passes, an evaluation too.
    assert _between_other_steps(2) == ([], [0, 1])


def test_a_generator_s_samples_before_its_first_training_pass_are_let_go():
    """Control: the same passes, a hundred critic steps before each generator step
    (the original WGAN's warm-up), then five: its training passes let them go."""
    judge = EvalPassJudge()
    told, step = [], 0
    for iteration in range(12):
        for _ in range(100 if iteration < 3 else 5):
            record = StepRecord(step=step, source="forward")
            told += judge.nograd_pass(record, iteration, step, stepped_between=step > 0)
            step += 1
        judge.training_pass()
        told += judge.step_boundary()
    assert told + judge.flush() == []


def test_one_or_two_last_passes_of_a_model_never_trained_nor_seen_moving_are_told_at_close():
    # An SWA copy evaluated once at the end (one pass, or two batches): nothing
    # showed it to be a target, and it never trained: an evaluation.
    for passes in (1, 2):
        judge = EvalPassJudge()
        for _ in range(passes):
            assert judge.nograd_pass(StepRecord(step=7, source="forward"), 0, 7) == []
        assert [r.step for r in judge.step_boundary() + judge.flush()] == [7] * passes


def test_a_target_s_last_passes_at_close_are_let_go():
    # Control: a target run on two views a step, its weights moving with every
    # step; its last step's two passes are still held when the monitor closes.
    judge = EvalPassJudge()
    told = []
    for step in range(20):
        for _ in range(2):
            told += judge.nograd_pass(StepRecord(step=step, source="forward"), step, step)
        told += judge.step_boundary()
    assert told + judge.flush() == []


def test_a_model_checked_once_under_no_grad_then_trained_is_silent_at_close():
    # Control: the shape check before training, let go at the first training pass.
    judge = EvalPassJudge()
    judge.nograd_pass(StepRecord(step=0, source="forward"), 0, 0)
    for _ in range(5):
        judge.training_pass()
        assert judge.step_boundary() == []
    assert judge.flush() == []


def _trained_then_used(
    passes: int, others_per_own: int = 0, moves: bool = False, pretrain: int = 40
) -> tuple[list[tuple[int, int]], list[int]]:
    """A model trained ``pretrain`` steps (with ``others_per_own`` steps of another
    optimizer beside each), then run under no_grad once per step of another model,
    as the behaviour checks feed it: (the pass, the step told) for what was told
    during the run, and the steps told at close."""
    judge = EvalPassJudge()
    judge.training_pass((0, 0))
    optimizer_steps = 0
    for _ in range(pretrain):
        judge.step_boundary()
        optimizer_steps += 1 + others_per_own
    told = []
    for index in range(passes):
        record = StepRecord(step=pretrain, source="forward")
        record.eval_in_train = ModeReport(["2"], ["Dropout"], False, 1)
        # The student's step in progress once it stepped; before, the model's own.
        now = index if index else pretrain
        steps = (optimizer_steps + index, now)
        weights = index if moves else 0
        due = judge.nograd_pass(record, weights, pretrain + index, index > 0, steps)
        told += [(index, r.step) for r in due]
    return told, [r.step for r in judge.flush(optimized=True)]


def test_a_model_trained_alone_then_used_frozen_is_told_after_a_few_other_steps():
    # A teacher trained first, then distilled from: at the pass after FROZEN_AFTER
    # student steps, every pass so far, each dated at the student's step it ran in.
    told, at_close = _trained_then_used(12)
    assert told[: FROZEN_AFTER + 1] == [(FROZEN_AFTER, step) for step in range(FROZEN_AFTER + 1)]
    assert told[FROZEN_AFTER + 1 :] == [(i, i) for i in range(FROZEN_AFTER + 1, 12)]
    assert at_close == []


def test_a_model_trained_beside_another_optimizer_waits_for_idle_passes():
    # Control: trained with another optimizer stepping between its steps (a
    # generator with its critic): its idle optimizer is told only at IDLE_PASSES.
    told, _ = _trained_then_used(IDLE_PASSES + 2, others_per_own=5)
    assert told[0] == (IDLE_PASSES - 1, 0) and len(told) == IDLE_PASSES + 2


def test_a_model_trained_alone_then_moved_by_ema_is_silent():
    # Control: started from the model trained first, it follows a student by EMA
    # (a mean teacher): its weights move between its passes, to the last one.
    assert _trained_then_used(30, moves=True) == ([], [])


def test_a_generator_trained_alone_then_sampled_for_five_critic_steps_is_silent():
    # Control: pretrained alone, then five critic steps a generator step; its own
    # step comes before the critic's sixth.
    judge = EvalPassJudge()
    judge.training_pass((0, 0))
    own = optimizer_steps = clock = 30
    for _ in range(own):
        judge.step_boundary()
    told = []
    for _ in range(8):
        for critic in range(5):
            record = StepRecord(step=own, source="forward")
            record.eval_in_train = ModeReport(["1"], ["BatchNorm1d"], False, 1)
            steps = (optimizer_steps, clock)
            told += judge.nograd_pass(record, own, clock, critic > 0 or own > 30, steps)
            optimizer_steps += 1
            clock += 1
        judge.training_pass((optimizer_steps, own))
        told += judge.step_boundary()
        own += 1
        optimizer_steps += 1
        clock += 1
    assert told + judge.flush(optimized=True) == []


def test_labels_guessed_over_up_to_short_run_augmentations_every_step_are_silent():
    # MixMatch with K augmentations, a teacher per view or crop: K passes a step.
    for k in (3, 4, 5, SHORT_RUN):
        assert _steps("n" * k + "t", 30) == []
        assert _steps("t" + "n" * k, 30) == []


def test_three_validation_passes_every_ten_steps_are_still_told_at_once():
    # Control: the same three passes, at every tenth step only: nothing before them
    # could make them a run of every step, so the third pass tells them (a halt
    # stops the evaluation there).
    told = _steps(lambda step: "tnnn" if step % 10 == 9 else "t", 30)
    assert told == [9, 9, 9, 19, 19, 19, 29, 29, 29]


def _first_step_run(passes: int) -> list[int]:
    """A run of no-grad passes after the model's first training pass, in its first
    step: how many records the judge tells at each pass."""
    judge = EvalPassJudge()
    judge.training_pass((0, 0))
    return [len(judge.nograd_pass(StepRecord(step=0, source="forward"))) for _ in range(passes)]


def test_a_run_in_the_first_step_is_held_up_to_short_run_and_told_beyond():
    assert _first_step_run(SHORT_RUN) == [0] * SHORT_RUN
    assert _first_step_run(SHORT_RUN + 1) == [0] * SHORT_RUN + [SHORT_RUN + 1]


def test_a_validation_next_to_four_label_guesses_a_step_is_told_at_its_sixth_pass():
    # Four guesses a step recur; a pass more may be the loop varying, held; a
    # second one more is an evaluation next to them, told at once.
    judge = EvalPassJudge()
    for step in range(3):
        for _ in range(4):
            assert judge.nograd_pass(StepRecord(step=step, source="forward")) == []
        judge.training_pass((0, step))
        assert judge.step_boundary() == []
    told = [len(judge.nograd_pass(StepRecord(step=3, source="forward"))) for _ in range(6)]
    assert told == [0, 0, 0, 0, 0, 2]


def test_a_baseline_of_three_then_one_pseudo_label_a_step_is_told():
    # Runs of other lengths at two steps are no run recurring: the three are told,
    # with their step, before one pass a step is taken for training.
    told = _steps(lambda step: "nnnt" if step == 0 else "nt", 30)
    assert told[:3] == [0, 0, 0] and set(told) <= {0, 1}


def test_a_copy_that_never_moves_run_on_three_views_a_step_is_told_at_the_next_step():
    # A model with no steps of its own, its three passes a step held; the next
    # step's first pass, its weights unchanged, goes on across a step: told.
    judge = EvalPassJudge()
    found = []
    for clock in range(3):
        for _ in range(3):
            found.append(len(judge.nograd_pass(StepRecord(step=0, source="forward"), 0, clock)))
    assert found[:3] == [0, 0, 0] and found[3] == 4


def test_a_moving_copy_run_on_five_views_a_step_is_a_silent_target():
    # Control: a mean teacher on five noisy views, its weights moved by EMA at every step.
    judge = EvalPassJudge()
    told = []
    for clock in range(20):
        for _ in range(5):
            told += judge.nograd_pass(StepRecord(step=clock, source="forward"), clock, clock)
    assert told + judge.flush() == []
