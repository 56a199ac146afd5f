"""Every headline figure from real ``correlation-worker run`` processes, each next to its reference, in one table.

The processes are started as a user starts them: the installed console script, settings by environment,
outside the repository; they are timed from outside (insert and release timestamps, the correlator's own clock,
the lock and message tables, the processes' CPU time from ``/proc``)::

    .venv/bin/python bench/run.py [--url URL] [--quick] [--json]

Figures (PostgreSQL; a throwaway database as in drain.py, unless ``--url`` names one):

1. **latency**: a producer's INSERT to the correlator's call, sequential, default settings (``latency.py``);
   reference: the INSERT until its NOTIFY reaches a listening connection.
2. **slow target**: a correlator waiting 10 ms, 32 lanes (``CORRELATION_POLL__CONCURRENCY=32``, everything else
   default), 5 000 messages over 1 000 hints released at once; reference: Little's limit, 32 / 10 ms.
3. **drain**: no-op correlator, 100 000 messages over 1 000 hints, page 1 000, released at once (``cluster.py``,
   one replica); references: drain.py's raw-SQL floors on the same rows, select+delete and select+record (each
   row made its delivery record, what a success writes at the default retention); the same drain again with
   ``CORRELATION_DELIVERY__RETENTION=PT0S`` (successes deleted) against select+delete; with the process's CPU
   per message at defaults; and the drain at defaults against the same with ``CORRELATION_METRICS__ENABLED=false``
   (no endpoint: successes counted from the delivery records), what the metrics cost. Each drain and floor runs
   twice, the second pass in the reverse order, and the mean is quoted with both values.
4. **cold start**: 20 000 messages over 1 000 hints already in the table, from starting the process to the
   last success recorded (its delivery record's ``finished_at`` against the database's clock read just before
   the start; default settings but the initial delay, PT0S); the time until the benchmark saw the table empty
   is printed beside it. Two starts, the mean quoted with both.
5. **scale**: 20 000 no-op messages drained by 1, 2 and 4 replicas, then by 4, 2 and 1 (``cluster.py``), each
   count's mean quoted with both; reference: one replica.
6. **kill storm**: four replicas under a steady stream, one SIGKILLed and replaced every 3 s for 60 s
   (``storm.py``): how soon each victim's slots are leased again and called again; reference: the bound
   ``LEASE__DURATION + LEASE__RENEW_INTERVAL``.

``--quick`` divides the message counts by ten (a smoke test of the harness, not figures to quote).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import storm
from cluster import (
    METRICS_ENABLED,
    RETENTION,
    ClusterFigures,
    Replica,
    measure_floor,
    run_cluster,
    slot_terms,
    slots_with_work,
    wait_for,
    worker_env,
)
from drain import LOCAL_SERVER, URL_ENV, PostgresDriver, bench_database, migrate
from latency import percentile
from latency import run as latency_run

import worker
from worker.db.store import normalise_url

BENCH_TREE = Path(__file__).resolve().parent.parent
CALL_MS = 10.0
SLOW_LANES = 32


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the table."""

    figure: str
    value: str
    reference: str
    ratio: str = ""


def _args(**values: object) -> argparse.Namespace:
    """cluster.py's arguments for one of its drains (its payloads ``{"n": i}`` unless said)."""
    return argparse.Namespace(**{"payload_bytes": 0, **values})


def latency_row(url: str, count: int) -> Row:
    engine, floor = latency_run(url, count)
    return Row(
        "insert → call latency, default settings (NOTIFY on)",
        f"p50 {percentile(engine, 0.5) * 1000:.2f} ms, p99 {percentile(engine, 0.99) * 1000:.2f} ms",
        f"NOTIFY round trip p50 {percentile(floor, 0.5) * 1000:.2f} ms, p99 {percentile(floor, 0.99) * 1000:.2f} ms",
    )


def slow_target_rate(url: str, driver: PostgresDriver, messages: int, log_dir: Path, slots: int) -> float:
    """Calls a second of one replica whose correlator waits CALL_MS, on SLOW_LANES lanes, from the release of
    ``messages`` over up to 1 000 hints."""
    args = _args(messages=messages, hints=min(1000, messages), page_size=100, concurrency=SLOW_LANES, slots=slots,
                 settings={"CORRELATION_CORRELATORS": json.dumps({"*": "sleep_correlator:call"}),
                           "BENCH_CALL_MS": f"{CALL_MS:g}"})
    return run_cluster(url, driver, 1, args, log_dir).rate


