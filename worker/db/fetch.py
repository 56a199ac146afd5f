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

import functools
import json
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import ARRAY, BigInteger, BindParameter, Integer, Text, bindparam, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.sql import TextClause

from worker.config import Mode
from worker.db.base import PREPARED, Fence, StoreBase, driver_rows, driver_sql, int_array, text_array
from worker.db.rows import ENGINE_COLUMNS, TEXT_COLUMNS, Unreadable, decode_row, sqlite_time
from worker.db.schema import pause_table
from worker.message import PAYLOAD_MAX_BYTES, Message
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
    table_bytes: int | None = None  # the message table's size on disk then (PostgreSQL)


@dataclass(frozen=True, slots=True)
class Fetched:
    """Batches read for some hints: messages in id order per hint, and rows that could not be read."""

    messages: tuple[Message, ...]
    unreadable: tuple[Unreadable, ...]
    now: datetime
    in_flight: frozenset[int] = frozenset()  # ids of messages with a call in flight (a batch ends before one)
    # Hints whose batch the page's limit cut short (PostgreSQL; None: not known, any hint may have been)
    cut: frozenset[str] | None = None
    marked: frozenset[int] = frozenset()  # calls the fetch marked in flight itself (see FetchMark)
    # Whether the page's payload bytes reached its bound (rows may have been left for the next fetch)
    bytes_full: bool = False
    remaining: float | None = None  # with them: the seconds left of the term they were marked under


@dataclass(frozen=True, slots=True)
class SlotLook:
    """What one look at a quiet slot found (:meth:`FetchStatements.messages_look`): whether a fetch would find
    anything to do there now, and its next due time still to come."""

    work: bool  # a fresh message, a delayed one now due, or a call of another term to adopt
    next_due: datetime | None  # the earliest due time still to come in the slot
    now: datetime  # the database clock when it was read


@dataclass(frozen=True, slots=True)
class FetchMark:
    """Calls a slot's fetch marks in flight itself, in its own round trip, for lanes waiting for work: the first
    run of each of the page's first ``count`` hints, under the term ``fence`` while it runs. A run is the start of
    its hint's batch, as many calls as ``runs`` says for its first message's name (one for a name not in it, as
    a lane sizes it), and ends before a call already in flight, one whose name is in ``paused`` (it is parked
    instead) and one delivered again; none is marked from the first hint whose first message was delivered again
    on (it is called alone, and the hints before it in the page are the ones the lanes would have taken before it
    anyway).
    PostgreSQL only."""

    fence: Fence
    count: int
    paused: tuple[str, ...] = ()
    runs: tuple[tuple[str, int], ...] = ()  # (message name, calls in its run)


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


def _candidates_sql(wrap: bool) -> TextClause:
    """SQLite: a slot's hints with fresh messages after :after (before it, with ``wrap``), hints with due messages
    (neither of them among :skip, the hints this replica is busy with: the budget is for hints it can take),
    the next due time and the clock. PostgreSQL reads the same in :func:`_slot_fetch_sql`."""
    now = _now_sql("sqlite")
    kept = "NOT IN (SELECT value FROM json_each(:skip))"
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
        SELECT 'f' AS kind, hint, NULL AS due FROM (
            SELECT hint FROM fresh WHERE hint IS NOT NULL AND hint {kept} LIMIT :budget) AS f
        UNION ALL
        SELECT 'd', hint, NULL FROM (
            SELECT m.correlation_hint AS hint FROM correlation_message m
             WHERE m.slot = :slot AND m.state = 'ready' AND m.next_attempt_at IS NOT NULL
               AND m.next_attempt_at <= {now} AND m.correlation_hint {kept}
             ORDER BY m.next_attempt_at LIMIT :budget) AS d
        UNION ALL
        SELECT 'n', NULL, (SELECT min(m.next_attempt_at) FROM correlation_message m
                            WHERE m.slot = :slot AND m.state = 'ready' AND m.next_attempt_at > {now})
        UNION ALL
        SELECT 't', NULL, {now}
        """
    ).bindparams(bindparam("slot", type_=Integer()), bindparam("budget", type_=Integer()))


# PostgreSQL: the hints a slot's fetch takes and the commit-order horizon its batches are read below, handed from
# the candidates' statement to the batches' statement inside their transaction (see _slot_fetch_sql).
_PAGE_HINTS = "correlation.page_hints"
_PAGE_HORIZON = "correlation.page_horizon"


def _fresh_probe(slot: str, after: str, bound: str = "") -> str:
    """PostgreSQL: the first hint after ``after`` with a fresh message in the slot ``slot`` (an expression), one
    index probe: a step of the loose index scan over a slot's hints."""
    # Each probe walks the slot's own fresh hints (correlation_message_fresh_hint_idx), never the hints of every
    # slot (correlation_message_hint_ready_idx, which gives hint order too, the slot filtered out row by row: a
    # probe there reads every ready row up to the slot's next hint), whatever the statistics say: taken while no
    # row was ready (an empty queue before a burst, a paused backlog before its release), they price both at one
    # row. The slot is compared through ANY, so that it is no constant the order can drop, and the probe asks for
    # (slot, hint) order: only the slot's index gives it without a sort, which the other index would need on top
    # of its scan. Sorts are not priced out instead: that takes a setting, so a transaction of the statement's own,
    # 0.1-0.15 ms more on every wake-up.
    return f"""(SELECT m.correlation_hint FROM correlation_message m
                 WHERE m.slot = ANY(ARRAY[CAST({slot} AS smallint)]) AND m.state = 'ready'
                   AND m.next_attempt_at IS NULL AND m.correlation_hint > {after} {bound}
                 ORDER BY m.slot, m.correlation_hint LIMIT 1)"""


# Past this many hints to leave out, a fetch compares the hints it walks with them through a hash: every step of
# the walk over a slot's hints is compared with all of them, and the hints left out are walked past, so with a
# plain ``<> ALL`` the statement grows with their square. Below it the plain comparison is cheaper: the hashes
# cost 0.1-0.2 ms a statement to build.
SKIP_HASHED = 100


