"""Single-replica drain benchmark: how fast the real poll cycle empties a table, against a raw-SQL floor.

One run, on the same data each time::

    1. create a database (or use the one given) and migrate it
    2. bulk-insert N messages over H hints, interleaved (message i has hint i % H)
    3. drain them with the real engine in-process, running as a replica runs (fetch loop, lanes, committer),
       through a SlotLeaser holding every slot (fenced commits, in-flight marks; --no-leases: every slot
       unfenced), with a no-op correlator that records (hint, id); the clock stops once every outcome is
       written; then check every message was handled exactly once and in id order per hint
    4. insert the same rows again and drain them with a plain loop on the bare driver:
       SELECT id ... LIMIT page; DELETE ... WHERE id = ANY(ids); COMMIT
    5. print engine msgs/s, floor msgs/s and their ratio (with --json, one JSON object as well)

Usage::

    .venv/bin/python bench/drain.py [--url URL] [--messages 100000] [--hints 1000] [--page-size 1000]
                                    [--concurrency 8] [--no-leases] [--runs 1] [--json]

``--url`` (default: ``CORRELATION_BENCH_DATABASE_URL``, else the local PostgreSQL server): a PostgreSQL URL
without a database name gets a throwaway database ``cw_bench_<random>``, dropped at the end; a URL naming a
database, or ``sqlite:///path``, is used as it is and must hold no messages.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import secrets
import sqlite3
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import psycopg
from sqlalchemy.engine import make_url

from worker.config import (
    DatabaseSettings,
    DeliverySettings,
    MetricsSettings,
    PollSettings,
    Settings,
    format_duration,
    parse_duration,
)
from worker.correlators import Router
from worker.db.store import Store, StoreError, build_engine, normalise_url
from worker.engine.engine import AllSlots, Engine, SlotSource
from worker.engine.leases import SlotLeaser
from worker.message import Message

URL_ENV = "CORRELATION_BENCH_DATABASE_URL"
LOCAL_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/"
MESSAGE_NAME = "bench.drained"


class Recorder:
    """The no-op correlator: remembers which message it saw, and nothing else."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def __call__(self, message: Message) -> None:
        with self._lock:
            self.seen.append((message.hint, message.id))


@dataclass(frozen=True, slots=True)
class RunFigures:
    """One run's measurements."""

    engine_seconds: float
    engine_rate: float
    engine_pages: int
    engine_cpu_us_per_message: float  # this process's CPU (poll cycle and handler threads), not the server's
    floor_seconds: float
    floor_rate: float

    @property
    def ratio(self) -> float:
        """Engine throughput as a share of the floor."""
        return self.engine_rate / self.floor_rate


# -- the database --------------------------------------------------------------------------------------------


def libpq_conninfo(url: str) -> str:
    """A libpq URL for psycopg (no SQLAlchemy driver suffix)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


@contextmanager
def bench_database(url: str) -> Iterator[str]:
    """The URL of the database to run in: a throwaway one when the URL names only a server."""
    if _is_sqlite(url) or make_url(url).database:
        yield url
        return
    name = f"cw_bench_{secrets.token_hex(6)}"
    server = libpq_conninfo(make_url(url).set(database="postgres").render_as_string(hide_password=False))
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(url).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def payload_of(i: int, size: int = 0) -> str:
    """Message i's payload: ``{"n": i}``, or with ``size`` an order of about that many bytes of JSON (a customer and
    as many line items as it takes), as a process engine's message carries."""
    if size <= 0:
        return f'{{"n": {i}}}'
    document: dict[str, object] = {
        "n": i, "orderId": f"ORD-{i:09d}", "currency": "EUR", "placedAt": "2026-12-01T10:00:00Z",
        "customer": {"id": 100_000 + i % 977, "name": "Jane Doe", "tier": "gold", "tags": ["b2b", "priority"]},
        "items": [],
    }
    items = document["items"]
    assert isinstance(items, list)
    while len(json.dumps(document)) < size:
        line = len(items)
        items.append({"sku": f"SKU-{line:04d}", "qty": 1 + line % 5, "price": 9.99 + line,
                      "attributes": {"color": "red", "size": "M"}})
    return json.dumps(document)