def slow_target_row(url: str, driver: PostgresDriver, messages: int, log_dir: Path, slots: int) -> Row:
    rate = slow_target_rate(url, driver, messages, log_dir, slots)
    limit = SLOW_LANES / (CALL_MS / 1000)
    return Row(
        f"{CALL_MS:g} ms target, {SLOW_LANES} lanes, {messages:,} msgs / {min(1000, messages):,} hints",
        f"{rate:,.0f} calls/s",
        f"Little's limit {limit:,.0f} calls/s",
        f"{rate / limit:.2f}",
    )


def both(values: Sequence[float], unit: str, digits: int = 0) -> str:
    """The mean of a figure measured twice, with both measurements."""
    return (f"{statistics.fmean(values):,.{digits}f} {unit} "
            f"({', '.join(f'{value:,.{digits}f}' for value in values)})")


def drain_rows(url: str, driver: PostgresDriver, messages: int, log_dir: Path, slots: int) -> list[Row]:
    """The drain at default settings against both floors: select+delete (the rows leave, as with
    ``CORRELATION_DELIVERY__RETENTION=PT0S``) and select+record (each row becomes its delivery record, as the
    default ``P7D`` keeps it); the drain with ``PT0S``, doing what the select+delete floor does; and the drain
    with the metrics off.

    Each is measured twice, the second time in the reverse order (floors, defaults, PT0S, metrics off; then
    metrics off, PT0S, defaults, floors), and quoted as the mean of the two: one drain of a few seconds moves
    by a tenth from one run to the next here, and whichever ran first after the load of the floors was the slow
    one, which made a single pass read as if the metrics cost a fifth of the throughput.
    """
    args = _args(messages=messages, hints=1000, page_size=1000, concurrency=8, slots=slots, settings=None)
    variants = {"defaults": None, "PT0S": {RETENTION: "PT0S"}, "quiet": {METRICS_ENABLED: "false"}}
    floors: dict[str, list[float]] = {"delete": [], "record": []}
    drains: dict[str, list[ClusterFigures]] = {name: [] for name in variants}

    def measure_floors() -> None:
        floors["delete"].append(measure_floor(driver, messages, args.hints, args.page_size))
        floors["record"].append(measure_floor(driver, messages, args.hints, args.page_size, record=True))
        driver.purge()

    def measure_drains(order: Sequence[str]) -> None:
        for name in order:
            drains[name].append(run_cluster(url, driver, 1, _args(**{**vars(args), "settings": variants[name]}),
                                            log_dir))
            driver.purge()  # its records: the next drain starts from a table as fresh as this one's

    measure_floors()
    measure_drains(list(variants))
    measure_drains(list(reversed(variants)))
    measure_floors()

    def rates(name: str) -> list[float]:
        return [figures.rate for figures in drains[name]]

    def cpus(name: str) -> list[float] | None:
        seconds = [figures.members[0].cpu_seconds for figures in drains[name]]
        return None if None in seconds else [cpu / messages * 1e6 for cpu in seconds if cpu is not None]

    rate, deleting, quiet = (statistics.fmean(rates(name)) for name in variants)
    floor, record_floor = statistics.fmean(floors["delete"]), statistics.fmean(floors["record"])
    drain = f"no-op drain, {messages:,} msgs, page 1 000, from release (mean of two)"
    rows = [
        Row(drain, both(rates("defaults"), "msgs/s"), f"select+delete floor {both(floors['delete'], 'msgs/s')}",
            f"{rate / floor:.2f}"),
        Row("  the same drain, against what its successes write (delivery records, the default)",
            both(rates("defaults"), "msgs/s"), f"select+record floor {both(floors['record'], 'msgs/s')}",
            f"{rate / record_floor:.2f}"),
        Row("  the same drain, successes deleted (DELIVERY__RETENTION=PT0S)", both(rates("PT0S"), "msgs/s"),
            f"select+delete floor {both(floors['delete'], 'msgs/s')}", f"{deleting / floor:.2f}"),
    ]
    on_cpu, off_cpu = cpus("defaults"), cpus("quiet")
    if on_cpu is not None:
        rows.append(Row("CPU per message of the worker process, no-op drain", both(on_cpu, "µs", 1), "", ""))
    rows.append(Row("  what the metrics cost: the drain at defaults (endpoint on, scraped at the end)",
                    both(rates("defaults"), "msgs/s") + (f", {statistics.fmean(on_cpu):.1f} µs/msg" if on_cpu else ""),
                    f"METRICS__ENABLED=false {both(rates('quiet'), 'msgs/s')}"
                    + (f", {statistics.fmean(off_cpu):.1f} µs/msg" if off_cpu else ""),
                    f"{rate / quiet:.2f}"))
    return rows


