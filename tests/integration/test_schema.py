"""The schema refuses nonsense at insert time, with SQL, on PostgreSQL and SQLite."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DataError, IntegrityError

from worker.db.store import Store

GOOD = {"name": "order.paid", "hint": "order-1", "payload": '{"amount": 3}'}


@pytest.fixture
def conn(any_store: Store) -> Iterator[Connection]:
    with any_store.engine.connect() as connection:
        yield connection


def insert(conn: Connection, columns: str = "", values: str = "", **params: object) -> None:
    row = {**GOOD, **params}
    with conn.begin():
        conn.execute(
            text(
                "INSERT INTO correlation_message (message_name, correlation_hint, payload"
                f"{columns}) VALUES (:name, :hint, :payload{values})"
            ),
            row,
        )


def rejected(conn: Connection, constraint: str | None = None, **kwargs: object) -> str:
    with pytest.raises((IntegrityError, DataError)) as info:
        insert(conn, **kwargs)  # type: ignore[arg-type]
    message = str(info.value.orig)
    if constraint is not None:
        assert constraint in message
    return message


def test_a_plain_insert_gets_every_worker_column_defaulted(conn: Connection) -> None:
    insert(conn)
    row = conn.execute(text("SELECT * FROM correlation_message")).mappings().one()
    assert row["state"] == "ready"
    assert row["attempt"] == 0 and row["reschedule_count"] == 0
    assert row["next_attempt_at"] is None and row["last_error"] is None
    assert row["created_at"] is not None
    assert 0 <= row["slot"] < 64


def test_empty_name_is_rejected(conn: Connection) -> None:
    rejected(conn, "correlation_message_name_not_empty", name="")


def test_empty_hint_is_rejected(conn: Connection) -> None:
    rejected(conn, "correlation_message_hint_not_empty", hint="")


def test_over_long_hint_is_rejected(conn: Connection) -> None:
    rejected(conn, "correlation_message_hint_length", hint="x" * 256)


def test_payload_that_is_not_json_is_rejected(conn: Connection) -> None:
    message = rejected(conn, payload="{not json")
    assert "json" in message.lower()


def test_negative_time_to_live_is_rejected(any_store: Store, conn: Connection) -> None:
    ttl = "interval '-5 seconds'" if any_store.dialect == "postgresql" else "-5"
    rejected(conn, "correlation_message_ttl_not_negative", columns=", time_to_live", values=f", {ttl}")


def test_expiry_before_creation_is_rejected(conn: Connection) -> None:
    rejected(
        conn,
        "correlation_message_expires_after_created",
        columns=", created_at, expires_at",
        values=", '2030-01-02 00:00:00', '2030-01-01 00:00:00'",
    )


def test_duplicate_message_id_is_rejected_unless_on_conflict_do_nothing(conn: Connection) -> None:
    insert(conn, columns=", message_id", values=", 'm-1'")
    rejected(conn, columns=", message_id", values=", 'm-1'")
    with conn.begin():
        conn.execute(
            text(
                "INSERT INTO correlation_message (message_id, message_name, correlation_hint, payload) "
                "VALUES ('m-1', 'order.paid', 'order-1', '{}') ON CONFLICT (message_id) DO NOTHING"
            )
        )
    assert conn.execute(text("SELECT count(*) FROM correlation_message")).scalar_one() == 1


def test_unknown_state_is_rejected(conn: Connection) -> None:
    rejected(conn, "correlation_message_state_known", columns=", state", values=", 'done'")


def test_slot_is_a_stable_function_of_the_hint_on_postgresql(store: Store) -> None:
    with store.engine.begin() as connection:
        for hint in ("a", "b", "a"):
            connection.execute(
                text("INSERT INTO correlation_message (message_name, correlation_hint) VALUES ('n', :h)"),
                {"h": hint},
            )
        slots = connection.execute(
            text("SELECT correlation_hint, slot FROM correlation_message ORDER BY id")
        ).all()
    assert slots[0].slot == slots[2].slot
    assert all(0 <= row.slot < 64 for row in slots)


def test_a_slot_other_than_0_is_refused_on_sqlite_where_one_replica_owns_every_message(
    any_store: Store, conn: Connection
) -> None:
    if any_store.dialect != "sqlite":
        pytest.skip("on PostgreSQL the slot is generated from the hint")
    rejected(conn, "correlation_message_slot_is_0", columns=", slot", values=", 3")
    insert(conn, columns=", slot", values=", 0")
    with pytest.raises(IntegrityError, match="correlation_message_slot_is_0"), conn.begin():
        conn.execute(text("UPDATE correlation_message SET slot = 1"))


def test_infinite_or_unreadable_times_are_rejected(any_store: Store, conn: Connection) -> None:
    rejected(conn, columns=", expires_at", values=", 'infinity'")
    if any_store.dialect == "postgresql":
        rejected(conn, "correlation_message_ttl_at_most_1000_years", columns=", time_to_live",
                 values=", interval '3000000 years'")
    else:
        rejected(conn, "correlation_message_expires_at_utc_text", columns=", expires_at",
                 values=", '2099-01-01T10:00:00+01:00'")
        rejected(conn, "correlation_message_created_at_utc_text", columns=", created_at",
                 values=", 'yesterday'")
        insert(conn, columns=", created_at, expires_at", values=", '2030-01-01 10:00:00', '2030-01-02 10:00:00.5'")


def test_times_past_the_year_9999_are_rejected_on_postgresql(store: Store) -> None:
    with store.engine.connect() as connection:
        rejected(connection, "correlation_message_expires_at_readable", columns=", expires_at",
                 values=", '9999-12-31 23:00-05'")


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_calls_marked_in_flight_by_the_previous_revision_become_call_rows_at_the_upgrade(
    dialect: str, empty_pg_url: str, tmp_path: Path
) -> None:
    """A replica of the previous release died with calls marked on its lease row: upgrading forgets none of them."""
    from alembic import command

    from worker.config import DatabaseSettings
    from worker.db.base import build_engine
    from worker.db.schema import alembic_config

    url = empty_pg_url if dialect == "postgresql" else f"sqlite:///{tmp_path / 'old.db'}"
    engine = build_engine(DatabaseSettings(url=url))
    with engine.begin() as connection:
        command.upgrade(alembic_config(connection), "0006")
        for hint in ("a", "b", "c", "d"):
            connection.execute(
                text("INSERT INTO correlation_message (message_name, correlation_hint) VALUES ('n', :h)"), {"h": hint}
            )
        connection.execute(
            text("UPDATE correlation_lock SET locked_by = 'old', fence = 7, in_flight = :marks "
                 "WHERE name = (SELECT min(name) FROM correlation_lock WHERE name LIKE 'slot:%')"),
            {"marks": '{"runs": [[1, 2], [3]], "abandoned": [4], "alone": [3]}'},
        )
    store = Store(engine)
    store.schema_migrate()
    calls = {row["message_id"]: (row["run_head"], row["state"], row["fence"]) for row in store.calls_in_flight()}
    assert calls == {1: (1, "called", 7), 2: (1, "called", 7), 3: (3, "alone", 7), 4: (4, "abandoned", 7)}
    store.close()


@pytest.mark.parametrize(
    ("name", "hint", "constraint"),
    [
        ("order.paid ", "o-1", "correlation_message_name_no_blank_at_either_end"),
        (" order.paid", "o-1", "correlation_message_name_no_blank_at_either_end"),
        ("order\tpaid", "o-1", "correlation_message_name_printable"),
        ("order.\u202epaid", "o-1", "correlation_message_name_printable"),
        ("order.paid\u200b", "o-1", "correlation_message_name_printable"),
        ("order.paid", "   ", "correlation_message_hint_not_blank"),
        ("order.paid", "o-1\x1b[31m", "correlation_message_hint_printable"),
        ("order.paid", "o\u2066-1", "correlation_message_hint_printable"),
    ],
)
def test_a_name_or_hint_that_would_not_read_as_it_matches_is_refused_by_its_rule(
    conn: Connection, name: str, hint: str, constraint: str
) -> None:
    rejected(conn, constraint, name=name, hint=hint)


def test_names_and_hints_with_inner_blanks_and_any_script_are_taken(conn: Connection) -> None:
    for name, hint in (("order paid", "Bestellung 4711"), ("заказ.оплачен", "注文-1"), ("a", "  x  ")):
        insert(conn, name=name, hint=hint)


def test_a_message_id_past_1000_bytes_is_refused_by_its_rule_not_an_index_error(conn: Connection) -> None:
    rule = "correlation_message_message_id_at_most_1000_bytes"
    rejected(conn, rule, columns=", message_id", values=", :mid", mid="é" * 501)
    insert(conn, ", message_id", ", :mid", mid="x" * 1000)


@pytest.mark.parametrize(
    ("name", "message_name", "rule"),
    [
        ("   ", "x", "correlation_schedule_name_no_blank_at_either_end"),
        ("nightly ", "x", "correlation_schedule_name_no_blank_at_either_end"),
        ("night\u202ely", "x", "correlation_schedule_name_printable"),
        ("nightly", " x", "correlation_schedule_message_name_no_blank_at_either_end"),
        ("nightly", "x\x00y".replace("\x00", "\x07"), "correlation_schedule_message_name_printable"),
    ],
)
def test_a_schedule_row_with_such_a_name_is_refused_by_its_rule(
    conn: Connection, name: str, message_name: str, rule: str
) -> None:
    with pytest.raises((IntegrityError, DataError)) as info, conn.begin():
        conn.execute(
            text("INSERT INTO correlation_schedule (name, cron, message_name) VALUES (:n, '0 0 3 * * ?', :m)"),
            {"n": name, "m": message_name},
        )
    assert rule in str(info.value.orig), info.value


def migrated_from_0007(url: str, rows: Sequence[tuple[str, str]]) -> Store:
    """A store on a database at revision 0007 (before the name rules) holding these (name, hint) messages, then
    migrated to the newest revision."""
    from alembic import command

    from worker.config import DatabaseSettings
    from worker.db.base import build_engine
    from worker.db.schema import alembic_config

    engine = build_engine(DatabaseSettings(url=url))
    with engine.begin() as connection:
        command.upgrade(alembic_config(connection), "0007")
        for name, hint in rows:
            connection.execute(
                text("INSERT INTO correlation_message (message_name, correlation_hint) VALUES (:n, :h)"),
                {"n": name, "h": hint},
            )
    store = Store(engine)
    store.schema_migrate()
    return store


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_messages_that_break_the_name_rules_before_the_upgrade_are_made_dead_with_the_rule(
    dialect: str, empty_pg_url: str, tmp_path: Path
) -> None:
    url = empty_pg_url if dialect == "postgresql" else f"sqlite:///{tmp_path / 'old.db'}"
    store = migrated_from_0007(url, [("order.paid ", "o-1"), ("order.paid", "o-2"), ("n", "\u202eh"), ("n", "  ")])
    engine = store.engine
    with engine.connect() as connection:
        rows = connection.execute(
            text("SELECT correlation_hint, state, last_error FROM correlation_message ORDER BY id")
        ).all()
    assert [(hint, state) for hint, state, _ in rows] == [
        ("o-1", "dead"), ("o-2", "ready"), ("\u202eh", "dead"), ("  ", "dead")
    ]
    assert all(error.startswith("schema revision 0008: ") for _, state, error in rows if state == "dead")
    assert "blank at either end" in rows[0][2]
    with engine.begin() as connection:  # the rows that keep the rules are worked on as before
        connection.execute(text("UPDATE correlation_message SET attempt = 1 WHERE state = 'ready'"))
    store.close()


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_an_operator_deletes_the_messages_the_upgrade_made_dead_and_their_records_are_kept(
    dialect: str, empty_pg_url: str, tmp_path: Path
) -> None:
    """Revision 0008 made such messages dead and told operators to delete them: a delete while records are kept
    turns each into its record, an update, which must not be refused by the rule its name or hint breaks."""
    from worker.db.base import MessageFilter
    from worker.message import MessageState

    url = empty_pg_url if dialect == "postgresql" else f"sqlite:///{tmp_path / 'old.db'}"
    store = migrated_from_0007(url, [("order.paid ", "o-1"), ("n", "\u202eh"), ("n", "  "), ("order.paid", "o-2")])
    engine = store.engine
    assert store.keep_records
    assert store.messages_delete(MessageFilter(state=MessageState.DEAD), by="ops") == 3
    with engine.connect() as connection:
        rows = connection.execute(
            text("SELECT correlation_hint, state, outcome, finished_by FROM correlation_message ORDER BY id")
        ).all()
    assert [tuple(row) for row in rows] == [
        ("o-1", "delivered", "deleted", "ops"), ("\u202eh", "delivered", "deleted", "ops"),
        ("  ", "delivered", "deleted", "ops"), ("o-2", "ready", None, None),
    ]
    store.close()


@pytest.mark.parametrize(
    ("name", "hint", "constraint"),
    [
        ("order.paid ", "o-1", "correlation_message_name_no_blank_at_either_end"),
        ("order\tpaid", "o-1", "correlation_message_name_printable"),
        ("order.paid", "   ", "correlation_message_hint_not_blank"),
        ("order.paid", "o\u2066-1", "correlation_message_hint_printable"),
    ],
)
def test_a_row_inserted_as_a_record_or_brought_back_to_life_is_held_to_the_name_rules(
    conn: Connection, name: str, hint: str, constraint: str
) -> None:
    """A record's update skips the rules (its name and hint were checked as a message); a row inserted as a
    record, or a record made a live message again, is still refused under the rule's name."""
    columns, values = ", state, outcome, finished_at", ", 'delivered', 'correlated', CURRENT_TIMESTAMP"
    rejected(conn, constraint, columns=columns, values=values, name=name, hint=hint)
    insert(conn, columns, values)  # a record whose name and hint keep the rules is taken
    with pytest.raises(IntegrityError) as info, conn.begin():
        conn.execute(
            text(
                "UPDATE correlation_message SET message_name = :name, correlation_hint = :hint, state = 'ready',"
                " outcome = NULL, finished_at = NULL"
            ),
            {"name": name, "hint": hint},
        )
    assert constraint in str(info.value.orig)


