"""What the schema's producer triggers cost producers: commit throughput with them on and off.

``--producers`` connections each commit single-row INSERTs (autocommit, the way most producers write) for
``--seconds``, in four configurations of the two statement triggers on ``correlation_message``:
``correlation_message_notify`` (the wake-up NOTIFY) and ``correlation_message_register_producer`` (the
commit-order registration). Nothing correlates meanwhile; the table is emptied between configurations::

    .venv/bin/python bench/notify_cost.py [--url URL] [--producers 4] [--seconds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from drain import LOCAL_SERVER, URL_ENV, bench_database, libpq_conninfo

from worker.config import DatabaseSettings
from worker.db.store import Store, build_engine, normalise_url

CONFIGURATIONS = {
    "both triggers (default)": {"correlation_message_notify": True, "correlation_message_register_producer": True},
    "order registration only": {"correlation_message_notify": False, "correlation_message_register_producer": True},
    "notify only": {"correlation_message_notify": True, "correlation_message_register_producer": False},
    "no trigger": {"correlation_message_notify": False, "correlation_message_register_producer": False},
}


def throughput(conninfo: str, producers: int, seconds: float) -> float:
    """Commits per second of ``producers`` connections inserting one message per transaction."""
    stop = threading.Event()
    counts = [0] * producers

    def produce(number: int) -> None:
        with psycopg.connect(conninfo, autocommit=True) as connection:
            while not stop.is_set():
                connection.execute(
                    "INSERT INTO correlation_message (message_name, correlation_hint) VALUES ('bench', %s)",
                    (f"hint-{number}-{counts[number] % 100}",),
                )
                counts[number] += 1

    threads = [threading.Thread(target=produce, args=(n,)) for n in range(producers)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="PostgreSQL URL (without a database name: a throwaway database)")
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures: dict[str, float] = {}
    with bench_database(normalise_url(args.url or os.environ.get(URL_ENV) or LOCAL_SERVER)) as url:
        store = Store(build_engine(DatabaseSettings(url=url)))
        store.schema_migrate()
        store.close()
        conninfo = libpq_conninfo(url)
        with psycopg.connect(conninfo, autocommit=True) as admin:
            for name, triggers in CONFIGURATIONS.items():
                for trigger, enabled in triggers.items():
                    admin.execute(
                        f"ALTER TABLE correlation_message {'ENABLE' if enabled else 'DISABLE'} TRIGGER {trigger}"
                    )
                figures[name] = throughput(conninfo, args.producers, args.seconds)
                admin.execute("TRUNCATE correlation_message")
                print(f"{name:26} {figures[name]:9,.0f} commits/s", flush=True)
    base = figures["no trigger"]
    for name, rate in figures.items():
        print(f"{name:26} {rate / base:.2f} of the rate without triggers")
    print(f"producers: {args.producers} connections, one INSERT per transaction, {args.seconds:g} s each")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