@dataclass(frozen=True, slots=True)
class ColdStart:
    """One cold start, in seconds from starting the process (the database's clock but ``watched``)."""

    first: float  # to the first success recorded
    last: float  # to the last success recorded
    watched: float  # to the table seen empty (the benchmark's clock)


def cold_start_seconds(url: str, driver: PostgresDriver, messages: int, hints: int, log_dir: Path,
                       slots: int) -> ColdStart:
    """One cold start: seconds from starting the process to the first and the last success recorded, and to the
    table seen empty."""
    driver.insert(messages, hints)
    driver.connection.execute("VACUUM ANALYZE correlation_message")
    env = worker_env(url, "cold-1", 100, 8)
    for key in ("POLL__INTERVAL", "POLL__PAGE_SIZE", "POLL__CONCURRENCY", "LEASE__RENEW_INTERVAL", "LEASE__DRAIN"):
        env.pop(f"CORRELATION_{key}", None)  # a process on defaults (but the initial delay, PT0S)
    # The end is the last success's record, on the database's clock like the start: the watch below only says when
    # the drain is over, and looks at the table every WATCH_INTERVAL (a twentieth of the figure at a second).
    clock = driver.connection.execute("SELECT clock_timestamp()").fetchone()
    assert clock is not None
    started_at = clock[0]
    started = time.perf_counter()
    replica = Replica("cold-1", env, log_dir)
    try:
        watched = wait_for(
            lambda: (time.perf_counter() - started) if not slots_with_work(driver, slots) else None,
            time.monotonic() + 120 + messages / 500, "the cold-start drain", [replica],
        )
        scrape = replica.scrape()
    finally:
        code = replica.stop()
    if code != 0 or scrape.successes != messages or driver.count():
        raise SystemExit(f"cold start: exit {code}, {scrape.successes} successes for {messages}, {driver.count()} left")
    records = driver.connection.execute(
        "SELECT min(finished_at), max(finished_at) FROM correlation_message WHERE state = 'delivered'").fetchone()
    assert records is not None
    first, last = records
    driver.purge()
    return ColdStart((first - started_at).total_seconds(), (last - started_at).total_seconds(), watched)


def cold_start_row(url: str, driver: PostgresDriver, messages: int, log_dir: Path, slots: int) -> Row:
    """Two cold starts, quoted as the mean rate with both (one start moves by a tenth from run to run)."""
    hints = min(1000, messages)
    starts = [cold_start_seconds(url, driver, messages, hints, log_dir, slots) for _ in range(2)]
    to_first = " and ".join(f"{start.first:.2f} s" for start in starts)
    to_last = " and ".join(f"{start.last:.2f} s" for start in starts)
    to_empty = " and ".join(f"{start.watched:.2f} s" for start in starts)
    return Row(f"no-op drain, {messages:,} msgs / {hints:,} hints, from process start to last call (mean of two)",
               both([messages / start.last for start in starts], "msgs/s"),
               f"{to_first} to the first success recorded, {to_last} to the last ({to_empty} to the table seen "
               "empty)")


def scale_rows(url: str, driver: PostgresDriver, messages: int, log_dir: Path, slots: int) -> list[Row]:
    """1, 2 and 4 replicas, then 4, 2 and 1 again, each count quoted as the mean of its two drains (one drain of
    these lasts under a second, and the same count moved by a sixth from one run to the next)."""
    args = _args(messages=messages, hints=1000, page_size=100, concurrency=8, slots=slots, settings=None)
    rates: dict[int, list[float]] = {count: [] for count in (1, 2, 4)}
    for count in (1, 2, 4, 4, 2, 1):
        rates[count].append(run_cluster(url, driver, count, args, log_dir).rate)
    one = statistics.fmean(rates[1])
    return [
        Row(f"{count} replica{'s' if count > 1 else ''}, {messages:,} no-op msgs (mean of two)",
            both(rates[count], "msgs/s"), f"1 replica {one:,.0f} msgs/s",
            f"{statistics.fmean(rates[count]) / one:.2f}")
        for count in rates
    ]


