"""I/O-bound drain: a correlator that waits (a slow target), against Little's limit.

A correlator that sleeps ``--call-ms`` per call, ``--concurrency`` lanes: no engine can do better than
``concurrency / call time`` calls per second (Little's law). The benchmark drains ``--messages`` messages over
``--hints`` hints with the real engine in-process, through a SlotLeaser holding every slot (marks and fenced
commits, as a lone replica), and prints the throughput next to that limit::

    .venv/bin/python bench/io_bound.py [--url URL] [--messages 5000] [--hints 1000] [--call-ms 10]
                                       [--concurrency 32] [--page-size 100] [--runs 3] [--json]

The clock runs from the engine's start until every outcome is written; every message is checked to have been
handled once, in id order per hint.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from drain import (
    LOCAL_SERVER,
    URL_ENV,
    Recorder,
    bench_database,
    connect_driver,
    settings_for,
    slot_source,
    verify,
)

from worker.config import DatabaseSettings, DeliverySettings, parse_duration
from worker.correlators import Router
from worker.db.store import Store, build_engine, normalise_url
from worker.engine.engine import Engine
from worker.engine.leases import SlotLeaser
from worker.message import Message


class SlowTarget(Recorder):
    """Records the call, then waits as a remote target would."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def __call__(self, message: Message) -> None:
        super().__call__(message)
        time.sleep(self.seconds)


def run_once(url: str, args: argparse.Namespace) -> float:
    """Insert, drain with the engine, verify; returns calls per second."""
    driver = connect_driver(url)
    try:
        driver.insert(args.messages, args.hints)
        expected = driver.ids_and_hints()
        settings = settings_for(url, args.page_size, args.concurrency)
        store = Store(build_engine(settings.database))
        store.keep_delivery_records(args.retention, "bench")
        target = SlowTarget(args.call_ms / 1000)
        with ExitStack() as stack:
            stack.callback(store.close)
            store.now()
            slots = stack.enter_context(slot_source(store, True))
            assert isinstance(slots, SlotLeaser)
            engine = Engine(store, Router({"*": target}), settings, slots, holder=slots.holder)
            stack.callback(engine.stop, 0.0)
            started = time.perf_counter()
            engine.start()
            deadline = started + 600
            while engine.committer.written < args.messages:
                if time.perf_counter() > deadline:
                    raise SystemExit(f"the drain did not end within 600 s ({engine.committer.written} written)")
                time.sleep(0.001)
            seconds = time.perf_counter() - started

        if driver.count():
            raise SystemExit("verification failed: messages left after the drain")
        verify(target.seen, expected)
        driver.purge()  # the delivery records (not timed): every run starts from an empty table
        return float(args.messages / seconds)
    finally:
        driver.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="PostgreSQL URL (without a database name: a throwaway database)")
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--hints", type=int, default=1000)
    parser.add_argument("--call-ms", type=float, default=10.0, help="each call's wait (default 10 ms)")
    parser.add_argument("--concurrency", type=int, default=32, help="lanes (default 32)")
    parser.add_argument("--page-size", type=int, default=100, help="CORRELATION_POLL__PAGE_SIZE (default 100)")
    parser.add_argument("--runs", type=int, default=3, help="repeat and report the median (default 3)")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    parser.add_argument(
        "--retention", type=parse_duration, default=DeliverySettings().retention,
        help="CORRELATION_DELIVERY__RETENTION: P7D (the default) keeps a delivery record per message, PT0S none",
    )
    args = parser.parse_args()
    rates = []
    with bench_database(normalise_url(args.url or os.environ.get(URL_ENV) or LOCAL_SERVER)) as url:
        store = Store(build_engine(DatabaseSettings(url=url)))
        store.schema_migrate()
        store.close()
        for number in range(args.runs):
            rate = run_once(url, args)
            print(f"run {number + 1}: {rate:,.0f} calls/s", file=sys.stderr)
            rates.append(rate)
    rate = statistics.median(rates)
    limit = args.concurrency / (args.call_ms / 1000)
    print(f"engine: {rate:,.0f} calls/s (median of {args.runs}; verified: each message once, in id order per hint)")
    print(f"limit:  {limit:,.0f} calls/s (Little's law: {args.concurrency} lanes / {args.call_ms:g} ms per call)")
    print(f"ratio:  {rate / limit:.2f} of the limit")
    if args.json:
        print(json.dumps({"rates": rates, "median": rate, "limit": limit, "ratio": rate / limit}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
