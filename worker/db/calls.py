"""Statements on ``correlation_call``: correlator calls in flight, one row per call, and their outcomes.

A call is *marked* before it starts: a row ``(message_id, slot, fence, holder, run_head, state)`` written under
the slot lease's term, only while that term runs (:meth:`CallStatements.calls_mark`, or the fetch itself for an
idle replica's first runs: :class:`worker.db.fetch.FetchMark`). The row is the call's
identity, and everything that ends the call compares it, so nothing depends on who wrote last::

    marked ──► the outcome is recorded ─────────────────────► row gone, message updated or deleted
       │        (only if the row is still there with this term: compare-and-delete)
       │
       └─────► the term ended with the row still there ──► the slot's next holder *adopts* it: counts one
                (a crash, a lost lease)                      lost call on the message (once: the row leaves
                                                             as it is counted) and delivers it again

Whichever of the two comes first wins; the other finds no row and does nothing. A message with a row is never
fetched (:mod:`worker.db.messages`), so it is never called twice at once, whatever a session changes on it. The
outcome of a call whose message row another session holds locked is *deferred*: its row is marked
``returned`` (the call is over, so a crash now is not its doing) and the outcome is written later; nothing
waits on that lock but the message's own hint.

Every outcome is settled one way, the group commits of the committer and a transactional call's own transaction
alike: :meth:`CallStatements._claim` takes the rows (in the one lock order it states), :meth:`CallStatements._settle`
writes the outcomes and ends the calls' rows.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import psycopg
from sqlalchemy import Boolean, bindparam, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import TextClause

from worker.db.base import Fence, driver_rows, int_array, text_array
from worker.db.errors import DatabaseBusy, DatabaseUnavailable, LeaseLost, StoreError, translate
from worker.db.locks import LockStatements
from worker.db.schema import UtcDateTime
from worker.policy.outcomes import Disposition, Kind, LostCallOutcome, storable_text

# -- values ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MarkRequest:
    """One run of calls to mark under a lease term, before they start: their messages in call order, and
    whether they run alone in their replica (no other call beside them: a crash meanwhile is their doing)."""

    slot: int
    fence: Fence
    ids: tuple[int, ...]
    alone: bool = False
    # The hint they were fetched under: a message whose hint changed since (its slot's holder, or another hint's
    # work, calls it now) is not marked. None: not checked.
    hint: str | None = None


@dataclass(frozen=True, slots=True)
class Marked:
    """What a mark wrote: the calls marked (the others must not be made) and the seconds left of each term
    still running (a term missing here has ended: nothing was marked under it)."""

    marked: frozenset[int] = frozenset()
    remaining: dict[Fence, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SlotWrite:
    """What one flush writes for the calls of one lease term (``fence`` None: an engine without leases, whose
    outcomes are written unconditionally)."""

    slot: int
    fence: Fence | None
    dispositions: tuple[Disposition, ...] = ()
    unmark: tuple[int, ...] = ()  # marked calls that were not made after all
    abandon: tuple[int, ...] = ()  # calls given up on at shutdown: delivered again, never blamed


@dataclass(frozen=True, slots=True)
class FlushOutcome:
    """What a flush wrote."""

    written: frozenset[int] = frozenset()  # message ids whose outcome is recorded
    gone: frozenset[int] = frozenset()  # ids no longer in the table (deleted meanwhile): nothing to record
    deferred: frozenset[int] = frozenset()  # ids locked by another session: to be written later
    failed: dict[int, str] = field(default_factory=dict)  # ids whose outcome the database refused, and why
    fenced: frozenset[int] = frozenset()  # ids whose call was taken over (its term ended): nothing written
    stuck: frozenset[int] = frozenset()  # of the failed, those not even made dead: nothing of them written


@dataclass(frozen=True, slots=True)
class CallSession:
    """The PostgreSQL backend running a transactional call, and when its transaction began (what tells that
    transaction from a later one on the same pooled connection)."""

    pid: int
    began: Any  # the transaction's start (``now()``), as the driver read it


@dataclass(frozen=True, slots=True)
class LostCall:
    """A call of an ended term found in flight by the slot's next holder."""

    id: int
    name: str
    lost_calls: int
    crashed_calls: int
    last_error: str | None
    # Under way when its replica died: marked alone (nothing else ran; it started as its mark was written) and
    # still so. A call of a run beside others may have returned or not started: the marks cannot tell, so it is lost
    # only, never blamed.
    crashed: bool
    alone: bool  # no other call ran in its replica meanwhile: a crash then is attributable to it


@dataclass(frozen=True, slots=True)
class Adoption:
    """What adopting the calls an ended term left in flight did."""

    lost: tuple[int, ...] = ()  # calls counted as lost (their messages are delivered again, each call alone)
    crashed: tuple[int, ...] = ()  # of them, calls that ran alone: their replica's death is attributed to them
    poisoned: tuple[tuple[int, str], ...] = ()  # (id, name) made dead as poison messages
    kept: int = 0  # calls left for later: their message rows were locked by another session


# -- statements -------------------------------------------------------------------------------------------------