def _slot_fetch(skipped: int, reused: bool = False) -> TextClause:
    """The slot's fetch statement for this many hints to leave out, reading the horizon or reusing one."""
    hashed = skipped > SKIP_HASHED
    return _statement("postgresql", "slot_fetch", (hashed, reused), lambda: _slot_fetch_sql(hashed, reused))


# A horizon reading taken moments before by another fetch of the replica, with no producer transaction open then,
# instead of reading every lock of the server again (see FetchStatements.messages_fetch_slot).
_REUSED_HORIZON = """SELECT CAST(:reuse AS bigint) AS last_id, CAST(NULL AS bigint[]) AS pin_ids,
                   CAST(NULL AS text[]) AS pin_holders, CAST(:reuse AS bigint) AS horizon"""


def _slot_fetch_sql(hashed: bool = False, reused: bool = False) -> TextClause:
    """PostgreSQL: a slot's candidates (as :func:`_candidates_sql` reads them on SQLite), both rounds of the
    cursor in one statement (the hints from the start up to the cursor are probed only when those after it fall
    short of the budget), with the clock and the commit-order horizon: its reading, and the id it allows, leaving
    out the pins in ``:passed`` (``after/holder``: producer transactions open longer than ``order.max_wait``).
    The hints to take (due and fresh, none of ``:skip``) and that id are set for the transaction, where the
    batches' statement that follows finds them (:func:`_page_sql`), with its generic plan (see
    :func:`_rows_of_generic_plan`): the fetch is one round trip, and the batches are still read from a snapshot
    taken after the horizon's reading. Alone (:meth:`FetchStatements.messages_candidates`) what it sets ends with
    it."""
    kept = "NOT IN (SELECT unnest(CAST(:skip AS text[])))" if hashed else "<> ALL(CAST(:skip AS text[]))"
    reading = _REUSED_HORIZON if reused else """SELECT o.last_id, o.pin_ids, o.pin_holders,
                   LEAST(o.last_id, (SELECT min(p.after) FROM unnest(o.pin_ids, o.pin_holders) AS p(after, holder)
                                      WHERE p.after::text || '/' || p.holder <> ALL(CAST(:passed AS text[]))))
                     AS horizon
              FROM correlation_order_horizon() AS o"""

    def probe(after: str, bound: str) -> str:
        return _fresh_probe(":slot", after, bound)

    wrap = "AND m.correlation_hint <= :after"
    nothing = ("CAST(NULL AS timestamptz), CAST(NULL AS bigint), CAST(NULL AS bigint[]), CAST(NULL AS text[]), "
               "CAST(NULL AS bigint)")
    return text(
        f"""
        WITH RECURSIVE after_cursor(hint) AS (
            SELECT {probe(":after", "")}
            UNION ALL
            SELECT {probe("a.hint", "")} FROM after_cursor a WHERE a.hint IS NOT NULL
        ), up_to_cursor(hint) AS (
            SELECT {probe("''", wrap)} WHERE :after <> ''
            UNION ALL
            SELECT {probe("u.hint", wrap)} FROM up_to_cursor u WHERE u.hint IS NOT NULL
        ), f AS MATERIALIZED (
            SELECT hint FROM (SELECT hint FROM after_cursor WHERE hint IS NOT NULL AND hint {kept}
                              UNION ALL
                              SELECT hint FROM up_to_cursor WHERE hint IS NOT NULL AND hint {kept}) AS r
             LIMIT :budget
        ), d AS MATERIALIZED (
            SELECT m.correlation_hint AS hint FROM correlation_message m
             WHERE m.slot = :slot AND m.state = 'ready' AND m.next_attempt_at IS NOT NULL
               AND m.next_attempt_at <= now() AND m.correlation_hint {kept}
             ORDER BY m.next_attempt_at LIMIT :budget
        ), h AS MATERIALIZED (
            {reading}
        )
        SELECT 'f' AS kind, hint, {nothing} FROM f
        UNION ALL
        SELECT 'd', hint, {nothing} FROM d
        UNION ALL
        SELECT 'n', NULL, (SELECT min(m.next_attempt_at) FROM correlation_message m
                            WHERE m.slot = :slot AND m.state = 'ready' AND m.next_attempt_at > now()),
               CAST(NULL AS bigint), CAST(NULL AS bigint[]), CAST(NULL AS text[]), CAST(NULL AS bigint)
        UNION ALL
        SELECT 't', NULL, now(), h.last_id, h.pin_ids, h.pin_holders,
               pg_relation_size(CAST('correlation_message' AS regclass)) FROM h
         WHERE set_config('{_PAGE_HINTS}', CAST(ARRAY(SELECT hint FROM d UNION SELECT hint FROM f) AS text), true)
                 IS NOT NULL
           AND set_config('{_PAGE_HORIZON}', CAST(h.horizon AS text), true) IS NOT NULL
           AND set_config('plan_cache_mode', 'force_generic_plan', true) IS NOT NULL
           AND set_config('enable_seqscan', 'off', true) IS NOT NULL
        """
    ).bindparams(bindparam("slot", type_=Integer()), bindparam("budget", type_=Integer()))


# PostgreSQL: one look at many quiet slots at once (see FetchStatements.messages_look), three index probes a slot:
# its first fresh hint (as a fetch's candidates probe it), its earliest delayed message, and a call of a term
# other than the one given (what an adoption sweep looks for first).
_LOOK_SQL = text(
    f"""
    SELECT s.slot, {_fresh_probe("s.slot", "''")} IS NOT NULL AS fresh,
           (SELECT m.next_attempt_at FROM correlation_message m
             WHERE m.slot = ANY(ARRAY[CAST(s.slot AS smallint)]) AND m.state = 'ready'
               AND m.next_attempt_at IS NOT NULL
             ORDER BY m.slot, m.next_attempt_at LIMIT 1) AS due,
           EXISTS (SELECT FROM correlation_call c WHERE c.slot = s.slot AND c.fence <> s.fence) AS ended,
           now() AS now
      FROM unnest(CAST(:slots AS integer[]), CAST(:fences AS bigint[])) AS s(slot, fence)
    """
)

