"""Rules declare the collectors they need; the Monitor attaches only their union."""

from __future__ import annotations

import pytest

from tests.conftest import TinyNet
from trainwatch.config import Config
from trainwatch.rules import COLLECTORS, RULE_CLASSES, RULE_IDS, rules_needing


def test_there_is_one_list_of_rule_ids_and_every_rule_has_a_config_section():
    assert len(set(RULE_IDS)) == len(RULE_IDS)
    assert RULE_IDS[-1] == "internal_error"
    for cls in RULE_CLASSES:
        assert Config().rule(cls.id) is not None, cls.id
        assert cls.needs <= set(COLLECTORS), cls.id


def _attached(monitor) -> set[str]:
    found = set(monitor._pipeline.passes.listener_names())
    behaviour = monitor._pipeline.behaviour
    if behaviour is not None:
        if behaviour.modes is not None:
            found.add("modes")
        if behaviour.broadcast is not None:
            found.add("broadcast_audit")
        if behaviour.sampler is not None:
            found.add("activation_sampler")
    if monitor._pipeline.tracker.check_resets:
        found.add("accumulation_tracker")
    look = monitor._pipeline.class_targets
    if look is not None and look._counting:
        found.add("class_targets")
    if look is not None and look.padding is not None:
        found.add("padded_labels")
    return found


COLLECTOR_NAMES = {
    "nonfinite_probe": "non-finite probe",
    "call_tracker": "call tracker",
    "accumulation_tracker": "accumulation_tracker",
    "modes": "modes",
    "broadcast_audit": "broadcast_audit",
    "activation_sampler": "activation_sampler",
    "class_targets": "class_targets",
    "padded_labels": "padded_labels",
    "first_batch": "stalled training",
}


@pytest.mark.parametrize("collector", COLLECTORS)
def test_a_collector_no_enabled_rule_needs_is_not_attached(collector, quiet_watch):
    off = {rule: False for rule in rules_needing(collector)}
    monitor = quiet_watch(TinyNet(), **off)
    assert COLLECTOR_NAMES[collector] not in _attached(monitor)
    monitor.close()
    control = quiet_watch(TinyNet())
    assert COLLECTOR_NAMES[collector] in _attached(control)
