"""The enabled rules, run over each record: one rule's failure never stops the others."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import compress
from operator import attrgetter

from trainwatch.alert import Alert
from trainwatch.errors import TrainingHealthError
from trainwatch.guard import Guard
from trainwatch.record import StepRecord
from trainwatch.rules.base import Rule


class RuleSet:
    """Each rule judges the records holding what it reads (``Rule.reads``); a rule
    that raises is switched off through the guard (reported once) and the rest go
    on. A halt (``TrainingHealthError``) passes through: that is a rule's job."""

    def __init__(self, rules: Sequence[Rule], guard: Guard) -> None:
        self.rules = list(rules)
        self._guard = guard
        # What each rule reads, every field in one C call; a rule that sees every
        # record reads ``__class__``, which is always there and true. Two more of
        # those at the end keep the result a tuple for any number of rules
        # (``compress`` stops with the rules).
        fields = [rule.reads or "__class__" for rule in self.rules]
        self._read = attrgetter(*fields, "__class__", "__class__")

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def evaluate(self, record: StepRecord) -> list[Alert]:
        alerts: list[Alert] = []
        disabled = self._guard.disabled
        # The rules with something in this record, in order, picked in C.
        for rule in compress(self.rules, self._read(record)):
            component = rule.component
            if component in disabled:
                continue
            try:  # the guard written out: this runs for every rule at every step
                found = rule.evaluate(record)
            except TrainingHealthError:
                raise
            except Exception as exc:
                self._guard.fail(component, exc)
                continue
            if found:
                alerts.extend(found)
        return alerts
