"""The tables as SQLAlchemy sees them, their column types on each database, and migrations.

The DDL of record is in ``schema/ddl/`` (run by the alembic migrations in ``schema/versions/``); the
:class:`~sqlalchemy.Table` objects here describe the same columns for typed statements and must match it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Dialect,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    bindparam,
    text,
)
from sqlalchemy.dialects.postgresql import INTERVAL, JSONB, TIMESTAMP
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.types import TypeEngine

from worker import __version__
from worker.db.errors import SchemaTooNew

if TYPE_CHECKING:
    from alembic.config import Config

VERSION_TABLE = "correlation_schema_version"
SLOT_COUNT = 64  # fixed by the schema: slot = hash(correlation_hint) mod 64 on PostgreSQL
SQLITE_TIME_FORMAT = "%Y-%m-%d %H:%M:%S.%f"
HINT_MAX_LENGTH = 255
LOCK_NAME_MAX_LENGTH = 64
NOTIFY_CHANNEL = "correlation_message"  # the producers' trigger notifies the slots it inserted into here
# A notification whose payload is not a slot list wakes every slot; this one also says the pauses changed.
PAUSES_CHANGED = "pauses"


class UtcDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes: ``timestamptz`` on PostgreSQL, fixed-width UTC text on SQLite."""

    impl = Text
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(TIMESTAMP(timezone=True))
        return dialect.type_descriptor(Text())

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> Any:
        if value is None or dialect.name == "postgresql":
            return value
        if value.tzinfo is not None:
            value = value.astimezone(UTC)
        return value.strftime(SQLITE_TIME_FORMAT)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if isinstance(value, str):
            value = datetime.fromisoformat(value.replace("T", " ").removesuffix("Z"))
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value


class TimeToLive(TypeDecorator[timedelta]):
    """An interval: ``interval`` on PostgreSQL, seconds (a number) on SQLite."""

    impl = Float
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(INTERVAL())
        return dialect.type_descriptor(Float())

    def process_bind_param(self, value: timedelta | None, dialect: Dialect) -> Any:
        if value is None or dialect.name == "postgresql":
            return value
        return value.total_seconds()

    def process_result_value(self, value: Any, dialect: Dialect) -> timedelta | None:
        if value is None or isinstance(value, timedelta):
            return value
        return timedelta(seconds=float(value))


class Document(TypeDecorator[Any]):
    """JSON: ``jsonb`` on PostgreSQL, JSON text on SQLite."""

    impl = JSON
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(JSONB())
        return dialect.type_descriptor(JSON())

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        # SQLite hands back text when a row was written by hand with a JSON string literal.
        if isinstance(value, str) and dialect.name != "postgresql":
            try:
                return json.loads(value)
            except ValueError:
                return value
        return value


metadata = MetaData()

message_table = Table(
    "correlation_message",
    metadata,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True),
    Column("message_id", Text, unique=True),
    Column("message_name", Text, nullable=False),
    Column("correlation_hint", Text, nullable=False),
    Column("payload", Document, nullable=False),
    Column("headers", Document, nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
    Column("time_to_live", TimeToLive),
    Column("expires_at", UtcDateTime),
    Column("attempt", Integer, nullable=False),
    Column("next_attempt_at", UtcDateTime),
    Column("reschedule_count", Integer, nullable=False),
    Column("last_error", Text),
    Column("state", Text, nullable=False),
    Column("slot", Integer, nullable=False),
    Column("lost_calls", Integer, nullable=False),
    Column("crashed_calls", Integer, nullable=False),
    Column("pause_id", BigInteger),
    # The delivery record (state 'delivered', schema revision 0010).
    Column("outcome", Text),
    Column("result", Document),
    Column("finished_at", UtcDateTime),
    Column("finished_by", Text),
)

pause_table = Table(
    "correlation_pause",
    metadata,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True),
    Column("scope", Text, nullable=False),
    Column("target", Text, nullable=False),
    Column("reason", Text, nullable=False),
    Column("created_by", Text, nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
)

audit_table = Table(
    "correlation_audit",
    metadata,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True),
    Column("at", UtcDateTime, nullable=False),
    Column("actor", Text, nullable=False),
    Column("via", Text, nullable=False),
    Column("action", Text, nullable=False),
    Column("target", Document, nullable=False),
    Column("affected", BigInteger, nullable=False),
    Column("error", Text),
)

lock_table = Table(
    "correlation_lock",
    metadata,
    Column("name", String(LOCK_NAME_MAX_LENGTH), primary_key=True),
    Column("lock_until", UtcDateTime, nullable=False),
    Column("locked_at", UtcDateTime, nullable=False),
    Column("locked_by", String(255), nullable=False),
    Column("fence", BigInteger, nullable=False),
)