def _rows(messages: int, hints: int, payload_bytes: int = 0) -> Iterator[tuple[str, str, str]]:
    """(name, hint, payload) of message i, whose hint is i % hints: every hint gets ordered messages. The payload is
    ``{"n": i}``, or about ``payload_bytes`` of JSON (:func:`payload_of`)."""
    width = len(str(hints - 1))
    names = [f"hint-{h:0{width}d}" for h in range(hints)]
    for i in range(messages):
        yield MESSAGE_NAME, names[i % hints], payload_of(i, payload_bytes)


class Driver(Protocol):
    """The bare driver for the bulk insert, the floor loop and the checks."""

    def count(self) -> int:
        """Messages in the table (delivery records apart)."""
        ...

    def purge(self) -> None:
        """Delete every row, delivery records included."""
        ...

    def ids_and_hints(self) -> list[tuple[int, str]]:
        """(id, hint) of every message, in id order."""
        ...

    def insert(self, messages: int, hints: int, payload_bytes: int = 0) -> None:
        """Insert the rows of :func:`_rows` in one transaction, then refresh the planner's statistics."""
        ...

    def drain_floor(self, page_size: int) -> int:
        """The raw-SQL floor: read a page as a correlator needs it, delete it, commit; until empty; the count."""
        ...

    def close(self) -> None:
        """Close the connection."""
        ...


class PostgresDriver:
    """psycopg: COPY to insert, ``id = ANY(%s)`` to delete."""

    def __init__(self, url: str) -> None:
        self.connection = psycopg.connect(libpq_conninfo(url), autocommit=True)

    def count(self) -> int:
        row = self.connection.execute("SELECT count(*) FROM correlation_message WHERE state <> 'delivered'").fetchone()
        return int(row[0]) if row else 0

    def ids_and_hints(self) -> list[tuple[int, str]]:
        statement = "SELECT id, correlation_hint FROM correlation_message WHERE state <> 'delivered' ORDER BY id"
        return [(int(i), str(h)) for i, h in self.connection.execute(statement)]

    def insert(self, messages: int, hints: int, payload_bytes: int = 0) -> None:
        buffer = io.StringIO()
        for name, hint, payload in _rows(messages, hints, payload_bytes):
            buffer.write(f"{name}\t{hint}\t{payload}\n")
        copy_sql = "COPY correlation_message (message_name, correlation_hint, payload) FROM STDIN"
        with self.connection.transaction(), self.connection.cursor() as cursor, cursor.copy(copy_sql) as copy:
            copy.write(buffer.getvalue())
        # What autovacuum does soon after a bulk load; both drains start from the same state.
        self.connection.execute("VACUUM ANALYZE correlation_message")

    def drain_floor(self, page_size: int) -> int:
        drained = 0
        while True:
            with self.connection.transaction():
                cursor = self.connection.execute(
                    "SELECT id, message_name, correlation_hint, payload, headers FROM correlation_message"
                    " ORDER BY id LIMIT %s",
                    (page_size,),
                )
                ids = [row[0] for row in cursor]
                if ids:
                    self.connection.execute("DELETE FROM correlation_message WHERE id = ANY(%s)", (ids,))
            if not ids:
                return drained
            drained += len(ids)

    def record_floor(self, page_size: int) -> int:
        """The floor of the default retention (P7D): each page read as a correlator needs it and made its
        delivery records (one UPDATE setting what the worker's record sets), committed; until none is left."""
        drained, last = 0, 0
        while True:
            with self.connection.transaction():
                cursor = self.connection.execute(
                    "SELECT id, message_name, correlation_hint, payload, headers FROM correlation_message"
                    " WHERE id > %s ORDER BY id LIMIT %s",
                    (last, page_size),
                )
                ids = [row[0] for row in cursor]
                if ids:
                    self.connection.execute(
                        "UPDATE correlation_message SET state = 'delivered', outcome = 'correlated',"
                        " finished_at = now(), finished_by = 'floor', payload = '{}', headers = '{}',"
                        " expires_at = NULL, next_attempt_at = NULL, pause_id = NULL, lost_calls = 0,"
                        " crashed_calls = 0 WHERE id = ANY(%s)",
                        (ids,),
                    )
            if not ids:
                return drained
            drained += len(ids)
            last = ids[-1]

    def purge(self) -> None:
        self.connection.execute("DELETE FROM correlation_message")

    def close(self) -> None:
        self.connection.close()


