"""The engine's reads of ``correlation_message``: a slot's work, and the durable pauses that hold it back.

A slot is read in two steps, each bounded by what it returns rather than by what the table holds (DESIGN.md
§2.1 "a poll must cost O(page)"):

1. :meth:`FetchStatements.messages_candidates` finds the slot's hints that may have work: hints with fresh
   messages by a loose index scan (one index probe per hint, however many messages it has queued, starting
   after a round-robin cursor), and hints with a delayed message now due.
2. :meth:`FetchStatements.messages_fetch_batches` reads each chosen hint's batch: its ready, due messages in
   id order up to the first one that holds the hint back (a waiting retry, a paused message, a dead one in
   ``fail_first`` mode: one index probe each) and up to the commit-order horizon. Each message says whether
   a call of it is in flight (:mod:`worker.db.calls`): the engine ends the hint's batch before such a message.

Rows come back as :class:`~worker.message.Message` values; a row the worker cannot read (a payload it cannot
decode, say) comes back as an :class:`Unreadable` so that the engine dead-letters it and goes on.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import ARRAY, BigInteger, Integer, Text, bindparam, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.sql import TextClause

from worker.config import Mode
from worker.db.base import StoreBase, driver_rows, driver_sql, text_array
from worker.db.rows import ENGINE_COLUMNS, Unreadable, decode_row, sqlite_time
from worker.db.schema import pause_table
from worker.message import Message
from worker.policy.outcomes import storable_text

# -- values ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HorizonReading:
    """The id sequence's last value and the producer transactions still registered (see policy.horizon)."""

    last_id: int
    pins: tuple[tuple[int, str], ...]  # (every id of it is above this, the transaction holding it)


@dataclass(frozen=True, slots=True)
class Candidates:
    """A slot's hints that may have work now."""

    fresh: tuple[str, ...]  # hints with fresh messages, in hint order after the cursor
    due: tuple[str, ...]  # hints with a delayed message that is due now
    next_due: datetime | None  # the earliest due time still to come in the slot
    now: datetime  # the database clock when they were read
    horizon: HorizonReading | None = None  # the commit-order horizon read by the same statement (PostgreSQL)


@dataclass(frozen=True, slots=True)
class Fetched:
    """Batches read for some hints: messages in id order per hint, and rows that could not be read."""

    messages: tuple[Message, ...]
    unreadable: tuple[Unreadable, ...]
    now: datetime
    in_flight: frozenset[int] = frozenset()  # ids of messages with a call in flight (a batch ends before one)
    # Hints whose batch the page's limit cut short (PostgreSQL; None: not known, any hint may have been)
    cut: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class Pause:
    """A durable pause: a message name, a hint, or everything (``scope`` all), held back until lifted."""

    id: int
    scope: str
    target: str
    reason: str
    created_by: str
    created_at: datetime



# -- the engine's statements ------------------------------------------------------------------------------------


def _now_sql(dialect: str) -> str:
    return "now()" if dialect == "postgresql" else "strftime('%Y-%m-%d %H:%M:%f000', 'now')"


