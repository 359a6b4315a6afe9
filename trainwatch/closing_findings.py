"""What a monitor still has to tell when it closes, judged from what no step judged.

Some findings wait for evidence that only the run's end settles: a step
gathered but never landed, a rule's finding held back for one more step
(a gradient jump that may be a target network's sync), evaluation passes held back to be judged with
the next training step (none came), a frozen part's behaviour over the whole
run, a loss handed over after the last step. Closing judges them here, in
that order, and the monitor publishes each batch as it comes (never halting:
closing raises no halt).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from trainwatch.alert import Alert

if TYPE_CHECKING:
    from trainwatch.guard import Guard
    from trainwatch.rules.rule_set import RuleSet
    from trainwatch.step_pipeline import StepPipeline


def findings_at_close(
    pipeline: StepPipeline, rules: RuleSet, guard: Guard, step: int
) -> Iterator[list[Alert]]:
    """Each batch of alerts closing finds (``step``: the steps taken), in turn: the
    monitor publishes each before the next is judged, so judging and telling keep
    their order."""
    unfinished = guard.run("step collector", pipeline.unfinished_alerts, step)
    if unfinished:
        yield unfinished
    for rule in rules:
        held_back = guard.run(rule.component, rule.closing)  # a finding held for one more step
        if held_back:
            yield held_back
    behaviour = pipeline.behaviour
    if behaviour is not None:
        evaluated = behaviour.evaluation_flush()
        held = behaviour.eval_passes.flush(behaviour.optimized())
        for record in [*evaluated, *held, *behaviour.frozen_part_flush()]:
            yield rules.evaluate(record)
    if pipeline.late_loss is not None:
        late_step, value = pipeline.late_loss
        pipeline.late_loss = None
        number = float(value) if value is not None else None
        alerts = guard.run("step collector", pipeline.late_loss_alerts, late_step, number)
        if alerts:
            yield alerts
