"""Statements on ``correlation_message`` (and the durable pauses that hold its rows back).

For the engine a slot is read in two steps, each bounded by what it returns rather than by what the table
holds (DESIGN.md §2.1 "a poll must cost O(page)"):

1. :meth:`MessageStatements.messages_candidates` finds the slot's hints that may have work: hints with fresh
   messages by a loose index scan (one index probe per hint, however many messages it has queued, starting
   after a round-robin cursor), and hints with a delayed message now due.
2. :meth:`MessageStatements.messages_fetch_batches` reads each chosen hint's batch: its ready, due messages in
   id order up to the first one that holds the hint back (a waiting retry, a paused message, a dead one in
   ``fail_first`` mode: one index probe each) and up to the commit-order horizon.

Rows come back as :class:`~worker.message.Message` values; a row the worker cannot read (a payload it cannot
decode, say) comes back as an :class:`Unreadable` so that the engine dead-letters it and goes on.

:meth:`MessageStatements.messages_record` writes the outcomes of calls, fenced by the slots' leases, together
with the leases' in-flight marks. It never waits on a message row another session holds: such a row's outcome
is *deferred* (written at a later flush) while the others are written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import partial
from types import MappingProxyType
from typing import Any

from sqlalchemy import ARRAY, BigInteger, Boolean, Integer, Text, bindparam, select, text
from sqlalchemy import delete as sa_delete
from sqlalchemy import update as sa_update
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Row
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import ColumnElement, TextClause

from worker.config import Mode
from worker.db.base import Fence, MessageFilter, NewMessage, StateCounts, StoreBase, UnreadableJson, json_loads
from worker.db.errors import DatabaseBusy, DatabaseUnavailable, LeaseLost, StoreError, translate
from worker.db.schema import NOTIFY_CHANNEL, UtcDateTime, message_table, pause_table
from worker.message import HEADERS_MAX_BYTES, PAYLOAD_MAX_BYTES, Message, MessageState
from worker.policy.outcomes import Disposition, Kind, LostCallOutcome, storable_text

# -- values ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Candidates:
    """A slot's hints that may have work now."""

    fresh: tuple[str, ...]  # hints with fresh messages, in hint order after the cursor
    due: tuple[str, ...]  # hints with a delayed message that is due now
    next_due: datetime | None  # the earliest due time still to come in the slot
    now: datetime  # the database clock when they were read


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A row the worker cannot turn into a message, and why."""

    id: int
    hint: str
    slot: int
    reason: str


@dataclass(frozen=True, slots=True)
class Fetched:
    """Batches read for some hints: messages in id order per hint, and rows that could not be read."""

    messages: tuple[Message, ...]
    unreadable: tuple[Unreadable, ...]
    now: datetime


@dataclass(frozen=True, slots=True)
class HorizonReading:
    """The id sequence's last value and the producer transactions still registered (see policy.horizon)."""

    last_id: int
    pins: tuple[tuple[int, str], ...]  # (every id of it is above this, the transaction holding it)


@dataclass(frozen=True, slots=True)
class SlotWrite:
    """What one flush writes for one slot: outcomes, and the lease's in-flight marks after it."""

    slot: int
    fence: Fence | None  # None: no lease (a single unfenced engine)
    dispositions: tuple[Disposition, ...] = ()
    marks: str | None = None  # the JSON of in_flight after this flush
    version: int = 0  # the marks' version: a write replaces only an older one


class _FenceLost(Exception):
    """A flush found these slots' leases gone after writing their outcomes; its transaction is rolled back."""

    def __init__(self, slots: frozenset[int]) -> None:
        super().__init__(f"the leases of slots {sorted(slots)} are gone")
        self.slots = slots


@dataclass(frozen=True, slots=True)
class FlushOutcome:
    """What a flush wrote."""

    lost: frozenset[int] = frozenset()  # slots whose lease is gone: nothing of theirs was written
    remaining: dict[int, float] = field(default_factory=dict)  # seconds left of each held lease's term
    written: frozenset[int] = frozenset()  # message ids whose outcome is recorded
    gone: frozenset[int] = frozenset()  # ids no longer in the table (deleted meanwhile): nothing to record
    deferred: frozenset[int] = frozenset()  # ids locked by another session: to be written later
    failed: dict[int, str] = field(default_factory=dict)  # ids whose outcome the database refused, and why


@dataclass(frozen=True, slots=True)
class LostCall:
    """A call found in a lease's in-flight marks when the slot was taken over."""

    id: int
    name: str
    lost_calls: int
    crashed_calls: int
    last_error: str | None
    crashed: bool  # under way when its replica died: the first unrecorded call of its run, not given up at shutdown
    alone: bool  # no other call ran in its replica meanwhile: a crash then is attributable to it


@dataclass(frozen=True, slots=True)
class Adoption:
    """What taking over a slot's in-flight marks did."""

    lost: tuple[int, ...] = ()  # calls counted as lost (their messages are delivered again, each call alone)
    crashed: tuple[int, ...] = ()  # of them, calls that ran alone: their replica's death is attributed to them
    poisoned: tuple[tuple[int, str], ...] = ()  # (id, name) made dead as poison messages
    kept: int = 0  # marks left for later: their rows were locked by another session


@dataclass(frozen=True, slots=True)
class Pause:
    """A durable pause: a message name, a hint, or everything (``scope`` all), held back until lifted."""

    id: int
    scope: str
    target: str
    reason: str
    created_by: str
    created_at: datetime