# Mark calls under the terms that still run, in one statement committed without waiting for the disk (a mark lost
# in a database crash costs the count of one redelivery). A mark that read its term as running just before the
# term ended can commit after the next holder adopted the slot: its call never starts (the lane stops at its own
# deadline, a safety margin before the term can end), and the holder's next adoption sweep counts it. A message
# no longer ready (paused, deleted, made dead), moved to another hint since its fetch, or in flight under another
# term is not marked; marking a call of the same term again (a run put back in the rotation and taken up again)
# keeps its row. It answers the terms still running and the calls *not* marked (usually none: the answer stays
# small however many calls are marked).
_MARK_PG = text(
    """
    WITH fast AS (SELECT set_config('synchronous_commit', 'off', true) AS off),
    terms AS MATERIALIZED (
        SELECT l.name, l.fence, t.slot, EXTRACT(EPOCH FROM l.lock_until - now()) AS remaining
          FROM correlation_lock l
          JOIN unnest(CAST(:t_names AS text[]), CAST(:t_holders AS text[]), CAST(:t_fences AS bigint[]),
                      CAST(:t_slots AS integer[]))
               AS t(name, holder, fence, slot) ON l.name = t.name AND l.locked_by = t.holder AND l.fence = t.fence
         CROSS JOIN fast
         WHERE l.lock_until > now()
    ), rows AS MATERIALIZED (
        -- by primary key only: with the state in this WHERE, statistics taken while no row is ready make the
        -- partial index of ready rows look cheapest, and each mark would scan all of it
        SELECT id, state, correlation_hint FROM correlation_message WHERE id = ANY(CAST(:ids AS bigint[]))
    ), marked AS (
        INSERT INTO correlation_call (message_id, slot, fence, holder, run_head, state)
        SELECT v.id, v.slot, v.fence, v.holder, v.head, v.state
          FROM unnest(CAST(:ids AS bigint[]), CAST(:slots AS integer[]), CAST(:fences AS bigint[]),
                      CAST(:holders AS text[]), CAST(:heads AS bigint[]), CAST(:states AS text[]),
                      CAST(:hints AS text[]))
               AS v(id, slot, fence, holder, head, state, hint)
         WHERE EXISTS (SELECT 1 FROM rows r WHERE r.id = v.id AND r.state = 'ready'
                          AND (v.hint IS NULL OR r.correlation_hint = v.hint))
           AND (v.slot, v.fence) IN (SELECT slot, fence FROM terms)
         ORDER BY v.id  -- call rows are locked in ascending message id (see CallStatements._claim)
        ON CONFLICT (message_id) DO UPDATE SET state = excluded.state, run_head = excluded.run_head
         WHERE correlation_call.slot = excluded.slot AND correlation_call.fence = excluded.fence
           AND correlation_call.state IN ('called', 'alone')
        RETURNING message_id
    )
    SELECT name, fence, remaining, NULL::bigint AS id FROM terms
    UNION ALL
    SELECT NULL, NULL, NULL, v.id FROM unnest(CAST(:ids AS bigint[])) AS v(id)
     WHERE v.id NOT IN (SELECT message_id FROM marked)
    """
)

_TERM_SQLITE = text(
    """
    SELECT (julianday(lock_until) - julianday('now')) * 86400.0 AS remaining FROM correlation_lock
     WHERE name = :name AND locked_by = :holder AND fence = :fence
       AND lock_until > strftime('%Y-%m-%d %H:%M:%f000', 'now')
    """
)
_MARK_SQLITE = text(
    """
    INSERT INTO correlation_call (message_id, slot, fence, holder, run_head, state)
    SELECT :id, :slot, :fence, :holder, :head, :state
     WHERE EXISTS (SELECT 1 FROM correlation_message m WHERE m.id = :id AND m.state = 'ready'
                      AND (:hint IS NULL OR m.correlation_hint = :hint))
    ON CONFLICT (message_id) DO UPDATE SET state = excluded.state, run_head = excluded.run_head
     WHERE correlation_call.slot = excluded.slot AND correlation_call.fence = excluded.fence
       AND correlation_call.state IN ('called', 'alone')
    """
)

# Settling outcomes (:meth:`CallStatements._claim`, then :meth:`CallStatements._settle`). Each statement comes as
# a pair: PostgreSQL's reaches the rows of the whole set through the primary key with `= ANY(array)` and joins no
# CTE, so that its plan stays linear in the set whatever the planner guesses of the arrays (prepared statements
# run generic plans); SQLite's takes one row (`:id`) at a time, inside a transaction that holds the database's
# write lock. The sets between them are worked out by the client.