def _candidates_sql(dialect: str, wrap: bool) -> TextClause:
    """A slot's hints with fresh messages after :after (before it, with ``wrap``), hints with due messages
    (neither of them among :skip, the hints this replica is busy with: the budget is for hints it can take),
    the next due time and the clock."""
    now = _now_sql(dialect)
    pg = dialect == "postgresql"
    kept = "<> ALL(CAST(:skip AS text[]))" if pg else "NOT IN (SELECT value FROM json_each(:skip))"
    no_time = "CAST(NULL AS timestamptz)" if dialect == "postgresql" else "NULL"
    # PostgreSQL: the commit-order horizon's reading comes with the clock (it must be read before the batches'
    # snapshot, and a reading this recent serves them), saving the fetch a round trip of its own.
    with_horizon = pg and not wrap
    extra = (
        ", CAST(NULL AS bigint) AS last_id, CAST(NULL AS bigint[]) AS pin_ids, CAST(NULL AS text[]) AS pin_holders"
        if with_horizon
        else ""
    )
    clock = (
        f"SELECT 't', NULL, {now}, h.last_id, h.pin_ids, h.pin_holders FROM correlation_order_horizon() AS h"
        if with_horizon
        else f"SELECT 't', NULL, {now}"
    )
    # PostgreSQL: each probe must walk the slot's own fresh hints (correlation_message_fresh_hint_idx), never
    # the hints of every slot (correlation_message_hint_ready_idx, which gives hint order too, the slot filtered
    # out row by row: a probe then reads every ready row up to the slot's next hint). Statistics taken while no
    # row was ready (an empty queue before a burst, a paused backlog before its release) price both at one row,
    # and the choice turned to the wrong one as the table grew during a drain: 6-10 ms a candidates statement
    # instead of 0.3. The slot is compared through ANY, so that it is no constant the order can drop, and the
    # probe asks for (slot, hint) order: only the slot's index gives it without a sort, which the other index
    # would need on top of its scan. (Pricing sorts out as well, SET LOCAL enable_sort in a transaction of the
    # statement's own, added 0.1-0.15 ms to every wake-up: left out.)
    slot = "m.slot = ANY(ARRAY[CAST(:slot AS smallint)])" if pg else "m.slot = :slot"
    order = "m.slot, m.correlation_hint" if pg else "m.correlation_hint"
    fresh = f"{slot} AND m.state = 'ready' AND m.next_attempt_at IS NULL"
    bound = "AND m.correlation_hint <= :after" if wrap else ""
    start = "''" if wrap else ":after"
    return text(
        f"""
        WITH RECURSIVE fresh(hint) AS (
            SELECT (SELECT m.correlation_hint FROM correlation_message m
                     WHERE {fresh} AND m.correlation_hint > {start} {bound}
                     ORDER BY {order} LIMIT 1)
            UNION ALL
            SELECT (SELECT m.correlation_hint FROM correlation_message m
                     WHERE {fresh} AND m.correlation_hint > fresh.hint {bound}
                     ORDER BY {order} LIMIT 1)
              FROM fresh WHERE fresh.hint IS NOT NULL
        )
        SELECT 'f' AS kind, hint, {no_time} AS due{extra} FROM (
            SELECT hint FROM fresh WHERE hint IS NOT NULL AND hint {kept} LIMIT :budget) AS f
        UNION ALL
        SELECT 'd', hint, {no_time}{extra} FROM (
            SELECT m.correlation_hint AS hint FROM correlation_message m
             WHERE m.slot = :slot AND m.state = 'ready' AND m.next_attempt_at IS NOT NULL
               AND m.next_attempt_at <= {now} AND m.correlation_hint {kept}
             ORDER BY m.next_attempt_at LIMIT :budget) AS d
        UNION ALL
        SELECT 'n', NULL, (SELECT min(m.next_attempt_at) FROM correlation_message m
                            WHERE m.slot = :slot AND m.state = 'ready' AND m.next_attempt_at > {now}){extra}
        UNION ALL
        {clock}
        """
    ).bindparams(bindparam("slot", type_=Integer()), bindparam("budget", type_=Integer()))


_HINT = 3  # the hint's column in ENGINE_COLUMNS

