"""A correlator for the acceptance tests: it records every call, then succeeds or fails as the payload says.

The worker process under test imports it as ``recorder:handle`` (its directory is on the worker's PYTHONPATH).
Every call is journalled where the test can read it while the worker runs:

- into the table ``acceptance_call`` of a PostgreSQL database, when ``ACCEPTANCE_RECORDER_DSN`` is set
  (times from the database clock, the same clock that sets ``next_attempt_at``);
- else into a JSON-lines file named by ``ACCEPTANCE_RECORDER_FILE`` (one line when a call starts, one when it
  ends; each line is one ``write`` on an append-only descriptor, then fsync).

Each call also records the replica that made it (``CORRELATION_REPLICA__NAME`` of the worker process).
A call is journalled when it starts, so that a test sees a message that was called even if the call is still
running. What the call does is read from the payload (a JSON object):

``seq``                  a number the test uses to check order (recorded with the call)
``sleep_seconds``        sleep this long first
``wait_for_file``        then wait until this file exists (the test opens the gate; after a minute, a retry)
``permanent``            raise :class:`worker.PermanentError` (dead at once)
``reschedule_seconds``   raise :class:`worker.Reschedule` with this delay, while the message's
                         ``reschedule_count`` is below ``reschedule_times`` (always, without it)
``fail``                 raise an exception (a retry), always
``fail_until_attempt``   raise an exception while the message's ``attempt`` is below this number
``exit_process``         end the worker process at once (``os._exit``), as a crashing native library would

A payload that is not a JSON object is refused with a TypeError (a retry), as a careful handler would.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import psycopg

from worker import Message, PermanentError, Reschedule

DSN_ENV = "ACCEPTANCE_RECORDER_DSN"
FILE_ENV = "ACCEPTANCE_RECORDER_FILE"
REPLICA_ENV = "CORRELATION_REPLICA__NAME"
GATE_WAIT = 60.0  # seconds a call waits for its wait_for_file

CALL_TABLE_DDL = """
CREATE TABLE IF NOT EXISTS acceptance_call (
    id               serial PRIMARY KEY,
    message_row_id   bigint NOT NULL,
    message_name     text NOT NULL,
    hint             text NOT NULL,
    seq              integer,
    attempt          integer NOT NULL,
    reschedule_count integer NOT NULL,
    started_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at         timestamptz,
    outcome          text,
    replica          text,
    redelivered      boolean NOT NULL DEFAULT false
)
"""


@dataclass(frozen=True, slots=True)
class Call:
    """One correlator call as the recorder saw it; ``ended_at`` and ``outcome`` are None while it runs."""

    message_row_id: int
    message_name: str
    hint: str
    seq: int | None
    attempt: int
    reschedule_count: int
    started_at: datetime
    ended_at: datetime | None
    outcome: str | None
    replica: str | None = None  # the worker's CORRELATION_REPLICA__NAME
    redelivered: bool = False  # the message said an earlier call of it may have been made


class _Journal(Protocol):
    def start(self, message: Message, seq: int | None) -> str: ...

    def end(self, call: str, outcome: str) -> None: ...


class _TableJournal:
    """Calls as rows of ``acceptance_call``; one autocommit connection per handler thread."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.local = threading.local()

    def _connection(self) -> psycopg.Connection[Any]:
        connection: psycopg.Connection[Any] | None = getattr(self.local, "connection", None)
        if connection is None or connection.closed:
            # Named after the replica, so that a test can see when a killed replica's sessions are gone.
            connection = psycopg.connect(self.dsn, autocommit=True, application_name=_replica() or "recorder")
            self.local.connection = connection
        return connection

    def start(self, message: Message, seq: int | None) -> str:
        statement = (
            "INSERT INTO acceptance_call"
            " (message_row_id, message_name, hint, seq, attempt, reschedule_count, replica, redelivered)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s) RETURNING id"
        )
        values = (
            message.id, message.name, message.hint, seq, message.attempt, message.reschedule_count, _replica(),
            message.redelivered,
        )
        row = self._connection().execute(statement, values).fetchone()
        assert row is not None
        return str(row[0])

    def end(self, call: str, outcome: str) -> None:
        self._connection().execute(
            "UPDATE acceptance_call SET ended_at = clock_timestamp(), outcome = %s WHERE id = %s",
            (outcome, int(call)),
        )