class SqliteDriver:
    """sqlite3: executemany to insert, ``id IN (?, ...)`` to delete (SQLite has no arrays)."""

    def __init__(self, url: str) -> None:
        database = make_url(url).database
        if not database:
            raise SystemExit("a SQLite URL needs a file: sqlite:///path/to/bench.db")
        self.connection = sqlite3.connect(database, timeout=30, isolation_level=None)
        self.connection.execute("PRAGMA journal_mode=WAL")

    def count(self) -> int:
        live = "SELECT count(*) FROM correlation_message WHERE state <> 'delivered'"
        return int(self.connection.execute(live).fetchone()[0])

    def ids_and_hints(self) -> list[tuple[int, str]]:
        statement = "SELECT id, correlation_hint FROM correlation_message WHERE state <> 'delivered' ORDER BY id"
        return [(int(i), str(h)) for i, h in self.connection.execute(statement)]

    def insert(self, messages: int, hints: int, payload_bytes: int = 0) -> None:
        self.connection.execute("BEGIN")
        self.connection.executemany(
            "INSERT INTO correlation_message (message_name, correlation_hint, payload) VALUES (?, ?, ?)",
            _rows(messages, hints, payload_bytes),
        )
        self.connection.execute("COMMIT")
        self.connection.execute("ANALYZE correlation_message")

    def drain_floor(self, page_size: int) -> int:
        drained = 0
        while True:
            self.connection.execute("BEGIN")
            select = (
                "SELECT id, message_name, correlation_hint, payload, headers FROM correlation_message"
                " ORDER BY id LIMIT ?"
            )
            cursor = self.connection.execute(select, (page_size,))
            ids = [row[0] for row in cursor]
            if ids:
                marks = ",".join("?" * len(ids))
                self.connection.execute(f"DELETE FROM correlation_message WHERE id IN ({marks})", ids)
            self.connection.execute("COMMIT")
            if not ids:
                return drained
            drained += len(ids)

    def purge(self) -> None:
        self.connection.execute("DELETE FROM correlation_message")

    def close(self) -> None:
        self.connection.close()


def connect_driver(url: str) -> Driver:
    """The bare driver of this database."""
    return SqliteDriver(url) if _is_sqlite(url) else PostgresDriver(url)


# -- one run -------------------------------------------------------------------------------------------------


def migrate(url: str) -> int:
    """Bring the database's schema up to date; its slot count."""
    store = Store(build_engine(DatabaseSettings(url=url)))
    try:
        store.schema_migrate()
        return store.slot_count
    finally:
        store.close()


def settings_for(url: str, page_size: int, concurrency: int) -> Settings:
    """The engine's settings for the drain; the correlator is given to the engine directly."""
    return Settings(
        database=DatabaseSettings(url=url),
        poll=PollSettings(
            initial_delay=timedelta(0),
            interval=timedelta(seconds=1),
            page_size=page_size,
            concurrency=concurrency,
        ),
        metrics=MetricsSettings(enabled=False, port=0),
        correlators={"*": "log"},
    )