# Whether a call of the message is in flight (a primary-key probe of the small correlation_call table).
_IN_FLIGHT = "EXISTS (SELECT 1 FROM correlation_call f WHERE f.message_id = {m}.id) AS in_flight"


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
        SELECT {ENGINE_COLUMNS}, {_IN_FLIGHT.format(m="m")} FROM correlation_message m
         WHERE m.correlation_hint = {hint_expression} AND m.state = 'ready' AND m.id <= :horizon
           AND (m.next_attempt_at IS NULL OR m.next_attempt_at <= {now})
           AND (m.expires_at IS NULL OR m.expires_at > {now})
           AND m.id < {least}({", ".join(blockers)})
         ORDER BY m.id LIMIT :per_hint"""


def _batches_statement(dialect: str, mode: Mode) -> TextClause:
    if dialect == "postgresql":
        def inner(hint: str) -> str:
            return _batch_sql(dialect, mode, hint).replace(f"{ENGINE_COLUMNS}, {_IN_FLIGHT.format(m='m')}", "m.*", 1)

        # The page takes the hints' batches whole, oldest first (by each batch's first id), until its limit: a
        # hint split between two fetches costs a second fetch, run and mark for the same batch, and the oldest
        # work (a message delivered again after a crash among it) goes first. The hints are put in that order
        # first (one probe each), so that the batches are read in it and no further than the limit.
        # Each row says how long its hint's batch is: a hint with fewer rows in the page was cut by the limit.
        sql = f"""
            SELECT {ENGINE_COLUMNS.replace("m.", "x.")}, x.batch, {_IN_FLIGHT.format(m="x")}
              FROM unnest(ARRAY(SELECT c.hint FROM unnest(CAST(:hints AS text[])) AS c(hint)
                                 CROSS JOIN LATERAL (SELECT y.id FROM ({inner("c.hint")}) AS y LIMIT 1) AS h
                                 ORDER BY h.id)) WITH ORDINALITY AS o(hint, turn)
             CROSS JOIN LATERAL (SELECT y.*, count(*) OVER () AS batch FROM ({inner("o.hint")}) AS y) AS x
             ORDER BY o.turn, x.id LIMIT :limit"""
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
def _statement(dialect: str, name: str, variant: object, build: Callable[[], TextClause]) -> TextClause:
    key = (dialect, name, variant)
    statement = _STATEMENTS.get(key)
    if statement is None:
        statement = _STATEMENTS[key] = build()
    return statement


# The batches' statement runs its generic plan (see FetchStatements._batches), set for its transaction alone.
_PIPELINE = psycopg.Pipeline.is_supported()
_GENERIC_PLAN = "SET LOCAL plan_cache_mode = force_generic_plan"

def _rows_of_generic_plan(driver: Any, sql: str, params: dict[str, Any]) -> list[Any]:
    """The rows of a statement run with its generic plan, in one round trip and a transaction of its own (so
    that the setting ends with it whatever happens), on a connection in autocommit; else as it is.

    For the batches' statement a plan made for the values at hand costs more to make (about half a millisecond
    here) than the generic one costs to run, yet PostgreSQL's own choice stays with such plans when the batch
    is one hint's.
    """
    with driver.cursor(binary=True) as cursor:
        if not (_PIPELINE and driver.autocommit):
            return cursor.execute(sql, params).fetchall()  # type: ignore[no-any-return]
        try:
            with driver.pipeline():
                driver.execute("BEGIN")
                driver.execute(_GENERIC_PLAN)
                cursor.execute(sql, params)
                driver.execute("COMMIT")
        except Exception:
            if driver.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                driver.rollback()
            raise
        return cursor.fetchall()  # type: ignore[no-any-return]


# The commit-order horizon's reading (PostgreSQL): see schema/ddl/0003 and worker.policy.horizon.
_HORIZON = text("SELECT last_id, pin_ids, pin_holders FROM correlation_order_horizon()")

# Dead-letter a row the worker cannot read or record, with the reason; its other values are left alone
# except next_attempt_at (the one worker-owned time that could be out of range).
_DEAD_LETTER = text(
    "UPDATE correlation_message SET state = 'dead', next_attempt_at = NULL, last_error = :reason WHERE id = :id"
)

# Pause one message for a durable pause of its name (it then holds back the later messages of its hint).
_PARK = text(
    "UPDATE correlation_message SET state = 'paused', pause_id = :pause_id WHERE id = :id AND state = 'ready' "
    "AND EXISTS (SELECT 1 FROM correlation_pause p WHERE p.id = :pause_id)"  # not once the pause is lifted
)



class FetchStatements(StoreBase):
    """The engine's reads of a slot's work (and the writes that put unreadable or paused rows aside)."""

    def messages_candidates(self, slot: int, after: str, budget: int, skip: Sequence[str] = ()) -> Candidates:
        """A slot's hints that may have work: up to ``budget`` with fresh messages after ``after`` (wrapping
        round to the start), up to ``budget`` with due delayed messages, and the slot's next due time."""
        return self._run(lambda c: self._candidates(c, slot, after, budget, skip))

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
        skip: Sequence[str] = (),
    ) -> tuple[Candidates, Fetched]:
        """A slot's fetch: its candidate hints, the hints ``choose`` takes of them, then the commit-order horizon
        (``horizon`` decides, reading it through the function it is given when it needs a fresh reading) and
        those hints' batches below it. ``skip``: hints this replica is busy with (not candidates).

        The batches must be read from a snapshot taken after ``choose`` ran (which looks at what this replica
        is still busy with) and after the horizon was read: on PostgreSQL each statement runs on its own (the
        candidates' statement reads the horizon too); SQLite keeps one snapshot per transaction, so the
        batches get a second one.
        """

        def batches(connection: Connection, candidates: Candidates, hints: Sequence[str]) -> Fetched:
            if not hints:
                return Fetched((), (), candidates.now)
            limit_id = horizon(lambda: candidates.horizon)
            return self._batches(connection, hints, limit_id, per_hint, limit, mode, candidates.now)

        if self.dialect == "sqlite":
            candidates = self._run(lambda c: self._candidates(c, slot, after, budget, skip))
            hints = choose(candidates)
            return candidates, self._run(lambda c: batches(c, candidates, hints))

        # Two statements, each its own transaction (no BEGIN, no COMMIT): the candidates with the horizon's
        # reading, then the batches from a snapshot taken after it.
        def work(connection: Connection) -> tuple[Candidates, Fetched]:
            candidates = self._candidates(connection, slot, after, budget, skip)
            return candidates, batches(connection, candidates, choose(candidates))

        return self._statements(work)

    def _candidates(
        self, connection: Connection, slot: int, after: str, budget: int, skip: Sequence[str] = ()
    ) -> Candidates:
        pg = self.dialect == "postgresql"
        busy = text_array(skip) if pg else json.dumps(list(skip))

        def read(wrap: bool, take: int) -> list[Any]:
            statement = _statement(self.dialect, "candidates", wrap, lambda: _candidates_sql(self.dialect, wrap))
            params = {"slot": slot, "after": after, "budget": take, "skip": busy}
            if pg:  # psycopg itself: this statement runs at every fetch
                return driver_rows(connection.connection.driver_connection, statement, params)
            return list(connection.execute(statement, params).all())

        # Rows: (kind, hint, due[, last_id, pin_ids, pin_holders]).
        rows = read(False, budget)
        fresh = [row[1] for row in rows if row[0] == "f"]
        if len(fresh) < budget and after:
            fresh += [row[1] for row in read(True, budget - len(fresh)) if row[0] == "f" and row[1] not in fresh]
        due = tuple(dict.fromkeys(row[1] for row in rows if row[0] == "d"))
        times = {row[0]: sqlite_time(row[2]) for row in rows if row[0] in ("n", "t")}
        now = times["t"]
        assert now is not None
        clock = next(row for row in rows if row[0] == "t")
        reading = _horizon_reading(*clock[3:]) if pg else None
        return Candidates(tuple(fresh), due, times.get("n"), now, reading)

    def _horizon(self, connection: Connection) -> HorizonReading:
        return _horizon_reading(*connection.execute(_HORIZON).one())

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
            rows: list[Any] = _rows_of_generic_plan(driver, driver_sql(statement), params)
        else:  # the same page: whole batches, oldest first, until the limit
            found = [connection.execute(statement, {"hint": hint, "horizon": horizon, "per_hint": per_hint}).all()
                     for hint in hints]
            rows = []
            for batch in sorted(filter(None, found), key=lambda batch: batch[0][0]):
                rows += batch[: limit - len(rows)]
                if len(rows) >= limit:
                    break
        messages: list[Message] = []
        unreadable: list[Unreadable] = []
        in_flight: list[int] = []
        batches: dict[str, int] = {}
        for row in rows:
            if row[-1]:
                in_flight.append(int(row[0]))
            if sqlite:
                decoded = decode_row(row[:-1], sqlite)
            else:
                decoded = decode_row(row[:-2], sqlite)
                batches[row[_HINT]] = int(row[-2])
            if isinstance(decoded, Message):
                messages.append(decoded)
            else:
                unreadable.append(decoded)
        cut = None
        if not sqlite:
            got = Counter(row[_HINT] for row in rows)
            cut = frozenset(hint for hint, batch in batches.items() if got[hint] < batch)
        return Fetched(tuple(messages), tuple(unreadable), now, frozenset(in_flight), cut)

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


def _horizon_reading(last_id: int, pin_ids: Sequence[int] | None, pin_holders: Sequence[str] | None) -> HorizonReading:
    pins = tuple(zip(pin_ids or (), pin_holders or (), strict=True))
    return HorizonReading(int(last_id), tuple((int(after), str(holder)) for after, holder in pins))


def _pause(row: Any) -> Pause:
    return Pause(row.id, row.scope, row.target, row.reason, row.created_by, row.created_at)



