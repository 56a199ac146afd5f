"""The store's plumbing: connections, transactions, the database clock, and driver errors translated.

Every statement correlation-worker runs is in the ``worker.db`` package: :mod:`worker.db.messages` (the
message table, for producers and operators), :mod:`worker.db.fetch` and :mod:`worker.db.calls` (the engine's
reads, and its calls in flight with their outcomes), :mod:`worker.db.locks` (leases and named locks) and
the tables that follow; :class:`worker.db.store.Store` puts them together. They return the project's own
frozen values, never driver rows.

Driver errors are translated at this boundary, by :mod:`worker.db.errors`: an unreachable database becomes
:class:`~worker.db.errors.DatabaseUnavailable`, a statement that waited too long for a lock or ran too long
(or lost a deadlock) :class:`~worker.db.errors.DatabaseBusy`, a row the schema refuses
:class:`~worker.db.errors.MessageRejected`. The first two are transient: the caller tries again later.

PostgreSQL sessions run with the settings' ``lock_timeout`` and ``statement_timeout``, TCP keepalives, the time
zone UTC (so that every time the schema accepts can be read) and the other session settings the worker depends on
(:data:`SESSION_SETTINGS`), whatever the database or role sets; every session begins in :class:`PostgresLogin`.

SQLite write transactions start with ``BEGIN IMMEDIATE``: the write lock is taken before the first read, so a
fenced commit checks its lease under the same lock it writes under.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import orjson
import psycopg
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import TextClause

from worker.config import DatabaseSettings
from worker.db.errors import URL_SETTING, DatabaseUnsuitable, translate
from worker.db.schema import VERSION_TABLE, current_revision, head_revision, migrate
from worker.message import MessageState

T = TypeVar("T")

# What a replica does to each table: fetch and record messages (and publish scheduled ones), lease slots and
# named locks, read pauses, claim schedules' fire times.
_PRIVILEGES = (
    *(("correlation_message", p) for p in ("SELECT", "INSERT", "UPDATE", "DELETE")),
    *(("correlation_lock", p) for p in ("SELECT", "INSERT", "UPDATE", "DELETE")),
    *(("correlation_call", p) for p in ("SELECT", "INSERT", "UPDATE", "DELETE")),
    *(("correlation_session_end", p) for p in ("SELECT", "INSERT", "DELETE")),
    *(("correlation_sample", p) for p in ("SELECT", "INSERT", "DELETE")),
    *(("correlation_target", p) for p in ("SELECT", "INSERT", "UPDATE", "DELETE")),
    *(("correlation_replica", p) for p in ("SELECT", "INSERT", "UPDATE", "DELETE")),
    ("correlation_pause", "SELECT"),
    *(("correlation_schedule", p) for p in ("SELECT", "UPDATE")),
)


@dataclass(frozen=True, slots=True)
class Fence:
    """A lease term: the lock name, its holder and the fence value of the acquisition."""

    name: str
    holder: str
    fence: int


@dataclass(frozen=True, slots=True)
class LockRow:
    """One row of ``correlation_lock``."""

    name: str
    lock_until: datetime
    locked_at: datetime
    locked_by: str
    fence: int


@dataclass(frozen=True, slots=True)
class StateCounts:
    """Messages by state; ``waiting`` are ready ones whose next attempt is not due yet."""

    ready: int
    waiting: int
    paused: int
    dead: int
    expired: int
    oldest_eligible_age: timedelta | None

    @property
    def total(self) -> int:
        """Every row in the table."""
        return self.ready + self.waiting + self.paused + self.dead + self.expired


@dataclass(frozen=True, slots=True)
class MessageFilter:
    """Which messages an admin command acts on; every set field must match."""

    ids: tuple[int, ...] = ()
    name: str | None = None
    hint: str | None = None
    state: MessageState | None = None

    def is_empty(self) -> bool:
        """True when nothing narrows the selection (the whole table)."""
        return not self.ids and self.name is None and self.hint is None and self.state is None


@dataclass(frozen=True, slots=True)
class NewMessage:
    """What a producer gives; everything else has a default."""

    name: str
    hint: str
    payload: Any = None
    headers: Mapping[str, Any] | None = None
    message_id: str | None = None
    time_to_live: timedelta | None = None
    expires_at: datetime | None = None
    created_at: datetime | None = None  # None: the database's now()


_JSON_DECODER = json.JSONDecoder()


class UnreadableJson(str):
    """A JSON document the worker could not decode (nested deeper than Python reads), shown as this text."""


# Integers of 19 digits or more: orjson reads those past 64 bits as floats (losing digits), Python as integers.
# Looked for on every message fetched, so in C (a regular expression costs more than orjson's whole decoding): each
# byte made a 9 (an ASCII digit, the only digits JSON writes numbers with) or a space, then nineteen 9s searched.
_DIGITS = bytes(0x39 if 0x30 <= byte <= 0x39 else 0x20 for byte in range(256))
_LONG_DIGITS = b"9" * 19


def long_digits(data: bytes | str) -> bool:
    """Whether a JSON text holds a run of 19 ASCII digits or more (bytes of UTF-8, or its text)."""
    raw = data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass")
    return _LONG_DIGITS in raw.translate(_DIGITS)


def json_loads(data: bytes | str) -> Any:
    """``json.loads`` for the UTF-8 text PostgreSQL sends, minus its encoding sniffing.

    orjson decodes it (a payload in a sixth of the time, on every message fetched), and Python's decoder
    whatever orjson would read otherwise than Python: a document with a run of 19 digits (an integer past 64
    bits becomes a float in orjson) and one orjson refuses (a lone surrogate, a number past a double's range,
    nesting past 1 024 levels). Both give the same values for everything else: dicts, lists, str, int, float
    (correctly rounded alike), bool and None.

    A document nested deeper than Python's decoder goes (the database takes it) would fail the whole query
    that reads it; it reads as an :class:`UnreadableJson` instead, so that listing a table never fails on one
    row (the engine decodes payloads itself and dead-letters such a message with the reason).
    """
    if not long_digits(data):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    text = data.decode("utf-8", "surrogatepass") if isinstance(data, bytes) else data
    try:
        return _JSON_DECODER.decode(text)
    except RecursionError:
        return UnreadableJson(f"<unreadable JSON of {len(text)} characters: nested too deeply to decode>")


def normalise_url(url: str) -> str:
    """Use psycopg 3 for PostgreSQL whatever driver the URL names (or none)."""
    parsed = make_url(url)
    if parsed.get_backend_name() in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def sqlite_file(url: str) -> Path | None:
    """The file of a file-backed SQLite URL; None for PostgreSQL and for an in-memory or URI-style SQLite URL."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return None
    database = parsed.database or ""
    if database in ("", ":memory:") or database.startswith("file:") or parsed.query.get("uri"):
        return None
    return Path(database)