def verify(recorded: Sequence[tuple[str, int]], expected: Sequence[tuple[int, str]]) -> None:
    """Every inserted message handled exactly once, with its own hint, in id order per hint."""
    if len(recorded) != len(expected):
        raise SystemExit(f"verification failed: {len(recorded)} calls for {len(expected)} messages")
    hint_of = dict(expected)
    seen: set[int] = set()
    last: dict[str, int] = {}
    for hint, message_id in recorded:
        if message_id in seen:
            raise SystemExit(f"verification failed: message {message_id} handled twice")
        if hint_of.get(message_id) != hint:
            raise SystemExit(f"verification failed: message {message_id} was not inserted with hint {hint}")
        if last.get(hint, 0) >= message_id:
            raise SystemExit(f"verification failed: hint {hint} saw {message_id} after {last[hint]}")
        seen.add(message_id)
        last[hint] = message_id


@contextmanager
def slot_source(store: Store, leases: bool) -> Iterator[SlotSource]:
    """Every slot unfenced, or (``--leases``) every slot leased and renewed as a lone replica does."""
    if not leases:
        yield AllSlots(store.slot_count)
        return
    leaser = SlotLeaser(store, f"bench-{secrets.token_hex(4)}")
    leaser.run_once()
    if len(leaser.slots()) != store.slot_count:
        held = len(leaser.slots())
        raise SystemExit(f"leased {held} of {store.slot_count} slots: is a replica running on this database?")
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(leaser.config.renew_interval.total_seconds()):
            leaser.run_once()

    renewer = threading.Thread(target=renew, name="bench-leases", daemon=True)
    renewer.start()
    try:
        yield leaser
    finally:
        stop.set()
        renewer.join()
        leaser.release_all()


def run_once(url: str, driver: Driver, args: argparse.Namespace) -> RunFigures:
    """Insert, drain with the engine, verify; insert again, drain with the floor loop."""
    driver.insert(args.messages, args.hints)
    expected = driver.ids_and_hints()

    settings = settings_for(url, args.page_size, args.concurrency)
    store = Store(build_engine(settings.database))
    store.keep_delivery_records(args.retention, "bench")
    recorder = Recorder()
    stack = ExitStack()
    try:
        store.now()  # open the pool's connection outside the measurement
        slots = stack.enter_context(slot_source(store, not args.no_leases))
        holder = slots.holder if isinstance(slots, SlotLeaser) else "bench"
        engine = Engine(store, Router({"*": recorder}), settings, slots, holder=holder)
        stack.callback(engine.stop, 0.0)
        cpu_started = time.process_time()
        started = time.perf_counter()
        engine.start()
        deadline = started + 600
        while engine.committer.written < args.messages:
            if time.perf_counter() > deadline:
                raise SystemExit(f"the drain did not end within 600 s ({engine.committer.written} outcomes written)")
            time.sleep(0.002)
        engine_seconds = time.perf_counter() - started
        engine_cpu = time.process_time() - cpu_started
        pages = engine.metrics.fetch_duration._sum.get() and int(
            sum(bucket.get() for bucket in engine.metrics.fetch_duration._buckets)
        )
    finally:
        stack.close()
        store.close()
    left = driver.count()
    if left:
        raise SystemExit(f"verification failed: {left} messages left after the engine's drain")
    verify(recorder.seen, expected)
    driver.purge()  # the delivery records the drain left (not timed): the floor starts from the same table

    driver.insert(args.messages, args.hints)
    started = time.perf_counter()
    drained = driver.drain_floor(args.page_size)
    floor_seconds = time.perf_counter() - started
    if drained != args.messages:
        raise SystemExit(f"the floor loop drained {drained} of {args.messages} messages")
    return RunFigures(
        engine_seconds=engine_seconds,
        engine_rate=args.messages / engine_seconds,
        engine_pages=pages,
        engine_cpu_us_per_message=engine_cpu / args.messages * 1e6,
        floor_seconds=floor_seconds,
        floor_rate=args.messages / floor_seconds,
    )