def test_a_message_inserted_paused_under_a_pause_that_does_not_exist_is_refused(conn: Connection) -> None:
    rejected(conn, "correlation_message_pause_exists", columns=", state, pause_id", values=", 'paused', 424242")
    insert(conn, ", state", ", 'paused'")  # paused by hand, no pause: resumed by hand


def test_a_message_inserted_dead_gets_a_reason_saying_so(conn: Connection) -> None:
    insert(conn, ", state", ", 'dead'")
    insert(conn, ", state, last_error", ", 'dead', 'moved here from the old system'")
    errors = conn.execute(text("SELECT last_error FROM correlation_message ORDER BY id")).scalars().all()
    assert errors == ["inserted as dead, not by the worker: it was never called", "moved here from the old system"]


def test_the_head_revision_a_replica_compares_with_is_the_newest_migration_shipped() -> None:
    """A replica starts without reading the migrations through alembic: the head it knows must be theirs."""
    from alembic.script import ScriptDirectory

    from worker.db.schema import alembic_config, head_revision, known_revisions

    scripts = ScriptDirectory.from_config(alembic_config())
    assert head_revision() == scripts.get_current_head()
    assert head_revision() in known_revisions()


def test_the_schema_check_reads_the_tables_unqualified_names_resolve_to(empty_pg_url: str) -> None:
    """The revision and the columns are read from the tables the statements' unqualified names find (the first of
    each name on the search path, as alembic finds its version table): a set of the tables in a schema off the path
    is not ours but is named (rather than reading as no schema at all), `migrate` creates a separate set where the
    path says, a column or table dropped by hand is named, and a schema first on the path that holds none of them
    hides nothing."""
    from worker.config import DatabaseSettings
    from worker.db.base import build_engine
    from worker.db.errors import DatabaseUnsuitable
    from worker.db.schema import VERSION_TABLE, head_revision

    store = Store(build_engine(DatabaseSettings(url=empty_pg_url)))
    try:
        with store.engine.begin() as connection:
            connection.execute(text("CREATE SCHEMA elsewhere"))
            connection.execute(text(f"CREATE TABLE elsewhere.{VERSION_TABLE} (version_num text PRIMARY KEY)"))
            connection.execute(text(f"INSERT INTO elsewhere.{VERSION_TABLE} VALUES ('{head_revision()}')"))
        with pytest.raises(DatabaseUnsuitable, match=r'\("\$user", public\) finds no correlation-worker tables, but '
                           r'schema elsewhere holds them.* a separate set in schema public$'):
            store.schema_revision()
        assert "table correlation_message" in store.schema_missing()

        store.schema_migrate()
        assert store.schema_revision() == head_revision()
        assert store.schema_missing() == []
        assert store.schema_name() == "public"
        with store.engine.begin() as connection:
            connection.execute(text("ALTER TABLE correlation_message DROP COLUMN finished_by"))
            connection.execute(text("ALTER TABLE correlation_session_end SET SCHEMA elsewhere"))
        assert store.schema_missing() == ["column correlation_message.finished_by", "table correlation_session_end"]
        with store.engine.begin() as connection:
            database = connection.execute(text("SELECT current_database()")).scalar_one()
            connection.execute(text("CREATE SCHEMA first_on_the_path"))
            path = "first_on_the_path, elsewhere, public"
            connection.execute(text(f'ALTER DATABASE "{database}" SET search_path = {path}'))
        store.engine.dispose()  # new sessions take the database's search path
        assert store.schema_revision() == head_revision()
        assert store.schema_missing() == ["column correlation_message.finished_by"]  # the moved table found again
        assert store.schema_name() == "elsewhere"  # the tables found, not the first schema of the path
    finally:
        store.close()