def _milliseconds(duration: timedelta) -> int:
    return max(1, int(duration.total_seconds() * 1000))


# The session settings the worker's statements and its driver depend on, given at every login (libpq's
# ``options``, which take precedence over what ALTER DATABASE and ALTER ROLE set): dates and intervals in the
# formats psycopg reads, string literals and array NULLs read as the statements mean them, floats exact, and no
# idle or transaction timeout of the role's ending a session the worker keeps in its pool or a call's
# transaction (the worker bounds its calls itself). The search path is the role's: the worker uses the tables it
# finds (see ``StoreBase.schema_revision``).
SESSION_SETTINGS: tuple[tuple[str, str], ...] = (
    ("timezone", "UTC"),
    ("datestyle", "ISO, MDY"),
    ("intervalstyle", "postgres"),
    ("standard_conforming_strings", "on"),
    ("array_nulls", "on"),
    ("transform_null_equals", "off"),
    ("extra_float_digits", "3"),
    ("bytea_output", "hex"),
    ("exit_on_error", "off"),
    ("default_transaction_isolation", "read committed"),
    ("idle_in_transaction_session_timeout", "0"),
)
# Settings of later PostgreSQL releases (an unknown name in the login's options would refuse the login), set
# after it on the servers that have them, with the release that brought them.
_LATER_SESSION_SETTINGS = (("idle_session_timeout", "0", 140000), ("transaction_timeout", "0", 170000))