_PAUSES_PG = text("SELECT id, scope, target, reason, created_by, created_at FROM correlation_pause ORDER BY id")

_HINT = ENGINE_COLUMNS.index("correlation_hint")  # the hint's column in a batch's row
_PAYLOAD = ENGINE_COLUMNS.index("payload")  # the payload's (as text)


def _engine_columns(row: str) -> str:
    """ENGINE_COLUMNS read from ``row``, a row of correlation_message: the JSON ones as text (see TEXT_COLUMNS)."""
    return ", ".join(f"CAST({row}.{name} AS TEXT) AS {name}" if name in TEXT_COLUMNS else f"{row}.{name}"
                     for name in ENGINE_COLUMNS)


def _engine_names(row: str) -> str:
    """ENGINE_COLUMNS by name, as ``row``, a row of a subquery that selected them, has them."""
    return ", ".join(f"{row}.{name}" for name in ENGINE_COLUMNS)


def _in_flight(dialect: str, row: str) -> str:
    """Whether a call of the message read as ``row`` is in flight: one primary-key probe of correlation_call.

    On PostgreSQL the OFFSET 0 keeps it a probe per row (with sequential scans priced out, see _GENERIC_PLANS).
    Without it the planner may answer the EXISTS from a hash of every row of correlation_call, built by each fetch:
    its estimate of a page's rows is a generic plan's (a handful) and the table's rows may have been counted while
    it was small, yet with a backlog in flight it holds tens of thousands of calls: the hash reads them all at every
    fetch, where the probes read one a row."""
    fence = " OFFSET 0" if dialect == "postgresql" else ""
    return f"EXISTS (SELECT 1 FROM correlation_call f WHERE f.message_id = {row}.id{fence}) AS in_flight"


def _batch_sql(dialect: str, mode: Mode, *, columns: str, hint: str, horizon: str = ":horizon") -> str:
    """One hint's batch as rows ``m`` selecting ``columns``: ready, due, unexpired messages of the hint ``hint``
    (an expression) in id order, at most ``:per_hint`` of them, none above ``horizon`` (an expression) nor at or
    after the first message that holds the hint back (a paused one, a waiting retry, a dead one in ``fail_first``
    mode).

    On PostgreSQL every probe goes through its hint's own index (of ready, of delayed, of paused and dead rows),
    whatever the statistics say: a plan made while the table was empty prices every path at nothing, and the
    primary key, which gives id order too, would then read every row of the table for each probe, filtering by
    hint. So the hint is compared through ANY, no constant the planner can use to drop the order, and the order
    asked for is (hint, id): only the hint's index gives it without a sort, which the primary key would need on top
    of its scan (as :func:`_fresh_probe` does with the slot). The batch's own probe can still go to the primary key
    once the ready rows' index has grown large, so a plan is not kept past a growth of the table (see
    PAGE_PLAN_SIZE_STEP)."""
    now = _now_sql(dialect)
    unexpired = f"(b.expires_at IS NULL OR b.expires_at > {now})"
    least = "LEAST" if dialect == "postgresql" else "min"
    if dialect == "postgresql":
        def of_hint(row: str) -> str:
            return f"{row}.correlation_hint = ANY(ARRAY[CAST({hint} AS text)])"

        def in_order(row: str) -> str:
            return f"{row}.correlation_hint, {row}.id"
    else:
        def of_hint(row: str) -> str:
            return f"{row}.correlation_hint = {hint}"

        def in_order(row: str) -> str:
            return f"{row}.id"
    blockers = [
        f"""COALESCE((SELECT b.id FROM correlation_message b
                       WHERE {of_hint("b")} AND b.state = 'paused' AND {unexpired}
                       ORDER BY {in_order("b")} LIMIT 1), {horizon} + 1)""",
        f"""COALESCE((SELECT b.id FROM correlation_message b
                       WHERE {of_hint("b")} AND b.state = 'ready'
                         AND b.next_attempt_at IS NOT NULL AND b.next_attempt_at > {now} AND {unexpired}
                       ORDER BY {in_order("b")} LIMIT 1), {horizon} + 1)""",
    ]
    if mode is Mode.FAIL_FIRST:
        blockers.append(
            f"""COALESCE((SELECT b.id FROM correlation_message b
                           WHERE {of_hint("b")} AND b.state = 'dead' AND {unexpired}
                           ORDER BY {in_order("b")} LIMIT 1), {horizon} + 1)"""
        )
    return f"""
        SELECT {columns} FROM correlation_message m
         WHERE {of_hint("m")} AND m.state = 'ready' AND m.id <= {horizon}
           AND (m.next_attempt_at IS NULL OR m.next_attempt_at <= {now})
           AND (m.expires_at IS NULL OR m.expires_at > {now})
           AND m.id < {least}({", ".join(blockers)})
         ORDER BY {in_order("m")} LIMIT :per_hint"""


# PostgreSQL: where the page reads its hints (text[]) and its horizon (bigint). In a slot's fetch they are what its
# candidates' statement set for the transaction (see _slot_fetch_sql); the batches' statement alone takes :hints.
_HINTS_SET = f"CAST(current_setting('{_PAGE_HINTS}', true) AS text[])"
_HORIZON_SET = f"CAST(current_setting('{_PAGE_HORIZON}', true) AS bigint)"
_HINTS_PARAMETER = "CAST(:hints AS text[])"


