"""Acceptance harness: real ``correlation-worker run`` processes against a real database.

A test inserts messages with plain SQL (as producers do), starts a worker process whose correlator is
``recorder:handle`` (see ``recorder.py``), and waits on conditions in the database with a deadline
(:func:`wait_until`), never with fixed sleeps.

Absence ("this message was never called") is shown by :meth:`Database.wait_for_full_polls`: probe messages
whose slot is polled last prove that whole poll cycles ran after the state under test was in place.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from prometheus_client.parser import text_string_to_metric_families
from psycopg.rows import dict_row
from recorder import CALL_TABLE_DDL, DSN_ENV, FILE_ENV, Call, calls_from_file, calls_from_table
from sqlalchemy.engine import make_url

ACCEPTANCE_DIR = Path(__file__).resolve().parent
DEADLINE = 30.0  # seconds: generous, for a loaded machine; waits end as soon as the condition holds
STOP_DEADLINE = 20.0  # seconds a worker may take to exit after SIGTERM
STACKS_HEADER = "Thread MainThread (most recent call last):"  # a line of the stacks SIGUSR1 writes
PROBE = "probe"  # message_name of the messages that prove poll cycles ran

T = TypeVar("T")


class Timeout(AssertionError):
    """A condition did not come true before its deadline."""


def wait_until(
    predicate: Callable[[], T],
    timeout: float = DEADLINE,
    what: str = "the condition",
    workers: Sequence[WorkerProcess] = (),
    interval: float = 0.05,
) -> T:
    """Poll ``predicate`` until it returns something truthy (returned) or ``timeout`` seconds pass.

    A worker in ``workers`` that exits meanwhile fails the wait at once (its log goes into the report).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        for worker in workers:
            if not worker.running():
                raise AssertionError(f"worker exited with {worker.returncode()} while waiting for {what}")
        if time.monotonic() >= deadline:
            raise Timeout(f"{what} did not happen within {timeout:.0f}s")
        time.sleep(interval)


# -- databases -----------------------------------------------------------------------------------------------


class Database:
    """The test's view of one database: producer inserts, message rows, and the recorder's journal."""

    url: str
    recorder_env: dict[str, str]

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[dict[str, Any]]:
        """Run one statement (autocommit) and return its rows as dicts."""
        raise NotImplementedError

    def insert(self, name: str, hint: str, payload: object) -> int:
        """INSERT one message as a producer does; returns its id."""
        raise NotImplementedError

    def calls(self) -> list[Call]:
        """Every correlator call the recorder saw, in the order they started."""
        raise NotImplementedError

    def hint_in_slot(self, slot: int, prefix: str) -> str:
        """A hint (starting with ``prefix``) whose messages fall into this slot."""
        raise NotImplementedError

    @property
    def probe_hint(self) -> str:
        """A hint whose slot a poll cycle visits last."""
        return self.hint_in_slot(63, "probe-")

    def close(self) -> None:
        """Close the test's connection."""

    def message(self, row_id: int) -> dict[str, Any] | None:
        """One message of correlation_message, or None once it is gone (a delivery record is not a message)."""
        rows = self.execute(f"SELECT * FROM correlation_message WHERE id = {int(row_id)} AND state <> 'delivered'")
        return rows[0] if rows else None

    def record(self, row_id: int) -> dict[str, Any] | None:
        """The delivery record of a message that left the table (state delivered), or None."""
        rows = self.execute(f"SELECT * FROM correlation_message WHERE id = {int(row_id)} AND state = 'delivered'")
        return rows[0] if rows else None

    def messages(self) -> list[dict[str, Any]]:
        """Every message of correlation_message (delivery records apart), in id order."""
        return self.execute("SELECT * FROM correlation_message WHERE state <> 'delivered' ORDER BY id")

    def gone(self, *row_ids: int) -> bool:
        """True when none of these messages is in the table any more (a delivery record is not a message)."""
        present = {row["id"] for row in self.execute("SELECT id FROM correlation_message WHERE state <> 'delivered'")}
        return not present.intersection(row_ids)

    def calls_of(self, *row_ids: int) -> list[Call]:
        """The calls of these messages, in the order they started."""
        wanted = set(row_ids)
        return [call for call in self.calls() if call.message_row_id in wanted]

    def wait_for_full_polls(self, workers: Sequence[WorkerProcess]) -> None:
        """Return once a whole poll cycle has started and ended after this call was made.

        A probe in the last-visited slot is correlated in a cycle that started before or after now; a second
        probe, inserted once the first is done, can only be taken by a later cycle, which visited every other
        slot (after now) before reaching the probe's.
        """
        for _ in range(2):
            probe = self.insert(PROBE, self.probe_hint, {})
            wait_until(partial(self.gone, probe), what=f"probe {probe} correlated", workers=workers)


