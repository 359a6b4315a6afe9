"""The probe's per-pass and per-step states, made at every pass and step by their
fresh makers: equal to what the classes themselves make, and slotted."""

from __future__ import annotations

import pytest

from trainwatch.collect.nonfinite import (
    _new_pass_state,
    _new_step_state,
    _PassState,
    _StepState,
)


@pytest.mark.parametrize(
    ("maker", "state"), [(_new_pass_state, _PassState), (_new_step_state, _StepState)]
)
def test_the_maker_gives_what_the_class_gives(maker, state) -> None:
    assert maker() == state()


@pytest.mark.parametrize("maker", [_new_pass_state, _new_step_state])
def test_a_field_not_declared_cannot_be_set(maker) -> None:
    # Slotted: a typo in the probe fails at once instead of adding a stray field.
    with pytest.raises(AttributeError):
        maker().not_a_field = 1
