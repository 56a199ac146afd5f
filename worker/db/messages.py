"""Statements on ``correlation_message`` for producers and operators: insert, read, count, requeue, pause,
resume, delete. The engine's reads are in :mod:`worker.db.fetch`, its outcomes in :mod:`worker.db.calls`, the
rows' decoding in :mod:`worker.db.rows`.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Integer, bindparam, select, text
from sqlalchemy import delete as sa_delete
from sqlalchemy import update as sa_update
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection
from sqlalchemy.sql import ColumnElement

from worker.db.base import MessageFilter, NewMessage, StateCounts, StoreBase
from worker.db.rows import message_of_row
from worker.db.schema import NOTIFY_CHANNEL, UtcDateTime, message_table
from worker.message import Message, MessageState

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
# The live messages, records apart: read through the partial indexes of ready and of paused or dead rows, so
# that a week of delivery records costs the census nothing.
_LIVE = """(SELECT message_name, state, expires_at, next_attempt_at FROM correlation_message WHERE state = 'ready'
         UNION ALL
         SELECT message_name, state, expires_at, next_attempt_at FROM correlation_message
          WHERE state IN ('paused', 'dead')) AS live"""
_COUNT_BY_STATE = text(f"SELECT {_CENSUS_COLUMNS} FROM {_LIVE}").bindparams(bindparam("now", type_=UtcDateTime()))

# The same census per message name, for the backlog gauge (bounded to the largest names by the caller).
_COUNT_BY_NAME_AND_STATE = text(
    f"SELECT message_name, {_CENSUS_COLUMNS} FROM {_LIVE} GROUP BY message_name"
).bindparams(bindparam("now", type_=UtcDateTime()))

_DELETE_EXPIRED = text(
    """
    DELETE FROM correlation_message WHERE id IN (
        SELECT id FROM correlation_message m WHERE expires_at IS NOT NULL AND expires_at <= :now
           AND NOT EXISTS (SELECT 1 FROM correlation_call c WHERE c.message_id = m.id) LIMIT :limit
    )
    """
).bindparams(bindparam("now", type_=UtcDateTime()), bindparam("limit", type_=Integer()))

# Expired messages become records (their expires_at goes: a record never expires, it is removed after the
# retention). Rows another session holds, and messages being called (their call marked), are left for a later run:
# a call under way decides its message's fate, its success is not overwritten as an expiry.
_RECORD_EXPIRED = {
    dialect: text(
        f"""
        UPDATE correlation_message
           SET state = 'delivered', outcome = 'expired', finished_at = {now}, finished_by = :by,
               payload = '{{}}', headers = '{{}}', expires_at = NULL, next_attempt_at = NULL, pause_id = NULL
         WHERE id IN (SELECT id FROM correlation_message m WHERE expires_at IS NOT NULL AND expires_at <= :now
                         AND NOT EXISTS (SELECT 1 FROM correlation_call c WHERE c.message_id = m.id)
                       LIMIT :limit {lock})
        """
    ).bindparams(bindparam("now", type_=UtcDateTime()), bindparam("limit", type_=Integer()))
    for dialect, now, lock in (
        ("postgresql", "now()", "FOR UPDATE SKIP LOCKED"),
        ("sqlite", "strftime('%Y-%m-%d %H:%M:%f000', 'now')", ""),
    )
}

# Records past the retention, oldest first, a chunk at a time.
_DELETE_RECORDS = text(
    """
    DELETE FROM correlation_message WHERE id IN (
        SELECT id FROM correlation_message WHERE state = 'delivered' AND finished_at < :before
         ORDER BY finished_at LIMIT :limit
    )
    """
).bindparams(bindparam("before", type_=UtcDateTime()), bindparam("limit", type_=Integer()))

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
    elif not selection.ids:  # the live messages: records only when asked for by state (or by id)
        conditions.append(message_table.c.state != MessageState.DELIVERED.value)
    return conditions


def _record_values(outcome: str, by: str, now: Any) -> dict[str, Any]:
    """A message's row as its delivery record (see schema/ddl/0010)."""
    return {
        "state": MessageState.DELIVERED.value, "outcome": outcome, "finished_at": now, "finished_by": by,
        "payload": {}, "headers": {}, "expires_at": None, "next_attempt_at": None, "pause_id": None,
    }




class MessageStatements(StoreBase):
    """Statements on the message table for producers and operators."""


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

    def messages_delete(self, selection: MessageFilter, *, by: str = "") -> int:
        """Delete the matching messages; returns how many. A live message becomes its delivery record (outcome
        ``deleted``, ``by`` the operator) while records are kept; records asked for by state are removed."""
        return self._write(lambda c: self._notify_changed(c, self.messages_delete_statement(c, selection, by)))

    def messages_delete_statement(self, connection: Connection, selection: MessageFilter, by: str) -> Any:
        """The statement deleting the selected messages (see :meth:`messages_delete`)."""
        conditions = _conditions(selection)
        if not self.keep_records or selection.state is MessageState.DELIVERED:
            return sa_delete(message_table).where(*conditions)
        live = message_table.c.state != MessageState.DELIVERED.value
        values = _record_values("deleted", by or "operator", self._now(connection))
        return sa_update(message_table).where(*conditions, live).values(**values)

    def messages_delete_expired(self, *, now: datetime, limit: int) -> int:
        """Remove at most ``limit`` expired messages (each becomes its record while records are kept); returns
        how many."""
        if not self.keep_records:
            return self._write(lambda c: c.execute(_DELETE_EXPIRED, {"now": now, "limit": limit}).rowcount)
        params = {"now": now, "limit": limit, "by": self.finished_by}
        return self._write(lambda c: c.execute(_RECORD_EXPIRED[self.dialect], params).rowcount)

    def messages_delete_records(self, *, before: datetime, limit: int) -> int:
        """Delete at most ``limit`` delivery records that finished before ``before``; returns how many."""
        return self._write(lambda c: c.execute(_DELETE_RECORDS, {"before": before, "limit": limit}).rowcount)

    def _notify_changed(self, connection: Connection, statement: Any) -> int:
        """Run an UPDATE or DELETE of messages and wake the replicas holding the slots it touched."""
        if self.dialect != "postgresql":
            return int(connection.execute(statement).rowcount)
        slots = connection.execute(statement.returning(message_table.c.slot)).scalars().all()
        if slots:
            wake = ",".join(str(slot) for slot in sorted(set(slots)))
            connection.execute(_NOTIFY, {"channel": NOTIFY_CHANNEL, "slots": wake})
        return len(slots)