class PostgresDatabase(Database):
    """A fresh migrated PostgreSQL database; the recorder journals into its table ``acceptance_call``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        self.connection = psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row)
        self.connection.execute(CALL_TABLE_DDL)
        self.recorder_env = {DSN_ENV: self.dsn}

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[dict[str, Any]]:
        """Run one statement (autocommit) and return its rows as dicts."""
        cursor = self.connection.execute(sql, params)
        return cursor.fetchall() if cursor.description else []

    def insert(self, name: str, hint: str, payload: object) -> int:
        """INSERT one message as a producer does; returns its id."""
        rows = self.execute(
            "INSERT INTO correlation_message (message_name, correlation_hint, payload)"
            " VALUES (%s, %s, %s::jsonb) RETURNING id",
            (name, hint, json.dumps(payload)),
        )
        return int(rows[0]["id"])

    def calls(self) -> list[Call]:
        """Every correlator call the recorder saw, in the order they started."""
        with psycopg.connect(self.dsn, autocommit=True) as connection:
            return calls_from_table(connection)

    def hint_in_slot(self, slot: int, prefix: str) -> str:
        """A hint (starting with ``prefix``) in this slot; a poll cycle visits slots in ascending order."""
        rows = self.execute(
            "SELECT h FROM (SELECT %s || i AS h FROM generate_series(1, 10000) AS i) AS hints"
            " WHERE ((hashtext(h) %% 64) + 64) %% 64 = %s LIMIT 1",
            (prefix, slot),
        )
        return str(rows[0]["h"])

    def close(self) -> None:
        """Close the test's connection (the database is dropped by the pg_url fixture)."""
        self.connection.close()


class SqliteDatabase(Database):
    """A migrated SQLite file; the recorder journals into a JSON-lines file next to it."""

    def __init__(self, url: str, journal: Path) -> None:
        self.url = url
        self.journal = journal
        self.connection = sqlite3.connect(make_url(url).database or "", timeout=30, isolation_level=None)
        self.connection.row_factory = sqlite3.Row
        self.connection.execute("PRAGMA busy_timeout = 30000")
        self.recorder_env = {FILE_ENV: str(journal)}

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[dict[str, Any]]:
        """Run one statement (autocommit) and return its rows as dicts."""
        return [dict(row) for row in self.connection.execute(sql, params).fetchall()]

    def insert(self, name: str, hint: str, payload: object) -> int:
        """INSERT one message as a producer does; returns its id."""
        cursor = self.connection.execute(
            "INSERT INTO correlation_message (message_name, correlation_hint, payload) VALUES (?, ?, ?)",
            (name, hint, json.dumps(payload)),
        )
        assert cursor.lastrowid is not None
        return int(cursor.lastrowid)

    def calls(self) -> list[Call]:
        """Every correlator call the recorder saw, in the order they started."""
        return calls_from_file(str(self.journal))

    def hint_in_slot(self, slot: int, prefix: str) -> str:
        """Any hint: SQLite has a single slot."""
        return prefix + "1"

    def close(self) -> None:
        """Close the test's connection."""
        self.connection.close()


# -- worker processes ----------------------------------------------------------------------------------------