def _page_of_batches(mode: Mode, *, hints: str, horizon: str, page_turn: bool) -> str:
    """PostgreSQL: the batches of the hints in ``hints`` (a text[] expression) below ``horizon`` (a bigint
    expression), whole, oldest first (by each batch's first id), ``:limit`` rows at most. Each row has
    ENGINE_COLUMNS, its batch's length (``batch``: a hint with fewer rows in the page was cut by the limit), with
    ``page_turn`` also its hint's place in the page (``page_turn``), and whether a call of it is in flight.

    The page takes batches whole and the oldest first: a hint split between two fetches costs a second fetch, run
    and mark for the same batch, and the oldest work (a message delivered again after a crash among it) goes first.
    The hints are put in that order first (one probe each), so that the batches are read in it and no further than
    the limit."""

    def batch(hint: str) -> str:
        return _batch_sql("postgresql", mode, columns="m.*", hint=hint, horizon=horizon)

    turn = " o.turn AS page_turn," if page_turn else ""
    return f"""
            SELECT {_engine_columns("x")}, x.batch,{turn} {_in_flight("postgresql", "x")}
              FROM unnest(ARRAY(SELECT c.hint FROM unnest({hints}) AS c(hint)
                                 CROSS JOIN LATERAL (SELECT y.id FROM ({batch("c.hint")}) AS y LIMIT 1) AS h
                                 ORDER BY h.id)) WITH ORDINALITY AS o(hint, turn)
             CROSS JOIN LATERAL (SELECT y.*, count(*) OVER () AS batch FROM ({batch("o.hint")}) AS y) AS x
             ORDER BY o.turn, x.id LIMIT :limit"""


def _page_sql_text(mode: Mode, *, bounded: bool, hints: str, horizon: str, page_turn: bool = False) -> str:
    """PostgreSQL: :func:`_page_of_batches`, and with ``bounded`` no row added once the payloads before it reach
    ``:page_bytes`` (the page's first row is always taken).

    The bound is a running sum over the rows the limit lets through, so the batches are still read no further than
    the limit. It costs about a tenth of the statement: a fetch whose limit cannot reach the bound (its limit times
    the largest payload the schema lets in) runs the page alone (see _page_bounded)."""
    if not bounded:
        return _page_of_batches(mode, hints=hints, horizon=horizon, page_turn=page_turn)
    page = _page_of_batches(mode, hints=hints, horizon=horizon, page_turn=True)  # the sum runs in page order
    turn = " w.page_turn," if page_turn else ""
    return f"""
            SELECT {_engine_names("w")}, w.batch,{turn} w.in_flight FROM (
              SELECT q.*, sum(octet_length(q.payload)) OVER (ORDER BY q.page_turn, q.id
                                                             ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
                            AS bytes_before
                FROM ({page}) AS q
            ) AS w
             WHERE w.bytes_before IS NULL OR w.bytes_before < :page_bytes"""


def _batches_statement(dialect: str, mode: Mode, bounded: bool = True) -> TextClause:
    """The batches' statement: on PostgreSQL the page of the hints in ``:hints`` below ``:horizon``
    (:func:`_page_sql_text`; ``bounded``: it also stops at ``:page_bytes`` of payloads); on SQLite the batch of
    ``:hint``, the engine's columns and whether a call is in flight."""
    if dialect == "postgresql":
        sql = _page_sql_text(mode, bounded=bounded, hints=_HINTS_PARAMETER, horizon=":horizon")
        parameters: list[BindParameter[Any]] = [
            bindparam("hints", type_=ARRAY(Text())),
            bindparam("horizon", type_=BigInteger()),
            bindparam("per_hint", type_=Integer()),
            bindparam("limit", type_=Integer()),
        ]
        if bounded:
            parameters.append(bindparam("page_bytes", type_=BigInteger()))
        return text(sql).bindparams(*parameters)
    columns = f"{_engine_columns('m')}, {_in_flight(dialect, 'm')}"
    return text(_batch_sql(dialect, mode, columns=columns, hint=":hint")).bindparams(
        bindparam("horizon", type_=BigInteger()), bindparam("per_hint", type_=Integer())
    )


def _page_bounded(limit: int, page_bytes: int) -> bool:
    """Whether a page of ``limit`` rows could reach ``page_bytes`` of payloads (each at most PAYLOAD_MAX_BYTES)."""
    return limit * PAYLOAD_MAX_BYTES > page_bytes


@functools.cache
def _page_sql(mode: Mode, bounded: bool = True) -> str:
    """PostgreSQL: the batches' statement reading its hints and horizon from what :func:`_slot_fetch_sql` set for
    the transaction (driver placeholders)."""
    return driver_sql(text(_page_sql_text(mode, bounded=bounded, hints=_HINTS_SET, horizon=_HORIZON_SET)))


# The columns of the batches' rows (ENGINE_COLUMNS, the batch's length and whether a call is in flight), by name.
_PAGE_COLUMNS = _engine_names("p") + ", p.batch, p.in_flight"