# -- in-flight marks ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InFlight:
    """A lease's in-flight marks: runs of calls marked together, calls abandoned at shutdown, and which of the
    calls run alone in their replica (no other call beside them: a crash during one is attributable to it)."""

    runs: tuple[tuple[int, ...], ...] = ()
    abandoned: tuple[int, ...] = ()
    alone: tuple[int, ...] = ()

    def to_json(self) -> str | None:
        """The ``in_flight`` column's text (None when nothing is in flight)."""
        runs = [list(run) for run in self.runs if run]
        if not runs and not self.abandoned:
            return None
        value: dict[str, list[Any]] = {"runs": runs, "abandoned": list(self.abandoned)}
        marked = {i for run in runs for i in run}
        alone = [i for i in self.alone if i in marked]
        if alone:
            value["alone"] = alone
        return json.dumps(value, separators=(",", ":"))

    @classmethod
    def from_json(cls, data: str | None) -> InFlight:
        """Parse the column; the first revision's plain id array reads as one run (not attributable)."""
        if not data:
            return cls()
        value = json.loads(data)
        if isinstance(value, list):
            return cls(runs=(tuple(int(i) for i in value),))
        runs = tuple(tuple(int(i) for i in run) for run in value.get("runs", ()))
        return cls(
            runs=runs,
            abandoned=tuple(int(i) for i in value.get("abandoned", ())),
            alone=tuple(int(i) for i in value.get("alone", ())),
        )


# -- reading rows ---------------------------------------------------------------------------------------------

