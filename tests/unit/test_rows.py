"""Rows of the engine's fetch made into messages (worker.db.rows)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from types import MappingProxyType

import pytest

from worker.db.rows import decode_row, freeze
from worker.message import Message, MessageState, slot_constructor
from worker.policy.outcomes import Disposition, Kind, succeeded


def test_a_row_decodes_into_the_same_message_as_the_dataclass_makes() -> None:
    now = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)
    row = (
        7, "m-7", "payment.received", "order-1", '{"amount": 5, "items": [1, {"sku": "x"}]}', '{"traceparent": "t"}',
        now, timedelta(hours=1), now + timedelta(hours=1), 2, None, 1, "earlier error", "ready", 12, 1, 0,
    )
    decoded = decode_row(row, sqlite=False)
    expected = Message(
        7, "m-7", "payment.received", "order-1", freeze({"amount": 5, "items": [1, {"sku": "x"}]}),
        freeze({"traceparent": "t"}), now, timedelta(hours=1), now + timedelta(hours=1), 2, None, 1, "earlier error",
        MessageState.READY, 12, 1, 0,
    )
    assert decoded == expected
    assert all(getattr(decoded, field.name) == getattr(expected, field.name) for field in dataclasses.fields(Message))
    assert decoded.delivery is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        decoded.id = 8  # type: ignore[misc]


def test_the_constructor_sets_the_fields_it_is_not_given_to_their_defaults() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Point:
        x: int
        y: int
        label: str = "origin"
        tags: tuple[str, ...] = ()

    make = slot_constructor(Point, 2)
    assert make(1, 2) == Point(1, 2)
    assert make(1, 2).label == "origin" and make(1, 2).tags == ()


def test_a_success_is_the_disposition_the_dataclass_makes() -> None:
    assert succeeded(3, 1, '{"key": 1}') == Disposition(3, Kind.DELETE, 1, result='{"key": 1}')
    assert succeeded(3, 0, None).outcome == "success"


def test_payloads_are_frozen_all_the_way_down() -> None:
    frozen = freeze({"a": [1, {"b": [2.5, None, True]}], "c": {}})
    assert isinstance(frozen, MappingProxyType) and frozen["a"] == (1, MappingProxyType({"b": (2.5, None, True)}))
    assert isinstance(frozen["c"], MappingProxyType) and not frozen["c"]
    with pytest.raises(TypeError):
        frozen["a"] = 1  # type: ignore[index]
    assert freeze("text") == "text" and freeze([]) == ()


def test_the_constructor_refuses_a_class_it_could_not_make_as_its_init_would() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        x: int

        def __post_init__(self) -> None:
            assert self.x >= 0

    @dataclasses.dataclass(frozen=True, slots=True)
    class Listed:
        x: int
        items: list[int] = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError):
        slot_constructor(Checked, 1)
    with pytest.raises(TypeError):
        slot_constructor(Listed, 1)