# The call rows of the set, locked in ascending message id, whatever their term; the client keeps those still
# under the term their outcome was made in.
_CALLS_OF_PG = text(
    """
    SELECT array_agg(message_id), array_agg(slot), array_agg(fence)
      FROM (SELECT message_id, slot, fence FROM correlation_call
             WHERE message_id = ANY(CAST(:ids AS bigint[])) ORDER BY message_id FOR UPDATE) AS c
    """
)
_CALL_OF_SQLITE = text("SELECT slot, fence FROM correlation_call WHERE message_id = :id")
# Message rows locked, skipping those another session holds (their outcomes are deferred, never waited on).
# A record (state 'delivered') is a message gone: no outcome is written on it. The ids come back as one array
# (one row to read, whatever the size of the set).
_LOCK_MESSAGES_PG = text(
    """
    SELECT array_agg(id) FROM (SELECT id FROM correlation_message
                                WHERE id = ANY(CAST(:ids AS bigint[])) AND state <> 'delivered'
                                ORDER BY id FOR UPDATE SKIP LOCKED) AS m
    """
)
_PRESENT_PG = text(
    "SELECT array_agg(id) FROM correlation_message WHERE id = ANY(CAST(:ids AS bigint[])) AND state <> 'delivered'"
)
_PRESENT_ONE = text("SELECT id FROM correlation_message WHERE id = :id AND state <> 'delivered'")
_Pair = tuple[TextClause, TextClause]  # a statement for a set of ids (PostgreSQL) and for one (SQLite)
_LOCK_MESSAGES: _Pair = (_LOCK_MESSAGES_PG, _PRESENT_ONE)
_PRESENT = (_PRESENT_PG, _PRESENT_ONE)
_DELETE_MESSAGES_PG = text("DELETE FROM correlation_message WHERE id = ANY(CAST(:ids AS bigint[]))")
_DELETE_MESSAGES = (_DELETE_MESSAGES_PG, text("DELETE FROM correlation_message WHERE id = :id"))
# Correlated messages become their delivery records (schema revision 0010): the payload and headers go, the
# outcome, the target's answer, the time the outcome was written and the replica stay.
_RECORD_SET = """
    state = 'delivered', outcome = 'correlated', finished_at = {now}, finished_by = :by,
    payload = '{{}}', headers = '{{}}', expires_at = NULL, next_attempt_at = NULL, pause_id = NULL,
    lost_calls = 0, crashed_calls = 0"""
_DELIVER_PG = text(
    f"UPDATE correlation_message SET {_RECORD_SET.format(now='statement_timestamp()')} "
    "WHERE id = ANY(CAST(:ids AS bigint[]))"
)
_DELIVER_WITH_RESULTS_PG = text(
    f"""
    UPDATE correlation_message AS m SET {_RECORD_SET.format(now='statement_timestamp()')},
           result = CAST(v.result AS jsonb)
      FROM unnest(CAST(:ids AS bigint[]), CAST(:results AS text[])) AS v(id, result)
     WHERE m.id = v.id AND m.id = ANY(CAST(:ids AS bigint[]))
    """
)
_DELIVER_SQLITE = text(
    "UPDATE correlation_message SET "
    + _RECORD_SET.format(now="strftime('%Y-%m-%d %H:%M:%f000', 'now')")
    + ", result = :result WHERE id = :id"
)
# The other outcomes; a message an operator paused meanwhile stays paused.
_UPDATE_MESSAGES_PG = text(
    """
    UPDATE correlation_message AS m
       SET attempt = v.attempt, next_attempt_at = v.next_attempt_at, reschedule_count = v.reschedule_count,
           last_error = v.last_error, state = CASE WHEN v.dead THEN 'dead' ELSE m.state END,
           lost_calls = 0, crashed_calls = 0
      FROM unnest(CAST(:u_ids AS bigint[]), CAST(:u_attempts AS integer[]), CAST(:u_next AS timestamptz[]),
                  CAST(:u_reschedules AS integer[]), CAST(:u_errors AS text[]), CAST(:u_dead AS boolean[]))
           AS v(id, attempt, next_attempt_at, reschedule_count, last_error, dead)
     WHERE m.id = v.id AND m.id = ANY(CAST(:u_ids AS bigint[]))
    """
)
_UPDATE_SQLITE = text(
    """
    UPDATE correlation_message
       SET attempt = :attempt, next_attempt_at = :next_attempt_at, reschedule_count = :reschedule_count,
           last_error = :last_error, state = CASE WHEN :dead THEN 'dead' ELSE state END,
           lost_calls = 0, crashed_calls = 0
     WHERE id = :id
    """
).bindparams(bindparam("next_attempt_at", type_=UtcDateTime()), bindparam("dead", type_=Boolean()))
# How a settled call's row ends (locked already, and known to be of the outcome's term): released (the outcome is
# written, or the message is gone, or the call was not made after all); returned (the call is over, its outcome
# waits for its message row, held elsewhere); abandoned (given up on at shutdown: delivered again, never blamed).
_RELEASE_CALLS_PG = text("DELETE FROM correlation_call WHERE message_id = ANY(CAST(:ids AS bigint[]))")
_RETURN_CALLS_PG = text(
    "UPDATE correlation_call SET state = 'returned' WHERE message_id = ANY(CAST(:ids AS bigint[]))"
)
_ABANDON_CALLS_PG = text(
    "UPDATE correlation_call SET state = 'abandoned' WHERE message_id = ANY(CAST(:ids AS bigint[]))"
)
_RELEASE_CALLS = (_RELEASE_CALLS_PG, text("DELETE FROM correlation_call WHERE message_id = :id"))
_RETURN_CALLS = (_RETURN_CALLS_PG, text("UPDATE correlation_call SET state = 'returned' WHERE message_id = :id"))
_ABANDON_CALLS = (_ABANDON_CALLS_PG, text("UPDATE correlation_call SET state = 'abandoned' WHERE message_id = :id"))
# Dead-letter a row whose outcome the database refused, with the reason.
_DEAD_LETTER = text(
    "UPDATE correlation_message SET state = 'dead', next_attempt_at = NULL, last_error = :reason WHERE id = :id"
)

# Calls a failed fetch may have marked (see Engine._take_back_unknown_marks): this term's rows still `called`, of
# hints the replica is not busy with, that it does not know.
_UNMARK_UNKNOWN_PG = text(
    """
    DELETE FROM correlation_call c USING correlation_message m
     WHERE c.slot = :slot AND c.fence = :fence AND c.holder = :holder AND c.state = 'called'
       AND m.id = c.message_id AND m.correlation_hint <> ALL(CAST(:busy AS text[]))
       AND c.message_id <> ALL(CAST(:known AS bigint[]))
    RETURNING c.message_id
    """
)

