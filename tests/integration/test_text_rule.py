"""The schema holds names and hints to the worker's rule for printable text (worker/policy/text.py), on PostgreSQL
and SQLite; what SQLite's SQL cannot tell (NFC) the worker dead-letters with the reason. A producer cannot insert a
record that holds its message_id for ever, and SQLite names a value of the wrong type by its column's rule."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DataError, IntegrityError

from tests.conftest import stop_at_teardown
from tests.unit.test_text import TABLE
from worker.config import DatabaseSettings, Settings
from worker.correlators import Router
from worker.db.base import build_engine
from worker.db.store import MessageFilter, NewMessage, Store
from worker.engine.engine import AllSlots, Engine
from worker.message import Message, MessageState
from worker.policy.text import (
    EDGE_RANGES,
    JOINERS,
    SQLITE_UNSEEN,
    UNICODE_VERSION,
    WHITE_SPACE,
    WHITE_SPACE_RANGES,
    refused,
    refused_ranges,
)

STORABLE = [row for row in TABLE if not any(0xD800 <= ord(char) <= 0xDFFF for char in row[0])]


@pytest.fixture
def conn(any_store: Store) -> Iterator[Connection]:
    with any_store.engine.connect() as connection:
        yield connection


def refusal(conn: Connection, statement: str, **params: object) -> str | None:
    """The database's refusal of a statement (its first line), or None when it was taken."""
    try:
        with conn.begin():
            conn.execute(text(statement), params)
    except (IntegrityError, DataError) as error:
        return str(error.orig).splitlines()[0]
    return None


def insert_message(conn: Connection, name: str, hint: str) -> str | None:
    return refusal(
        conn, "INSERT INTO correlation_message (message_name, correlation_hint) VALUES (:name, :hint)",
        name=name, hint=hint,
    )


@pytest.mark.parametrize(("value", "name_refused", "hint_refused", "reason"), STORABLE)
def test_the_schema_refuses_a_name_or_hint_exactly_when_the_rule_does(
    any_store: Store, conn: Connection, value: str, name_refused: bool, hint_refused: bool, reason: str
) -> None:
    """As a message name, as a hint, as a schedule's name and message name, on PostgreSQL and SQLite alike; SQLite
    alone cannot tell NFC (the worker dead-letters such a message instead, below)."""
    nfc_only = not unicodedata.is_normalized("NFC", value)
    if any_store.dialect == "sqlite" and nfc_only:
        name_refused = hint_refused = False
    as_name = insert_message(conn, value, "o-1")
    as_hint = insert_message(conn, "order.paid", value)
    assert (as_name is not None, as_hint is not None) == (name_refused, hint_refused), (as_name, as_hint)
    assert as_name is None or "correlation_message_name_" in as_name
    assert as_hint is None or "correlation_message_hint_" in as_hint
    schedule = refusal(
        conn, "INSERT INTO correlation_schedule (name, cron, message_name) VALUES (:n, '0 0 3 * * ?', :m)",
        n=f"nightly-{len(value)}", m=value,
    )
    assert (schedule is not None) == name_refused, schedule
    assert schedule is None or "correlation_schedule_message_name_" in schedule


@pytest.mark.parametrize(
    ("name", "hint", "rule"),
    [
        ("order.paid\u00a0", "o-1", "correlation_message_name_no_blank_at_either_end"),
        ("order.paid", "\u00a0", "correlation_message_hint_not_blank"),
        ("order.paid", "\u3000", "correlation_message_hint_not_blank"),
        ("a\U000e0041", "o-1", "correlation_message_name_printable"),
        ("order.paid", "o\u200d", "correlation_message_hint_printable"),
        ("cafe\u0301", "o-1", "correlation_message_name_nfc"),
        ("order.paid", "cafe\u0301", "correlation_message_hint_nfc"),
    ],
)
def test_each_rule_refuses_under_its_own_name_on_postgresql(store: Store, name: str, hint: str, rule: str) -> None:
    with store.engine.connect() as connection:
        assert rule in (insert_message(connection, name, hint) or "")
        columns = "state, outcome, finished_at, message_name, correlation_hint"
        record = refusal(  # a row inserted as a record is held to the same rules
            connection,
            f"INSERT INTO correlation_message ({columns}) VALUES ('delivered', 'correlated', now(), :name, :hint)",
            name=name, hint=hint,
        )
        assert rule in (record or "")