def storm_rows(url: str, seconds: float, log_dir: Path) -> list[Row]:
    deaths = storm.run(url, seconds, 3.0, log_dir)
    retaken, called = storm.summary(deaths)
    bound = f"bound DURATION + RENEW_INTERVAL = {storm.LEASE_SECONDS + storm.RENEW_SECONDS:g} s"
    holding = sum(1 for death in deaths if death.slots)
    passed = sum(death.passed_on for death in deaths)
    chained = f"; {passed} slots whose taker was killed too, counted in its death" if passed else ""
    what = (f"kill storm, 4 replicas, one SIGKILLed every 3 s for {seconds:g} s ({holding} deaths holding "
            f"slots{chained})")
    return [Row(f"{what}: slots leased again", retaken.removeprefix("re-taken "), bound),
            Row(f"{what}: their work called again", called.removeprefix("called "), bound)]


def print_table(rows: Sequence[Row]) -> None:
    widths = [max(len(getattr(row, column)) for row in rows) for column in ("figure", "value", "reference")]
    header = ("figure", "value", "reference in the same run")
    print(f"| {header[0]:<{widths[0]}} | {header[1]:<{widths[1]}} | {header[2]:<{widths[2]}} | ratio |")
    print(f"|{'-' * (widths[0] + 2)}|{'-' * (widths[1] + 2)}|{'-' * (widths[2] + 2)}|-------|")
    for row in rows:
        print(f"| {row.figure:<{widths[0]}} | {row.value:<{widths[1]}} | {row.reference:<{widths[2]}} | "
              f"{row.ratio:<5} |")


def _worker_source() -> str:
    """Where the measured worker comes from: the benchmark's git revision says nothing of an install made from
    another tree (two revisions are compared each from its own install)."""
    package = Path(worker.__file__).resolve().parent
    if package == BENCH_TREE / "worker":  # not merely under it: the README's install puts .venv in the tree
        return "this tree (an editable install)"
    return f"the install at {package.parent}"


def parse_args(argv: Sequence[str] | None, doc: str | None, script: str) -> tuple[argparse.Namespace, str, int]:
    """The command line of a side-by-side benchmark (this one, versus_graphile.py): its arguments, the PostgreSQL
    URL and the scale (10 with ``--quick``, else 1)."""
    parser = argparse.ArgumentParser(description=doc.split("\n", 1)[0] if doc else None)
    parser.add_argument("--url", default=os.environ.get(URL_ENV, LOCAL_SERVER), help="PostgreSQL server or database")
    parser.add_argument("--quick", action="store_true", help="a tenth of the messages: checks the harness only")
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = parser.parse_args(argv)
    url = normalise_url(args.url)
    if not url.startswith("postgresql"):
        raise SystemExit(f"{script} needs PostgreSQL")
    return args, url, 10 if args.quick else 1


def main(argv: Sequence[str] | None = None) -> int:
    args, url, scale = parse_args(argv, __doc__, "bench/run.py")
    rows: list[Row] = []
    with ExitStack() as stack:
        database_url = stack.enter_context(bench_database(url))
        slots = migrate(database_url)
        driver = PostgresDriver(database_url)
        stack.callback(driver.close)
        if driver.count() or slot_terms(driver):
            raise SystemExit("the database holds messages or live slot leases: give an empty one")
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cw-bench-")))
        steps: list[tuple[str, Callable[[], list[Row]]]] = [
            ("latency", lambda: [latency_row(database_url, 500 // scale)]),
            ("slow target", lambda: [slow_target_row(database_url, driver, 5000 // scale, log_dir, slots)]),
            ("drain", lambda: drain_rows(database_url, driver, 100_000 // scale, log_dir, slots)),
            ("cold start", lambda: [cold_start_row(database_url, driver, 20_000 // scale, log_dir, slots)]),
            ("scale", lambda: scale_rows(database_url, driver, 20_000 // scale, log_dir, slots)),
            ("kill storm", lambda: storm_rows(database_url, 60.0 / scale, log_dir)),
        ]
        for name, step in steps:
            started = time.monotonic()
            rows += step()
            driver.purge()
            print(f"{name}: done in {time.monotonic() - started:.0f} s", file=sys.stderr)
    version = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=False).stdout.strip()
    print_table(rows)
    return print_footer(rows, f"bench/ at revision {version or '?'}", url, "real `correlation-worker run` processes",
                        quick=args.quick, as_json=args.json)


def print_footer(rows: Sequence[Any], first: str, url: str, processes: str, *, quick: bool, as_json: bool) -> int:
    """The line under a table (which worker, how many CPUs, which server, what ran), then the rows as JSON if asked;
    the exit code."""
    print(f"\n{first}, the worker from {_worker_source()}, {os.cpu_count()} CPUs, PostgreSQL on "
          f"{url.split('@')[-1]}, {processes}{' (--quick: not figures to quote)' if quick else ''}")
    if as_json:
        print(json.dumps([asdict(row) for row in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