call_table = Table(
    "correlation_call",
    metadata,
    Column("message_id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True),
    Column("slot", Integer, nullable=False),
    Column("fence", BigInteger, nullable=False),
    Column("holder", Text, nullable=False),
    Column("run_head", BigInteger, nullable=False),
    Column("state", Text, nullable=False),
    Column("marked_at", UtcDateTime, nullable=False),
)


target_table = Table(
    "correlation_target",
    metadata,
    Column("replica", Text, primary_key=True),
    Column("target", Text, primary_key=True),
    Column("circuit", Text, nullable=False),
    Column("reason", Text, nullable=False),
    Column("concurrency_limit", Integer, nullable=False),
    Column("in_flight", Integer, nullable=False),
    Column("since", UtcDateTime, nullable=False),
    Column("seen_at", UtcDateTime, nullable=False),
)

replica_table = Table(
    "correlation_replica",
    metadata,
    Column("replica", Text, primary_key=True),
    Column("routes", Text, nullable=False),
    Column("settings", Text, nullable=False),
    Column("seen_at", UtcDateTime, nullable=False),
)

sample_table = Table(
    "correlation_sample",
    metadata,
    Column("taken_at", UtcDateTime, primary_key=True),
    Column("replica", Text, primary_key=True),
    Column("success", BigInteger, nullable=False),
    Column("retry", BigInteger, nullable=False),
    Column("buffered", BigInteger, nullable=False),
    Column("rescheduled", BigInteger, nullable=False),
    Column("dead", BigInteger, nullable=False),
    Column("inserted_total", BigInteger),
    Column("ready", BigInteger),
    Column("waiting", BigInteger),
    Column("paused", BigInteger),
    Column("dead_messages", BigInteger),
    Column("expired", BigInteger),
    Column("oldest_eligible_seconds", Float),
)


# alembic is imported where a migration runs or its scripts are read, not when the package is: a replica
# starting up only compares the database's revision with the newest shipped one (SCHEMA_HEAD).


def alembic_config(connection: Connection | None = None, url: str | None = None) -> Config:
    """An alembic configuration pointing at the migrations shipped in the package."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(resources.files("worker.migrations")))
    if url is not None:
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


# The newest migration shipped with this version (schema/versions/), written down so that a replica compares the
# database's revision with it at every start without reading the scripts through alembic (importing it took about
# a tenth of the time from starting the process to its first call); a test checks it against alembic's reading.
SCHEMA_HEAD = "0017"


def head_revision() -> str:
    """The newest migration shipped with this version."""
    return SCHEMA_HEAD


@cache
def known_revisions() -> frozenset[str]:
    """Every schema revision this version ships."""
    from alembic.script import ScriptDirectory

    return frozenset(script.revision for script in ScriptDirectory.from_config(alembic_config()).walk_revisions())


def check_revision_known(revision: str | None) -> None:
    """Raise :class:`SchemaTooNew` when the database is at a revision this version does not ship.

    That happens after a rollback of the worker to an older release: its ``migrate`` cannot go back, and its
    statements may not fit the newer tables.
    """
    if revision is not None and revision not in known_revisions():
        raise SchemaTooNew(
            f"the database schema is at revision {revision!r}, which this version of correlation-worker "
            f"({__version__}, schema {head_revision()}) does not know: a newer release migrated it; run that "
            "release (this one can neither use nor downgrade the schema)"
        )


# The columns of the tables named, as unqualified names find them (the first of that name on the search path, as
# alembic and the statements find them), in one read of the catalog. SQLAlchemy's reflection read the same with a
# statement it builds and compiles at each use, and parsed every column's type: about 10 ms of a replica's start,
# whose steps after the imports take about 0.1 s.
_POSTGRESQL_COLUMNS = text(
    "SELECT c.relname AS table_name, a.attname AS column_name "
    "FROM pg_catalog.pg_class AS c "
    "JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace "
    "LEFT JOIN pg_catalog.pg_attribute AS a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped "
    "WHERE c.relname = ANY(:names) AND c.relkind IN ('r', 'p', 'f') AND n.nspname <> 'pg_catalog' "
    "AND pg_catalog.pg_table_is_visible(c.oid)"
)
_SQLITE_COLUMNS = text(
    "SELECT m.name AS table_name, p.name AS column_name "
    "FROM sqlite_master AS m LEFT JOIN pragma_table_info(m.name) AS p "
    "WHERE m.type = 'table' AND m.name IN :names"
).bindparams(bindparam("names", expanding=True))


def table_columns(connection: Connection, tables: Iterable[str]) -> dict[str, set[str]]:
    """The columns of each of ``tables`` the database has; a table it lacks is left out."""
    names = sorted(set(tables))
    if connection.dialect.name == "postgresql":
        rows = connection.execute(_POSTGRESQL_COLUMNS, {"names": names})
    else:
        rows = connection.execute(_SQLITE_COLUMNS, {"names": names})
    found: dict[str, set[str]] = {}
    for table, column in rows:
        columns = found.setdefault(table, set())
        if column is not None:
            columns.add(column)
    return found


def current_revision(connection: Connection) -> str | None:
    """The schema revision the database is at (None: never migrated): the one row of alembic's version table,
    read as alembic reads it."""
    if VERSION_TABLE not in table_columns(connection, [VERSION_TABLE]):
        return None
    revisions = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    if len(revisions) > 1:
        raise RuntimeError(f"the database records several schema revisions: {', '.join(sorted(revisions))}")
    return revisions[0] if revisions else None


def migrate(engine: Engine) -> tuple[str | None, str]:
    """Bring the schema to the newest revision; returns (before, after).

    On PostgreSQL an advisory lock serialises replicas that start at the same moment.
    """
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(hashtext('correlation-worker migrate'))"))
        before = current_revision(connection)
        check_revision_known(before)
        from alembic import command

        command.upgrade(alembic_config(connection), "head")
        after = current_revision(connection)
    assert after is not None
    return before, after