def _edges(ranges: list[tuple[int, int]]) -> list[int]:
    """Every range's first and last code point and their neighbours: where a range spelled wrong would show."""
    codes = {code for start, end in ranges for code in (start - 1, start, end, end + 1)}
    return sorted(code for code in codes if 0 < code <= 0x10FFFF and not 0xD800 <= code <= 0xDFFF)


@pytest.mark.skipif(
    unicodedata.unidata_version != UNICODE_VERSION, reason=f"the schema's ranges are Unicode {UNICODE_VERSION}'s"
)
def test_the_schemas_character_classes_agree_with_the_rule_at_every_range_edge(any_store: Store) -> None:
    """Each refused range, whitespace and joiner's bounds and neighbours, inside a text ('a' + c + 'a'), at its
    start, and as a whole hint, judged by the database's own expressions and by the rule."""
    codes = [*_edges(refused_ranges() + list(WHITE_SPACE_RANGES) + list(EDGE_RANGES)), 0x41, 0xE9, 0x4E2D]
    with any_store.engine.connect() as connection:
        if any_store.dialect == "postgresql":
            got = connection.execute(
                text(
                    "SELECT c, correlation_text_printable('a' || chr(c) || 'a'),"
                    " correlation_text_unpadded(chr(c) || 'a'), correlation_text_not_blank(chr(c))"
                    " FROM unnest(CAST(:codes AS integer[])) AS c"
                ),
                {"codes": codes},
            ).all()
        else:
            def pattern(name: str) -> str:
                return f"(SELECT pattern FROM correlation_text_pattern WHERE name = '{name}')"
            got = [
                connection.execute(
                    text(
                        f"SELECT :c, NOT (:inside GLOB {pattern('refused')}),"
                        f" NOT (:start GLOB {pattern('blank_first')}), :alone GLOB {pattern('not_only_blank')}"
                    ),
                    {"c": code, "inside": f"a{chr(code)}a", "start": f"{chr(code)}a", "alone": chr(code)},
                ).one()
                for code in codes
            ]
    disagree = []
    for code, printable, unpadded, not_blank in got:
        char = chr(code)
        unseen = any_store.dialect == "sqlite" and SQLITE_UNSEEN[0] <= code <= SQLITE_UNSEEN[1]
        blank = char in WHITE_SPACE
        expected = (not refused(char) or unseen, not blank, not blank and char not in JOINERS)
        if (bool(printable), bool(unpadded), bool(not_blank)) != expected:
            disagree.append((f"U+{code:04X}", (printable, unpadded, not_blank), expected))
    assert not disagree


# -- what SQLite's SQL cannot tell: the worker dead-letters it ---------------------------------------------------


def test_a_message_sqlite_took_that_breaks_the_rule_is_dead_with_the_reason_and_not_called(
    sqlite_url: str,
) -> None:
    store = Store(build_engine(DatabaseSettings(url=sqlite_url)))
    stop_at_teardown(store.close)
    decomposed = store.messages_insert(NewMessage(name="cafe\u0301", hint="o-1"))
    hint = store.messages_insert(NewMessage(name="caf\u00e9", hint="Zo\u0308e"))
    unseen = store.messages_insert(NewMessage(name="caf\u00e9\ufffe", hint="o-3"))  # SQLite reads it as U+FFFD
    good = store.messages_insert(NewMessage(name="caf\u00e9", hint="o-2"))
    called: list[int] = []

    def route(message: Message) -> None:
        called.append(message.id)

    settings = Settings(poll={"interval": "PT1S", "initial_delay": "PT0S"}, metrics={"enabled": False})
    engine = Engine(store, Router({"caf\u00e9": route}), settings, AllSlots(store.slot_count), None)
    stop_at_teardown(lambda: engine.stop(grace=0))
    result = engine.run_once()
    assert called == [good]
    assert result.unreadable == 3
    found = {m.id: m for m in store.messages_list(MessageFilter(), limit=10)}
    assert {found[i].state for i in (decomposed, hint, unseen)} == {MessageState.DEAD}
    assert "U+FFFE" in (found[unseen].last_error or "")
    assert "message_name 'cafe\\u0301' is not in Unicode normalisation form NFC" in (found[decomposed].last_error or "")
    assert "correlation_hint 'Zo\\u0308e' is not in Unicode normalisation form NFC" in (found[hint].last_error or "")


