"""Makers of the per-step dataclasses: equal to the class's own constructor, faster."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from trainwatch.fresh import fresh_maker
from trainwatch.record import StepRecord, new_step_record
from trainwatch.step_pipeline import PendingStep, _new_pending_step


@dataclass(slots=True)
class _Sample:
    first: int
    second: str
    items: list[int] = field(default_factory=list)
    table: dict[str, int] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)
    pair: tuple[int, int] = field(default_factory=lambda: (1, 2))
    flag: bool = False
    name: str | None = None


def test_a_fresh_record_equals_the_one_the_class_makes() -> None:
    assert new_step_record(7) == StepRecord(step=7)


def test_a_fresh_pending_step_equals_the_one_the_class_makes() -> None:
    record = StepRecord(step=3)
    made, expected = _new_pending_step(record), PendingStep(record)
    # Each makes its own frame: compare every field but that one by value.
    for f in dataclasses.fields(PendingStep):
        if f.name != "frame":
            assert getattr(made, f.name) == getattr(expected, f.name), f.name
    assert type(made.frame) is type(expected.frame)


def test_the_required_fields_come_in_order_and_the_rest_take_their_defaults() -> None:
    made = fresh_maker(_Sample)(1, "two")
    assert made == _Sample(1, "two")
    assert made.pair == (1, 2)  # a factory other than list, dict or set is called


def test_every_fresh_object_has_containers_of_its_own() -> None:
    maker = fresh_maker(_Sample)
    first, second = maker(1, "a"), maker(1, "a")
    first.items.append(1)
    first.table["k"] = 1
    first.seen.add(1)
    assert second.items == [] and second.table == {} and second.seen == set()
    record_a, record_b = new_step_record(0), new_step_record(0)
    assert record_a.present is not record_b.present


def test_a_class_with_a_post_init_is_refused() -> None:
    @dataclass
    class Checked:
        value: int = 0

        def __post_init__(self) -> None:
            self.value += 1

    with pytest.raises(TypeError, match="__post_init__"):
        fresh_maker(Checked)


@dataclass
class _Shared:
    first: int
    items: list[int] = field(default_factory=list)
    flag: bool = False
    name: str | None = None


def test_a_class_without_slots_reads_plain_defaults_from_the_class_and_stores_fewer() -> None:
    made = fresh_maker(_Shared)(4)
    assert made == _Shared(4)
    # Only the required field and the container are the instance's own.
    assert set(vars(made)) == {"first", "items"}
    made.flag = True  # set on the instance: the class default stays
    assert fresh_maker(_Shared)(5).flag is False and _Shared.flag is False


def test_a_fresh_step_window_equals_the_one_the_class_makes() -> None:
    from trainwatch.collect.nonfinite import _new_window
    from trainwatch.collect.nonfinite_locate import StepWindow

    made = _new_window([], [], None, None, [])
    assert made == StepWindow(
        calls=[], finite=[], forward_origin=None, backward_origin=None, grad_events=[]
    )