_STATES = {state.value: state for state in MessageState}


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return MappingProxyType({key: _freeze(item) for key, item in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(item) for item in value)
    return value


def _sqlite_time(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    parsed = datetime.fromisoformat(str(value).replace("T", " ").removesuffix("Z"))
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed


# The engine's columns, payload and headers as JSON text (decoded here, row by row, so that one row the
# driver could not decode never fails a whole page).
_ENGINE_COLUMNS = (
    "m.id, m.message_id, m.message_name, m.correlation_hint, CAST(m.payload AS TEXT) AS payload, "
    "CAST(m.headers AS TEXT) AS headers, m.created_at, m.time_to_live, m.expires_at, m.attempt, "
    "m.next_attempt_at, m.reschedule_count, m.last_error, m.state, m.slot, m.lost_calls, m.crashed_calls"
)


def decode_row(values: Sequence[Any], sqlite: bool) -> Message | Unreadable:
    """A message from the engine's columns, or an :class:`Unreadable` saying why it cannot be one."""
    (
        id_, message_id, name, hint, payload_text, headers_text, created_at, time_to_live, expires_at, attempt,
        next_attempt_at, reschedule_count, last_error, state, slot, lost_calls, crashed_calls,
    ) = values
    try:
        if len(payload_text) > PAYLOAD_MAX_BYTES or len(headers_text) > HEADERS_MAX_BYTES:
            raise ValueError(
                f"payload or headers larger than {PAYLOAD_MAX_BYTES} / {HEADERS_MAX_BYTES} bytes"
            )
        payload = json_loads(payload_text)
        headers = json_loads(headers_text) if headers_text != "{}" else {}
        if isinstance(payload, UnreadableJson) or isinstance(headers, UnreadableJson):
            raise ValueError("the JSON is nested too deeply to decode")
        if not isinstance(headers, dict):
            raise ValueError("headers are not a JSON object")
        if sqlite:
            created_at = _sqlite_time(created_at)
            expires_at = _sqlite_time(expires_at)
            next_attempt_at = _sqlite_time(next_attempt_at)
            time_to_live = None if time_to_live is None else timedelta(seconds=float(time_to_live))
        return Message(  # positionally: a keyword call costs more than the rest of building the message
            id_, message_id, name, hint, _freeze(payload), _freeze(headers), created_at, time_to_live, expires_at,
            attempt, next_attempt_at, reschedule_count, last_error, _STATES.get(state) or MessageState(state),
            slot, lost_calls, crashed_calls,
        )
    except (ValueError, TypeError, OverflowError, RecursionError) as error:
        reason = f"the worker cannot read this message: {type(error).__name__}: {str(error)[:300]}"
        return Unreadable(int(id_), str(hint), int(slot), storable_text(reason))


def message_of_row(row: Row[Any]) -> Message:
    """A message from a row of ``select(message_table)`` (admin reads)."""
    mapping = row._mapping
    return Message(
        id=mapping["id"],
        message_id=mapping["message_id"],
        name=mapping["message_name"],
        hint=mapping["correlation_hint"],
        payload=_freeze(mapping["payload"]),
        headers=_freeze(mapping["headers"] or {}),
        created_at=mapping["created_at"],
        time_to_live=mapping["time_to_live"],
        expires_at=mapping["expires_at"],
        attempt=mapping["attempt"],
        next_attempt_at=mapping["next_attempt_at"],
        reschedule_count=mapping["reschedule_count"],
        last_error=mapping["last_error"],
        state=_STATES.get(mapping["state"]) or MessageState(mapping["state"]),
        slot=mapping["slot"],
        lost_calls=mapping["lost_calls"],
        crashed_calls=mapping["crashed_calls"],
    )


# -- the engine's statements ------------------------------------------------------------------------------------


def _now_sql(dialect: str) -> str:
    return "now()" if dialect == "postgresql" else "strftime('%Y-%m-%d %H:%M:%f000', 'now')"


def _candidates_sql(dialect: str, wrap: bool) -> TextClause:
    """A slot's hints with fresh messages after :after (before it, with ``wrap``), hints with due messages,
    the next due time and the clock."""
    now = _now_sql(dialect)
    no_time = "CAST(NULL AS timestamptz)" if dialect == "postgresql" else "NULL"
    fresh = "m.slot = :slot AND m.state = 'ready' AND m.next_attempt_at IS NULL"
    bound = "AND m.correlation_hint <= :after" if wrap else ""
    start = "''" if wrap else ":after"
    return text(
        f"""
        WITH RECURSIVE fresh(hint) AS (
            SELECT (SELECT m.correlation_hint FROM correlation_message m
                     WHERE {fresh} AND m.correlation_hint > {start} {bound}
                     ORDER BY m.correlation_hint LIMIT 1)
            UNION ALL
            SELECT (SELECT m.correlation_hint FROM correlation_message m
                     WHERE {fresh} AND m.correlation_hint > fresh.hint {bound}
                     ORDER BY m.correlation_hint LIMIT 1)
              FROM fresh WHERE fresh.hint IS NOT NULL
        )
        SELECT 'f' AS kind, hint, {no_time} AS due FROM (
            SELECT hint FROM fresh WHERE hint IS NOT NULL LIMIT :budget) AS f
        UNION ALL
        SELECT 'd', hint, {no_time} FROM (
            SELECT m.correlation_hint AS hint FROM correlation_message m
             WHERE m.slot = :slot AND m.state = 'ready' AND m.next_attempt_at IS NOT NULL
               AND m.next_attempt_at <= {now}
             ORDER BY m.next_attempt_at LIMIT :budget) AS d
        UNION ALL
        SELECT 'n', NULL, (SELECT min(m.next_attempt_at) FROM correlation_message m
                            WHERE m.slot = :slot AND m.state = 'ready' AND m.next_attempt_at > {now})
        UNION ALL
        SELECT 't', NULL, {now}
        """
    ).bindparams(bindparam("slot", type_=Integer()), bindparam("budget", type_=Integer()))


def _batch_sql(dialect: str, mode: Mode, hint_expression: str) -> str:
    """One hint's batch: ready, due, unexpired messages in id order below the first that holds it back."""
    now = _now_sql(dialect)
    unexpired = f"(b.expires_at IS NULL OR b.expires_at > {now})"
    least = "LEAST" if dialect == "postgresql" else "min"
    blockers = [
        f"""COALESCE((SELECT b.id FROM correlation_message b
                       WHERE b.correlation_hint = {hint_expression} AND b.state = 'paused' AND {unexpired}
                       ORDER BY b.id LIMIT 1), :horizon + 1)""",
        f"""COALESCE((SELECT b.id FROM correlation_message b
                       WHERE b.correlation_hint = {hint_expression} AND b.state = 'ready'
                         AND b.next_attempt_at IS NOT NULL AND b.next_attempt_at > {now} AND {unexpired}
                       ORDER BY b.id LIMIT 1), :horizon + 1)""",
    ]
    if mode is Mode.FAIL_FIRST:
        blockers.append(
            f"""COALESCE((SELECT b.id FROM correlation_message b
                           WHERE b.correlation_hint = {hint_expression} AND b.state = 'dead' AND {unexpired}
                           ORDER BY b.id LIMIT 1), :horizon + 1)"""
        )
    return f"""
        SELECT {_ENGINE_COLUMNS} FROM correlation_message m
         WHERE m.correlation_hint = {hint_expression} AND m.state = 'ready' AND m.id <= :horizon
           AND (m.next_attempt_at IS NULL OR m.next_attempt_at <= {now})
           AND (m.expires_at IS NULL OR m.expires_at > {now})
           AND m.id < {least}({", ".join(blockers)})
         ORDER BY m.id LIMIT :per_hint"""


def _batches_statement(dialect: str, mode: Mode) -> TextClause:
    if dialect == "postgresql":
        inner = _batch_sql(dialect, mode, "c.hint").replace(_ENGINE_COLUMNS, "m.*", 1)
        sql = f"""
            SELECT {_ENGINE_COLUMNS.replace("m.", "x.")}
              FROM unnest(CAST(:hints AS text[])) AS c(hint)
             CROSS JOIN LATERAL ({inner}) AS x
             ORDER BY x.id LIMIT :limit"""
        return text(sql).bindparams(
            bindparam("hints", type_=ARRAY(Text())),
            bindparam("horizon", type_=BigInteger()),
            bindparam("per_hint", type_=Integer()),
            bindparam("limit", type_=Integer()),
        )
    return text(_batch_sql(dialect, mode, ":hint")).bindparams(
        bindparam("horizon", type_=BigInteger()), bindparam("per_hint", type_=Integer())
    )


_STATEMENTS: dict[tuple[str, str, object], TextClause] = {}
_DRIVER_SQL: dict[int, str] = {}


def _driver_sql(statement: TextClause) -> str:
    """A text statement's SQL with psycopg's ``%(name)s`` placeholders instead of ``:name``."""
    sql = _DRIVER_SQL.get(id(statement))
    if sql is None:
        sql = re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", statement.text.replace("%", "%%"))
        _DRIVER_SQL[id(statement)] = sql
    return sql


def _statement(dialect: str, name: str, variant: object, build: Callable[[], TextClause]) -> TextClause:
    key = (dialect, name, variant)
    statement = _STATEMENTS.get(key)
    if statement is None:
        statement = _STATEMENTS[key] = build()
    return statement


# The commit-order horizon's reading (PostgreSQL): see schema/ddl/0003 and worker.policy.horizon.
_HORIZON = text("SELECT last_id, pin_ids, pin_holders FROM correlation_order_horizon()")

# Lock the rows of outcomes about to be written, skipping rows another session holds (never waiting), then
# delete the successes and record the rest. A message an operator paused meanwhile stays paused.
_RECORD_PG = text(
    """
    WITH locked AS (
        SELECT id FROM correlation_message WHERE id = ANY(CAST(:ids AS bigint[])) FOR UPDATE SKIP LOCKED
    ), deleted AS (
        DELETE FROM correlation_message
         WHERE id IN (SELECT id FROM locked) AND id = ANY(CAST(:done AS bigint[]))
        RETURNING id
    ), updated AS (
        UPDATE correlation_message AS m
           SET attempt = v.attempt, next_attempt_at = v.next_attempt_at, reschedule_count = v.reschedule_count,
               last_error = v.last_error, state = CASE WHEN v.dead THEN 'dead' ELSE m.state END,
               lost_calls = 0, crashed_calls = 0
          FROM unnest(CAST(:u_ids AS bigint[]), CAST(:u_attempts AS integer[]),
                      CAST(:u_next AS timestamptz[]), CAST(:u_reschedules AS integer[]),
                      CAST(:u_errors AS text[]), CAST(:u_dead AS boolean[]))
               AS v(id, attempt, next_attempt_at, reschedule_count, last_error, dead)
         WHERE m.id = v.id AND m.id IN (SELECT id FROM locked)
        RETURNING m.id
    )
    SELECT id FROM deleted UNION ALL SELECT id FROM updated
    """
)

# The same, one row at a time (SQLite holds the whole file; a savepoint per row isolates a refused value).
_DELETE_ONE = text("DELETE FROM correlation_message WHERE id = :id")
_RECORD_ONE = text(
    """
    UPDATE correlation_message
       SET attempt = :attempt, next_attempt_at = :next_attempt_at, reschedule_count = :reschedule_count,
           last_error = :last_error, state = CASE WHEN :dead THEN 'dead' ELSE state END,
           lost_calls = 0, crashed_calls = 0
     WHERE id = :id
    """
).bindparams(bindparam("next_attempt_at", type_=UtcDateTime()), bindparam("dead", type_=Boolean()))

_EXISTING = text("SELECT id FROM correlation_message WHERE id IN :ids").bindparams(
    bindparam("ids", expanding=True)
)

# A lease's fence, locked for the rest of the transaction, with the seconds left of its term; and its marks.
# A lease's fence, locked for the rest of the transaction, with the seconds left of its term; and its marks.
# Marks are written by the committer and by lanes at once: each write carries a version ("v") and replaces
# only an older one, so a write that arrives late never undoes a newer one (which includes what it had).
_FENCE_AND_MARKS = {
    "postgresql": text(
        """
        UPDATE correlation_lock
           SET in_flight = CASE WHEN in_flight_version < CAST(:version AS bigint) THEN :marks ELSE in_flight END,
               in_flight_version = greatest(in_flight_version, CAST(:version AS bigint))
         WHERE name = :name AND locked_by = :holder AND fence = :fence AND lock_until > now()
        RETURNING EXTRACT(EPOCH FROM lock_until - now()) AS remaining
        """
    ),
    "sqlite": text(
        """
        UPDATE correlation_lock
           SET in_flight = CASE WHEN in_flight_version < :version THEN :marks ELSE in_flight END,
               in_flight_version = max(in_flight_version, :version)
         WHERE name = :name AND locked_by = :holder AND fence = :fence
           AND lock_until > strftime('%Y-%m-%d %H:%M:%f000', 'now')
        RETURNING (julianday(lock_until) - julianday('now')) * 86400.0 AS remaining
        """
    ),
}

# Several leases at once (PostgreSQL), in name order: the fence check of a group commit in one statement.
_FENCE_AND_MARKS_MANY_SQL = """
    UPDATE correlation_lock AS l
       SET in_flight = CASE WHEN l.in_flight_version < v.version THEN v.marks ELSE l.in_flight END,
           in_flight_version = greatest(l.in_flight_version, v.version)
      FROM unnest(CAST(:names AS text[]), CAST(:holders AS text[]), CAST(:fences AS bigint[]),
                  CAST(:marks AS text[]), CAST(:versions AS bigint[])) AS v(name, holder, fence, marks, version)
           {fast}
     WHERE l.name = v.name AND l.locked_by = v.holder AND l.fence = v.fence AND l.lock_until > now()
    RETURNING l.name, EXTRACT(EPOCH FROM l.lock_until - now()) AS remaining
"""
_FENCE_AND_MARKS_MANY = text(_FENCE_AND_MARKS_MANY_SQL.format(fast=""))
# Marks alone: one statement, its own transaction, committed without waiting for the disk.
_MARKS_ONLY = text(
    "WITH fast AS (SELECT set_config('synchronous_commit', 'off', true))"
    + _FENCE_AND_MARKS_MANY_SQL.format(fast=", fast")
)

_READ_MARKS = {
    "postgresql": text(
        "SELECT in_flight FROM correlation_lock "
        "WHERE name = :name AND locked_by = :holder AND fence = :fence AND lock_until > now() FOR UPDATE"
    ),
    "sqlite": text(
        "SELECT in_flight FROM correlation_lock WHERE name = :name AND locked_by = :holder AND fence = :fence "
        "AND lock_until > strftime('%Y-%m-%d %H:%M:%f000', 'now')"
    ),
}
# A new term's marks start from version 0.
_WRITE_MARKS = text("UPDATE correlation_lock SET in_flight = :marks, in_flight_version = 0 WHERE name = :name")

_LOST_ROWS = {
    "postgresql": text(
        "SELECT id, message_name, lost_calls, crashed_calls, last_error FROM correlation_message "
        "WHERE id = ANY(CAST(:ids AS bigint[])) FOR UPDATE SKIP LOCKED"
    ),
    "sqlite": text(
        "SELECT id, message_name, lost_calls, crashed_calls, last_error FROM correlation_message WHERE id IN :ids"
    ).bindparams(bindparam("ids", expanding=True)),
}
_SETTLE_LOST = text(
    """
    UPDATE correlation_message
       SET lost_calls = :lost_calls, crashed_calls = :crashed_calls, last_error = :last_error,
           state = CASE WHEN :dead THEN 'dead' ELSE state END
     WHERE id = :id
    """
).bindparams(bindparam("dead", type_=Boolean()))

# Dead-letter a row the worker cannot read or record, with the reason; its other values are left alone
# except next_attempt_at (the one worker-owned time that could be out of range).
_DEAD_LETTER = text(
    "UPDATE correlation_message SET state = 'dead', next_attempt_at = NULL, last_error = :reason WHERE id = :id"
)

# Pause one message for a durable pause of its name (it then holds back the later messages of its hint).
_PARK = text(
    "UPDATE correlation_message SET state = 'paused', pause_id = :pause_id WHERE id = :id AND state = 'ready'"
)

# How many rows of each state, expired ones apart (the census of `status` and the gauges).
_CENSUS_COLUMNS = """
      sum(CASE WHEN expires_at IS NOT NULL AND expires_at <= :now THEN 1 ELSE 0 END) AS expired,
      sum(CASE WHEN (expires_at IS NULL OR expires_at > :now) AND state = 'ready'
                    AND (next_attempt_at IS NULL OR next_attempt_at <= :now) THEN 1 ELSE 0 END) AS ready,
      sum(CASE WHEN (expires_at IS NULL OR expires_at > :now) AND state = 'ready'
                    AND next_attempt_at > :now THEN 1 ELSE 0 END) AS waiting,
      sum(CASE WHEN (expires_at IS NULL OR expires_at > :now) AND state = 'paused' THEN 1 ELSE 0 END) AS paused,
      sum(CASE WHEN (expires_at IS NULL OR expires_at > :now) AND state = 'dead' THEN 1 ELSE 0 END) AS dead
"""
_COUNT_BY_STATE = text(f"SELECT {_CENSUS_COLUMNS} FROM correlation_message").bindparams(
    bindparam("now", type_=UtcDateTime())
)

# The same census per message name, for the backlog gauge (bounded to the largest names by the caller).
_COUNT_BY_NAME_AND_STATE = text(
    f"SELECT message_name, {_CENSUS_COLUMNS} FROM correlation_message GROUP BY message_name"
).bindparams(bindparam("now", type_=UtcDateTime()))

_DELETE_EXPIRED = text(
    """
    DELETE FROM correlation_message WHERE id IN (
        SELECT id FROM correlation_message WHERE expires_at IS NOT NULL AND expires_at <= :now LIMIT :limit
    )
    """
).bindparams(bindparam("now", type_=UtcDateTime()), bindparam("limit", type_=Integer()))

_NOTIFY = text("SELECT pg_notify(:channel, :slots)")


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


class MessageStatements(StoreBase):
    """Every statement on the message table (and on the pauses that hold it back)."""

    # -- the engine -----------------------------------------------------------------------------------------

    def messages_candidates(self, slot: int, after: str, budget: int) -> Candidates:
        """A slot's hints that may have work: up to ``budget`` with fresh messages after ``after`` (wrapping
        round to the start), up to ``budget`` with due delayed messages, and the slot's next due time."""
        return self._run(lambda c: self._candidates(c, slot, after, budget))

    def order_horizon(self) -> HorizonReading | None:
        """The sequence's last id and the registered producer transactions; None where order needs no
        horizon (SQLite: one writer at a time, so ids commit in order)."""
        if self.dialect != "postgresql":
            return None
        return self._run(self._horizon)

    def messages_fetch_batches(
        self, hints: Sequence[str], *, horizon: int, per_hint: int, limit: int, mode: Mode
    ) -> Fetched:
        """Each hint's batch (at most ``per_hint`` messages, ``limit`` in all), in id order per hint."""
        return self._run(lambda c: self._batches(c, hints, horizon, per_hint, limit, mode, self._now(c)))

    def messages_fetch_slot(
        self,
        slot: int,
        after: str,
        budget: int,
        *,
        choose: Callable[[Candidates], Sequence[str]],
        horizon: Callable[[Callable[[], HorizonReading | None]], int],
        per_hint: int,
        limit: int,
        mode: Mode,
    ) -> tuple[Candidates, Fetched]:
        """A slot's fetch: its candidate hints, the hints ``choose`` takes of them, then the commit-order horizon
        (``horizon`` decides, reading it through the function it is given when it needs a fresh reading) and
        those hints' batches below it.

        The batches must be read from a snapshot taken after ``choose`` ran (which looks at what this replica
        is still busy with): on PostgreSQL every statement of a READ COMMITTED transaction takes a new one, so
        one transaction serves; SQLite keeps one snapshot per transaction, so the batches get a second one.
        """

        def batches(connection: Connection, candidates: Candidates, hints: Sequence[str]) -> Fetched:
            if not hints:
                return Fetched((), (), candidates.now)
            limit_id = horizon(lambda: self._horizon(connection) if self.dialect == "postgresql" else None)
            return self._batches(connection, hints, limit_id, per_hint, limit, mode, candidates.now)

        if self.dialect == "sqlite":
            candidates = self._run(lambda c: self._candidates(c, slot, after, budget))
            hints = choose(candidates)
            return candidates, self._run(lambda c: batches(c, candidates, hints))

        def work(connection: Connection) -> tuple[Candidates, Fetched]:
            candidates = self._candidates(connection, slot, after, budget)
            return candidates, batches(connection, candidates, choose(candidates))

        return self._run(work)

    def _candidates(self, connection: Connection, slot: int, after: str, budget: int) -> Candidates:
        rows = connection.execute(
            _statement(self.dialect, "candidates", False, lambda: _candidates_sql(self.dialect, False)),
            {"slot": slot, "after": after, "budget": budget},
        ).all()
        fresh = [row.hint for row in rows if row.kind == "f"]
        if len(fresh) < budget and after:
            more = connection.execute(
                _statement(self.dialect, "candidates", True, lambda: _candidates_sql(self.dialect, True)),
                {"slot": slot, "after": after, "budget": budget - len(fresh)},
            ).all()
            fresh += [row.hint for row in more if row.kind == "f" and row.hint not in fresh]
        due = tuple(dict.fromkeys(row.hint for row in rows if row.kind == "d"))
        times = {row.kind: _sqlite_time(row.due) for row in rows if row.kind in ("n", "t")}
        now = times["t"]
        assert now is not None
        return Candidates(tuple(fresh), due, times.get("n"), now)

    def _horizon(self, connection: Connection) -> HorizonReading:
        row = connection.execute(_HORIZON).one()
        pins = tuple(zip(row.pin_ids or (), row.pin_holders or (), strict=True))
        return HorizonReading(int(row.last_id), tuple((int(after), str(holder)) for after, holder in pins))

    def _batches(
        self,
        connection: Connection,
        hints: Sequence[str],
        horizon: int,
        per_hint: int,
        limit: int,
        mode: Mode,
        now: datetime,
    ) -> Fetched:
        if not hints:
            return Fetched((), (), now)
        statement = _statement(self.dialect, "batches", mode, lambda: _batches_statement(self.dialect, mode))
        sqlite = self.dialect == "sqlite"
        if not sqlite:
            # The driver's own cursor, binary: this statement reads every message the engine handles, and rows
            # built by the driver alone cost a fraction of the general result machinery.
            params = {"hints": list(hints), "horizon": horizon, "per_hint": per_hint, "limit": limit}
            driver = connection.connection.driver_connection
            with driver.cursor(binary=True) as cursor:  # type: ignore[union-attr]
                cursor.execute(_driver_sql(statement), params)
                rows: list[Any] = cursor.fetchall()
        else:
            rows = []
            for hint in hints:
                take = min(per_hint, limit - len(rows))
                if take <= 0:
                    break
                rows += connection.execute(statement, {"hint": hint, "horizon": horizon, "per_hint": take}).all()
        messages: list[Message] = []
        unreadable: list[Unreadable] = []
        for row in rows:
            decoded = decode_row(row, sqlite)
            if isinstance(decoded, Message):
                messages.append(decoded)
            else:
                unreadable.append(decoded)
        return Fetched(tuple(messages), tuple(unreadable), now)

    def messages_record(self, writes: Sequence[SlotWrite]) -> FlushOutcome:
        """Write outcomes and in-flight marks, fenced per slot, in one transaction.

        A slot whose lease is gone has nothing written (listed in ``lost``). A row another session holds
        locked is skipped (``deferred``), never waited on. If the database refuses a value, every outcome
        is written again one at a time, and those refused are reported in ``failed`` (nothing else is lost).
        """
        if not writes:
            return FlushOutcome()
        one_by_one = False
        lost: frozenset[int] = frozenset()
        while True:
            held = [w for w in writes if w.slot not in lost]
            try:
                result = self._write(partial(self._record, writes=held, one_by_one=one_by_one))
            except _FenceLost as error:  # rolled back: written again without the slots whose lease is gone
                lost |= error.slots
                continue
            except (StoreError, DBAPIError) as error:
                if one_by_one or isinstance(error, DatabaseBusy | DatabaseUnavailable | LeaseLost):
                    raise
                one_by_one = True
                continue
            return replace(result, lost=result.lost | lost) if lost else result

    def _record(self, connection: Connection, writes: Sequence[SlotWrite], *, one_by_one: bool) -> FlushOutcome:
        # The outcomes first, the lease rows last: the marks lanes wait for update the same rows, so the
        # transaction holds them only for its last statement and its commit. A lease found gone then rolls
        # the whole transaction back (``_FenceLost``), and it is written again without that slot.
        held = [d for write in writes for d in write.dispositions]
        ids = [d.message_id for d in held]
        failed: dict[int, str] = {}
        written: set[int] = set()
        if held:
            if one_by_one or self.dialect != "postgresql":
                written = self._record_each(connection, held, failed, isolate=one_by_one)
            else:
                written = self._record_together(connection, held)
        remaining: dict[int, float] = {}
        lost: frozenset[int] = frozenset()
        fenced = sorted((w for w in writes if w.fence is not None), key=lambda w: w.slot)  # one lock order
        if fenced:
            remaining = self._fence_and_mark(connection, fenced)
            lost = frozenset(w.slot for w in fenced if w.slot not in remaining)
            if any(w.dispositions for w in fenced if w.slot in lost):
                raise _FenceLost(lost)
        missing = [i for i in ids if i not in written and i not in failed]
        present = set(connection.execute(_EXISTING, {"ids": missing}).scalars().all()) if missing else set()
        return FlushOutcome(
            lost,
            remaining,
            frozenset(written),
            frozenset(i for i in missing if i not in present),
            frozenset(present),
            failed,
        )

    def leases_mark(self, writes: Sequence[SlotWrite]) -> FlushOutcome:
        """Write in-flight marks alone (no outcomes), fenced: on PostgreSQL one statement in a transaction of
        its own, committed without waiting for the disk (a mark lost in a database crash costs the count of one
        redelivery at most; later commits are durable in order)."""
        fenced = sorted((w for w in writes if w.fence is not None), key=lambda w: w.slot)
        if not fenced:
            return FlushOutcome()
        if self.dialect != "postgresql":
            return self.messages_record(fenced)
        slot_of = {w.fence.name: w.slot for w in fenced if w.fence is not None}
        params = _marks_params(fenced)
        try:
            with self._autocommit.connect() as connection:
                rows = connection.execute(_MARKS_ONLY, params).all()
        except DBAPIError as error:
            raise (translate(error) or error) from error
        remaining = {slot_of[row.name]: float(row.remaining) for row in rows}
        return FlushOutcome(frozenset(w.slot for w in fenced if w.slot not in remaining), remaining)

    def _fence_and_mark(self, connection: Connection, writes: Sequence[SlotWrite]) -> dict[int, float]:
        """Lock the lease rows still held under these terms and set their marks; seconds left per slot."""
        slot_of = {w.fence.name: w.slot for w in writes if w.fence is not None}
        if self.dialect == "postgresql":
            rows = connection.execute(_FENCE_AND_MARKS_MANY, _marks_params(writes)).all()
            return {slot_of[row.name]: float(row.remaining) for row in rows}
        remaining: dict[int, float] = {}
        for write in writes:
            assert write.fence is not None
            params = {
                "name": write.fence.name, "holder": write.fence.holder, "fence": write.fence.fence,
                "marks": write.marks, "version": write.version,
            }
            row = connection.execute(_FENCE_AND_MARKS[self.dialect], params).first()
            if row is not None:
                remaining[write.slot] = float(row.remaining)
        return remaining

    def _record_together(self, connection: Connection, held: Sequence[Disposition]) -> set[int]:
        updates = [d for d in held if d.kind is not Kind.DELETE]
        params = {
            "ids": [d.message_id for d in held],
            "done": [d.message_id for d in held if d.kind is Kind.DELETE],
            "u_ids": [d.message_id for d in updates],
            "u_attempts": [d.attempt for d in updates],
            "u_next": [d.next_attempt_at for d in updates],
            "u_reschedules": [d.reschedule_count for d in updates],
            "u_errors": [d.last_error for d in updates],
            "u_dead": [d.kind is Kind.DEAD for d in updates],
        }
        return set(connection.execute(_RECORD_PG, params).scalars().all())

    def _record_each(
        self, connection: Connection, held: Sequence[Disposition], failed: dict[int, str], *, isolate: bool
    ) -> set[int]:
        written: set[int] = set()
        for disposition in held:
            try:
                if isolate:
                    with connection.begin_nested():
                        count = self._record_one(connection, disposition)
                else:
                    count = self._record_one(connection, disposition)
            except DBAPIError as error:
                if not isolate:
                    raise
                reason = storable_text(f"the worker could not record the outcome of this message: {error.orig}")
                try:
                    with connection.begin_nested():
                        params = {"id": disposition.message_id, "reason": reason}
                        count = int(connection.execute(_DEAD_LETTER, params).rowcount)
                except DBAPIError as again:
                    failed[disposition.message_id] = f"{error.orig}; dead-lettering it failed too: {again.orig}"
                    continue
                failed[disposition.message_id] = str(error.orig)
                if count:
                    written.add(disposition.message_id)
                continue
            if count:
                written.add(disposition.message_id)
        return written

    def _record_one(self, connection: Connection, disposition: Disposition) -> int:
        if disposition.kind is Kind.DELETE:
            return int(connection.execute(_DELETE_ONE, {"id": disposition.message_id}).rowcount)
        params = {
            "id": disposition.message_id,
            "attempt": disposition.attempt,
            "next_attempt_at": disposition.next_attempt_at,
            "reschedule_count": disposition.reschedule_count,
            "last_error": disposition.last_error,
            "dead": disposition.kind is Kind.DEAD,
        }
        return int(connection.execute(_RECORD_ONE, params).rowcount)

    def slot_adopt_lost_calls(
        self, fence: Fence, settle: Callable[[LostCall], LostCallOutcome]
    ) -> Adoption:
        """Count the calls a slot's previous holder left in flight, in one transaction under the new term.

        Each is a lost call, and unless abandoned at shutdown a crash; ``settle`` decides what that means (e.g.
        that a message whose call ran alone is poison). Rows another session holds are left in the marks for a
        later adoption.
        """

        def work(connection: Connection) -> Adoption:
            params = {"name": fence.name, "holder": fence.holder, "fence": fence.fence}
            row = connection.execute(_READ_MARKS[self.dialect], params).first()
            if row is None:
                raise LeaseLost(f"lease {fence.name} is no longer held by {fence.holder} (fence {fence.fence})")
            marks = InFlight.from_json(row.in_flight)
            alone_ids, abandoned_ids = set(marks.alone), set(marks.abandoned)
            ids = sorted({i for run in marks.runs for i in run} | abandoned_ids)
            if not ids:
                return Adoption()
            found = connection.execute(_LOST_ROWS[self.dialect], {"ids": ids}).all()
            present = set(connection.execute(_EXISTING, {"ids": ids}).scalars().all())
            # A run's calls are made in order and leave the marks as their outcomes are written: its first call
            # still there is taken for the one under way (it may have been made, its outcome not written yet, or,
            # in a run marked ahead, not started); the rest may not have started.
            under_way = {next((i for i in run if i in present), None) for run in marks.runs} - abandoned_ids
            lost, crashed, poisoned = [], [], []
            for r in found:
                call = LostCall(
                    r.id, r.message_name, r.lost_calls, r.crashed_calls, r.last_error,
                    crashed=r.id in under_way, alone=r.id in alone_ids,
                )
                outcome = settle(call)
                connection.execute(
                    _SETTLE_LOST,
                    {
                        "id": r.id,
                        "lost_calls": outcome.lost_calls,
                        "crashed_calls": outcome.crashed_calls,
                        "last_error": outcome.last_error,
                        "dead": outcome.dead,
                    },
                )
                lost.append(r.id)
                if call.crashed and call.alone:
                    crashed.append(r.id)
                if outcome.dead:
                    poisoned.append((r.id, r.message_name))
            settled = {r.id for r in found}
            kept = [i for i in ids if i in present and i not in settled]
            rest = InFlight(
                runs=tuple(kept_run for run in marks.runs if (kept_run := tuple(i for i in run if i in kept))),
                abandoned=tuple(i for i in kept if i in abandoned_ids),
                alone=tuple(i for i in kept if i in alone_ids),
            )
            connection.execute(_WRITE_MARKS, {"name": fence.name, "marks": rest.to_json()})
            return Adoption(tuple(lost), tuple(crashed), tuple(poisoned), len(kept))

        return self._write(work)

    def messages_dead_letter(self, reasons: dict[int, str]) -> int:
        """Make these messages dead with a reason each (rows the worker cannot read or record)."""

        def work(connection: Connection) -> int:
            done = 0
            for row_id, reason in reasons.items():
                done += connection.execute(_DEAD_LETTER, {"id": row_id, "reason": storable_text(reason)}).rowcount
            return done

        return self._write(work)

    def message_park(self, message_id: int, pause_id: int) -> bool:
        """Pause one message on behalf of a durable pause of its name; False if it was no longer ready."""
        params = {"id": message_id, "pause_id": pause_id}
        return bool(self._write(lambda c: c.execute(_PARK, params).rowcount))

    # -- durable pauses ---------------------------------------------------------------------------------------

    def pauses_list(self) -> list[Pause]:
        """Every durable pause, oldest first."""
        statement = select(pause_table).order_by(pause_table.c.id)
        return self._run(lambda c: [_pause(row) for row in c.execute(statement)])

    # -- producers and operators ------------------------------------------------------------------------------

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

        return self._write(work)

    def messages_get(self, message_id: int) -> Message | None:
        """One message by id."""
        statement = select(message_table).where(message_table.c.id == message_id)
        row = self._run(lambda c: c.execute(statement).first())
        return None if row is None else message_of_row(row)

    def messages_get_by_message_id(self, message_id: str) -> Message | None:
        """One message by the producer's ``message_id`` (unique)."""
        statement = select(message_table).where(message_table.c.message_id == message_id)
        row = self._run(lambda c: c.execute(statement).first())
        return None if row is None else message_of_row(row)

    def messages_list(self, selection: MessageFilter, *, after: int = 0, limit: int = 50) -> list[Message]:
        """Messages matching the filter, in id order, from a keyset position."""
        statement = (
            select(message_table)
            .where(*_conditions(selection), message_table.c.id > after)
            .order_by(message_table.c.id)
            .limit(limit)
        )
        return self._run(lambda c: [message_of_row(row) for row in c.execute(statement)])

    def messages_count_by_state(self, oldest_eligible: datetime | None = None) -> StateCounts:
        """Counts by state (waiting and expired apart); the oldest eligible message's age from the created_at
        the caller found (see :meth:`messages_oldest_eligible`)."""

        def work(connection: Connection) -> StateCounts:
            now = self._now(connection)
            row = connection.execute(_COUNT_BY_STATE, {"now": now}).one()
            age = None if oldest_eligible is None else max(timedelta(0), now - oldest_eligible)
            return StateCounts(
                ready=row.ready or 0,
                waiting=row.waiting or 0,
                paused=row.paused or 0,
                dead=row.dead or 0,
                expired=row.expired or 0,
                oldest_eligible_age=age,
            )

        return self._run(work)

    def messages_count_by_name_and_state(self) -> dict[tuple[str, str], int]:
        """Non-zero counts by (message_name, state), the states of :meth:`messages_count_by_state`."""

        def work(connection: Connection) -> dict[tuple[str, str], int]:
            now = self._now(connection)
            counts: dict[tuple[str, str], int] = {}
            for row in connection.execute(_COUNT_BY_NAME_AND_STATE, {"now": now}):
                for state in ("ready", "waiting", "paused", "dead", "expired"):
                    count = int(getattr(row, state) or 0)
                    if count:
                        counts[(row.message_name, state)] = count
            return counts

        return self._run(work)

    def messages_oldest_eligible(self, slots: Collection[int], mode: Mode, budget: int = 50) -> datetime | None:
        """The created_at of the oldest message that could be correlated now, looking at up to ``budget``
        hints per slot (beyond that it is a lower bound of the age)."""
        oldest: datetime | None = None
        horizon = self.order_horizon()
        limit = horizon.last_id if horizon is not None else 2**62
        for slot in slots:
            candidates = self.messages_candidates(slot, "", budget)
            hints = list(dict.fromkeys(candidates.fresh + candidates.due))
            fetched = self.messages_fetch_batches(hints, horizon=limit, per_hint=1, limit=len(hints), mode=mode)
            for message in fetched.messages:
                if oldest is None or message.created_at < oldest:
                    oldest = message.created_at
        return oldest

    def messages_requeue(self, selection: MessageFilter) -> int:
        """Dead → ready with the attempt count reset, due at once; returns how many."""
        statement = (
            sa_update(message_table)
            .where(*_conditions(selection), message_table.c.state == MessageState.DEAD.value)
            .values(
                state=MessageState.READY.value, attempt=0, next_attempt_at=None, lost_calls=0, crashed_calls=0
            )
        )
        return self._write(lambda c: self._notify_changed(c, statement))

    def messages_pause(self, selection: MessageFilter) -> int:
        """Ready → paused (the messages hold back their hints); returns how many."""
        statement = (
            sa_update(message_table)
            .where(*_conditions(selection), message_table.c.state == MessageState.READY.value)
            .values(state=MessageState.PAUSED.value)
        )
        return self._write(lambda c: c.execute(statement).rowcount)

    def messages_resume(self, selection: MessageFilter) -> int:
        """Paused → ready, due no earlier than before the pause; returns how many."""
        statement = (
            sa_update(message_table)
            .where(*_conditions(selection), message_table.c.state == MessageState.PAUSED.value)
            .values(state=MessageState.READY.value, pause_id=None)
        )
        return self._write(lambda c: self._notify_changed(c, statement))

    def messages_delete(self, selection: MessageFilter) -> int:
        """Delete the matching messages; returns how many."""
        statement = sa_delete(message_table).where(*_conditions(selection))
        return self._write(lambda c: self._notify_changed(c, statement))

    def messages_delete_expired(self, *, now: datetime, limit: int) -> int:
        """Delete at most ``limit`` expired messages; returns how many."""
        return self._write(lambda c: c.execute(_DELETE_EXPIRED, {"now": now, "limit": limit}).rowcount)

    def _notify_changed(self, connection: Connection, statement: Any) -> int:
        """Run an UPDATE or DELETE of messages and wake the replicas holding the slots it touched."""
        if self.dialect != "postgresql":
            return int(connection.execute(statement).rowcount)
        slots = connection.execute(statement.returning(message_table.c.slot)).scalars().all()
        if slots:
            wake = ",".join(str(slot) for slot in sorted(set(slots)))
            connection.execute(_NOTIFY, {"channel": NOTIFY_CHANNEL, "slots": wake})
        return len(slots)


def _marks_params(writes: Sequence[SlotWrite]) -> dict[str, list[Any]]:
    fences = [w.fence for w in writes if w.fence is not None]
    return {
        "names": [fence.name for fence in fences],
        "holders": [fence.holder for fence in fences],
        "fences": [fence.fence for fence in fences],
        "marks": [w.marks for w in writes if w.fence is not None],
        "versions": [w.version for w in writes if w.fence is not None],
    }


def _pause(row: Any) -> Pause:
    return Pause(row.id, row.scope, row.target, row.reason, row.created_by, row.created_at)


