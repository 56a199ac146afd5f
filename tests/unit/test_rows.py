"""Rows of the engine's fetch made into messages (worker.db.rows)."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import struct
from datetime import UTC, datetime, timedelta
from types import MappingProxyType

import pytest

from worker.db.base import UnreadableJson, json_loads, long_digits
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


def _frozen_copy(value: object) -> object:
    """What freezing means, written plainly: a read-only copy of each object, a tuple of each array."""
    if isinstance(value, dict):
        return MappingProxyType({key: _frozen_copy(item) for key, item in value.items()})
    if isinstance(value, list):
        return tuple(_frozen_copy(item) for item in value)
    return value


def test_any_decoded_document_freezes_into_its_read_only_copy() -> None:
    rng = random.Random(5)

    def document(depth: int) -> object:
        kind = rng.choice(["object", "array", "scalar"] if depth < 5 else ["scalar"])
        if kind == "object":
            return {f"k{n}": document(depth + 1) for n in range(rng.randint(0, 4))}
        if kind == "array":
            return [document(depth + 1) for _ in range(rng.randint(0, 4))]
        return rng.choice([1, -2.5, "text", True, False, None, 10**20])

    for _ in range(500):
        text = json.dumps(document(0))
        frozen = freeze(json_loads(text))
        assert frozen == _frozen_copy(json.loads(text)), text
        if isinstance(frozen, tuple):
            assert all(not isinstance(item, list | dict) for item in frozen)


@pytest.mark.parametrize(
    "document",
    [
        '{"order": 123456789012345678901234567890}',  # past 64 bits: orjson would give a float
        "[-9223372036854775809, 18446744073709551616]",
        '{"id": "1234567890123456789"}',  # 19 digits in a string: Python's decoder, the same value
        '"\\ud800 a lone surrogate"',
        "[1e400, -1e400]",
    ],
)
def test_json_that_orjson_would_read_otherwise_is_read_as_python_reads_it(document: str) -> None:
    assert json_loads(document) == json.loads(document)
    assert json_loads(document.encode("utf-8", "surrogatepass")) == json.loads(document)


def test_json_is_read_as_python_reads_it() -> None:
    rng = random.Random(7)
    numbers = [struct.unpack("d", rng.getrandbits(64).to_bytes(8, "little"))[0] for _ in range(2000)]
    finite = [number for number in numbers if number == number and abs(number) != float("inf")]
    documents = [
        json.dumps({"amount": 5, "items": [1, {"sku": "x"}], "ok": True, "none": None, "text": "ünï\u2028\n"}),
        json.dumps(finite),
        json.dumps([rng.randint(-(2**63), 2**63 - 1) for _ in range(500)]),
        "[0.1, -0.0, 1E2, 5e-324, 1.7976931348623157e308, 2.2250738585072014e-308]",
        '{"a": 1, "a": 2}',
    ]
    for document in documents:
        read, python = json_loads(document), json.loads(document)
        assert read == python
        assert [type(x) for x in read] == [type(x) for x in python]  # 1 stays an int, 1E2 a float


def test_a_run_of_19_digits_is_found_wherever_it_stands_and_only_then() -> None:
    """The check that sends a document to Python's decoder finds every run of 19 ASCII digits that a regular
    expression finds, in text and in UTF-8 bytes, and nothing else."""
    rng = random.Random(11)
    arabic_indic, fullwidth = "\u0661", "\uff11"  # digits, but not JSON's
    pieces = ["1", "9", "0", "-", ".", "e", " ", ",", '"', "a", "\u00fc", arabic_indic, fullwidth, "\u2028", "\ud800"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) if rng.random() < 0.6 else "7" * rng.randint(15, 21) for _ in range(6))
        expected = re.search("[0-9]{19}", text) is not None
        assert long_digits(text) is expected, text
        assert long_digits(text.encode("utf-8", "surrogatepass")) is expected, text
    assert long_digits("1" * 19) and long_digits(b"x" + b"0" * 25) and not long_digits("1" * 18 + "." + "1" * 18)
    assert not long_digits(arabic_indic * 19) and not long_digits(fullwidth * 19), "JSON writes numbers in ASCII digits"


def test_a_payload_with_a_run_of_non_ascii_digits_reads_as_python_reads_it() -> None:
    arabic_indic = "".join(chr(0x0660 + n % 10) for n in range(1, 21))
    fullwidth = "".join(chr(0xFF10 + n % 10) for n in range(1, 21))
    for document in (f'{{"id": "{arabic_indic}"}}', f'["{fullwidth}", 1]'):
        assert json_loads(document) == json.loads(document)
        assert json_loads(document.encode()) == json.loads(document)


def test_json_nested_deeper_than_python_reads_is_unreadable_not_an_error() -> None:
    assert isinstance(json_loads("[" * 100_000 + "]" * 100_000), UnreadableJson)


def test_a_payload_is_frozen_in_place_not_copied() -> None:
    decoded = {"flat": 1, "nested": {"b": [1]}}
    frozen = freeze(decoded)
    assert frozen == MappingProxyType({"flat": 1, "nested": MappingProxyType({"b": (1,)})})
    assert decoded["nested"] is frozen["nested"]  # the decoded object itself, wrapped


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


def test_a_statements_driver_sql_is_its_own_even_when_a_statement_read_before_was_freed() -> None:
    """The placeholders' translation is kept per statement text: kept per object id, a statement built after an
    earlier one was freed could get the address, and then the SQL, of that one (in full runs of the suite, the
    plan read for the fetch's statement for many hints left out was the plan of the one for a few)."""
    from sqlalchemy import text

    from worker.db.base import driver_sql

    for n in range(200):
        statement = text(f"SELECT :a{n} AS b{n}")
        assert driver_sql(statement) == f"SELECT %(a{n})s AS b{n}"
        del statement