# The calls of a slot's ended terms, with their messages (absent: deleted meanwhile), oldest term and run first;
# rows a concurrent flush holds are skipped (it is writing their outcomes).
_ENDED_CALLS = {
    "postgresql": text(
        """
        SELECT c.message_id, c.fence, c.holder, c.run_head, c.state, m.id IS NOT NULL AS present,
               m.message_name, m.lost_calls, m.crashed_calls, m.last_error
          FROM correlation_call c LEFT JOIN correlation_message m ON m.id = c.message_id AND m.state <> 'delivered'
         WHERE c.slot = :slot AND c.fence <> :fence
         ORDER BY c.fence, c.run_head, c.message_id
           FOR UPDATE OF c SKIP LOCKED
        """
    ),
    "sqlite": text(
        """
        SELECT c.message_id, c.fence, c.holder, c.run_head, c.state, m.id IS NOT NULL AS present,
               m.message_name, m.lost_calls, m.crashed_calls, m.last_error
          FROM correlation_call c LEFT JOIN correlation_message m ON m.id = c.message_id AND m.state <> 'delivered'
         WHERE c.slot = :slot AND c.fence <> :fence
         ORDER BY c.fence, c.run_head, c.message_id
        """
    ),
}
# Whether a slot has any call row of another term (the adoption's own statement locks and reads them all).
_ANY_ENDED_CALL_PG = text(
    "SELECT EXISTS (SELECT FROM correlation_call c WHERE c.slot = :slot AND c.fence <> :fence)"
)
_SETTLE_LOST = text(
    """
    UPDATE correlation_message
       SET lost_calls = :lost_calls, crashed_calls = :crashed_calls, last_error = :last_error,
           state = CASE WHEN :dead THEN 'dead' ELSE state END
     WHERE id = :id
    """
).bindparams(bindparam("dead", type_=Boolean()))
_FORGET_CALL = text("DELETE FROM correlation_call WHERE message_id = :id AND fence = :fence AND slot = :slot")


# Whether a lease term still runs, by the database clock at this moment (read, not locked: the call's own row,
# locked, keeps every other replica from calling the message meanwhile).
_TERM_RUNS = {
    dialect: text(
        "SELECT 1 FROM correlation_lock WHERE name = :name AND locked_by = :holder AND fence = :fence "
        f"AND lock_until > {now}"
    )
    for dialect, now in (("postgresql", "clock_timestamp()"), ("sqlite", "strftime('%Y-%m-%d %H:%M:%f000', 'now')"))
}


# The call's session and transaction; a session the client leaves idle in it longer than the call may take (a
# frozen or cut-off replica) is ended by the server, which lets go of the call's and the message's rows.
_THIS_TRANSACTION = text(
    "SELECT pg_backend_pid(), now(), set_config('idle_in_transaction_session_timeout', :idle, true)"
)


def _ended(connection: Connection, transaction: Any) -> bool:
    """Whether the transaction a handler was given is over (it is not the connection's any more, or the driver's
    session is outside any transaction)."""
    if connection.closed:
        return True
    if connection.get_transaction() is not transaction or transaction is None or not transaction.is_active:
        return True
    driver: Any = connection.connection.driver_connection
    status = getattr(getattr(driver, "info", None), "transaction_status", None)
    if status is not None:  # psycopg: INTRANS (or INERROR: aborted, which the commit reports)
        return bool(status == psycopg.pq.TransactionStatus.IDLE)
    in_transaction = getattr(driver, "in_transaction", None)  # sqlite3
    return in_transaction is False


class _Rollback(Exception):
    """Ends a transactional call's transaction without committing it, saying why."""

    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status


def _term_of(fence: Fence) -> dict[str, Any]:
    return {"name": fence.name, "holder": fence.holder, "fence": fence.fence}


def _update_params(updates: Sequence[Disposition]) -> dict[str, Any]:
    """The arrays of outcomes other than a success, for the update of their rows."""
    return {
        "u_ids": int_array(d.message_id for d in updates),
        "u_attempts": int_array(d.attempt for d in updates),
        "u_next": [d.next_attempt_at for d in updates],
        "u_reschedules": int_array(d.reschedule_count for d in updates),
        "u_errors": [d.last_error for d in updates],
        "u_dead": [d.kind is Kind.DEAD for d in updates],
    }


