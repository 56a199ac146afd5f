"""Latency from a producer's INSERT to the correlator's call, with a real worker process on default settings.

Sequential inserts with plain SQL (one autocommit INSERT, then wait until its message is called, then the next)
against a ``correlation-worker run`` process whose correlator tells the benchmark (a UDP datagram on the
loopback) when each call starts. Both processes read the same machine clock, and both figures run from the
moment the producer sends its INSERT. The reference, measured in the same run on the same database: the same
INSERT until its NOTIFY reaches a listening connection, the floor of any wake-up::

    .venv/bin/python bench/latency.py [--url URL] [--messages 500] [--json]

Only the database URL, the metrics port, the correlator and the initial delay (PT0S: the measurement starts
once the worker works) differ from the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import worker_command
from drain import LOCAL_SERVER, URL_ENV, bench_database, libpq_conninfo

from worker.config import DatabaseSettings
from worker.db.store import Store, build_engine, normalise_url

HERE = Path(__file__).resolve().parent


def percentile(values: list[float], fraction: float) -> float:
    """The value below which ``fraction`` of the values lie (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))]


def notify_floor(conninfo: str, count: int) -> list[float]:
    """Seconds from sending an INSERT (autocommit) to the arrival of its NOTIFY on a listening connection."""
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
        sent = time.time()
        producer.execute("INSERT INTO correlation_message (message_name, correlation_hint) VALUES ('floor', 'f')")
        if not got.wait(10):
            raise SystemExit("a NOTIFY did not arrive within 10 s")
        latencies.append(arrived[-1] - sent)
    thread.join(10)
    producer.execute("DELETE FROM correlation_message WHERE message_name = 'floor'")
    listener.close()
    producer.close()
    return latencies


def run(url: str, count: int) -> tuple[list[float], list[float]]:
    """Latencies of the engine and of the NOTIFY floor, in seconds."""
    conninfo = libpq_conninfo(url)
    floor = notify_floor(conninfo, count)
    calls = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    calls.bind(("127.0.0.1", 0))
    workdir = Path(tempfile.mkdtemp(prefix="cw-latency-"))
    env = {key: value for key, value in os.environ.items() if not key.startswith("CORRELATION_")}
    env.update(
        {
            "CORRELATION_DATABASE__URL": url,
            "CORRELATION_METRICS__PORT": "0",
            "CORRELATION_POLL__INITIAL_DELAY": "PT0S",
            "CORRELATION_CORRELATORS": json.dumps({"*": "latency_correlator:record"}),
            "LATENCY_PORT": str(calls.getsockname()[1]),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")])),
        }
    )
    log_path = workdir / "worker.log"
    log = log_path.open("wb")
    # The installed console script, started outside the repository: the source tree must not shadow the install
    # (its ``worker`` directory has no ``worker.migrations``: the package maps it from schema/ when installed).
    worker = subprocess.Popen(worker_command(), env=env, stdout=log, stderr=log, cwd=workdir)
    failed = True  # until the measurement returns: the log a failure names is kept
    try:
        producer = psycopg.connect(conninfo, autocommit=True)
        warmup = 20
        latencies = []
        seen: dict[int, float] = {}
        for number in range(count + warmup):
            sent = time.time()
            row = producer.execute(
                "INSERT INTO correlation_message (message_name, correlation_hint) VALUES ('bench', %s) RETURNING id",
                (f"hint-{number}",),
            ).fetchone()
            assert row is not None
            deadline = sent + 30
            while row[0] not in seen:
                calls.settimeout(max(0.001, deadline - time.time()))
                try:
                    datagram = calls.recv(100)
                except TimeoutError:
                    raise SystemExit(f"message {row[0]} was not called within 30 s; see {log_path}") from None
                message_id, at = datagram.decode().split()
                seen[int(message_id)] = float(at)
            if number >= warmup:
                latencies.append(seen[row[0]] - sent)
        producer.close()
        failed = False
        return latencies, floor
    finally:
        worker.terminate()
        code = worker.wait(30)
        log.close()
        calls.close()
        if code != 0:
            print(f"the worker exited with {code}; its log: {log_path}", file=sys.stderr)
        elif not failed:
            shutil.rmtree(workdir, ignore_errors=True)


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
    for name, label in (("engine", "insert → call"), ("notify_floor", "insert → NOTIFY received")):
        f = figures[name]
        print(f"{label:26} p50 {f['p50_ms']:6.2f} ms  p90 {f['p90_ms']:6.2f} ms  p99 {f['p99_ms']:6.2f} ms")
    print(f"messages: {args.messages} sequential inserts (each waits for the call before the next)")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
