"""A burst after a quiet spell: one real ``correlation-worker run`` process, idle on a table that autovacuum last
saw quiet, then a burst of messages inserted in one statement while it runs.

    .venv/bin/python bench/burst.py [--url URL] [--messages 20000] [--hints 1000] [--rounds 2]

Each round measures three bursts, each on a fresh replica at default settings (the no-op correlator):

1. **records**: the table holds only the delivery records of an earlier burst (the default retention), and was
   analyzed then: the statistics say no message is live;
2. **emptied** (``CORRELATION_DELIVERY__RETENTION=PT0S``): the table was emptied and vacuumed after an earlier
   burst that was analyzed while it was there (ANALYZE of an empty table keeps its columns' statistics);
3. **analyzed**, the reference: the burst is inserted paused, the table analyzed with it, then released in one
   UPDATE (what ``bench/cluster.py`` measures).

Each burst is timed from the insert's commit (the release's, for the reference) until no slot holds a ready
message, watched every 20 ms; its rate is messages over that time. The replica starts after the table is
prepared and idles two seconds before the burst (its statements are prepared and planned on the quiet table, as
a replica's are between bursts).

``--url`` as in drain.py (default: ``CORRELATION_BENCH_DATABASE_URL``, else the local server; a URL without a
database name gets a throwaway database). PostgreSQL only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

from cluster import Replica, release, slot_terms, slots_with_work, wait_for, worker_env
from drain import LOCAL_SERVER, URL_ENV, PostgresDriver, bench_database, migrate

from worker.db.store import normalise_url

IDLE_SECONDS = 2.0
WATCH_INTERVAL = 0.02
BURST = ("INSERT INTO correlation_message (message_name, correlation_hint, state) "
         "SELECT 'order.paid', 'hint-' || (g %% %(hints)s), %(state)s FROM generate_series(1, %(messages)s) g")


def quiet_records(driver: PostgresDriver, messages: int, hints: int) -> None:
    """Delivery records of an earlier burst only, analyzed so."""
    driver.connection.execute(BURST, {"messages": messages, "hints": hints, "state": "ready"})
    driver.connection.execute(
        "UPDATE correlation_message SET state = 'delivered', outcome = 'correlated', finished_at = now(), "
        "finished_by = 'earlier', payload = '{}' WHERE state = 'ready'")
    driver.connection.execute("VACUUM ANALYZE correlation_message")


def quiet_emptied(driver: PostgresDriver, messages: int, hints: int) -> None:
    """Empty, after an earlier burst analyzed while it was there."""
    driver.connection.execute(BURST, {"messages": messages, "hints": hints, "state": "ready"})
    driver.connection.execute("ANALYZE correlation_message")
    driver.connection.execute("DELETE FROM correlation_message")
    driver.connection.execute("VACUUM ANALYZE correlation_message")


def burst(url: str, driver: PostgresDriver, messages: int, hints: int, log_dir: Path, slots: int,
          quiet: Callable[[PostgresDriver, int, int], None] | None, settings: dict[str, str]) -> float:
    """One burst on a fresh replica: msgs/s from the commit until no slot holds a ready message."""
    driver.connection.execute("DELETE FROM correlation_message")
    driver.connection.execute("DELETE FROM correlation_call")
    if quiet is not None:
        quiet(driver, messages, hints)
    else:  # the reference: the burst loaded paused and analyzed with the table
        driver.connection.execute(BURST, {"messages": messages, "hints": hints, "state": "paused"})
        driver.connection.execute("VACUUM ANALYZE correlation_message")
    env = worker_env(url, "burst-1", 100, 8, settings)
    for key in ("POLL__PAGE_SIZE", "POLL__CONCURRENCY", "LEASE__RENEW_INTERVAL", "LEASE__DRAIN"):
        env.pop(f"CORRELATION_{key}", None)  # default settings, but the initial delay (PT0S)
    replica = Replica("burst-1", env, log_dir)
    try:
        wait_for(lambda: True if len(slot_terms(driver)) == slots else None, time.monotonic() + 60,
                 "the replica's slot leases", [replica])
        time.sleep(IDLE_SECONDS)
        if quiet is not None:
            driver.connection.execute(BURST, {"messages": messages, "hints": hints, "state": "ready"})
        else:
            release(driver)
        started = time.perf_counter()
        while slots_with_work(driver, slots):
            replica.check_running()
            time.sleep(WATCH_INTERVAL)
        seconds = time.perf_counter() - started
    finally:
        code = replica.stop()
    if code != 0:
        raise SystemExit(f"the replica exited with {code}")
    return messages / seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--url", default=None, help="PostgreSQL server or database")
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--hints", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    url = normalise_url(args.url or os.environ.get(URL_ENV, LOCAL_SERVER))
    if not url.startswith("postgresql"):
        raise SystemExit("bench/burst.py needs PostgreSQL")
    cases: list[tuple[str, Callable[[PostgresDriver, int, int], None] | None, dict[str, str]]] = [
        ("after a quiet spell of delivery records (default retention)", quiet_records, {}),
        ("after the table was emptied and vacuumed (retention PT0S)", quiet_emptied,
         {"CORRELATION_DELIVERY__RETENTION": "PT0S"}),
        ("reference: loaded paused, analyzed, released", None, {}),
    ]
    rates: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    with ExitStack() as stack:
        database_url = stack.enter_context(bench_database(url))
        slots = migrate(database_url)
        driver = PostgresDriver(database_url)
        stack.callback(driver.close)
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cw-burst-")))
        for _ in range(args.rounds):
            for name, quiet, settings in cases:
                rates[name].append(burst(database_url, driver, args.messages, args.hints, log_dir, slots, quiet,
                                         settings))
                print(f"{name}: {rates[name][-1]:,.0f} msgs/s", file=sys.stderr)
    reference = statistics.fmean(rates[cases[-1][0]])
    print(f"\n{args.messages:,} messages over {args.hints:,} hints, one replica at default settings")
    for name, values in rates.items():
        mean = statistics.fmean(values)
        each = ", ".join(f"{value:,.0f}" for value in values)
        print(f"  {name:<64} {mean:>8,.0f} msgs/s ({each})  {mean / reference:.2f} of the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