class CallStatements(LockStatements):
    """Calls in flight: marking them, recording their outcomes, adopting those an ended term left."""

    # -- marks ------------------------------------------------------------------------------------------------

    def calls_mark(self, requests: Sequence[MarkRequest]) -> Marked:
        """Mark calls in flight under their terms, before they start.

        Only under a term that still runs (the others are missing from ``remaining``), and only messages still
        ready and not in flight already (the others are missing from ``marked``: they must not be called).
        """
        requests = [r for r in requests if r.ids]
        if not requests:
            return Marked()
        if self.dialect == "postgresql":
            return self._mark_pg(requests)
        return self._write(partial(self._mark_sqlite, requests=requests))

    def _mark_pg(self, requests: Sequence[MarkRequest]) -> Marked:
        terms = {r.fence: r.slot for r in requests}
        columns: dict[str, list[Any]] = {
            "ids": [], "slots": [], "fences": [], "holders": [], "heads": [], "states": [], "hints": [],
        }
        for request in requests:
            count = len(request.ids)
            columns["ids"] += request.ids
            columns["slots"] += [request.slot] * count
            columns["fences"] += [request.fence.fence] * count
            columns["holders"] += [request.fence.holder] * count
            columns["heads"] += [request.ids[0]] * count
            columns["states"] += ["alone" if request.alone else "called"] * count
            columns["hints"] += [request.hint] * count
        params: dict[str, Any] = {
            "t_names": text_array(fence.name for fence in terms),
            "t_holders": text_array(fence.holder for fence in terms),
            "t_fences": int_array(fence.fence for fence in terms),
            "t_slots": int_array(terms.values()),
            **{key: int_array(columns[key]) for key in ("ids", "slots", "fences", "heads")},
            "holders": text_array(columns["holders"]),
            "states": text_array(columns["states"]),
            "hints": text_array(columns["hints"]),
        }
        rows = self._driver_statements(lambda driver: driver_rows(driver, _MARK_PG, params))
        by_term = {(fence.name, fence.fence): fence for fence in terms}
        remaining = {by_term[(row[0], row[1])]: float(row[2]) for row in rows if row[0] is not None}
        refused = {row[3] for row in rows if row[3] is not None}
        marked = frozenset(i for r in requests if r.fence in remaining for i in r.ids if i not in refused)
        return Marked(marked, remaining)

    def _mark_sqlite(self, connection: Connection, requests: Sequence[MarkRequest]) -> Marked:
        marked: set[int] = set()
        remaining: dict[Fence, float] = {}
        for request in requests:
            fence = request.fence
            row = connection.execute(
                _TERM_SQLITE, {"name": fence.name, "holder": fence.holder, "fence": fence.fence}
            ).first()
            if row is None:
                continue
            remaining[fence] = float(row.remaining)
            for message_id in request.ids:
                params = {
                    "id": message_id, "slot": request.slot, "fence": fence.fence, "holder": fence.holder,
                    "head": request.ids[0], "state": "alone" if request.alone else "called", "hint": request.hint,
                }
                if connection.execute(_MARK_SQLITE, params).rowcount:
                    marked.add(message_id)
        return Marked(frozenset(marked), remaining)

    def calls_unmark_unknown(
        self, slot: int, fence: Fence, known: Sequence[int], busy: Sequence[str]
    ) -> list[int]:
        """Delete the term's calls still ``called`` that are not ``known`` to this replica, of hints it is not
        ``busy`` with: marks no call will follow (a fetch that marked them failed before handing them over).
        PostgreSQL; returns their message ids."""
        if self.dialect != "postgresql":
            return []
        params = {"slot": slot, "fence": fence.fence, "holder": fence.holder, "busy": text_array(busy),
                  "known": int_array(known)}
        rows = self._driver_statements(lambda driver: driver_rows(driver, _UNMARK_UNKNOWN_PG, params))
        return [int(row[0]) for row in rows]

    # -- outcomes ---------------------------------------------------------------------------------------------

    def messages_record(self, writes: Sequence[SlotWrite]) -> FlushOutcome:
        """Write outcomes, in one transaction, each only if its call is still marked under its term.

        A call taken over meanwhile (its term ended, the slot's next holder counted it) has nothing written
        (``fenced``). A row another session holds locked is skipped (``deferred``), never waited on. If the
        database refuses a value, every outcome is written again one at a time, and those refused are reported
        in ``failed`` (made dead with the reason where possible; nothing else is lost).
        """
        if not any(w.dispositions or w.unmark or w.abandon for w in writes):
            return FlushOutcome()
        if self.dialect == "postgresql":
            try:
                return self._write(partial(self._settle_writes, writes=writes, isolate=False))
            except (StoreError, DBAPIError) as error:  # a value refused: written one at a time, it is found
                if isinstance(error, DatabaseBusy | DatabaseUnavailable | LeaseLost):
                    raise
            return self._write(partial(self._settle_writes, writes=writes, isolate=True))
        return self._write(partial(self._settle_writes, writes=writes, isolate=False))

    def _settle_writes(self, connection: Connection, writes: Sequence[SlotWrite], *, isolate: bool) -> FlushOutcome:
        outcomes = [(_term(w), d) for w in writes for d in w.dispositions]
        unmark = {i: (w.slot, w.fence.fence) for w in writes if w.fence is not None for i in w.unmark}
        abandon = {i: (w.slot, w.fence.fence) for w in writes if w.fence is not None for i in w.abandon}
        result = _Result()
        claim = self._claim(connection, {d.message_id: term for term, d in outcomes}, result, unmark, abandon)
        self._settle(connection, claim, [d for _, d in outcomes], result, isolate=isolate)
        return result.outcome()

    def _claim(
        self,
        connection: Connection,
        calls: Mapping[int, _Term | None],
        result: _Result,
        unmark: Mapping[int, _Term] | None = None,
        abandon: Mapping[int, _Term] | None = None,
    ) -> _Claim:
        """The first half of settling outcomes under their terms (:meth:`_settle` is the second): take the rows.

        ``calls``: the messages whose outcomes are to be written, each with the term its call was marked under
        (None: written whatever is marked, for an engine without leases); ``unmark``, ``abandon``: calls that were
        not made, or were given up on at shutdown, with their terms. Reported in ``result``: ``fenced``, a call no
        longer marked under its term (the term ended and the slot's next holder counts or counted it: nothing is
        written); ``deferred``, a message whose row another session holds (its call is marked ``returned``, the
        outcome written by a later settle); ``gone``, a message deleted or recorded meanwhile (its call leaves).

        Lock order, the one invariant that keeps settling free of deadlocks:

        1. The call rows of every message named (outcomes, unmarks, abandons), whatever their term, in one
           statement, in ascending message id (``FOR UPDATE``: this is the only wait of a settle).
        2. Then the message rows of the outcomes whose call is still this term's, ``SKIP LOCKED``: never waited for.
        3. Then writes, only on the rows taken in 1 and 2.

        The other statements that take these rows: a mark (:meth:`calls_mark`) writes call rows only, in one
        statement, in ascending message id too, and reads message rows without locking them; the fetch's own
        mark (:class:`worker.db.fetch.FetchMark`) inserts new call rows only (``ON CONFLICT DO NOTHING``), which
        no settle can wait for before they commit; :meth:`calls_unmark_unknown` deletes call rows of calls this
        replica does not know, which none of its settles holds. An adoption (:meth:`calls_adopt`) waits only for
        its lease row, which no settle locks, and takes call rows, then message rows, both ``SKIP LOCKED``.
        Cleanup and operators write message rows and hold no call row. So a settle waits only for sessions that
        wait for nothing it holds, and no wait closes a cycle. A transactional call (:meth:`calls_transact`) claims
        its rows in this order too and holds them while its handler runs: what the handler's own statements wait
        for is outside this order (PostgreSQL ends such a cycle by rolling one side back).
        """
        unmark, abandon = unmark or {}, abandon or {}
        terms = {**unmark, **abandon, **{i: term for i, term in calls.items() if term is not None}}
        marked = {i for i, call in self._calls_of(connection, terms).items() if terms[i] == call}
        result.fenced |= {i for i, term in calls.items() if term is not None and i not in marked}
        wanted = {i for i, term in calls.items() if term is None or i in marked}
        locked = self._rows_of(connection, _LOCK_MESSAGES, wanted)
        present = self._rows_of(connection, _PRESENT, wanted - locked)
        gone = wanted - locked - present
        result.gone |= gone
        result.deferred |= present
        return _Claim(
            locked=locked,
            release=((locked | gone) & marked) | (unmark.keys() & marked),
            returned=present & marked,
            abandon=abandon.keys() & marked,
        )

    def _settle(
        self,
        connection: Connection,
        claim: _Claim,
        outcomes: Sequence[Disposition],
        result: _Result,
        *,
        isolate: bool,
    ) -> None:
        """The second half of settling (after :meth:`_claim`, in its transaction): write the outcomes of the
        messages claimed, and end their calls' rows. ``isolate`` (PostgreSQL): each outcome in a savepoint of its
        own, a value the database refuses making its message dead with the reason (``failed``; ``stuck`` if even
        that is refused); otherwise all together, and a refused value fails the transaction."""
        claimed = [d for d in outcomes if d.message_id in claim.locked]
        if isolate:
            for disposition in claimed:
                try:
                    with connection.begin_nested():
                        self._put(connection, [disposition])
                except DBAPIError as error:
                    if _transient(error):
                        raise
                    self._dead_letter(connection, disposition, error, result)
                    continue
                result.written.add(disposition.message_id)
        else:
            self._put(connection, claimed)
            result.written |= {d.message_id for d in claimed}
        self._each(connection, _RELEASE_CALLS, claim.release)
        self._each(connection, _RETURN_CALLS, claim.returned)
        self._each(connection, _ABANDON_CALLS, claim.abandon)

    def _dead_letter(
        self, connection: Connection, disposition: Disposition, error: DBAPIError, result: _Result
    ) -> None:
        """Make a message whose outcome the database refused dead, with the reason."""
        reason = f"the worker could not record the outcome of this message: {error.orig}"
        if disposition.last_error:  # the failure it was to record stays the message's reason too
            reason += f"; the outcome was a failure: {disposition.last_error}"
        try:
            with connection.begin_nested():
                connection.execute(_DEAD_LETTER, {"id": disposition.message_id, "reason": storable_text(reason)})
        except DBAPIError as again:
            result.failed[disposition.message_id] = f"{error.orig}; dead-lettering it failed too: {again.orig}"
            result.stuck.add(disposition.message_id)
            return
        result.failed[disposition.message_id] = str(error.orig)

    def _put(self, connection: Connection, outcomes: Sequence[Disposition]) -> None:
        """Write outcomes on message rows this transaction holds: a success makes its message a delivery record
        (or deletes it, when none is kept); any other outcome updates it."""
        done = [d for d in outcomes if d.kind is Kind.DELETE]
        others = [d for d in outcomes if d.kind is not Kind.DELETE]
        if done and not self.keep_records:
            self._each(connection, _DELETE_MESSAGES, [d.message_id for d in done])
            done = []
        if self.dialect != "postgresql":
            if done:
                connection.execute(
                    _DELIVER_SQLITE, [{"id": d.message_id, "result": d.result, "by": self.finished_by} for d in done]
                )
            if others:
                connection.execute(_UPDATE_SQLITE, [
                    {"id": d.message_id, "attempt": d.attempt, "next_attempt_at": d.next_attempt_at,
                     "reschedule_count": d.reschedule_count, "last_error": d.last_error, "dead": d.kind is Kind.DEAD}
                    for d in others
                ])
            return
        plain = [d.message_id for d in done if d.result is None]
        if plain:
            connection.execute(_DELIVER_PG, {"ids": int_array(plain), "by": self.finished_by})
        answered = [d for d in done if d.result is not None]
        if answered:
            connection.execute(
                _DELIVER_WITH_RESULTS_PG,
                {"ids": int_array(d.message_id for d in answered), "results": [d.result for d in answered],
                 "by": self.finished_by},
            )
        if others:
            connection.execute(_UPDATE_MESSAGES_PG, _update_params(others))

    def _calls_of(self, connection: Connection, ids: Collection[int]) -> dict[int, _Term]:
        """The call rows of these messages, locked in ascending message id: message id -> (slot, fence)."""
        if not ids:
            return {}
        if self.dialect == "postgresql":
            found, slots, fences = connection.execute(_CALLS_OF_PG, {"ids": int_array(sorted(ids))}).one()
            return {i: (s, f) for i, s, f in zip(found or (), slots or (), fences or (), strict=True)}
        rows = ((i, connection.execute(_CALL_OF_SQLITE, {"id": i}).first()) for i in sorted(ids))
        return {i: (row.slot, row.fence) for i, row in rows if row is not None}

    def _rows_of(self, connection: Connection, statements: _Pair, ids: Collection[int]) -> set[int]:
        """The ids a query of a pair answers: PostgreSQL's for all at once, SQLite's one at a time."""
        if not ids:
            return set()
        many, one = statements
        if self.dialect == "postgresql":
            return set(connection.execute(many, {"ids": int_array(sorted(ids))}).scalar_one() or ())
        return {i for i in sorted(ids) if connection.execute(one, {"id": i}).first() is not None}

    def _each(self, connection: Connection, statements: _Pair, ids: Collection[int]) -> None:
        """Run a statement of a pair on these ids: PostgreSQL's once, SQLite's for each."""
        if not ids:
            return
        many, one = statements
        if self.dialect == "postgresql":
            connection.execute(many, {"ids": int_array(sorted(ids))})
        else:
            connection.execute(one, [{"id": i} for i in sorted(ids)])

    def calls_transact(
        self,
        slot: int,
        fence: Fence | None,
        disposition: Callable[[Connection], Disposition | None],
        message_id: int,
        *,
        session: Callable[[CallSession | None], None] = lambda pid: None,
        idle_limit: float = 0.0,
    ) -> str:
        """Make one call inside the transaction that records its outcome (a transactional correlator).

        The call's row is locked first, only while it is still marked under ``fence``'s term (``fenced``
        otherwise: the term ended and the slot's next holder counts or has counted it), then the message's row
        (``busy``: another session holds it; ``gone``: deleted or recorded meanwhile, its mark taken out). Then
        ``disposition(connection)`` runs the handler on this connection: a success is recorded in the same
        transaction (``written``: the handler's writes and the outcome commit together) once the slot's lease
        term is seen to run still by the database clock (``fenced`` when it ran out meanwhile: nothing commits,
        and the slot's next holder delivers the message again); None means the call did not succeed, and
        everything, the handler's writes too, is rolled back (``failed``: the caller records the failure the
        usual way); ``ended`` when the handler ended the transaction itself (a commit, a rollback, a close, through
        SQLAlchemy or the driver): its writes may have committed without the outcome; ``unavailable`` when its session
        was lost during the call (nothing committed). ``session`` is told the
        PostgreSQL backend running the transaction and when that transaction began (None once it is over), so that
        a call past its timeout can be ended from outside (:meth:`session_end`: that transaction only, never a
        later one on the same pooled connection). ``idle_limit``: seconds the server lets the session sit idle in
        the transaction (the replica frozen, or cut off) before it ends it (PostgreSQL; 0: no limit).
        """

        term = None if fence is None else (slot, fence.fence)

        def work(connection: Connection) -> str:
            if self.dialect == "postgresql":
                idle = f"{max(0, round(idle_limit * 1000))}ms"  # 0: no limit
                row = connection.execute(_THIS_TRANSACTION, {"idle": idle}).one()
                session(CallSession(int(row[0]), row[1]))
            result = _Result()
            claim = self._claim(connection, {message_id: term}, result)
            if result.fenced:
                raise _Rollback("fenced")
            if result.deferred:
                raise _Rollback("busy")
            if result.gone:
                self._settle(connection, claim, (), result, isolate=False)  # its mark leaves
                return "gone"
            transaction = connection.get_transaction()
            outcome = disposition(connection)
            if connection.invalidated:  # its session was lost (a restart, a failover): rolled back by the server
                raise _Rollback("unavailable")
            if _ended(connection, transaction):  # the handler committed, rolled back or closed it
                raise _Rollback("ended")
            if outcome is None:
                raise _Rollback("failed")
            if fence is not None and connection.execute(_TERM_RUNS[self.dialect], _term_of(fence)).first() is None:
                raise _Rollback("fenced")  # the lease ran out during the call: its next holder delivers it again
            self._settle(connection, claim, [outcome], result, isolate=False)
            return "written"

        try:
            return self._write(work)
        except _Rollback as rollback:
            return rollback.status
        except DBAPIError as error:  # a statement the handler left failed (its transaction aborted), say
            raise StoreError(f"the transaction of the call did not commit: {error.orig}") from error
        finally:
            session(None)

    def session_end(self, session: CallSession) -> bool:
        """End the PostgreSQL session of a transactional call past its timeout, if it is still in that call's
        transaction (its connection may have gone back to the pool and be running something else of the
        replica's since): the transaction is rolled back and its locks let go. Whether it was ended."""
        if self.dialect != "postgresql":
            return False
        ended = self._driver_statements(lambda driver: driver.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = %s AND xact_start = %s",
            (session.pid, session.began),
        ).fetchall())
        return bool(ended and ended[0][0])

    # -- takeover ---------------------------------------------------------------------------------------------

    def calls_adopt(
        self,
        slot: int,
        fence: Fence,
        settle: Callable[[LostCall], LostCallOutcome],
        keep: Container[int] = (),
    ) -> Adoption:
        """Count the calls that ended terms of this slot left in flight, in one transaction under ``fence``.

        Each call is lost, once: its row leaves as it is counted, so adopting again counts nothing twice, and
        the calls of the current term (this holder's own) are never read. ``keep``: calls of this holder's
        earlier terms that it still makes or records (left to it). A call still marked ``alone`` was under way
        (a crash); ``settle`` decides what that means (e.g. that the message is poison). A call of a run marked
        beside others is lost only: it may have returned with its outcome unwritten, or not started. Calls whose
        message row another session holds are left for a later adoption (``kept``); nothing fetches those messages
        meanwhile.

        On PostgreSQL a slot without a call of another term is told by one autocommit statement first: the sweeps
        of every held slot, once a poll, then cost no transaction each.
        """
        if self.dialect == "postgresql":
            params = {"slot": slot, "fence": fence.fence}
            if not self._driver_statements(lambda driver: driver_rows(driver, _ANY_ENDED_CALL_PG, params)[0][0]):
                return Adoption()
        return self._write(partial(self._adopt, slot=slot, fence=fence, settle=settle, keep=keep))

    def _adopt(
        self,
        connection: Connection,
        slot: int,
        fence: Fence,
        settle: Callable[[LostCall], LostCallOutcome],
        keep: Container[int],
    ) -> Adoption:
        self.lock_check_fence(connection, fence)
        rows = connection.execute(_ENDED_CALLS[self.dialect], {"slot": slot, "fence": fence.fence}).all()
        lost, crashed, poisoned = [], [], []
        kept = 0
        for row in rows:
            if row.holder == fence.holder and row.message_id in keep:
                continue
            key = {"id": row.message_id, "fence": row.fence, "slot": slot}
            if not row.present:
                connection.execute(_FORGET_CALL, key)
                continue
            if not self._rows_of(connection, _LOCK_MESSAGES, {row.message_id}):
                kept += 1
                continue
            call = LostCall(
                int(row.message_id), row.message_name, row.lost_calls, row.crashed_calls, row.last_error,
                crashed=row.state == "alone", alone=row.state == "alone",
            )
            outcome = settle(call)
            connection.execute(
                _SETTLE_LOST,
                {
                    "id": call.id,
                    "lost_calls": outcome.lost_calls,
                    "crashed_calls": outcome.crashed_calls,
                    "last_error": outcome.last_error,
                    "dead": outcome.dead,
                },
            )
            connection.execute(_FORGET_CALL, key)
            lost.append(call.id)
            if call.crashed and call.alone:
                crashed.append(call.id)
            if outcome.dead:
                poisoned.append((call.id, call.name))
        return Adoption(tuple(lost), tuple(crashed), tuple(poisoned), kept)

    def calls_in_flight(self) -> list[dict[str, Any]]:
        """Every call marked in flight (for operators and tests), oldest term first."""
        statement = text(
            "SELECT message_id, slot, fence, holder, run_head, state FROM correlation_call "
            "ORDER BY slot, fence, run_head, message_id"
        )
        return self._run(lambda c: [dict(row._mapping) for row in c.execute(statement)])