@functools.cache
def _page_marking_sql(mode: Mode, bounded: bool = True) -> str:
    """PostgreSQL: :func:`_page_sql` that also marks in flight the first run of the page's first ``mark`` hints
    (see :class:`FetchMark`), as :data:`worker.db.calls._MARK_PG` marks a run: under the term while it runs,
    committed without waiting for the disk, a message in flight already left alone. One statement, so the calls
    marked start their hints' batches as the rows returned have them. Each row also says whether it was marked,
    and the seconds left of the term (NULL: the term has ended, nothing was marked)."""
    page = driver_sql(text(_page_sql_text(mode, bounded=bounded, hints=_HINTS_SET, horizon=_HORIZON_SET,
                                          page_turn=True)))
    return f"""
        WITH page AS MATERIALIZED ({page}
        ), term AS MATERIALIZED (
            SELECT CAST(EXTRACT(EPOCH FROM l.lock_until - now()) AS float8) AS remaining,
                   set_config('synchronous_commit', 'off', true) AS fast
              FROM correlation_lock l
             WHERE l.name = %(mark_lock)s AND l.locked_by = %(mark_holder)s
               AND l.fence = CAST(%(mark_fence)s AS bigint) AND l.lock_until > now()
        ), runs AS MATERIALIZED (
            -- each row's place in its hint's batch, and whether its run may reach it: no call before it (nor
            -- itself) in flight, of a paused name, or delivered again after the first
            SELECT id, page_turn, lost_calls,
                   row_number() OVER w AS place,
                   bool_or(in_flight OR message_name = ANY(CAST(%(mark_paused)s AS text[]))) OVER w AS stopped,
                   count(*) FILTER (WHERE lost_calls > 0) OVER w AS again,
                   COALESCE((SELECT r.calls
                               FROM unnest(CAST(%(mark_names)s AS text[]), CAST(%(mark_runs)s AS integer[]))
                                    AS r(name, calls)
                              WHERE r.name = page.message_name), 1) AS run
              FROM page WINDOW w AS (PARTITION BY page_turn ORDER BY id)
        ), heads AS MATERIALIZED (
            -- a run is as long as its first call's name says (as a lane sizes it), and starts at its batch's first
            -- message; in one pass over the page (joined back to runs, the window is planned as a nested loop
            -- computing it again for every row: quadratic in the page)
            SELECT id, page_turn, place, stopped, again,
                   first_value(run) OVER w AS head_run, first_value(id) OVER w AS head_id
              FROM runs WINDOW w AS (PARTITION BY page_turn ORDER BY id)
        ), turns AS (
            SELECT page_turn FROM runs
             WHERE place = 1 AND NOT stopped
               AND page_turn < COALESCE((SELECT min(page_turn) FROM runs WHERE place = 1 AND lost_calls > 0),
                                        2147483647)
             ORDER BY page_turn LIMIT CAST(%(mark)s AS integer)
        ), marked AS (
            INSERT INTO correlation_call (message_id, slot, fence, holder, run_head, state)
            SELECT h.id, CAST(%(slot)s AS integer), CAST(%(mark_fence)s AS bigint), %(mark_holder)s, h.head_id,
                   'called'
              FROM heads h
             WHERE h.page_turn IN (SELECT page_turn FROM turns) AND NOT h.stopped AND h.again = 0
               AND h.place <= h.head_run AND EXISTS (SELECT 1 FROM term)
            ON CONFLICT (message_id) DO NOTHING
            RETURNING message_id
        )
        SELECT {_PAGE_COLUMNS}, p.id IN (SELECT message_id FROM marked) AS marked_now,
               (SELECT remaining FROM term) AS remaining
          FROM page p ORDER BY p.page_turn, p.id"""


def _oldest_eligible_sql(mode: Mode) -> TextClause:
    """PostgreSQL: the created_at of the oldest message that could be correlated now over the slots in
    ``:slots``, in one statement: each slot's candidate hints (up to ``:budget`` fresh ones, probed as a fetch
    probes them, and up to ``:budget`` due ones), then each hint's first message in its batch below
    ``:horizon``."""
    batch = _batch_sql("postgresql", mode, columns="m.created_at", hint="c.hint")
    return text(
        f"""
        SELECT min(b.created_at) FROM unnest(CAST(:slots AS int[])) AS s(slot)
         CROSS JOIN LATERAL (
            (WITH RECURSIVE fresh(hint) AS (
                SELECT {_fresh_probe("s.slot", "''")}
                UNION ALL
                SELECT {_fresh_probe("s.slot", "fresh.hint")} FROM fresh WHERE fresh.hint IS NOT NULL
             )
             SELECT hint FROM fresh WHERE hint IS NOT NULL LIMIT :budget)
            UNION
            (SELECT m.correlation_hint FROM correlation_message m
              WHERE m.slot = s.slot AND m.state = 'ready' AND m.next_attempt_at IS NOT NULL
                AND m.next_attempt_at <= now()
              ORDER BY m.next_attempt_at LIMIT :budget)
         ) AS c(hint)
         CROSS JOIN LATERAL ({batch}) AS b
        """
    ).bindparams(bindparam("horizon", type_=BigInteger()), bindparam("budget", type_=Integer()),
                 bindparam("per_hint", type_=Integer()))


# The statements built so far, by dialect, name and variant: each is built once, and the same object is run again.
_STATEMENTS: dict[tuple[str, str, object], TextClause] = {}


def _statement(dialect: str, name: str, variant: object, build: Callable[[], TextClause]) -> TextClause:
    key = (dialect, name, variant)
    statement = _STATEMENTS.get(key)
    if statement is None:
        statement = _STATEMENTS[key] = build()
    return statement


# The batches' statement runs its generic plan (see FetchStatements._batches), set for its transaction alone, and
# that plan is made with sequential scans priced out: a fetch reaches every row it reads by an index, whatever the
# statistics said when its plan was made. correlation_call above all is analyzed while it is nearly empty (between
# two backlogs) and then holds a backlog's calls in flight: a plan that may scan it would scan all of it for each
# row read. As set_config calls, not SET LOCAL: in a pipeline without BEGIN, SET LOCAL works but warns.
_PIPELINE = psycopg.Pipeline.is_supported()
_GENERIC_PLANS = ("SELECT set_config('plan_cache_mode', 'force_generic_plan', true), "
                  "set_config('enable_seqscan', 'off', true)")


def _rows_of_generic_plan(driver: Any, sql: str, params: dict[str, Any]) -> list[Any]:
    """The rows of a statement run with its generic plan, in one round trip and a transaction of its own (so
    that the setting ends with it whatever happens), on a connection in autocommit; else as it is.

    For the batches' statement a plan made for the values at hand costs more to make than the generic one costs
    to run, yet PostgreSQL's own choice stays with such plans when the batch is one hint's.
    """
    with driver.cursor(binary=True) as cursor:
        if not (_PIPELINE and driver.autocommit):
            return cursor.execute(sql, params, prepare=PREPARED).fetchall()  # type: ignore[no-any-return]
        try:
            with driver.pipeline():
                driver.execute("BEGIN")
                driver.execute(_GENERIC_PLANS)
                cursor.execute(sql, params, prepare=PREPARED)
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

