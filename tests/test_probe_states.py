"""The probe's per-pass and per-step states: written-out constructors, declared fields.

Both are made at every pass or step, so their ``__init__`` is written by
hand instead of the dataclass's own; these tests keep the two in step.
"""

from __future__ import annotations

import dataclasses

import pytest

from trainwatch.collect.nonfinite import _PassState, _StepState


def _declared_default(field: dataclasses.Field) -> object:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


@pytest.mark.parametrize("state", [_PassState, _StepState])
def test_the_written_out_init_sets_every_declared_field_to_its_default(state: type) -> None:
    made = state()
    for field in dataclasses.fields(state):
        assert getattr(made, field.name) == _declared_default(field), field.name


@pytest.mark.parametrize("state", [_PassState, _StepState])
def test_each_new_state_has_containers_of_its_own(state: type) -> None:
    first, second = state(), state()
    for field in dataclasses.fields(state):
        if field.default_factory is not dataclasses.MISSING:
            assert getattr(first, field.name) is not getattr(second, field.name), field.name


@pytest.mark.parametrize("state", [_PassState, _StepState])
def test_a_field_not_declared_cannot_be_set(state: type) -> None:
    # Slotted: a typo in the probe fails at once instead of adding a stray field.
    with pytest.raises(AttributeError):
        state().not_a_field = 1