_Term = tuple[int, int]  # the lease term a call was marked under: (slot, fence)


@dataclass(frozen=True, slots=True)
class _Claim:
    """The rows a settle holds (:meth:`CallStatements._claim`), and how their calls' rows end."""

    locked: set[int]  # message rows held: their outcomes are written
    release: set[int]  # call rows that leave
    returned: set[int]  # call rows marked returned (their message rows are held elsewhere)
    abandon: set[int]  # call rows marked abandoned


@dataclass
class _Result:
    written: set[int] = field(default_factory=set)
    gone: set[int] = field(default_factory=set)
    deferred: set[int] = field(default_factory=set)
    failed: dict[int, str] = field(default_factory=dict)
    fenced: set[int] = field(default_factory=set)
    stuck: set[int] = field(default_factory=set)

    def outcome(self) -> FlushOutcome:
        return FlushOutcome(
            frozenset(self.written), frozenset(self.gone), frozenset(self.deferred), dict(self.failed),
            frozenset(self.fenced), frozenset(self.stuck),
        )


def _term(write: SlotWrite) -> _Term | None:
    return None if write.fence is None else (write.slot, write.fence.fence)


def _transient(error: DBAPIError) -> bool:
    """A lock or statement timeout, a deadlock, a lost connection: the flush is tried again, not split."""
    return isinstance(translate(error), DatabaseBusy | DatabaseUnavailable)
