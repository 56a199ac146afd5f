"""The one seam to the database: every statement correlation-worker runs is in this module.

Methods read noun-then-verb (``messages_fetch_eligible``, ``lock_try_acquire``) and return the project's own
frozen values, never driver rows. Driver errors are translated here: an unreachable database becomes
:class:`DatabaseUnavailable`, a row the schema refuses becomes :class:`MessageRejected`.

Times come from the database clock: :meth:`Store.now` reads it once per page, and statements that take or
renew a lease use the database's own ``now()``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any, TypeVar

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    Integer,
    Text,
    bindparam,
    case,
    create_engine,
    event,
    select,
    text,
)
from sqlalchemy import delete as sa_delete
from sqlalchemy import update as sa_update
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine, Result, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.exc import InterfaceError as SAInterfaceError
from sqlalchemy.sql import ColumnElement, TextClause
from sqlalchemy.sql.expression import TextualSelect

from worker.config import DatabaseSettings, Mode
from worker.db.schedules import ScheduleStatements
from worker.db.schema import (
    LOCK_NAME_MAX_LENGTH,
    SLOT_COUNT,
    Document,
    TimeToLive,
    UtcDateTime,
    current_revision,
    head_revision,
    lock_table,
    message_table,
    migrate,
)
from worker.message import Message, MessageState
from worker.policy.outcomes import Disposition, Kind

T = TypeVar("T")


class StoreError(Exception):
    """A database operation failed; the message says what and how to fix it."""


class DatabaseUnavailable(StoreError):
    """The database cannot be reached (or the connection broke); retry later."""


class MessageRejected(StoreError):
    """The schema refused a row; ``constraint`` names the rule it broke."""

    def __init__(self, message: str, constraint: str | None = None) -> None:
        super().__init__(message)
        self.constraint = constraint


class LeaseLost(StoreError):
    """A fenced write found that this replica no longer holds the lease; nothing was written."""


class InvalidLockName(StoreError, ValueError):
    """A lock name (or holder) that the lock table cannot store as given; it is never truncated."""


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


MESSAGE_TYPES: dict[str, Any] = {
    "id": BigInteger,
    "message_id": Text,
    "message_name": Text,
    "correlation_hint": Text,
    "payload": Document,
    "headers": Document,
    "created_at": UtcDateTime,
    "time_to_live": TimeToLive,
    "expires_at": UtcDateTime,
    "attempt": Integer,
    "next_attempt_at": UtcDateTime,
    "reschedule_count": Integer,
    "last_error": Text,
    "state": Text,
    "slot": Integer,
}

# An earlier message of the same hint that holds the hint back. The first condition repeats the predicate of
# correlation_message_blocking_idx so that the planner can use it; literals (not parameters) keep it provable.
_BLOCKED_BY_EARLIER = """
    EXISTS (
        SELECT 1 FROM correlation_message e
         WHERE e.correlation_hint = m.correlation_hint AND e.id < m.id
           AND (e.state <> 'ready' OR e.next_attempt_at IS NOT NULL)
           AND (e.expires_at IS NULL OR e.expires_at > :now)
           AND (e.state = 'paused'
                OR (e.state = 'ready' AND e.next_attempt_at > :now){dead_blocks})
    )"""


def _eligible_sql(mode: Mode, by_slot: bool) -> str:
    """Eligible messages after a keyset position in id order: fresh ones and delayed ones now due."""
    blocked = _BLOCKED_BY_EARLIER.format(dead_blocks=" OR e.state = 'dead'" if mode is Mode.FAIL_FIRST else "")
    slot = "AND m.slot = :slot" if by_slot else ""
    arm = f"""
        SELECT {", ".join("m." + column for column in MESSAGE_TYPES)}
          FROM correlation_message m
         WHERE m.state = 'ready' AND {{due}} {slot} AND m.id > :after
           AND (m.expires_at IS NULL OR m.expires_at > :now)
           AND NOT {blocked}
         ORDER BY m.id LIMIT :limit"""
    fresh = arm.format(due="m.next_attempt_at IS NULL")
    delayed = arm.format(due="m.next_attempt_at IS NOT NULL AND m.next_attempt_at <= :now")
    return (
        f"SELECT {', '.join(MESSAGE_TYPES)} FROM ("
        f"SELECT * FROM ({fresh}) AS fresh UNION ALL SELECT * FROM ({delayed}) AS delayed"
        ") AS page ORDER BY id LIMIT :limit"
    )


def _typed(sql: str, **types: Any) -> TextClause:
    """A text statement with typed parameters (so that datetimes bind correctly on every database)."""
    return text(sql).bindparams(*(bindparam(name, type_=type_) for name, type_ in types.items()))


def _message_select(sql: str, **types: Any) -> Any:
    return _typed(sql, **types).columns(**MESSAGE_TYPES)


_ELIGIBLE = {
    (mode, by_slot): _message_select(
        _eligible_sql(mode, by_slot), now=UtcDateTime(), after=BigInteger(), limit=Integer()
    )
    for mode in Mode
    for by_slot in (True, False)
}

_CONSTRAINT = re.compile(r'constraint "?([a-z_]+)"?', re.IGNORECASE)
_SQLITE_CHECK = re.compile(r"CHECK constraint failed: ([a-z_]+)", re.IGNORECASE)


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return MappingProxyType({key: _freeze(item) for key, item in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(item) for item in value)
    return value


_MESSAGE_COLUMNS = tuple(MESSAGE_TYPES)
_STATES = {state.value: state for state in MessageState}


def _message_of(values: Sequence[Any]) -> Message:
    """A message from the values of the MESSAGE_TYPES columns, in that order."""
    (
        id_, message_id, name, hint, payload, headers, created_at, time_to_live, expires_at, attempt,
        next_attempt_at, reschedule_count, last_error, state, slot,
    ) = values
    return Message(
        id=id_,
        message_id=message_id,
        name=name,
        hint=hint,
        payload=_freeze(payload),
        headers=_freeze(headers or {}),
        created_at=created_at,
        time_to_live=time_to_live,
        expires_at=expires_at,
        attempt=attempt,
        next_attempt_at=next_attempt_at,
        reschedule_count=reschedule_count,
        last_error=last_error,
        state=_STATES.get(state) or MessageState(state),  # the dict spares an Enum call per row
        slot=slot,
    )


def _message(row: Any) -> Message:
    """A message from a row holding every MESSAGE_TYPES column (by name, in any order)."""
    mapping = row._mapping
    return _message_of([mapping[column] for column in _MESSAGE_COLUMNS])


def _messages(result: Result[Any]) -> list[Message]:
    """Every row of a result as a message.

    Rows are fetched at once and read by position when the columns are in MESSAGE_TYPES order (every
    message statement here): on a poll page, reading fifteen attributes by name costs more than the rest
    of building the message.
    """
    rows = result.all()
    if tuple(result.keys()) == _MESSAGE_COLUMNS:
        return [_message_of(row) for row in rows]
    return [_message(row) for row in rows]


_JSON_DECODER = json.JSONDecoder()


def _json_loads(data: bytes | str) -> Any:
    """``json.loads`` for the UTF-8 text PostgreSQL sends, minus its encoding sniffing (twice per message)."""
    return _JSON_DECODER.decode(data.decode("utf-8", "surrogatepass") if isinstance(data, bytes) else data)


def normalise_url(url: str) -> str:
    """Use psycopg 3 for PostgreSQL whatever driver the URL names (or none)."""
    parsed = make_url(url)
    if parsed.get_backend_name() in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def build_engine(settings: DatabaseSettings) -> Engine:
    """An engine for the configured database with sane pooling and timeouts."""
    url = normalise_url(settings.url)
    timeout = max(1, int(settings.connect_timeout.total_seconds()))
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30}, pool_pre_ping=False)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        return engine
    return create_engine(
        url,
        pool_size=settings.pool_size,
        max_overflow=settings.pool_size,
        pool_pre_ping=True,
        pool_recycle=1800,
        connect_args={"connect_timeout": timeout, "application_name": "correlation-worker"},
        json_deserializer=_json_loads,
    )


class Store(ScheduleStatements):
    """Every statement against ``correlation_message`` and ``correlation_lock`` (and, through
    :class:`~worker.db.schedules.ScheduleStatements`, the schedules)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name

    @classmethod
    def from_settings(cls, settings: DatabaseSettings) -> Store:
        """A store on a new engine for these settings."""
        return cls(build_engine(settings))

    def close(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()

    @property
    def slot_count(self) -> int:
        """How many slots hints are spread over (one on SQLite: one process at a time works on the file)."""
        return SLOT_COUNT if self.dialect == "postgresql" else 1

    # -- plumbing ---------------------------------------------------------------------------------------

    @contextmanager
    def _transaction(self) -> Iterator[Connection]:
        try:
            with self.engine.begin() as connection:
                yield connection
        except IntegrityError as error:
            raise _rejected(error) from None
        except (OperationalError, SAInterfaceError) as error:
            raise DatabaseUnavailable(_describe_unavailable(error)) from error
        except DBAPIError as error:
            if error.connection_invalidated:
                raise DatabaseUnavailable(_describe_unavailable(error)) from error
            raise

    def _run(self, work: Callable[[Connection], T]) -> T:
        with self._transaction() as connection:
            return work(connection)

    def _now(self, connection: Connection) -> datetime:
        if self.dialect == "postgresql":
            value = connection.execute(text("SELECT now()")).scalar_one()
        else:
            raw = connection.execute(text("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')")).scalar_one()
            value = datetime.fromisoformat(raw)
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value

    # -- schema -------------------------------------------------------------------------------------------

    def now(self) -> datetime:
        """The database clock."""
        return self._run(self._now)

    def ping(self) -> None:
        """Raise DatabaseUnavailable unless the database answers."""
        self._run(lambda c: c.execute(text("SELECT 1")))

    def schema_revision(self) -> str | None:
        """The schema revision of the database (None: never migrated)."""
        return self._run(current_revision)

    def schema_is_current(self) -> bool:
        """True when the database schema is at the newest revision this version ships."""
        return self.schema_revision() == head_revision()

    def schema_migrate(self) -> tuple[str | None, str]:
        """Apply every pending migration; returns (revision before, revision after)."""
        try:
            return migrate(self.engine)
        except (OperationalError, SAInterfaceError) as error:
            raise DatabaseUnavailable(_describe_unavailable(error)) from error

    # -- correlation ------------------------------------------------------------------------------------

    def messages_fetch_eligible(
        self, *, slot: int | None, after: int, limit: int, mode: Mode, now: datetime
    ) -> list[Message]:
        """Eligible messages of one slot with ``id > after``, in id order; O(page) by the slot indexes.

        ``slot=None`` looks at every slot at once; it is not index-bounded and serves tests and admin views.
        """
        params: dict[str, Any] = {"after": after, "limit": limit, "now": now}
        if slot is not None:
            params["slot"] = slot
        statement = _ELIGIBLE[(mode, slot is not None)]
        return self._run(lambda c: _messages(c.execute(statement, params)))

    def messages_record_results(
        self,
        dispositions: Sequence[Disposition],
        fences: Sequence[Fence] = (),
        still_in_flight: Sequence[int] = (),
    ) -> None:
        """Write the outcome of a page in one transaction: delete successes, update the rest.

        With ``fences``, first check (locking the lease rows) that this replica still holds every lease with
        the same fence and an unexpired term; if not, write nothing and raise :class:`LeaseLost`. The leases'
        in-flight marks are then set to ``still_in_flight`` (calls given up without a result), or cleared.
        """
        if not dispositions and not fences:
            return

        def work(connection: Connection) -> None:
            for fence in fences:
                self._fence_check(connection, fence)
                connection.execute(
                    _SET_IN_FLIGHT, {"name": fence.name, "in_flight": _id_list(still_in_flight)}
                )
            done = [d.message_id for d in dispositions if d.kind is Kind.DELETE]
            if done:
                delete = _DELETE_BY_ID_ARRAY if self.dialect == "postgresql" else _DELETE_BY_IDS
                connection.execute(delete, {"ids": done})
            updates = [
                {
                    "b_id": d.message_id,
                    "attempt": d.attempt,
                    "next_attempt_at": d.next_attempt_at,
                    "reschedule_count": d.reschedule_count,
                    "last_error": d.last_error,
                    "dead": d.kind is Kind.DEAD,
                }
                for d in dispositions
                if d.kind is not Kind.DELETE
            ]
            if updates:
                connection.execute(_RECORD_ATTEMPT, updates)

        self._run(work)

    def lock_mark_in_flight(self, fence: Fence, message_ids: Sequence[int]) -> bool:
        """Note the messages about to be handed to a correlator under this term; False if it ended."""
        statement = _MARK_IN_FLIGHT
        params = {
            "name": fence.name, "holder": fence.holder, "fence": fence.fence, "in_flight": _id_list(message_ids)
        }
        return bool(self._run(lambda c: c.execute(statement, params).rowcount))

    def locks_in_flight(self, names: Sequence[str]) -> dict[str, list[int]]:
        """The in-flight marks left on these lock rows (by a holder that did not record its results)."""
        if not names:
            return {}
        rows = self._run(lambda c: c.execute(_READ_IN_FLIGHT, {"names": list(names)}).all())
        return {row.name: [int(i) for i in json.loads(row.in_flight)] for row in rows if row.in_flight}

    def _fence_check(self, connection: Connection, fence: Fence) -> None:
        # Lock the lease row so that no one can take it over until this transaction commits; the term must
        # still run by the same database clock that granted it (see _lock_statements).
        row = connection.execute(_lock_statements(self.dialect).fence_check, {"name": fence.name}).first()
        if row is None or row.locked_by != fence.holder or row.fence != fence.fence or not row.held:
            raise LeaseLost(f"lease {fence.name} is no longer held by {fence.holder} (fence {fence.fence})")

    # -- producers and admin -----------------------------------------------------------------------------

    def messages_insert(self, message: NewMessage) -> int | None:
        """Insert one message; returns its id, or None when its ``message_id`` was already there."""
        values: dict[str, Any] = {
            "message_name": message.name,
            "correlation_hint": message.hint,
            "payload": message.payload if message.payload is not None else {},
            "headers": dict(message.headers or {}),
            "message_id": message.message_id,
            "time_to_live": message.time_to_live,
            "expires_at": message.expires_at,
        }
        if message.created_at is not None:
            values["created_at"] = message.created_at

        insert = postgresql_insert if self.dialect == "postgresql" else sqlite_insert
        # A resend of a known message_id is a no-op, also when two producers race (ON CONFLICT DO NOTHING).
        statement = (
            insert(message_table)
            .values(**values)
            .on_conflict_do_nothing(index_elements=["message_id"])
            .returning(message_table.c.id)
        )

        def work(connection: Connection) -> int | None:
            row_id = connection.execute(statement).scalar_one_or_none()
            return None if row_id is None else int(row_id)

        return self._run(work)

    def messages_get(self, message_id: int) -> Message | None:
        """One message by id."""
        statement = select(message_table).where(message_table.c.id == message_id)
        row = self._run(lambda c: c.execute(statement).first())
        return None if row is None else _message(row)

    def messages_list(self, selection: MessageFilter, *, after: int = 0, limit: int = 50) -> list[Message]:
        """Messages matching the filter, in id order, from a keyset position."""
        statement = (
            select(message_table)
            .where(*_conditions(selection), message_table.c.id > after)
            .order_by(message_table.c.id)
            .limit(limit)
        )
        return self._run(lambda c: _messages(c.execute(statement)))

    def messages_count_by_state(self) -> StateCounts:
        """Counts by state (waiting and expired apart) and the age of the oldest eligible message."""

        def work(connection: Connection) -> StateCounts:
            now = self._now(connection)
            row = connection.execute(_COUNT_BY_STATE, {"now": now}).one()
            heads = [
                connection.execute(
                    _ELIGIBLE[(Mode.FAIL_FIRST, True)], {"after": 0, "limit": 1, "now": now, "slot": slot}
                ).first()
                for slot in range(self.slot_count)
            ]
            created = [head.created_at for head in heads if head is not None]
            age = max(timedelta(0), now - min(created)) if created else None
            return StateCounts(
                ready=row.ready or 0,
                waiting=row.waiting or 0,
                paused=row.paused or 0,
                dead=row.dead or 0,
                expired=row.expired or 0,
                oldest_eligible_age=age,
            )

        return self._run(work)

    def messages_requeue(self, selection: MessageFilter) -> int:
        """Dead → ready with the attempt count reset, due now; returns how many.

        Due *now*, not "on arrival": a poll cycle already under way treats it as not yet due, so that it cannot
        be overtaken by later messages of its hint on the cycle's later pages.
        """

        def work(connection: Connection) -> int:
            statement = (
                sa_update(message_table)
                .where(*_conditions(selection), message_table.c.state == MessageState.DEAD.value)
                .values(state=MessageState.READY.value, attempt=0, next_attempt_at=self._now(connection))
            )
            return int(connection.execute(statement).rowcount)

        return self._run(work)

    def messages_pause(self, selection: MessageFilter) -> int:
        """Ready → paused (the messages hold back their hints); returns how many."""
        statement = (
            sa_update(message_table)
            .where(*_conditions(selection), message_table.c.state == MessageState.READY.value)
            .values(state=MessageState.PAUSED.value)
        )
        return self._run(lambda c: c.execute(statement).rowcount)

    def messages_resume(self, selection: MessageFilter) -> int:
        """Paused → ready, due no earlier than now (see :meth:`messages_requeue`); returns how many."""

        def work(connection: Connection) -> int:
            now = self._now(connection)
            due = message_table.c.next_attempt_at
            statement = (
                sa_update(message_table)
                .where(*_conditions(selection), message_table.c.state == MessageState.PAUSED.value)
                .values(
                    state=MessageState.READY.value,
                    next_attempt_at=case((due.is_(None), now), (due < now, now), else_=due),
                )
            )
            return int(connection.execute(statement).rowcount)

        return self._run(work)

    def messages_delete(self, selection: MessageFilter) -> int:
        """Delete the matching messages; returns how many."""
        statement = sa_delete(message_table).where(*_conditions(selection))
        return self._run(lambda c: c.execute(statement).rowcount)

    def messages_delete_expired(self, *, now: datetime, limit: int) -> int:
        """Delete at most ``limit`` expired messages; returns how many."""
        return self._run(lambda c: c.execute(_DELETE_EXPIRED, {"now": now, "limit": limit}).rowcount)

    # -- locks ----------------------------------------------------------------------------------------------

    def locks_list(self) -> list[LockRow]:
        """Every row of the lock table, by name."""
        statement = select(lock_table).order_by(lock_table.c.name)
        return self._run(
            lambda c: [
                LockRow(r.name, r.lock_until, r.locked_at, r.locked_by, r.fence) for r in c.execute(statement)
            ]
        )

    def locks_list_held(self) -> list[LockRow]:
        """The rows whose term is still running by the database clock, by name."""
        statement = _lock_statements(self.dialect).held
        return self._run(lambda c: [_lock_row(r) for r in c.execute(statement)])

    def lock_try_acquire(self, name: str, holder: str, lock_at_most_for: timedelta) -> Fence | None:
        """Take the named lock if it is free or expired (creating its row if missing); None if it is held.

        The term runs until ``now() + lock_at_most_for`` by the database clock, and the fence goes up by one.
        """
        _check_lock_name(name)
        params = {"name": name, "holder": _checked_holder(holder), "at_most": _seconds(lock_at_most_for)}
        statement = _lock_statements(self.dialect).acquire
        row = self._run(lambda c: c.execute(statement, params).first())
        return None if row is None else Fence(name, holder, int(row.fence))

    def lock_try_acquire_many(
        self, names: Sequence[str], holder: str, lock_at_most_for: timedelta, limit: int
    ) -> list[Fence]:
        """Take up to ``limit`` of the named locks that are free or expired, skipping rows others are taking.

        Missing rows are created free first. Returns the terms acquired, by name.
        """
        for name in names:
            _check_lock_name(name)
        params = {"holder": _checked_holder(holder), "at_most": _seconds(lock_at_most_for), "limit": limit}
        if not names or limit <= 0:
            return []
        statements = _lock_statements(self.dialect)
        wanted = sorted(set(names))  # one order for every replica: concurrent creators never deadlock

        # Its own transaction first, so that the rows exist for everyone before anyone locks them.
        self._run(lambda c: c.execute(statements.create, [{"name": name} for name in wanted]))
        rows = self._run(lambda c: c.execute(statements.acquire_many, {**params, "names": wanted}).all())
        return sorted((Fence(row.name, holder, int(row.fence)) for row in rows), key=lambda f: f.name)

    def lock_extend(self, fence: Fence, lock_at_most_for: timedelta) -> bool:
        """Renew a term to ``now() + lock_at_most_for``; False when it expired, was released or taken over."""
        return bool(self.lock_extend_many([fence], lock_at_most_for))

    def lock_extend_many(self, fences: Sequence[Fence], lock_at_most_for: timedelta) -> list[Fence]:
        """Renew several terms in one transaction; returns those still held (the others are lost)."""
        at_most = _seconds(lock_at_most_for)
        if not fences:
            return []
        statement = _lock_statements(self.dialect).extend

        def work(connection: Connection) -> list[Fence]:
            return [
                fence
                for fence in sorted(fences, key=lambda fence: fence.name)  # one lock order everywhere
                if connection.execute(statement, {**_term(fence), "at_most": at_most}).rowcount == 1
            ]

        return self._run(work)

    def lock_release(self, fence: Fence, lock_at_least_for: timedelta = timedelta(0)) -> bool:
        """End a term, though never before ``locked_at + lock_at_least_for``; False if it was not held."""
        params = {**_term(fence), "at_least": _seconds(lock_at_least_for, allow_zero=True)}
        statement = _lock_statements(self.dialect).release
        return bool(self._run(lambda c: c.execute(statement, params).rowcount == 1))

    def locks_delete_expired(self, prefix: str, expired_for: timedelta) -> int:
        """Delete rows named ``prefix…`` that expired more than ``expired_for`` ago; returns how many.

        Only for rows that never fence anything (such as replica membership): a deleted row starts again
        at fence 1.
        """
        if not prefix:
            raise ValueError("deleting expired locks needs a name prefix (such as 'member:')")
        ago = _seconds(expired_for, allow_zero=True)
        params = {"prefix": prefix, "prefix_length": len(prefix), "ago": ago}
        statement = _lock_statements(self.dialect).delete_expired
        return self._run(lambda c: c.execute(statement, params).rowcount)


def _conditions(selection: MessageFilter) -> list[ColumnElement[bool]]:
    conditions: list[ColumnElement[bool]] = []
    if selection.ids:
        conditions.append(message_table.c.id.in_(selection.ids))
    if selection.name is not None:
        conditions.append(message_table.c.message_name == selection.name)
    if selection.hint is not None:
        conditions.append(message_table.c.correlation_hint == selection.hint)
    if selection.state is not None:
        conditions.append(message_table.c.state == selection.state.value)
    return conditions


# Delete the messages correlated successfully.
_DELETE_BY_IDS = text("DELETE FROM correlation_message WHERE id IN :ids").bindparams(
    bindparam("ids", expanding=True)
)
# The same on PostgreSQL with one array parameter: a single statement text whatever the page holds, so the
# driver prepares it once instead of parsing an IN list of a new length on every page.
_DELETE_BY_ID_ARRAY = text(
    "DELETE FROM correlation_message WHERE id = ANY(CAST(:ids AS bigint[]))"
).bindparams(bindparam("ids", type_=ARRAY(BigInteger())))

# Record one correlator call: attempts, due time and error; dead when the policy says so. A message an
# operator paused meanwhile stays paused.
_RECORD_ATTEMPT = _typed(
    """
    UPDATE correlation_message
       SET attempt = :attempt, next_attempt_at = :next_attempt_at, reschedule_count = :reschedule_count,
           last_error = :last_error, state = CASE WHEN :dead THEN 'dead' ELSE state END
     WHERE id = :b_id
    """,
    next_attempt_at=UtcDateTime(),
    dead=Boolean(),
    b_id=BigInteger(),
)

# Messages by state; waiting and expired counted apart.
_COUNT_BY_STATE = _typed(
    """
    SELECT
      sum(CASE WHEN expires_at IS NOT NULL AND expires_at <= :now THEN 1 ELSE 0 END) AS expired,
      sum(CASE WHEN (expires_at IS NULL OR expires_at > :now) AND state = 'ready'
                    AND (next_attempt_at IS NULL OR next_attempt_at <= :now) THEN 1 ELSE 0 END) AS ready,
      sum(CASE WHEN (expires_at IS NULL OR expires_at > :now) AND state = 'ready'
                    AND next_attempt_at > :now THEN 1 ELSE 0 END) AS waiting,
      sum(CASE WHEN (expires_at IS NULL OR expires_at > :now) AND state = 'paused' THEN 1 ELSE 0 END) AS paused,
      sum(CASE WHEN (expires_at IS NULL OR expires_at > :now) AND state = 'dead' THEN 1 ELSE 0 END) AS dead
    FROM correlation_message
    """,
    now=UtcDateTime(),
)

# Remove one bounded chunk of expired messages (by the expiry index).
_DELETE_EXPIRED = _typed(
    """
    DELETE FROM correlation_message WHERE id IN (
        SELECT id FROM correlation_message WHERE expires_at IS NOT NULL AND expires_at <= :now LIMIT :limit
    )
    """,
    now=UtcDateTime(),
    limit=Integer(),
)


def _rejected(error: IntegrityError) -> MessageRejected:
    detail = str(error.orig).strip().splitlines()[0] if error.orig is not None else str(error)
    match = _SQLITE_CHECK.search(detail) or _CONSTRAINT.search(detail)
    constraint = match.group(1) if match else None
    if "UNIQUE" in detail.upper() or "duplicate key" in detail:
        constraint = constraint or "correlation_message_message_id_key"
    return MessageRejected(f"the database refused the message: {detail}", constraint)


def _describe_unavailable(error: DBAPIError) -> str:
    detail = str(error.orig).strip().splitlines()[0] if error.orig is not None else str(error)
    return f"database unavailable: {detail}"


# -- lock statements ------------------------------------------------------------------------------------
# A term is decided by the database clock inside the statement that grants, renews, checks or ends it, never
# by a replica's clock: replicas whose clocks disagree still agree on who holds what. PostgreSQL's now() is
# the start of the (short, one-statement) transaction; SQLite gets the same fixed-width UTC text that
# UtcDateTime stores, so that its text comparisons order times correctly.

HOLDER_MAX_LENGTH = 255  # correlation_lock.locked_by


@dataclass(frozen=True, slots=True)
class _LockStatements:
    """The lease statements of one dialect."""

    acquire: TextClause
    create: TextClause
    acquire_many: TextClause
    extend: TextClause
    release: TextClause
    fence_check: TextClause
    held: TextualSelect
    delete_expired: TextClause


def _build_lock_statements(dialect: str) -> _LockStatements:
    if dialect == "postgresql":
        now = "now()"

        def plus(time: str, seconds: str) -> str:
            return f"{time} + make_interval(secs => :{seconds})"

        def minus(time: str, seconds: str) -> str:
            return f"{time} - make_interval(secs => :{seconds})"

        greatest, now_arg = "greatest", "now()"
        skip_locked, for_update = "FOR UPDATE SKIP LOCKED", "FOR UPDATE"
    else:
        now = "strftime('%Y-%m-%d %H:%M:%f000', 'now')"

        def plus(time: str, seconds: str) -> str:
            return f"strftime('%Y-%m-%d %H:%M:%f000', {time}, printf('%+.6f seconds', :{seconds}))"

        def minus(time: str, seconds: str) -> str:
            return f"strftime('%Y-%m-%d %H:%M:%f000', {time}, printf('%+.6f seconds', -:{seconds}))"

        # SQLite runs one writer at a time, so a plain UPDATE already excludes concurrent takers.
        greatest, now_arg, skip_locked, for_update = "max", "'now'", "", ""
    until = plus(now_arg, "at_most")
    columns = {"lock_until": UtcDateTime, "locked_at": UtcDateTime}
    return _LockStatements(
        # Take one lock: create it held, or take it over when its term has ended; the fence counts terms.
        acquire=text(
            f"""
            INSERT INTO correlation_lock (name, lock_until, locked_at, locked_by, fence)
            VALUES (:name, {until}, {now}, :holder, 1)
            ON CONFLICT (name) DO UPDATE
               SET lock_until = excluded.lock_until, locked_at = excluded.locked_at,
                   locked_by = excluded.locked_by, fence = correlation_lock.fence + 1
             WHERE correlation_lock.lock_until <= {now}
            RETURNING fence
            """
        ),
        # Create missing lock rows free (ended now, never held: fence 0).
        create=text(
            f"""
            INSERT INTO correlation_lock (name, lock_until, locked_at, locked_by, fence)
            VALUES (:name, {now}, {now}, '', 0)
            ON CONFLICT (name) DO NOTHING
            """
        ),
        # Take up to :limit of the named locks whose term has ended, skipping rows another replica is taking.
        acquire_many=text(
            f"""
            WITH free AS {"MATERIALIZED" if skip_locked else ""} (
                SELECT name FROM correlation_lock
                 WHERE name IN :names AND lock_until <= {now}
                 ORDER BY name LIMIT :limit
                 {skip_locked}
            )
            UPDATE correlation_lock
               SET lock_until = {until}, locked_at = {now}, locked_by = :holder, fence = fence + 1
             WHERE name IN (SELECT name FROM free)
            RETURNING name, fence
            """
        ).bindparams(bindparam("names", expanding=True)),
        # Renew a running term of this holder and fence.
        extend=text(
            f"""
            UPDATE correlation_lock SET lock_until = {until}
             WHERE name = :name AND locked_by = :holder AND fence = :fence AND lock_until > {now}
            """
        ),
        # End a running term of this holder and fence, though not before locked_at + :at_least.
        release=text(
            f"""
            UPDATE correlation_lock SET lock_until = {greatest}({now}, {plus("locked_at", "at_least")})
             WHERE name = :name AND locked_by = :holder AND fence = :fence AND lock_until > {now}
            """
        ),
        # Lock a lease row for the rest of a transaction and tell whether its term still runs.
        fence_check=text(
            f"""
            SELECT locked_by, fence, lock_until > {now} AS held FROM correlation_lock
             WHERE name = :name {for_update}
            """
        ),
        # Rows whose term still runs.
        held=text(
            f"""
            SELECT name, lock_until, locked_at, locked_by, fence FROM correlation_lock
             WHERE lock_until > {now} ORDER BY name
            """
        ).columns(**columns),
        # Rows of a prefix whose term ended more than :ago seconds ago.
        delete_expired=text(
            f"""
            DELETE FROM correlation_lock
             WHERE substr(name, 1, :prefix_length) = :prefix AND lock_until < {minus(now_arg, "ago")}
            """
        ),
    )


_LOCK_STATEMENTS = {dialect: _build_lock_statements(dialect) for dialect in ("postgresql", "sqlite")}


def _lock_statements(dialect: str) -> _LockStatements:
    try:
        return _LOCK_STATEMENTS[dialect]
    except KeyError:
        raise StoreError(f"leases are not implemented for {dialect}; use PostgreSQL or SQLite") from None


def _lock_row(row: Any) -> LockRow:
    return LockRow(row.name, row.lock_until, row.locked_at, row.locked_by, int(row.fence))


def _check_lock_name(name: str) -> str:
    if not name:
        raise InvalidLockName("a lock name must not be empty")
    if len(name) > LOCK_NAME_MAX_LENGTH:
        raise InvalidLockName(
            f"lock name {name[:20]!r}… is {len(name)} characters long; the lock table stores at most "
            f"{LOCK_NAME_MAX_LENGTH}: use a shorter name"
        )
    return name


def _checked_holder(holder: str) -> str:
    if not holder or len(holder) > HOLDER_MAX_LENGTH:
        raise InvalidLockName(
            f"a lock holder must be 1 to {HOLDER_MAX_LENGTH} characters long, not {len(holder)}: "
            "use a shorter replica name"
        )
    return holder


def _seconds(duration: timedelta, *, allow_zero: bool = False) -> float:
    seconds = duration.total_seconds()
    if seconds < 0 or (seconds == 0 and not allow_zero):
        expected = "zero or more" if allow_zero else "positive"
        raise ValueError(f"a lock duration must be {expected}, not {duration}")
    return seconds


def _term(fence: Fence) -> dict[str, Any]:
    return {"name": fence.name, "holder": fence.holder, "fence": fence.fence}


def _id_list(ids: Sequence[int]) -> str | None:
    return json.dumps(list(ids)) if ids else None


# Mark the messages of a page as handed out under a term still held by this holder (before calling them).
_MARK_IN_FLIGHT = text(
    "UPDATE correlation_lock SET in_flight = :in_flight "
    "WHERE name = :name AND locked_by = :holder AND fence = :fence"
)

# Set a lease's in-flight mark inside the results transaction (its row is already locked by the fence check).
_SET_IN_FLIGHT = text("UPDATE correlation_lock SET in_flight = :in_flight WHERE name = :name")

# The in-flight marks of some lock rows.
_READ_IN_FLIGHT = text(
    "SELECT name, in_flight FROM correlation_lock WHERE name IN :names AND in_flight IS NOT NULL"
).bindparams(bindparam("names", expanding=True))
