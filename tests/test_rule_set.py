"""RuleSet: each rule judges only the records holding what it reads, in order."""

from __future__ import annotations

import pytest

from trainwatch.config import RuleConfig
from trainwatch.guard import Guard
from trainwatch.record import StepRecord
from trainwatch.rules.base import Rule
from trainwatch.rules.rule_set import RuleSet


def _rule(name: str, field: str | None, seen: list[str]) -> Rule:
    class Recording(Rule):
        id = name
        reads = field

        def evaluate(self, record):
            seen.append(name)
            return [self.alert(record.step, None, name, "")]

    return Recording(RuleConfig())


@pytest.mark.parametrize("count", [1, 2, 5])
def test_a_rule_reading_a_field_judges_only_records_that_hold_it(count):
    seen: list[str] = []
    rules = RuleSet([_rule(f"r{i}", "accumulated", seen) for i in range(count)], Guard(print))
    assert rules.evaluate(StepRecord(step=1)) == [] and seen == []
    alerts = rules.evaluate(StepRecord(step=2, accumulated=["x"]))
    assert seen == [f"r{i}" for i in range(count)]
    assert [a.message for a in alerts] == seen


def test_rules_reading_every_record_and_a_field_run_in_their_order():
    seen: list[str] = []
    rules = RuleSet(
        [
            _rule("every", None, seen),
            _rule("frozen", "frozen", seen),
            _rule("also_every", None, seen),
            _rule("amp", "amp", seen),
        ],
        Guard(print),
    )
    rules.evaluate(StepRecord(step=1, frozen=["p"]))
    assert seen == ["every", "frozen", "also_every"]


def test_a_failing_rule_is_switched_off_and_the_others_go_on():
    seen: list[str] = []
    failures: list[str] = []

    class Broken(Rule):
        id = "broken"

        def evaluate(self, record):
            raise RuntimeError("bug")

    rules = RuleSet(
        [Broken(RuleConfig()), _rule("fine", None, seen)],
        Guard(lambda component, exc: failures.append(component)),
    )
    rules.evaluate(StepRecord(step=1))
    rules.evaluate(StepRecord(step=2))
    assert seen == ["fine", "fine"] and failures == ["rule broken"]


def test_an_empty_rule_set_judges_nothing():
    assert RuleSet([], Guard(print)).evaluate(StepRecord(step=1)) == []