# Pause one message for a durable pause of its name (it then holds back the later messages of its hint), not once
# the pause is lifted. On PostgreSQL the pause's row is locked (KEY SHARE) until the park commits: a lift deletes
# that row, then resumes what its pause parked, so a park either commits before the delete (and the lift resumes it)
# or waits for the lift's commit and then finds no pause. Read from a snapshot alone, a pause being lifted would
# still be seen and the message parked, after the lift's last sweep, by a pause that no longer exists: paused for good.
def _park_sql(lock: str) -> TextClause:
    """The park, the pause's row read with ``lock`` (a locking clause, or nothing)."""
    return text(
        "UPDATE correlation_message SET state = 'paused', pause_id = :pause_id WHERE id = :id AND state = 'ready' "
        f"AND EXISTS (SELECT 1 FROM correlation_pause p WHERE p.id = :pause_id{lock})"
    )


_PARK_BY_DIALECT = {"postgresql": _park_sql(" FOR KEY SHARE"), "sqlite": _park_sql("")}


# The batches' statement runs on a generic plan made at its first run on a connection and kept (see
# _rows_of_generic_plan) until something invalidates it, a vacuum of the table usually. A plan made while the table
# was empty or nearly (a quiet queue whose successes are deleted, vacuumed so) prices every path at nothing and can
# take the primary key for the probes of each hint's batch, each probe then reading every row of a grown table.
# Planning the statement at every fetch instead doubles a wake-up's latency (about 1.5 ms a fetch). So a plan is
# kept for each size of the table, as the previous fetch of the replica saw it on disk, by steps of a factor of 4
# (PAGE_PLAN_SIZE_STEP bits): the statement's text names its size class, and a table that grew past its class gets
# a statement of its own, planned at its first run at that size. Only the fetch that first sees the growth runs
# the smaller table's plan.
PAGE_PLAN_SIZE_STEP = 2


def page_size_class(table_bytes: int) -> int:
    """The class of the message table's size on disk that the batches' statement keeps a plan for: the same for
    sizes within a factor of 4 of each other, from 0 (empty)."""
    return (table_bytes.bit_length() + PAGE_PLAN_SIZE_STEP - 1) // PAGE_PLAN_SIZE_STEP


@functools.cache
def _page_statement(mode: Mode, marking: bool, size_class: int, bounded: bool = True) -> str:
    """The batches' statement (:func:`_page_sql`, or :func:`_page_marking_sql` when it marks) as a fetch runs it
    while the table is of ``size_class``: a distinct text, so a prepared plan of its own."""
    page = _page_marking_sql(mode, bounded) if marking else _page_sql(mode, bounded)
    return page + f"\n/* table size class {size_class} */"


