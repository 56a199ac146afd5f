"""What a fetch costs with a million held-back rows in the table, against the same fetch on an empty one.

For each shape of held-back rows the table is filled (in one statement), analysed, then one slot holding a few
live hints is fetched many times as the engine fetches it (``Store.messages_fetch_slot``: candidate hints with
the commit-order horizon, then their batches, in one round trip), with the planner's custom plans and, on a
second connection, with ``plan_cache_mode = force_generic_plan`` (what a prepared statement turns into). The
median fetch time is printed next to the empty table's::

    .venv/bin/python bench/scale.py [--url URL] [--rows 1000000] [--fetches 200] [--json]

Shapes: dead heads, waiting retries and paused messages each on a hint of its own ("spread"), and the same
rows queued behind one blocked head ("behind one hint": a dead head, a waiting retry, a paused message). It
also reads a batch of one message (batch size 1) from a hint of 50 000 messages and reports the rows it read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parent))

from drain import LOCAL_SERVER, URL_ENV, bench_database

from worker.config import DatabaseSettings, Mode
from worker.db.fetch import _batches_statement
from worker.db.store import Store, build_engine, normalise_url

SHAPES = {
    "dead heads, spread": "INSERT INTO correlation_message (message_name, correlation_hint, state, attempt) "
    "SELECT 'n', 'dead-' || g, 'dead', 3 FROM generate_series(1, :rows) g",
    "waiting retries, spread": "INSERT INTO correlation_message (message_name, correlation_hint, attempt, "
    "next_attempt_at) SELECT 'n', 'wait-' || g, 1, now() + interval '1 hour' FROM generate_series(1, :rows) g",
    "paused, spread": "INSERT INTO correlation_message (message_name, correlation_hint, state) "
    "SELECT 'n', 'paused-' || g, 'paused' FROM generate_series(1, :rows) g",
    "behind a dead head": "INSERT INTO correlation_message (message_name, correlation_hint, state, attempt) "
    "SELECT 'n', 'blocked', CASE WHEN g = 1 THEN 'dead' ELSE 'ready' END, 0 FROM generate_series(1, :rows) g",
    "behind a waiting retry": "INSERT INTO correlation_message (message_name, correlation_hint, attempt, "
    "next_attempt_at) SELECT 'n', 'blocked', 0, CASE WHEN g = 1 THEN now() + interval '1 hour' END "
    "FROM generate_series(1, :rows) g",
    "behind a paused message": "INSERT INTO correlation_message (message_name, correlation_hint, state) "
    "SELECT 'n', 'blocked', CASE WHEN g = 1 THEN 'paused' ELSE 'ready' END FROM generate_series(1, :rows) g",
}


def slot_of(store: Store, hint: str) -> int:
    with store.engine.connect() as connection:
        return int(connection.execute(text("SELECT ((hashtext(:h) % 64) + 64) % 64"), {"h": hint}).scalar_one())


def fetch_times(store: Store, slot: int, fetches: int, generic: bool) -> float:
    """Median seconds of a slot's fetch (nothing taken: the same rows every time)."""

    if generic:
        with store.engine.connect() as connection:
            connection.execute(text("ALTER DATABASE " + str(store.engine.url.database) + " SET plan_cache_mode = "
                                    "force_generic_plan"))
            connection.commit()
        store.engine.dispose()  # new sessions take the setting
    try:
        times = []
        for _ in range(fetches):
            started = time.perf_counter()
            store.messages_fetch_slot(slot, "", 100, per_hint=100, limit=100, mode=Mode.FAIL_FIRST)
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    finally:
        if generic:
            with store.engine.connect() as connection:
                connection.execute(text("ALTER DATABASE " + str(store.engine.url.database) + " RESET "
                                        "plan_cache_mode"))
                connection.commit()
            store.engine.dispose()


def rows_read_for_one(store: Store) -> int:
    """Rows the batch statement touches to read one message of a 50 000-message hint."""
    with store.engine.begin() as connection:
        connection.execute(text("INSERT INTO correlation_message (message_name, correlation_hint) "
                                "SELECT 'n', 'long' FROM generate_series(1, 50000)"))
        connection.execute(text("ANALYZE correlation_message"))
        plan = connection.execute(
            text("EXPLAIN (ANALYZE, FORMAT JSON) " + _batches_statement("postgresql", Mode.FAIL_FIRST).text),
            {"hints": ["long"], "horizon": 2**62, "per_hint": 1, "limit": 1},
        ).scalar_one()
        connection.execute(text("DELETE FROM correlation_message WHERE correlation_hint = 'long'"))

    def walk(node: dict[str, Any]) -> int:
        own = node.get("Actual Rows", 0) * node.get("Actual Loops", 1) + node.get("Rows Removed by Filter", 0)
        return int(own + sum(walk(child) for child in node.get("Plans", [])))

    return walk(plan[0]["Plan"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="PostgreSQL URL (without a database name: a throwaway database)")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--fetches", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures: dict[str, dict[str, float]] = {}
    with bench_database(normalise_url(args.url or os.environ.get(URL_ENV) or LOCAL_SERVER)) as url:
        store = Store(build_engine(DatabaseSettings(url=url)))
        store.schema_migrate()
        slot = slot_of(store, "blocked")
        live = [f"live-{n}" for n in range(2000) if slot_of(store, f"live-{n}") == slot][:8]
        with store.engine.begin() as connection:
            for hint in live:
                connection.execute(text("INSERT INTO correlation_message (message_name, correlation_hint) "
                                        "SELECT 'n', :h FROM generate_series(1, 5)"), {"h": hint})
            connection.execute(text("ANALYZE correlation_message"))
        empty = {kind: fetch_times(store, slot, args.fetches, kind == "generic") for kind in ("custom", "generic")}
        print(f"{'empty table (8 live hints)':28} custom {empty['custom'] * 1000:6.2f} ms  "
              f"generic {empty['generic'] * 1000:6.2f} ms", flush=True)
        figures["empty"] = empty
        for shape, statement in SHAPES.items():
            with store.engine.begin() as connection:
                connection.execute(text(statement), {"rows": args.rows})
                connection.execute(text("ANALYZE correlation_message"))
            loaded = {kind: fetch_times(store, slot, args.fetches, kind == "generic") for kind in ("custom", "generic")}
            figures[shape] = loaded
            print(f"{shape:28} custom {loaded['custom'] * 1000:6.2f} ms ({loaded['custom'] / empty['custom']:.2f} x)"
                  f"  generic {loaded['generic'] * 1000:6.2f} ms ({loaded['generic'] / empty['generic']:.2f} x)",
                  flush=True)
            with store.engine.begin() as connection:
                connection.execute(text("DELETE FROM correlation_message WHERE correlation_hint NOT LIKE 'live-%'"))
            with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
                connection.execute(text("VACUUM ANALYZE correlation_message"))
        read = rows_read_for_one(store)
        print(f"batch size 1 on a hint of 50 000 messages: {read} rows read for one message")
        figures["batch_size_1_rows_read"] = {"rows": float(read)}
        store.close()
    print(f"rows per shape: {args.rows:,}; fetches per figure: {args.fetches} (median)")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