# -- records a producer inserts ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("finished_at", "refused_by"),
    [
        (datetime(2999, 1, 1, tzinfo=UTC), "correlation_message_finished_at_not_in_the_future"),
        (timedelta(days=1), "correlation_message_finished_at_not_in_the_future"),
        (timedelta(minutes=5), "correlation_message_finished_at_not_in_the_future"),
        (datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC), "correlation_message_finished_at_not_in_the_future"),
        (timedelta(0), None),
        (timedelta(days=-1), None),
        (datetime(1, 1, 2, tzinfo=UTC), None),
    ],
)
def test_a_record_finished_in_the_future_is_refused_and_one_finished_long_ago_ages_out(
    any_store: Store, conn: Connection, finished_at: datetime | timedelta, refused_by: str | None
) -> None:
    """A record holds its message_id until the retention after finished_at: a producer's record finished in 2999
    would hold it for ever. One finished long ago is deleted by the next cleanup, and its message_id is free."""
    at = datetime.now(UTC) + finished_at if isinstance(finished_at, timedelta) else finished_at
    value: object = at if any_store.dialect == "postgresql" else at.replace(tzinfo=None).isoformat(" ", "microseconds")
    insert = (
        "INSERT INTO correlation_message (message_id, message_name, correlation_hint, state, outcome, finished_at)"
        " VALUES ('m-1', 'order.paid', 'o-1', 'delivered', 'correlated', :at)"
    )
    got = refusal(conn, insert, at=value)
    if refused_by is not None:
        assert got is not None and refused_by in got and "finished_at" in got
        taken = refusal(conn, "INSERT INTO correlation_message (message_name, correlation_hint, message_id)"
                              " VALUES ('order.paid', 'o-1', 'm-1')")
        assert taken is None  # the id was never held
        return
    assert got is None
    future = datetime(2999, 1, 1, tzinfo=UTC)
    update = refusal(conn, "UPDATE correlation_message SET finished_at = :at",
                     at=future if any_store.dialect == "postgresql" else "2999-01-01 00:00:00")
    assert update is not None and "correlation_message_finished_at_not_in_the_future" in update
    if at < datetime.now(UTC) - timedelta(days=7):
        deleted = any_store.messages_delete_records(before=datetime.now(UTC) - timedelta(days=7), limit=10)
        assert deleted == 1


@pytest.mark.parametrize(
    ("finished_at", "rule"),
    [("tomorrow", "correlation_message_finished_at_utc_text"), (20991231, "correlation_message_finished_at_utc_text"),
     ("2999-01-01T00:00:00Z", "correlation_message_finished_at_utc_text")],
)
def test_a_record_finished_at_a_time_sqlite_cannot_compare_is_refused(
    sqlite_url: str, finished_at: object, rule: str
) -> None:
    """SQLite compares times as text: a finished_at that is not UTC text would sort after every cutoff."""
    store = Store(build_engine(DatabaseSettings(url=sqlite_url)))
    stop_at_teardown(store.close)
    with store.engine.connect() as connection:
        got = refusal(
            connection,
            "INSERT INTO correlation_message (message_name, correlation_hint, state, outcome, finished_at)"
            " VALUES ('order.paid', 'o-1', 'delivered', 'correlated', :at)",
            at=finished_at,
        )
    assert got is not None and rule in got, got