def worker_env(database: Database, **settings: str) -> dict[str, str]:
    """The environment of a worker or CLI process: fast schedules, the recorder, and ``settings``.

    ``settings`` are CORRELATION_ variables without the prefix, in lower case: ``policy__mode="all"``.
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith("CORRELATION_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ACCEPTANCE_DIR), os.environ.get("PYTHONPATH")]))
    env.update(database.recorder_env)
    env.update(
        {
            "CORRELATION_DATABASE__URL": database.url,
            "CORRELATION_POLL__INITIAL_DELAY": "PT0S",
            "CORRELATION_POLL__INTERVAL": "PT0.1S",
            "CORRELATION_METRICS__PORT": "0",
            "CORRELATION_METRICS__HOST": "127.0.0.1",
            "CORRELATION_CORRELATORS": json.dumps({"*": "recorder:handle"}),
            "CORRELATION_REPLICA__NAME": "acceptance",
        }
    )
    env.update({"CORRELATION_" + key.upper(): value for key, value in settings.items()})
    return env


ENDPOINT_LINE = re.compile(r"serving /metrics\S* .*? on (\S+):(\d+)")
IDENTITY_LINE = re.compile(r"replica (\S+) polling ")


class WorkerProcess:
    """A running ``correlation-worker run`` (``python -m worker run``) with its log in a file."""

    def __init__(self, env: dict[str, str], log_path: Path, cwd: Path) -> None:
        self.log_path = log_path
        self.name = env["CORRELATION_REPLICA__NAME"]  # the pod name; the recorder journals it with each call
        self.killed = False  # SIGKILLed on purpose: exempt from the clean-exit check at teardown
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "worker", "run"],
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def log(self) -> str:
        """Everything the worker wrote so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def running(self) -> bool:
        """True while the process has not exited."""
        return self.process.poll() is None

    def returncode(self) -> int | None:
        """The exit code, or None while it runs."""
        return self.process.poll()

    def wait_ready(self) -> None:
        """Wait until the worker logged that it is polling."""
        wait_until(lambda: " polling " in self.log(), what="the worker to start polling", workers=[self])

    def holder(self) -> str:
        """Its ``locked_by`` in the lock table (pod name plus per-boot suffix), from its start-up log line."""
        found = IDENTITY_LINE.search(self.log())
        assert found, f"{self.name} has not logged its identity yet"
        return found.group(1)

    def metrics_port(self) -> int:
        """The port of its /metrics endpoint (any free port with CORRELATION_METRICS__PORT=0), from its log."""
        found = ENDPOINT_LINE.search(self.log())
        assert found, f"{self.name} has not logged its metrics endpoint yet"
        return int(found.group(2))

    def metric(self, name: str) -> float:
        """The sum of the samples called ``name`` (``correlation_redeliveries_total``) on its /metrics."""
        url = f"http://127.0.0.1:{self.metrics_port()}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        )

    def send(self, signum: signal.Signals) -> None:
        """Send a signal (SIGSTOP and SIGCONT freeze and resume it)."""
        self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL, and wait until it is gone."""
        self.killed = True
        self.process.kill()
        self.process.wait(timeout=STOP_DEADLINE)

    def stop(self) -> int:
        """SIGTERM, then wait for the exit code (killed, and -9 returned, after the deadline)."""
        if self.running():
            self.process.send_signal(signal.SIGTERM)
            self.process.send_signal(signal.SIGCONT)  # a frozen worker must wake up to see it
        try:
            return self.process.wait(timeout=STOP_DEADLINE)
        except subprocess.TimeoutExpired:
            # Every thread's stack into its log, where it waits: written by the process itself, then it is killed.
            dumps = self.log().count(STACKS_HEADER)
            self.process.send_signal(signal.SIGUSR1)
            with contextlib.suppress(Timeout):  # killed all the same: the log then lacks them
                wait_until(lambda: self.log().count(STACKS_HEADER) > dumps, 2.0, "the worker's stacks in its log")
            self.process.kill()
            self.process.wait()
            return -9


def cli(database: Database, *args: str, **settings: str) -> subprocess.CompletedProcess[str]:
    """Run ``correlation-worker ARGS`` to its end, with the workers' environment plus ``settings``."""
    return subprocess.run(
        [sys.executable, "-m", "worker", *args],
        env=worker_env(database, **settings),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def run_cli(database: Database, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m worker ARGS`` with the same environment as the workers; it must exit 0."""
    result = cli(database, *args)
    assert result.returncode == 0, f"correlation-worker {' '.join(args)}: {result.stdout}{result.stderr}"
    return result


StartWorker = Callable[..., WorkerProcess]
StartReplicas = Callable[..., list[WorkerProcess]]