class FetchStatements(StoreBase):
    """The engine's reads of a slot's work (and the writes that put unreadable or paused rows aside)."""

    _table_bytes = 0  # the message table's size as the last fetch saw it (PostgreSQL; see page_size_class)

    def messages_candidates(self, slot: int, after: str, budget: int, skip: Sequence[str] = ()) -> Candidates:
        """A slot's hints that may have work: up to ``budget`` with fresh messages after ``after`` (wrapping
        round to the start), up to ``budget`` with due delayed messages, and the slot's next due time."""
        if self.dialect == "postgresql":
            params = {"slot": slot, "after": after, "budget": budget, "skip": text_array(skip), "passed": "{}"}
            statement = _slot_fetch(len(skip))
            return self._driver_statements(lambda driver: _candidates_of(driver_rows(driver, statement, params)))
        return self._run(lambda c: self._candidates(c, slot, after, budget, skip))

    def order_horizon(self) -> HorizonReading | None:
        """The sequence's last id and the registered producer transactions; None where order needs no
        horizon (SQLite: one writer at a time, so ids commit in order)."""
        if self.dialect != "postgresql":
            return None
        return self._run(self._horizon)

    def messages_look(self, terms: Mapping[int, int | None]) -> dict[int, SlotLook]:
        """Whether each slot (``{slot: fence of its term}``, None without leases) has anything a fetch would do
        now, in one autocommit statement (PostgreSQL): a fresh message, a delayed one now due, or a call of
        another term in flight (to adopt; without leases none is); with the slot's next due time. An idle replica
        looks at its quiet slots this way instead of fetching each of them once a poll."""
        if self.dialect != "postgresql":
            raise NotImplementedError("looking at many slots at once is for PostgreSQL")
        fences = ",".join("NULL" if fence is None else str(int(fence)) for fence in terms.values())
        params = {"slots": int_array(terms), "fences": "{" + fences + "}"}

        def work(driver: Any) -> dict[int, SlotLook]:
            looks = {}
            for slot, fresh, due, ended, now in driver_rows(driver, _LOOK_SQL, params):
                looks[int(slot)] = SlotLook(bool(fresh or ended or (due is not None and due <= now)),
                                            due if due is not None and due > now else None, now)
            return looks

        return self._driver_statements(work)

    def messages_fetch_batches(
        self, hints: Sequence[str], *, horizon: int, per_hint: int, limit: int, mode: Mode,
        page_bytes: int | None = None,
    ) -> Fetched:
        """Each hint's batch (at most ``per_hint`` messages, ``limit`` in all, and no message added once the
        payloads reach ``page_bytes``), in id order per hint."""
        bound = _bytes_bound(page_bytes)
        return self._run(lambda c: self._batches(c, hints, horizon, per_hint, limit, mode, self._now(c), bound))

    def messages_fetch_slot(
        self,
        slot: int,
        after: str,
        budget: int,
        *,
        per_hint: int,
        limit: int,
        mode: Mode,
        skip: Sequence[str] = (),
        passed_over: Sequence[tuple[int, str]] = (),
        mark: FetchMark | None = None,
        reuse_horizon: int | None = None,
        page_bytes: int | None = None,
    ) -> tuple[Candidates, Fetched]:
        """A slot's fetch: its candidate hints (up to ``budget`` fresh ones after ``after``, wrapping round, and up
        to ``budget`` due ones; none of ``skip``, the hints this replica will not take now), and those hints'
        batches below the commit-order horizon, whole, oldest first, ``per_hint`` and ``limit`` at most.

        The horizon leaves out the producer transactions in ``passed_over`` (``(after, holder)`` pins open longer
        than ``order.max_wait``); the candidates carry its reading. The batches are read from a snapshot taken
        after it: on PostgreSQL the two statements go in one round trip, a transaction in which each takes its
        own snapshot; SQLite keeps one snapshot per transaction, so the batches get a second one (and need no
        horizon: one writer at a time, so ids commit in order).

        With ``mark`` (PostgreSQL), the batches' statement also marks the first calls of the page's first hints in
        flight, in the same round trip: their ids and the term's seconds left come back in the
        :class:`Fetched` (``marked``, ``remaining``); SQLite marks nothing here.

        With ``reuse_horizon`` (PostgreSQL), the horizon is not read again: it is that ``last_id``, of a reading an
        earlier fetch took when no producer transaction was registered. A reading taken before this fetch's
        snapshot is as safe as its own (every id at or below it belonged to a transaction that had ended); it
        only leaves out what was committed since, and reading the horizon reads every lock of the server.

        With ``page_bytes``, the page takes no further message once its payloads reach that many bytes (its first
        message is always taken); :attr:`Fetched.bytes_full` says the bound was reached.
        """
        bound = _bytes_bound(page_bytes)
        if self.dialect == "sqlite":
            candidates = self._run(lambda c: self._candidates(c, slot, after, budget, skip))
            hints = list(dict.fromkeys(candidates.due + candidates.fresh))
            fetched = self._run(
                lambda c: self._batches(c, hints, 2**62, per_hint, limit, mode, candidates.now, bound)
            )
            return candidates, fetched
        params = {
            "slot": slot, "after": after, "budget": budget, "skip": text_array(skip),
            "passed": text_array(f"{pin}/{holder}" for pin, holder in passed_over),
            "per_hint": per_hint, "limit": limit, "reuse": reuse_horizon, "page_bytes": bound,
        }
        marking = mark is not None and mark.count > 0
        if mark is not None and marking:
            params.update(
                mark=mark.count, mark_lock=mark.fence.name, mark_holder=mark.fence.holder,
                mark_fence=mark.fence.fence, mark_paused=text_array(mark.paused),
                mark_names=text_array(name for name, _ in mark.runs), mark_runs=int_array(n for _, n in mark.runs),
            )
        return self._driver_statements(lambda driver: self._fetch_pg(driver, params, mode, len(skip), marking))

    def _fetch_pg(
        self, driver: Any, params: dict[str, Any], mode: Mode, skipped: int, marking: bool = False
    ) -> tuple[Candidates, Fetched]:
        statement = _slot_fetch(skipped, reused=params["reuse"] is not None)
        # A plan kept for each size of the table (see PAGE_PLAN_SIZE_STEP).
        bounded = _page_bounded(params["limit"], params["page_bytes"])
        page_sql = _page_statement(mode, marking, page_size_class(self._table_bytes), bounded)
        clock, page = driver.cursor(), driver.cursor(binary=True)
        with clock, page:
            if _PIPELINE and driver.autocommit:
                # One exchange: the statements up to the pipeline's sync run as one transaction.
                with driver.pipeline():
                    driver.execute(_GENERIC_PLANS)  # the slot's statement's too: made at every run otherwise
                    clock.execute(driver_sql(statement), params, prepare=PREPARED)
                    page.execute(page_sql, params, prepare=PREPARED)
            else:  # a libpq without pipelines: the same statements, a round trip each
                with driver.transaction():
                    clock.execute(driver_sql(statement), params, prepare=PREPARED)
                    page.execute(page_sql, params, prepare=PREPARED)
            candidates = _candidates_of(clock.fetchall())
            rows = page.fetchall()
        self._table_bytes = candidates.table_bytes or 0
        bound = params["page_bytes"]
        if not marking:
            return candidates, _fetched(rows, sqlite=False, now=candidates.now, page_bytes=bound)
        marked = frozenset(int(row[0]) for row in rows if row[-2])
        remaining = next((float(row[-1]) for row in rows if row[-1] is not None), None)
        fetched = _fetched([row[:-2] for row in rows], sqlite=False, now=candidates.now, page_bytes=bound)
        return candidates, replace(fetched, marked=marked, remaining=remaining)

    def _candidates(
        self, connection: Connection, slot: int, after: str, budget: int, skip: Sequence[str] = ()
    ) -> Candidates:
        """SQLite: the candidates' statement, and its round from the start when the hints after ``after`` fall
        short of the budget."""

        def read(wrap: bool, take: int) -> list[Any]:
            statement = _statement(self.dialect, "candidates", wrap, lambda: _candidates_sql(wrap))
            params = {"slot": slot, "after": after, "budget": take, "skip": json.dumps(list(skip))}
            return list(connection.execute(statement, params).all())

        rows = read(False, budget)
        fresh = [row[1] for row in rows if row[0] == "f"]
        if len(fresh) < budget and after:
            fresh += [row[1] for row in read(True, budget - len(fresh)) if row[0] == "f" and row[1] not in fresh]
        due = tuple(dict.fromkeys(row[1] for row in rows if row[0] == "d"))
        times = {row[0]: sqlite_time(row[2]) for row in rows if row[0] in ("n", "t")}
        now = times["t"]
        assert now is not None
        return Candidates(tuple(fresh), due, times.get("n"), now)

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
        page_bytes: int = 2**62,
    ) -> Fetched:
        if not hints:
            return Fetched((), (), now)
        sqlite = self.dialect == "sqlite"
        bounded = not sqlite and _page_bounded(limit, page_bytes)
        statement = _statement(self.dialect, "batches", (mode, bounded),
                               lambda: _batches_statement(self.dialect, mode, bounded))
        if not sqlite:
            # The driver's own cursor, binary: this statement reads every message the engine handles, and rows
            # built by the driver alone cost a fraction of the general result machinery.
            params = {"hints": list(hints), "horizon": horizon, "per_hint": per_hint, "limit": limit,
                      "page_bytes": page_bytes}
            driver = connection.connection.driver_connection
            rows: list[Any] = _rows_of_generic_plan(driver, driver_sql(statement), params)
            return _fetched(rows, sqlite=sqlite, now=now, page_bytes=page_bytes)
        # The same page: whole batches, oldest first, until the limit or the bytes. Each hint's batch is read as
        # its rows are taken: its first row only, to put the batches in order, then no further than the page.
        cursors = [connection.execute(statement, {"hint": hint, "horizon": horizon, "per_hint": per_hint})
                   for hint in hints]
        try:
            heads = sorted(((row, cursor) for cursor in cursors if (row := cursor.fetchone()) is not None),
                           key=lambda head: int(head[0][0]))
            rows, size = [], 0
            for head, cursor in heads:
                row = head
                while row is not None and len(rows) < limit and (not rows or size < page_bytes):
                    rows.append(row)
                    size += _text_bytes(row[_PAYLOAD])
                    row = cursor.fetchone()
                if len(rows) >= limit or size >= page_bytes:
                    break
        finally:
            for cursor in cursors:
                cursor.close()
        return replace(_fetched(rows, sqlite=sqlite, now=now), bytes_full=size >= page_bytes)

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
        statement = _PARK_BY_DIALECT[self.dialect]
        return bool(self._write(lambda c: c.execute(statement, params).rowcount))

    # -- durable pauses ---------------------------------------------------------------------------------------

    def pauses_list(self) -> list[Pause]:
        """Every durable pause, oldest first. On PostgreSQL one autocommit statement run by the driver itself: the
        engine reads the list once a second, and through a transaction of the general result machinery that read
        would be the largest part of an idle replica's CPU."""
        if self.dialect == "postgresql":
            return self._driver_statements(lambda driver: [Pause(*row) for row in driver_rows(driver, _PAUSES_PG, {})])
        statement = select(pause_table).order_by(pause_table.c.id)
        return self._run(lambda c: [_pause(row) for row in c.execute(statement)])

    # -- producers and operators ------------------------------------------------------------------------------

    def messages_oldest_eligible(self, slots: Collection[int], mode: Mode, budget: int = 50) -> datetime | None:
        """The created_at of the oldest message that could be correlated now, looking at up to ``budget``
        hints per slot (beyond that it is a lower bound of the age): the engine's candidates and batches, in one
        statement on PostgreSQL."""
        if self.dialect == "postgresql":
            horizon = self.order_horizon()
            assert horizon is not None
            statement = _statement(self.dialect, "oldest_eligible", mode, lambda: _oldest_eligible_sql(mode))
            params = {"slots": int_array(int(slot) for slot in slots), "budget": budget,
                      "horizon": horizon.last_id, "per_hint": 1}
            oldest: datetime | None = self._run(lambda c: c.execute(statement, params).scalar_one())
            return oldest

        def work(connection: Connection) -> datetime | None:
            hints: list[str] = []
            for slot in slots:
                candidates = self._candidates(connection, slot, "", budget)
                hints.extend(dict.fromkeys(candidates.due + candidates.fresh))
            fetched = self._batches(connection, hints, 2**62, 1, len(hints), mode, self._now(connection))
            return min((message.created_at for message in fetched.messages), default=None)

        return self._run(work)