@pytest.mark.parametrize(
    ("column", "value", "rule"),
    [
        ("time_to_live", "PT30S", "correlation_message_ttl_is_seconds"),
        ("time_to_live", "30 seconds", "correlation_message_ttl_is_seconds"),
        ("attempt", "x", "correlation_message_attempt_is_integer"),
        ("attempt", 1.5, "correlation_message_attempt_is_integer"),
        ("reschedule_count", "many", "correlation_message_reschedule_count_is_integer"),
        ("lost_calls", "1e3x", "correlation_message_lost_calls_is_integer"),
        ("message_name", b"order.paid", "correlation_message_message_name_is_text"),
        ("correlation_hint", b"o-1", "correlation_message_correlation_hint_is_text"),
        ("message_id", b"m", "correlation_message_message_id_is_text"),
        ("created_at", b"2020", "correlation_message_created_at_is_text"),
        ("expires_at", b"2020", "correlation_message_expires_at_is_text"),
        ("payload", b"{}", "correlation_message_payload_is_text"),
        ("pause_id", "p", "correlation_message_pause_id_is_integer"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_by_its_columns_type_rule_on_sqlite(
    sqlite_url: str, column: str, value: object, rule: str
) -> None:
    """SQLite stores what it is given; a value of another type broke whichever range rule compared it ('PT30S' was
    blamed on "at most 1000 years"). It is refused naming the column's type, on insert and on update."""
    store = Store(build_engine(DatabaseSettings(url=sqlite_url)))
    stop_at_teardown(store.close)
    with store.engine.connect() as connection:
        defaults = {"message_name": "order.paid", "correlation_hint": "o-1"}
        row = {**defaults, column: value}
        columns = ", ".join(row)
        got = refusal(
            connection, f"INSERT INTO correlation_message ({columns}) VALUES ({', '.join(':' + c for c in row)})", **row
        )
        assert got is not None and rule in got, got
        assert refusal(connection, "INSERT INTO correlation_message (message_name, correlation_hint)"
                                   " VALUES ('order.paid', 'o-1')") is None
        got = refusal(connection, f"UPDATE correlation_message SET {column} = :v", v=value)
        assert got is not None and rule in got, got


# -- the upgrade ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_rows_that_break_the_rule_before_the_upgrade_are_made_dead_with_it_and_future_records_bounded(
    dialect: str, empty_pg_url: str, tmp_path: Path
) -> None:
    from alembic import command

    from worker.db.schema import alembic_config

    url = empty_pg_url if dialect == "postgresql" else f"sqlite:///{tmp_path / 'old.db'}"
    engine = build_engine(DatabaseSettings(url=url))
    messages = [
        ("order.paid\u00a0", "o-1"), ("order.paid", "o-2"), ("a\U000e0041", "o-3"), ("order.paid", "\u00a0"),
        ("order.paid", "o\ue000"), ("cafe\u0301", "o-4"), ("order paid", "o-5"),
    ]
    with engine.begin() as connection:
        command.upgrade(alembic_config(connection), "0015")
        for name, hint in messages:
            connection.execute(
                text("INSERT INTO correlation_message (message_name, correlation_hint) VALUES (:n, :h)"),
                {"n": name, "h": hint},
            )
        connection.execute(text(
            "INSERT INTO correlation_message (message_id, message_name, correlation_hint, state, outcome, finished_at)"
            " VALUES ('kept-for-ever', 'order.paid', 'o-9', 'delivered', 'correlated', '2999-01-01 00:00:00')"
        ))
    store = Store(engine)
    stop_at_teardown(store.close)
    store.schema_migrate()
    with engine.connect() as connection:
        rows = connection.execute(
            text("SELECT message_name, correlation_hint, state, last_error, finished_at FROM correlation_message"
                 " ORDER BY id")
        ).all()
    # NFC is SQLite's blind spot: that row stays ready there, and the worker dead-letters it when it reads it.
    nfc_dead = dialect == "postgresql"
    assert [state for _, _, state, _, _ in rows] == [
        "dead", "ready", "dead", "dead", "dead", "dead" if nfc_dead else "ready", "ready", "delivered"
    ]
    assert all(error.startswith("schema revision 0016: ") for _, _, state, error, _ in rows if state == "dead")
    assert "whitespace at either end" in rows[0][3] and "not in Unicode normalisation form NFC" in (
        rows[5][3] if nfc_dead else "not in Unicode normalisation form NFC"
    )
    finished = rows[-1][4]
    finished = finished if isinstance(finished, datetime) else datetime.fromisoformat(finished).replace(tzinfo=UTC)
    assert finished < datetime.now(UTC) + timedelta(minutes=1)  # the record ages out with the retention
    with engine.begin() as connection:  # the rows that keep the rules are worked on as before
        connection.execute(text("UPDATE correlation_message SET attempt = 1 WHERE state = 'ready'"))