class _FileJournal:
    """Calls as JSON lines in a file (for the SQLite runs, which have no second database to write to)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()

    def _append(self, event: dict[str, Any]) -> None:
        line = (json.dumps(event) + "\n").encode()
        with self.lock:
            descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(descriptor, line)
                os.fsync(descriptor)
            finally:
                os.close(descriptor)

    def start(self, message: Message, seq: int | None) -> str:
        call = uuid.uuid4().hex
        self._append(
            {
                "event": "start",
                "call": call,
                "message_row_id": message.id,
                "message_name": message.name,
                "hint": message.hint,
                "seq": seq,
                "attempt": message.attempt,
                "reschedule_count": message.reschedule_count,
                "replica": _replica(),
                "redelivered": message.redelivered,
                "at": time.time(),
            }
        )
        return call

    def end(self, call: str, outcome: str) -> None:
        self._append({"event": "end", "call": call, "outcome": outcome, "at": time.time()})


def _replica() -> str | None:
    return os.environ.get(REPLICA_ENV)


_journal: _Journal | None = None
_journal_lock = threading.Lock()


def _the_journal() -> _Journal:
    global _journal
    with _journal_lock:
        if _journal is None:
            dsn = os.environ.get(DSN_ENV)
            _journal = _TableJournal(dsn) if dsn else _FileJournal(os.environ[FILE_ENV])
        return _journal


def _decide(message: Message) -> None:
    payload = message.payload
    if not isinstance(payload, Mapping):
        raise TypeError(f"payload must be a JSON object, not {type(payload).__name__}")
    seq = payload.get("seq")
    if payload.get("exit_process"):
        os._exit(3)
    if "sleep_seconds" in payload:
        time.sleep(float(payload["sleep_seconds"]))
    if "wait_for_file" in payload:
        gate = Path(str(payload["wait_for_file"]))
        shut_until = time.monotonic() + GATE_WAIT
        while not gate.exists():
            if time.monotonic() > shut_until:
                raise RuntimeError(f"message seq={seq}: {gate} did not appear within {GATE_WAIT:g} s")
            time.sleep(0.01)
    if payload.get("permanent"):
        raise PermanentError(f"message seq={seq} can never succeed")
    if "reschedule_seconds" in payload:
        times = payload.get("reschedule_times")
        if times is None or message.reschedule_count < int(times):
            delay = timedelta(seconds=float(payload["reschedule_seconds"]))
            raise Reschedule("target not ready", delay=delay)
    if payload.get("fail"):
        raise RuntimeError(f"message seq={seq} always fails")
    if message.attempt < int(payload.get("fail_until_attempt", 0)):
        raise RuntimeError(f"message seq={seq} fails until attempt {payload['fail_until_attempt']}")


def _recorded(message: Message, decide: Callable[[Message], None]) -> None:
    payload = message.payload
    seq = payload.get("seq") if isinstance(payload, Mapping) else None
    journal = _the_journal()
    call = journal.start(message, seq if isinstance(seq, int) else None)
    outcome = "retry"
    try:
        decide(message)
        outcome = "ok"
    except PermanentError:
        outcome = "permanent"
        raise
    except Reschedule:
        outcome = "reschedule"
        raise
    finally:
        journal.end(call, outcome)


def handle(message: Message) -> None:
    """Record the call, then behave as the payload says (see the module docstring)."""
    _recorded(message, _decide)


def _require_order_id(message: Message) -> None:
    # A handler written for well-formed messages: a missing key raises KeyError (a retry).
    order_id = message.payload["order_id"]
    assert order_id


def handle_order(message: Message) -> None:
    """Record the call, then read ``payload["order_id"]`` (a KeyError when the producer left it out)."""
    _recorded(message, _require_order_id)


# -- reading the journal (test side) -------------------------------------------------------------------------


def calls_from_table(connection: psycopg.Connection[Any]) -> list[Call]:
    """Every call in ``acceptance_call``, in the order they started."""
    rows = connection.execute(
        "SELECT message_row_id, message_name, hint, seq, attempt, reschedule_count, started_at, ended_at,"
        " outcome, replica, redelivered FROM acceptance_call ORDER BY id"
    ).fetchall()
    return [Call(*row) for row in rows]


def calls_from_file(path: str) -> list[Call]:
    """Every call in a JSON-lines journal, in the order they started (a torn last line is ignored)."""
    try:
        with open(path, encoding="utf-8") as journal:
            lines = journal.read().split("\n")[:-1]  # the part after the last newline may be half-written
    except FileNotFoundError:
        return []
    starts: dict[str, dict[str, Any]] = {}
    ends: dict[str, dict[str, Any]] = {}
    for line in lines:
        event = json.loads(line)
        (starts if event["event"] == "start" else ends)[event["call"]] = event
    calls = []
    for call, start in starts.items():  # dicts keep insertion order: the order calls started
        end = ends.get(call)
        calls.append(
            Call(
                message_row_id=start["message_row_id"],
                message_name=start["message_name"],
                hint=start["hint"],
                seq=start["seq"],
                attempt=start["attempt"],
                reschedule_count=start["reschedule_count"],
                started_at=datetime.fromtimestamp(start["at"], UTC),
                ended_at=None if end is None else datetime.fromtimestamp(end["at"], UTC),
                outcome=None if end is None else end["outcome"],
                replica=start.get("replica"),
                redelivered=bool(start.get("redelivered")),
            )
        )
    return calls
