"""Latency from a producer's INSERT to the correlator's call, with a real worker process on default settings.

Sequential inserts with plain SQL (one autocommit INSERT, then wait until its message is called, then the next)
against a ``correlation-worker run`` process whose correlator notes when each call starts. Both processes read
the same machine clock. The reference, measured in the same run on the same database: the bare round trip of
the producers' NOTIFY (commit → a listening connection receives it), the floor of any wake-up::

    .venv/bin/python bench/latency.py [--url URL] [--messages 500] [--json]

Only the database URL, the metrics port, the correlator and the initial delay (PT0S: the measurement starts
once the worker works) differ from the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from drain import LOCAL_SERVER, URL_ENV, _conninfo, bench_database

from worker.config import DatabaseSettings
from worker.db.store import Store, build_engine, normalise_url

HERE = Path(__file__).resolve().parent


def percentile(values: list[float], fraction: float) -> float:
    """The value below which ``fraction`` of the values lie (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))]


def notify_floor(conninfo: str, count: int) -> list[float]:
    """Seconds from an INSERT's commit to the arrival of its NOTIFY on a listening connection."""
    listener = psycopg.connect(conninfo, autocommit=True)
    producer = psycopg.connect(conninfo, autocommit=True)
    listener.execute("LISTEN correlation_message")
    arrived: list[float] = []
    got = threading.Event()

    def listen() -> None:
        for _ in listener.notifies(timeout=60, stop_after=count):
            arrived.append(time.time())
            got.set()

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    latencies = []
    for _ in range(count):
        got.clear()
        producer.execute("INSERT INTO correlation_message (message_name, correlation_hint) VALUES ('floor', 'f')")
        committed = time.time()
        got.wait(10)
        latencies.append(arrived[-1] - committed)
    thread.join(10)
    producer.execute("DELETE FROM correlation_message WHERE message_name = 'floor'")
    listener.close()
    producer.close()
    return latencies


def run(url: str, count: int) -> tuple[list[float], list[float]]:
    """Latencies of the engine and of the NOTIFY floor, in seconds."""
    conninfo = _conninfo(url)
    floor = notify_floor(conninfo, count)
    journal = Path(tempfile.mkdtemp(prefix="cw-latency-")) / "calls"
    env = {key: value for key, value in os.environ.items() if not key.startswith("CORRELATION_")}
    env.update(
        {
            "CORRELATION_DATABASE__URL": url,
            "CORRELATION_METRICS__PORT": "0",
            "CORRELATION_POLL__INITIAL_DELAY": "PT0S",
            "CORRELATION_CORRELATORS": json.dumps({"*": "latency_correlator:record"}),
            "LATENCY_JOURNAL": str(journal),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")])),
        }
    )
    log = journal.with_suffix(".log").open("wb")
    worker = subprocess.Popen([sys.executable, "-m", "worker", "run"], env=env, stdout=log, stderr=log)
    try:
        producer = psycopg.connect(conninfo, autocommit=True)
        warmup = 20
        latencies = []
        seen: dict[int, float] = {}
        offset = 0
        for number in range(count + warmup):
            row = producer.execute(
                "INSERT INTO correlation_message (message_name, correlation_hint) VALUES ('bench', %s) RETURNING id",
                (f"hint-{number}",),
            ).fetchone()
            committed = time.time()
            assert row is not None
            deadline = committed + 30
            while row[0] not in seen:
                if time.time() > deadline:
                    raise SystemExit(f"message {row[0]} was not called within 30 s; see {log.name}")
                if journal.exists():
                    with journal.open() as lines:
                        lines.seek(offset)
                        for line in lines.readlines():
                            message_id, at = line.split()
                            seen[int(message_id)] = float(at)
                        offset = lines.tell()
                time.sleep(0.0002)
            if number >= warmup:
                latencies.append(seen[row[0]] - committed)
        producer.close()
        return latencies, floor
    finally:
        worker.terminate()
        worker.wait(30)
        log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="PostgreSQL URL (without a database name: a throwaway database)")
    parser.add_argument("--messages", type=int, default=500)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with bench_database(normalise_url(args.url or os.environ.get(URL_ENV) or LOCAL_SERVER)) as url:
        store = Store(build_engine(DatabaseSettings(url=url)))
        store.schema_migrate()
        store.close()
        engine, floor = run(url, args.messages)
    figures = {
        name: {"p50_ms": percentile(values, 0.5) * 1000, "p90_ms": percentile(values, 0.9) * 1000,
               "p99_ms": percentile(values, 0.99) * 1000, "mean_ms": statistics.mean(values) * 1000}
        for name, values in (("engine", engine), ("notify_floor", floor))
    }
    for name, label in (("engine", "insert → call"), ("notify_floor", "commit → NOTIFY received")):
        f = figures[name]
        print(f"{label:26} p50 {f['p50_ms']:6.2f} ms  p90 {f['p90_ms']:6.2f} ms  p99 {f['p99_ms']:6.2f} ms")
    print(f"messages: {args.messages} sequential inserts (each waits for the call before the next)")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