# -- the command ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument(
        "--url",
        default=os.environ.get(URL_ENV, LOCAL_SERVER),
        help=f"PostgreSQL server or database URL, or sqlite:///path (default: ${URL_ENV} or {LOCAL_SERVER})",
    )
    parser.add_argument("--messages", type=int, default=100_000, help="messages per drain (default 100000)")
    parser.add_argument("--hints", type=int, default=1000, help="distinct hints (default 1000)")
    parser.add_argument(
        "--page-size", type=int, default=1000, help="poll page size, also the floor's (default 1000)"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="lanes: calls at once (default 8, as a replica)")
    parser.add_argument(
        "--no-leases", action="store_true", help="every slot unfenced (AllSlots), not leased as a replica does"
    )
    parser.add_argument("--runs", type=int, default=1, help="repeat and report the median (default 1)")
    parser.add_argument(
        "--retention", type=parse_duration, default=DeliverySettings().retention,
        help="CORRELATION_DELIVERY__RETENTION: P7D (the default) keeps a delivery record per message, PT0S none",
    )
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    args = parser.parse_args(argv)
    if args.messages < 1 or args.hints < 1 or args.runs < 1:
        parser.error("--messages, --hints and --runs must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the figures."""
    args = parse_args(argv)
    url = normalise_url(args.url)
    if _is_sqlite(url):
        database = make_url(url).database
        if database:
            Path(database).parent.mkdir(parents=True, exist_ok=True)
    runs: list[RunFigures] = []
    with bench_database(url) as database_url:
        store = Store(build_engine(DatabaseSettings(url=database_url)))
        try:
            store.schema_migrate()
            backend = store.dialect
            slots = store.slot_count
        finally:
            store.close()
        driver = connect_driver(database_url)
        try:
            present = driver.count()
            if present:
                raise SystemExit(f"the database already holds {present} messages; give an empty one")
            for number in range(1, args.runs + 1):
                figures = run_once(database_url, driver, args)
                runs.append(figures)
                if args.runs > 1:
                    print(
                        f"run {number}: engine {figures.engine_rate:,.0f} msgs/s, "
                        f"floor {figures.floor_rate:,.0f} msgs/s",
                        file=sys.stderr,
                    )
        finally:
            driver.close()

    engine = statistics.median(r.engine_rate for r in runs)
    cpu = statistics.median(r.engine_cpu_us_per_message for r in runs)
    floor = statistics.median(r.floor_rate for r in runs)
    parameters = (
        f"backend={backend} slots={slots} messages={args.messages} hints={args.hints} "
        f"page_size={args.page_size} concurrency={args.concurrency} leases={not args.no_leases} runs={args.runs} "
        f"retention={format_duration(args.retention)}"
    )
    print(
        f"engine: {engine:,.0f} msgs/s ({cpu:.0f} us of client CPU per message; "
        "verified: each message once, in id order per hint)"
    )
    delete = "id IN (...)" if backend == "sqlite" else "id = ANY(...)"
    print(
        f"floor:  {floor:,.0f} msgs/s (SELECT id, name, hint, payload, headers ... LIMIT page; "
        f"DELETE ... WHERE {delete}; COMMIT)"
    )
    print(f"ratio:  {engine / floor:.2f} engine/floor")
    print(f"params: {parameters}")
    if args.json:
        print(
            json.dumps(
                {
                    "engine_msgs_per_s": round(engine, 1),
                    "floor_msgs_per_s": round(floor, 1),
                    "ratio": round(engine / floor, 4),
                    "engine_cpu_us_per_message": round(cpu, 1),
                    "backend": backend,
                    "slots": slots,
                    "messages": args.messages,
                    "hints": args.hints,
                    "page_size": args.page_size,
                    "concurrency": args.concurrency,
                    "leases": not args.no_leases,
                    "runs": [asdict(r) | {"ratio": r.ratio} for r in runs],
                }
            )
        )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (StoreError, psycopg.Error, sqlite3.Error) as error:
        sys.exit(f"drain benchmark: {error}")
