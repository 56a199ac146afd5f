"""Statements of the console (HTTP API, pages) and the operator commands: O(page) reads, bounded counts, bulk
actions in chunks, durable pauses, and the audit trail.

Every read here is bounded by what it returns, not by what the table holds (DESIGN.md §8, "fast at a million
rows"):

- **Keyset pages** in id order. A filter on a name or a hint without a state is read as one index range per
  state (``ready``, ``paused``, ``dead``) merged by id, so that each range is an ordered index scan that stops
  after a page (PostgreSQL's indexes): ``(message_name, state, id) WHERE finished_at IS NULL``,
  ``(correlation_hint, id) WHERE state = 'ready'``, ``(correlation_hint, state, id)`` and ``(state, id)`` of
  paused and dead messages (the latter's also ``finished_at IS NULL``). The console's own indexes are partial on
  ``finished_at IS NULL``, which its reads of live messages say beside the state and the engine never says.
- Filters no index serves (text in ``last_error``, a ``created_at`` range) are applied to a **scan window**
  of at most ``scan`` rows of the indexed filter: a page may come back short with a ``next`` cursor that
  continues after the window.
- **Bounded counts**: ``count(*)`` over a sub-select with ``LIMIT limit + 1``, shown as "10000+" above it.
- **Bulk actions** run in chunks of ``chunk`` rows, each its own short transaction, advancing by id; so does
  lifting a durable pause (the order of its steps is in :mod:`worker.admin.pauses`).

The console runs these on an engine of its own whose sessions have a short ``statement_timeout``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Select, Update, any_, bindparam, func, literal, select, text, union_all
from sqlalchemy import delete as sa_delete
from sqlalchemy import update as sa_update
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Row
from sqlalchemy.sql import ColumnElement

from worker.config import Mode
from worker.db.base import MessageFilter
from worker.db.fetch import FetchStatements, Pause
from worker.db.messages import MessageStatements
from worker.db.rows import message_of_row
from worker.db.schema import (
    NOTIFY_CHANNEL,
    PAUSES_CHANGED,
    SLOT_COUNT,
    UtcDateTime,
    audit_table,
    message_table,
    pause_table,
)
from worker.message import Message, MessageState

m = message_table.c
STATES = (MessageState.READY, MessageState.PAUSED, MessageState.DEAD)
BULK_ACTIONS = ("requeue", "pause", "resume", "delete")
# The state a bulk action changes (delete: any).
ACTION_STATE: dict[str, MessageState | None] = {
    "requeue": MessageState.DEAD,
    "pause": MessageState.READY,
    "resume": MessageState.PAUSED,
    "delete": None,
}


# -- values ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Bounded:
    """A count that stopped at its limit: ``count`` rows, and ``more`` when there were more than that."""

    count: int
    more: bool

    def shown(self) -> int | str:
        """The count as the console shows it: a number, or e.g. ``"10000+"``."""
        return f"{self.count}+" if self.more else self.count


@dataclass(frozen=True, slots=True)
class Listed:
    """A message as the console lists it, with the durable pause that paused it (if one did)."""

    message: Message
    pause_id: int | None = None


@dataclass(frozen=True, slots=True)
class ConsoleFilter:
    """What a console page of messages shows: the operators' filter plus the console's own fields."""

    selection: MessageFilter = field(default_factory=MessageFilter)
    message_id: str | None = None
    error: str | None = None  # text in last_error (case-insensitive)
    created_from: datetime | None = None
    created_to: datetime | None = None
    # A state the census reports beside the column's: "waiting" (ready, due later) or "expired" (past expires_at).
    census_state: str | None = None

    @property
    def windowed(self) -> bool:
        """True when a filter needs the scan window (no index serves it)."""
        return (
            self.error is not None or self.created_from is not None or self.created_to is not None
            or self.census_state is not None
        )


@dataclass(frozen=True, slots=True)
class Page:
    """Rows in id order; ``next`` is the cursor of the next page (None: this was the last)."""

    rows: list[Listed]
    next: int | None


@dataclass(frozen=True, slots=True)
class Census:
    """Bounded counts of the message table by state, read at ``now`` (the database clock)."""

    counts: dict[str, Bounded]
    now: datetime


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One row of ``correlation_audit``."""

    id: int
    at: datetime
    actor: str
    via: str
    action: str
    target: Any
    affected: int
    error: str | None


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one chunk of a bulk action did: rows changed, and the last id it looked at (None: nothing left)."""

    changed: int
    last_id: int | None


@dataclass(frozen=True, slots=True)
class LiftEnd:
    """What a transaction at the end of a lift did: messages resumed, and whether the pause is gone (False: a
    whole chunk was still parked, the next transaction goes on)."""

    resumed: int
    lifted: bool


# -- statement builders ------------------------------------------------------------------------------------------


# A live message, as the console's indexes of live messages say it (schema revision 0013): a message has no end
# until it becomes its delivery record. Said beside the state, so that those indexes serve the console's reads,
# which no statement of the engine says (their predicates once were the states it reads).
_LIVE = m.finished_at.is_(None)


def _conditions(selection: MessageFilter, state: MessageState | None) -> list[ColumnElement[bool]]:
    conditions: list[ColumnElement[bool]] = []
    if selection.ids:
        conditions.append(m.id.in_(selection.ids))
    if selection.name is not None:
        conditions.append(m.message_name == selection.name)
    if selection.hint is not None:
        conditions.append(m.correlation_hint == selection.hint)
    if state is not None:
        conditions.append(m.state == state.value)
        if state is not MessageState.DELIVERED:
            conditions.append(_LIVE)
    elif not selection.ids:  # the live messages: records only when asked for by state (or by id)
        conditions += [m.state != MessageState.DELIVERED.value, _LIVE]
    return conditions


def _ids_in_order(
    selection: MessageFilter, after: int, limit: int, extra: Sequence[ColumnElement[bool]] = ()
) -> Select[Any]:
    """The ids matching the filter after ``after``, in id order, at most ``limit``: one ordered index range per
    state when a name or hint is given without a state (each stops after ``limit`` rows)."""
    if selection.state is None and not selection.ids and (selection.name is not None or selection.hint is not None):
        branches = [
            select(m.id)
            .where(*_conditions(selection, state), m.id > after, *extra)
            .order_by(m.id)
            .limit(limit)
            .subquery()
            for state in STATES
        ]
        merged = union_all(*[select(branch.c.id) for branch in branches]).subquery()
        return select(merged.c.id).order_by(merged.c.id).limit(limit)
    return (
        select(m.id)
        .where(*_conditions(selection, selection.state), m.id > after, *extra)
        .order_by(m.id)
        .limit(limit)
    )


def _unexpired(now: datetime) -> ColumnElement[bool]:
    return (m.expires_at.is_(None)) | (m.expires_at > now)


def _census_conditions(now: datetime) -> dict[str, list[ColumnElement[bool]]]:
    """What each state of the census means at ``now`` (``waiting``: ready, due later; ``expired``: past
    ``expires_at``, awaiting cleanup; the other states count unexpired rows)."""
    due = m.next_attempt_at.is_(None) | (m.next_attempt_at <= now)
    return {
        "ready": [m.state == MessageState.READY.value, _LIVE, due, _unexpired(now)],
        "waiting": [m.state == MessageState.READY.value, _LIVE, m.next_attempt_at > now, _unexpired(now)],
        "paused": [m.state == MessageState.PAUSED.value, _LIVE, _unexpired(now)],
        "dead": [m.state == MessageState.DEAD.value, _LIVE, _unexpired(now)],
        "expired": [m.expires_at.is_not(None), m.expires_at <= now],
    }


def _resume(ids: Sequence[int], dialect: str) -> Update:
    """These messages (locked, read paused by a durable pause) → ready, due no earlier than before the pause.

    On PostgreSQL the ids go as one array (``id = ANY(:ids)``): a thousand ids as a thousand parameters cost
    more to build and send than the update itself.
    """
    if dialect == "postgresql":
        chosen = m.id == any_(bindparam("ids", list(ids), type_=postgresql.ARRAY(BigInteger())))
    else:
        chosen = m.id.in_(ids)
    return sa_update(message_table).where(chosen).values(state=MessageState.READY.value, pause_id=None)


def _listed(row: Row[Any]) -> Listed:
    return Listed(message_of_row(row), row._mapping["pause_id"])


def _pause(row: Any) -> Pause:
    return Pause(row.id, row.scope, row.target, row.reason, row.created_by, row.created_at)


def _audit(row: Any) -> AuditEntry:
    return AuditEntry(row.id, row.at, row.actor, row.via, row.action, row.target, row.affected, row.error)


class ConsoleStatements(MessageStatements, FetchStatements):
    """The console's statements (see the module's docstring for how each stays O(page))."""

    # -- sessions ended at logout --------------------------------------------------------------------------------

    def sessions_end(self, nonce_digest: str, expires_at: datetime) -> None:
        """Record that a console session ended at logout (until it would have expired); forget older ones."""

        def work(connection: Connection) -> None:
            connection.execute(_FORGET_ENDED_SESSIONS)
            connection.execute(_END_SESSION[self.dialect], {"digest": nonce_digest, "expires_at": expires_at})

        self._write(work)

    def session_ended(self, nonce_digest: str) -> bool:
        """True when the console session with this nonce digest ended at logout."""
        return self._run(lambda c: c.execute(_SESSION_ENDED, {"digest": nonce_digest}).first() is not None)

    # -- reading messages ---------------------------------------------------------------------------------------

    def console_census(self, limit: int) -> Census:
        """Messages by state, each count stopping at ``limit`` (``waiting``: ready, due later; ``expired``:
        past ``expires_at``, awaiting cleanup; the other states count unexpired rows)."""

        def work(connection: Connection) -> Census:
            now = self._now(connection)
            conditions = _census_conditions(now)
            counts = {}
            for name, where in conditions.items():
                window = select(literal(1)).select_from(message_table).where(*where).limit(limit + 1).subquery()
                found = int(connection.execute(select(func.count()).select_from(window)).scalar_one())
                counts[name] = Bounded(min(found, limit), found > limit)
            return Census(counts, now)

        return self._run(work)

    def console_messages(self, wanted: ConsoleFilter, *, after: int, limit: int, scan: int) -> Page:
        """A keyset page of messages matching the filter, in id order after ``after``.

        Filters without an index (``error``, the ``created_at`` range) look at most ``scan`` rows of the
        indexed filter per page: the page may be short, and ``next`` then continues after what was looked at.
        """
        selection = wanted.selection
        if wanted.message_id is not None:
            extra: list[ColumnElement[bool]] = [m.message_id == wanted.message_id]
        else:
            extra = []

        def work(connection: Connection) -> Page:
            if not wanted.windowed:
                ids = _ids_in_order(selection, after, limit + 1, extra).scalar_subquery()
                statement = select(message_table).where(m.id.in_(ids)).order_by(m.id)
                rows = [_listed(r) for r in connection.execute(statement)]
                more = len(rows) > limit
                rows = rows[:limit]
                return Page(rows, rows[-1].message.id if more else None)
            window = _ids_in_order(selection, after, scan, extra).subquery()
            post: list[ColumnElement[bool]] = []
            if wanted.error is not None:
                post.append(func.lower(m.last_error).contains(wanted.error.lower(), autoescape=True))
            if wanted.created_from is not None:
                post.append(m.created_at >= wanted.created_from)
            if wanted.created_to is not None:
                post.append(m.created_at < wanted.created_to)
            if wanted.census_state is not None:
                post += _census_conditions(self._now(connection))[wanted.census_state]
            statement = (
                select(message_table)
                .where(m.id.in_(select(window.c.id)), *post)
                .order_by(m.id)
                .limit(limit + 1)
            )
            rows = [_listed(r) for r in connection.execute(statement)]
            if len(rows) > limit:
                rows = rows[:limit]
                return Page(rows, rows[-1].message.id)
            looked = connection.execute(select(func.count(), func.max(window.c.id))).one()
            return Page(rows, int(looked[1]) if looked[0] >= scan else None)

        return self._run(work)

    def console_message(self, row_id: int) -> Listed | None:
        """One message by id, with its pause."""
        row = self._run(lambda c: c.execute(select(message_table).where(m.id == row_id)).first())
        return None if row is None else _listed(row)

    def console_message_by_message_id(self, message_id: str) -> Listed | None:
        """One message by the producer's ``message_id``, with its pause."""
        row = self._run(lambda c: c.execute(select(message_table).where(m.message_id == message_id)).first())
        return None if row is None else _listed(row)

    def hint_holders(self, hint: str, paused_names: Sequence[str]) -> tuple[list[Listed], datetime, int | None]:
        """The unexpired messages of a hint that may hold it back, the database clock and (PostgreSQL) the id
        sequence's last value: its first paused, first waiting and first dead message, its first ready message of
        a paused name and its first ready message past the sequence (one index probe each)."""

        def work(connection: Connection) -> tuple[list[Listed], datetime, int | None]:
            now = self._now(connection)
            id_limit = self._horizon(connection).last_id if self.dialect == "postgresql" else None
            base = [m.correlation_hint == hint, _unexpired(now)]
            probes = [
                [m.state == MessageState.PAUSED.value],
                [m.state == MessageState.READY.value, m.next_attempt_at > now],
                [m.state == MessageState.DEAD.value],
            ]
            if id_limit is not None:
                probes.append([m.state == MessageState.READY.value, m.id > id_limit])
            if paused_names:
                probes.append([m.state == MessageState.READY.value, m.message_name.in_(list(paused_names))])
            found: dict[int, Listed] = {}
            for probe in probes:
                row = connection.execute(select(message_table).where(*base, *probe).order_by(m.id).limit(1)).first()
                if row is not None:
                    found[row.id] = _listed(row)
            return [found[key] for key in sorted(found)], now, id_limit

        return self._run(work)

    def console_oldest_eligible(self, mode: Mode, budget: int) -> datetime | None:
        """The created_at of the oldest message that could be correlated now, looking at up to ``budget``
        candidate hints per slot (beyond that a lower bound of the age)."""
        return self.messages_oldest_eligible(range(self.slot_count_of_dialect()), mode, budget)

    def slot_count_of_dialect(self) -> int:
        """How many slots hints are spread over on this database (64 on PostgreSQL, one on SQLite)."""
        return SLOT_COUNT if self.dialect == "postgresql" else 1

    def messages_last_id(self) -> int:
        """The largest id handed out so far (also of rows since deleted): arrivals, for the throughput."""
        if self.dialect == "postgresql":
            statement = text(
                "SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence('correlation_message', 'id')"
                "::regclass), 0)"
            )
        else:
            statement = text("SELECT coalesce(max(seq), 0) FROM sqlite_sequence WHERE name = 'correlation_message'")
        return int(self._run(lambda c: c.execute(statement).scalar_one()))

    # -- bulk actions ---------------------------------------------------------------------------------------------

    def console_count(self, selection: MessageFilter, limit: int) -> Bounded:
        """How many messages match the filter, stopping at ``limit``."""
        window = _ids_in_order(selection, 0, limit + 1).subquery()
        found = int(self._run(lambda c: c.execute(select(func.count()).select_from(window)).scalar_one()))
        return Bounded(min(found, limit), found > limit)

    def console_bulk_chunk(
        self, action: str, selection: MessageFilter, *, after: int, chunk: int, by: str = ""
    ) -> Chunk:
        """Apply a bulk action (requeue, pause, resume, delete) to the next ``chunk`` matching messages after
        ``after``, in one transaction; replicas holding their slots are woken for requeue, resume and delete.

        ``selection.state`` must already be the state the action changes (None for delete). A deleted message
        becomes its delivery record (outcome ``deleted``, ``by`` the operator) while records are kept; a delete of
        ``state: delivered`` removes records.
        """
        state = ACTION_STATE[action]
        guard: list[ColumnElement[bool]] = [] if state is None else [m.state == state.value]

        def work(connection: Connection) -> Chunk:
            ids = [int(i) for i in connection.execute(_ids_in_order(selection, after, chunk)).scalars()]
            if not ids:
                return Chunk(0, None)
            target = [m.id.in_(ids), *guard]
            if action == "delete":
                chosen = MessageFilter(ids=tuple(ids), state=selection.state)
                changed = self._notify_changed(connection, self.messages_delete_statement(connection, chosen, by))
            elif action == "requeue":
                statement = (
                    sa_update(message_table)
                    .where(*target)
                    .values(state="ready", attempt=0, next_attempt_at=None, lost_calls=0, crashed_calls=0)
                )
                changed = self._notify_changed(connection, statement)
            elif action == "resume":
                statement = sa_update(message_table).where(*target).values(state="ready", pause_id=None)
                changed = self._notify_changed(connection, statement)
            else:
                statement = sa_update(message_table).where(*target).values(state="paused")
                changed = int(connection.execute(statement).rowcount)
            return Chunk(changed, max(ids) if len(ids) >= chunk else None)

        return self._write(work)

    # -- durable pauses ---------------------------------------------------------------------------------------------

    def pauses_get(self, pause_id: int) -> Pause | None:
        """One durable pause by id."""
        row = self._run(lambda c: c.execute(select(pause_table).where(pause_table.c.id == pause_id)).first())
        return None if row is None else _pause(row)

    def pauses_find(self, scope: str, target: str) -> Pause | None:
        """The durable pause of a scope and target, if there is one."""
        statement = select(pause_table).where(pause_table.c.scope == scope, pause_table.c.target == target)
        row = self._run(lambda c: c.execute(statement).first())
        return None if row is None else _pause(row)

    def pauses_create(self, scope: str, target: str, reason: str, created_by: str) -> tuple[Pause, bool]:
        """Create a durable pause; returns it and True, or the one already there and False."""
        insert = postgresql_insert if self.dialect == "postgresql" else sqlite_insert

        def work(connection: Connection) -> tuple[Pause, bool]:
            values = {
                "scope": scope,
                "target": target,
                "reason": reason,
                "created_by": created_by,
                "created_at": self._now(connection),
            }
            statement = (
                insert(pause_table)
                .values(**values)
                .on_conflict_do_nothing(index_elements=["scope", "target"])
                .returning(*pause_table.c)
            )
            row = connection.execute(statement).first()
            if row is not None:
                self._notify_pauses(connection)
                return _pause(row), True
            existing = connection.execute(
                select(pause_table).where(pause_table.c.scope == scope, pause_table.c.target == target)
            ).one()
            return _pause(existing), False

        return self._write(work)

    def _notify_pauses(self, connection: Connection) -> None:
        """Tell every replica, at the commit, that the pauses changed: each reads them again and looks at every
        slot (a lifted pause of a hint, a name or everything may free messages of any slot)."""
        if self.dialect == "postgresql":
            connection.execute(text("SELECT pg_notify(:channel, :payload)"),
                               {"channel": NOTIFY_CHANNEL, "payload": PAUSES_CHANGED})

    def pauses_unpark_chunk(self, pause_id: int, name: str, *, after: int, chunk: int) -> Chunk:
        """Resume the messages that a durable pause of the message name ``name`` parked among the next ``chunk``
        paused messages of that name after ``after`` (id order), in one transaction. The pause stays, and no
        replica is woken (see :meth:`pauses_lift_rest`).

        The chunk is read without a condition on ``pause_id``: a new pause's id has no statistics yet, and a
        planner that takes it for rare walks every message of the pause through its index, for every chunk.
        Read by ``(message_name, state, id)``, a chunk costs what it changes; its rows are locked as they are
        read, so that those of the pause are changed as they were read.
        """
        window = (
            select(m.id, m.pause_id)
            .where(m.message_name == name, m.state == MessageState.PAUSED.value, _LIVE, m.id > after)
            .order_by(m.id)
            .limit(chunk)
            .with_for_update()
        )

        def work(connection: Connection) -> Chunk:
            rows = connection.execute(window).all()
            if not rows:
                return Chunk(0, None)
            theirs = [int(row.id) for row in rows if row.pause_id == pause_id]
            changed = int(connection.execute(_resume(theirs, self.dialect)).rowcount) if theirs else 0
            return Chunk(changed, int(rows[-1].id) if len(rows) >= chunk else None)

        return self._write(work)

    def pauses_lift_rest(self, pause_id: int, *, chunk: int) -> LiftEnd:
        """One transaction of a lift's end: resume up to ``chunk`` messages the pause still holds parked (any
        that no chunk met, e.g. parked by the engine behind the chunks); when fewer were left, also delete the
        pause, resume what was parked in between, and tell every replica that the pauses changed (each reads
        them again and looks at every slot)."""
        parked = (
            select(m.id)
            .where(m.pause_id == pause_id, m.state == MessageState.PAUSED.value)
            .limit(chunk)
            .with_for_update()
        )
        rest = (
            sa_update(message_table)
            .where(m.pause_id == pause_id, m.state == MessageState.PAUSED.value)
            .values(state=MessageState.READY.value, pause_id=None)
        )

        def work(connection: Connection) -> LiftEnd:
            ids = [int(i) for i in connection.execute(parked).scalars()]
            resumed = int(connection.execute(_resume(ids, self.dialect)).rowcount) if ids else 0
            if len(ids) >= chunk:
                return LiftEnd(resumed, lifted=False)
            # The pause goes before the last sweep, which resumes what was parked until then.
            connection.execute(sa_delete(pause_table).where(pause_table.c.id == pause_id))
            resumed += int(connection.execute(rest).rowcount)
            self._notify_pauses(connection)
            return LiftEnd(resumed, lifted=True)

        return self._write(work)

    # -- the audit trail --------------------------------------------------------------------------------------------

    def audit_add(
        self, actor: str, via: str, action: str, target: Any, affected: int, error: str | None = None
    ) -> AuditEntry:
        """Write one audit row (at the database clock)."""

        def work(connection: Connection) -> AuditEntry:
            values = {
                "at": self._now(connection),
                "actor": actor[:255],
                "via": via,
                "action": action,
                "target": target,
                "affected": affected,
                "error": error,
            }
            row = connection.execute(audit_table.insert().values(**values).returning(*audit_table.c)).one()
            return _audit(row)

        return self._write(work)

    def audit_page(self, *, before: int | None, limit: int) -> tuple[list[AuditEntry], int | None]:
        """Audit rows newest first, older than ``before`` (None: from the newest); and the next cursor."""
        statement = select(audit_table)
        if before is not None:
            statement = statement.where(audit_table.c.id < before)
        statement = statement.order_by(audit_table.c.id.desc()).limit(limit + 1)
        rows = self._run(lambda c: [_audit(r) for r in c.execute(statement)])
        more = len(rows) > limit
        rows = rows[:limit]
        return rows, rows[-1].id if more else None


# Console sessions ended at logout (a digest of the session's nonce), kept until they would have expired.
_END_SESSION = {
    "postgresql": text(
        "INSERT INTO correlation_session_end (nonce_digest, expires_at) VALUES (:digest, :expires_at) "
        "ON CONFLICT (nonce_digest) DO NOTHING"
    ).bindparams(bindparam("expires_at", type_=UtcDateTime())),
    "sqlite": text(
        "INSERT OR IGNORE INTO correlation_session_end (nonce_digest, expires_at) VALUES (:digest, :expires_at)"
    ).bindparams(bindparam("expires_at", type_=UtcDateTime())),
}
_SESSION_ENDED = text("SELECT 1 FROM correlation_session_end WHERE nonce_digest = :digest")
_FORGET_ENDED_SESSIONS = text(
    "DELETE FROM correlation_session_end WHERE expires_at < CURRENT_TIMESTAMP"
)