def _bytes_bound(page_bytes: int | None) -> int:
    """The bound of a page's payload bytes as the statements take it (None: no bound)."""
    return 2**62 if page_bytes is None else max(1, page_bytes)


def _text_bytes(text: str | None) -> int:
    """The UTF-8 length of a payload's text (the length itself for ASCII, which CPython knows without a scan)."""
    if text is None:
        return 0
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _fetched(rows: Sequence[Any], *, sqlite: bool, now: datetime, page_bytes: int = 2**62) -> Fetched:
    """The batches' rows as messages (and rows that could not be read), which are in flight, which hints the
    page's limit cut short (PostgreSQL: each row says how long its hint's batch is)."""
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
    bytes_full = False
    if not sqlite:
        got = Counter(row[_HINT] for row in rows)
        cut = frozenset(hint for hint, batch in batches.items() if got[hint] < batch)
        # A row was left out for the bytes only if those taken reach the bound (4 bytes a character at most).
        characters = sum(len(row[_PAYLOAD] or "") for row in rows)
        bytes_full = 4 * characters >= page_bytes and sum(_text_bytes(row[_PAYLOAD]) for row in rows) >= page_bytes
    return Fetched(tuple(messages), tuple(unreadable), now, frozenset(in_flight), cut, bytes_full=bytes_full)


def _candidates_of(rows: Sequence[Any]) -> Candidates:
    """The rows of :func:`_slot_fetch_sql`: (kind, hint, time, last_id, pin_ids, pin_holders, table_bytes)."""
    clock = next(row for row in rows if row[0] == "t")
    return Candidates(
        fresh=tuple(row[1] for row in rows if row[0] == "f"),
        due=tuple(dict.fromkeys(row[1] for row in rows if row[0] == "d")),
        next_due=next(row[2] for row in rows if row[0] == "n"),
        now=clock[2],
        horizon=_horizon_reading(*clock[3:6]),
        table_bytes=int(clock[6]),
    )


def _horizon_reading(last_id: int, pin_ids: Sequence[int] | None, pin_holders: Sequence[str] | None) -> HorizonReading:
    pins = tuple(zip(pin_ids or (), pin_holders or (), strict=True))
    return HorizonReading(int(last_id), tuple((int(after), str(holder)) for after, holder in pins))


def _pause(row: Any) -> Pause:
    return Pause(row.id, row.scope, row.target, row.reason, row.created_by, row.created_at)