def _option(name: str, value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace(" ", "\\ ")
    return f"-c {name}={escaped}"


def postgres_connect_args(settings: DatabaseSettings) -> dict[str, Any]:
    """libpq parameters of every worker session: the session settings, the timeouts, keepalives, UTF-8, a
    recognisable name. ``options`` given in the URL come first (the worker's own settings win over them)."""
    keepalive = max(1, int(settings.keepalive.total_seconds()))
    given = make_url(settings.url).query.get("options")
    given_options = " ".join(given) if isinstance(given, tuple) else (given or "")
    own = (
        *SESSION_SETTINGS,
        ("lock_timeout", str(_milliseconds(settings.lock_timeout))),
        ("statement_timeout", str(_milliseconds(settings.statement_timeout))),
    )
    return {
        "connect_timeout": int(settings.connect_timeout.total_seconds()),
        "application_name": "correlation-worker",
        "client_encoding": "UTF8",
        "options": " ".join(filter(None, [given_options, *(_option(name, value) for name, value in own)])),
        "keepalives": 1,
        "keepalives_idle": keepalive,
        "keepalives_interval": max(1, keepalive // 2),
        "keepalives_count": 3,
        # Unacknowledged data for this long means the peer is gone (e.g. a network partition mid-statement).
        "tcp_user_timeout": 3 * keepalive * 1000,
    }


class PostgresLogin:
    """Every PostgreSQL session of the worker begins here: logged in with :func:`postgres_connect_args`'s
    parameters, then checked (:class:`DatabaseUnsuitable` for a database whose encoding is not UTF-8: its text
    would reach the worker as bytes, and text the worker writes could not always be stored).

    The settings of later releases (``_LATER_SESSION_SETTINGS``) are given at login too, once the first session
    of the process has told the server's release: that first session is closed and opened again with them, since
    a setting set after login would race a timeout shorter than a round trip.
    """

    def __init__(self, settings: DatabaseSettings) -> None:
        self.options = postgres_connect_args(settings)["options"]
        self.server_version: int | None = None

    def _later(self, version: int | None) -> str:
        return "".join(
            " " + _option(name, value) for name, value, release in _LATER_SESSION_SETTINGS
            if version is not None and version >= release
        )

    def connect(self, login: Callable[[str], Any]) -> Any:
        """A new session, from ``login(options)`` (a psycopg connection), checked and set up."""
        known = self.server_version
        try:
            driver = login(self.options + self._later(known))
        except psycopg.Error as error:  # a login refused names the setting the server does not know
            if not self._later(known) or not any(f'"{name}"' in str(error) for name, _, _ in _LATER_SESSION_SETTINGS):
                raise
            self.server_version = known = None  # another server (a failover to an older release): learn it again
            driver = login(self.options)
        try:
            version = self.server_version = driver.info.server_version
            encoding = driver.info.parameter_status("server_encoding")
            encoding = encoding.decode("ascii", "replace") if isinstance(encoding, bytes) else encoding
            if encoding not in ("UTF8", None):
                raise DatabaseUnsuitable(
                    f"the database's encoding is {encoding}; correlation-worker needs UTF8 (create the database "
                    "with ENCODING 'UTF8' TEMPLATE template0 and move its data there)"
                )
        except BaseException:
            driver.close()
            raise
        if self._later(version) != self._later(known):
            driver.close()
            driver = login(self.options + self._later(version))
        return driver


def _in_pipeline(driver: Any) -> bool:
    """Whether a psycopg connection is (still) in pipeline mode."""
    pgconn = getattr(driver, "pgconn", None)
    return pgconn is not None and pgconn.pipeline_status != psycopg.pq.PipelineStatus.OFF


def build_engine(settings: DatabaseSettings) -> Engine:
    """An engine for the configured database with sane pooling, timeouts and transaction modes."""
    url = normalise_url(settings.url)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30}, pool_pre_ping=False)

        @event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.isolation_level = None  # transactions begin in the "begin" hook below
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(connection: Connection) -> None:
            immediate = connection.get_execution_options().get("sqlite_immediate", False)
            connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return engine
    engine = create_engine(
        url,
        pool_size=settings.pool_size,
        max_overflow=settings.pool_size,
        # No ping before each checkout (a round trip per transaction): a broken connection fails its
        # statement, is discarded, and the caller's retry takes a fresh one.
        pool_pre_ping=False,
        pool_recycle=1800,
        # The connection used last is taken first: its server process has just run (a wake-up's statements
        # answer sooner than from the connection idle longest) and connections beyond the load stay idle.
        pool_use_lifo=True,
        connect_args=postgres_connect_args(settings),
        json_deserializer=json_loads,
    )
    postgres_login = PostgresLogin(settings)

    @event.listens_for(engine, "do_connect")
    def _postgres_connect(dialect: Any, _record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
        return postgres_login.connect(lambda options: dialect.connect(*cargs, **{**cparams, "options": options}))

    return engine


_DRIVER_SQL: dict[str, str] = {}


def driver_sql(statement: TextClause) -> str:
    """A text statement's SQL with psycopg's ``%(name)s`` placeholders instead of ``:name``.

    Kept per statement text (a string keeps its hash: the lookup costs no more than by ``id``), never per object:
    an object's id is taken again by a later one once it is freed, which would then run the earlier SQL."""
    source = statement.text
    sql = _DRIVER_SQL.get(source)
    if sql is None:
        sql = _DRIVER_SQL[source] = re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", source.replace("%", "%%"))
    return sql


# The worker's own statements, run by the driver (the marks, the flushes, the fetches), are prepared at their first
# run on a connection, not at psycopg's fifth (its default threshold): every run before that is planned again, a
# large share of the server's statement time, more so with several replicas (each connection runs a statement fewer
# times). Only fixed statements: a text made from values would fill the connection's cache of prepared statements
# (psycopg keeps its 100 latest), and DDL of several statements in one text cannot be prepared at all.
PREPARED = True


def driver_rows(driver: Any, statement: TextClause, params: Mapping[str, Any]) -> list[Any]:
    """A text statement's rows (tuples), run by a psycopg connection itself, prepared (see :data:`PREPARED`)."""
    with driver.cursor() as cursor:
        cursor.execute(driver_sql(statement), params, prepare=PREPARED)
        return cursor.fetchall()  # type: ignore[no-any-return]


def int_array(values: Iterable[int]) -> str:
    """An integer array as PostgreSQL's text literal (``{1,2,3}``), cast by the statement: joined in C, where
    psycopg would dump a list element by element in Python (marks and flushes pass one element per call)."""
    return "{" + ",".join(map(str, values)) + "}"


def text_array(values: Iterable[str | None]) -> str:
    """A text array as PostgreSQL's literal (``{"a","b",NULL}``), cast by the statement (see :func:`int_array`)."""
    return "{" + ",".join(
        "NULL" if v is None else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values
    ) + "}"


class StoreBase:
    """Connections, transactions and the clock; the statement mixins build on it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        # Writes on SQLite take the write lock first (BEGIN IMMEDIATE); PostgreSQL needs nothing special.
        self._write_engine = engine.execution_options(sqlite_immediate=True) if self.dialect == "sqlite" else engine
        # The delivery record (schema revision 0010): a message leaving the table stays as its record (state
        # 'delivered') unless the retention is PT0S; finished_by names the replica or operator recording it.
        self.keep_records = True
        self.finished_by = ""

    def keep_delivery_records(self, retention: timedelta, finished_by: str) -> None:
        """Keep a record of each message that leaves the table (none with a retention of zero)."""
        self.keep_records = retention > timedelta(0)
        self.finished_by = finished_by

    def close(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()

    @contextmanager
    def _transaction(self, write: bool = False) -> Iterator[Connection]:
        with self._translated((self._write_engine if write else self.engine).begin()) as connection:
            yield connection

    @contextmanager
    def _translated(self, opened: AbstractContextManager[Connection]) -> Iterator[Connection]:
        """A connection whose errors, SQLAlchemy's or psycopg's own (driver_rows), read as the store's."""
        try:
            with opened as connection:
                try:
                    yield connection
                except psycopg.Error as error:
                    raise self._driver_failed(error, connection.connection, connection) from error
        except DBAPIError as error:
            translated = translate(error)
            if translated is None:
                raise
            raise translated from error

    def _driver_failed(self, error: psycopg.Error, pooled: Any, connection: Connection | None = None) -> Exception:
        """An error psycopg raised itself, handled as SQLAlchemy handles its own: on a lost server the pooled
        connection is let go (and the SQLAlchemy ``connection`` over it) and the pool's older ones are replaced as
        they are checked out (they most likely lost their server too); the store's exception for it.

        A connection the error left in pipeline mode (a pipeline that failed as the server went away: "cannot
        exit pipeline mode while busy") is let go alone: it cannot even be rolled back, and the pool's reset would
        log that failure as an error."""
        wrapped = DBAPIError.instance(None, None, error, psycopg.Error)
        assert isinstance(wrapped, DBAPIError)
        driver = pooled.driver_connection
        if self.engine.dialect.is_disconnect(error, driver, None):  # type: ignore[arg-type]
            wrapped.connection_invalidated = True
            if connection is None or not connection.invalidated:
                self.engine.pool._invalidate(pooled, error)
            if connection is not None and not connection.invalidated:
                connection.invalidate(error)
        elif _in_pipeline(driver):
            if connection is not None and not connection.invalidated:
                connection.invalidate(error)
            elif connection is None and pooled.is_valid:
                pooled.invalidate(error)
        return translate(wrapped) or wrapped

    def _run(self, work: Callable[[Connection], T]) -> T:
        """Run ``work`` in a read transaction (on SQLite it takes no write lock)."""
        with self._transaction() as connection:
            return work(connection)

    def _driver_statements(self, work: Callable[[Any], T]) -> T:
        """Run ``work`` on a pooled psycopg connection itself, each statement its own transaction (PostgreSQL):
        for the engine's statements of every call, where checking a connection out through SQLAlchemy, with
        its isolation level set and reset, costs more than the statement."""
        idle = psycopg.pq.TransactionStatus.IDLE
        try:
            pooled = self.engine.raw_connection()
        except psycopg.Error as error:  # no connection to be had (the server down, a login refused): the pool's
            # checkout raises the driver's error as it is, which engine.connect() would have wrapped
            wrapped = DBAPIError.instance(None, None, error, psycopg.Error)
            assert isinstance(wrapped, DBAPIError)
            raise (translate(wrapped) or wrapped) from error
        driver: Any = pooled.driver_connection
        try:
            driver.autocommit = True
            return work(driver)
        except psycopg.Error as error:
            raise self._driver_failed(error, pooled) from error
        finally:
            # Back to the pool as it came (not in autocommit), or discarded if it broke on the way.
            if pooled.is_valid and not driver.closed and driver.info.transaction_status == idle:
                driver.autocommit = False
            elif pooled.is_valid:
                pooled.invalidate()
            pooled.close()

    def _write(self, work: Callable[[Connection], T]) -> T:
        """Run ``work`` in a write transaction."""
        with self._transaction(write=True) as connection:
            return work(connection)

    def _now(self, connection: Connection) -> datetime:
        if self.dialect == "postgresql":
            value = connection.execute(text("SELECT now()")).scalar_one()
        else:
            raw = connection.execute(text("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')")).scalar_one()
            value = datetime.fromisoformat(raw)
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value

    # -- schema and clock ---------------------------------------------------------------------------------

    def now(self) -> datetime:
        """The database clock."""
        return self._run(self._now)

    def ping(self) -> None:
        """Raise DatabaseUnavailable unless the database answers."""
        self._run(lambda c: c.execute(text("SELECT 1")))

    def database_read_only(self) -> bool:
        """True when this replica's sessions cannot write: a standby (in recovery) or read-only by default
        (PostgreSQL; False on SQLite, whose read-only file fails its writes with a reason of its own)."""
        if self.dialect != "postgresql":
            return False
        statement = text("SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'")
        return bool(self._run(lambda c: c.execute(statement).scalar_one()))

    def schema_revision(self) -> str | None:
        """The schema revision of the database (None: never migrated).

        The schema is the tables the session's search path finds. Finding none while another schema of the
        database holds a set (the search path changed after ``migrate``) raises :class:`DatabaseUnsuitable`
        naming both, rather than reading as a database never migrated (where ``run`` would create a second set).
        """

        def work(connection: Connection) -> str | None:
            revision = current_revision(connection)
            if revision is None and self.dialect == "postgresql":
                path, schema, holders = connection.execute(_SEARCH_PATH, {"table": VERSION_TABLE}).one()
                if holders:
                    raise DatabaseUnsuitable(
                        f"the search_path of the worker's sessions ({path}) finds no correlation-worker tables, but "
                        f"schema {', '.join(holders)} holds them: set the search_path to include it (ALTER ROLE or "
                        "ALTER DATABASE ... SET search_path, or options=-csearch_path%3D... in "
                        f"{URL_SETTING}), or run `correlation-worker migrate` to create a separate set in "
                        f"{_schema_named(schema)}"
                    )
            return revision

        return self._run(work)

    def schema_name(self) -> str | None:
        """The schema of the tables the session's search path finds, or the one it creates tables in (where
        ``migrate`` puts them) when it finds none (PostgreSQL; None on SQLite, and when no schema on the search path
        exists)."""
        if self.dialect != "postgresql":
            return None
        schema = self._run(lambda c: c.execute(_SCHEMA_NAME, {"table": VERSION_TABLE}).scalar_one())
        return None if schema is None else str(schema)

    def privileges_missing(self) -> list[str]:
        """The table privileges a replica needs that the database user lacks (PostgreSQL; [] on SQLite).

        A user allowed only to read would fetch messages and never record an outcome; readiness says so.
        """
        if self.dialect != "postgresql":
            return []
        pairs = ", ".join(f"('{table}', '{privilege}')" for table, privilege in _PRIVILEGES)
        statement = text(
            f"SELECT t.name, t.privilege FROM (VALUES {pairs}) AS t (name, privilege) "
            "WHERE to_regclass(t.name) IS NOT NULL AND NOT has_table_privilege(t.name, t.privilege)"
        )
        rows = self._run(lambda c: c.execute(statement).all())
        return [f"{row.privilege} on {row.name}" for row in rows]

    def schema_is_current(self) -> bool:
        """True when the database schema is at the newest revision this version ships."""
        return self.schema_revision() == head_revision()

    def schema_migrate(self) -> tuple[str | None, str]:
        """Apply every pending migration; returns (revision before, revision after). On PostgreSQL the tables
        go in the first schema of the session's search path that exists (:meth:`schema_name`)."""
        if self.dialect == "postgresql" and self.schema_name() is None:
            path = self._run(lambda c: c.execute(text("SELECT current_setting('search_path')")).scalar_one())
            raise DatabaseUnsuitable(
                f"the search_path of the worker's sessions ({path}) names no schema that exists, and "
                "correlation-worker creates its tables in the first one that does: create the schema, or set "
                f"the search_path (ALTER ROLE or ALTER DATABASE ... SET search_path, or options in {URL_SETTING})"
            )
        try:
            return migrate(self.engine)
        except DBAPIError as error:
            translated = translate(error)
            if translated is None:
                raise
            raise translated from error


# The session's search path, the schema it creates tables in, and the schemas holding a table of that name that
# the search path does not find.
_SEARCH_PATH = text(
    "SELECT current_setting('search_path'), current_schema(), "
    "ARRAY(SELECT n.nspname FROM pg_catalog.pg_class AS c "
    "JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace "
    "WHERE c.relname = :table AND c.relkind IN ('r', 'p') AND NOT pg_catalog.pg_table_is_visible(c.oid) "
    "ORDER BY n.nspname)"
)


# The schema of the version table the search path finds, else the schema the search path creates tables in.
_SCHEMA_NAME = text(
    "SELECT coalesce((SELECT n.nspname FROM pg_catalog.pg_class AS c "
    "JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace "
    "WHERE c.relname = :table AND c.relkind IN ('r', 'p') AND pg_catalog.pg_table_is_visible(c.oid)), "
    "current_schema())"
)


def _schema_named(schema: str | None) -> str:
    return "the schema the search_path names first (none of its schemas exists)" if schema is None else (
        f"schema {schema}"
    )


def id_list(ids: Sequence[int]) -> str | None:
    """A JSON array of ids, or None for none."""
    return json.dumps(list(ids)) if ids else None
