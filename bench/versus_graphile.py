"""correlation-worker beside graphile-worker 0.18, on the same PostgreSQL database in the same run.

Each figure of ``bench/run.py`` that graphile-worker has a counterpart for, measured for both with their own
worker processes, one after the other, each next to the reference ``run.py`` gives it::

    npm ci --prefix bench/graphile          # once: graphile-worker 0.18.0 (Node.js 18 or newer)
    .venv/bin/python bench/versus_graphile.py [--url URL] [--quick] [--json]

A message's correlation hint is a job's named queue (``queue_name``): graphile-worker runs the jobs of one queue
one at a time, in order, as correlation-worker runs a hint's messages. Its jobs are added with its own SQL API
(``graphile_worker.add_job``), its worker is its command line (``graphile-worker -c URL -j N``) with the tasks of
``bench/graphile/tasks``, which tell the benchmark their times over UDP on the loopback as the correlators of
``latency.py`` do. Its settings: its defaults ("plain"), or a local queue of 100 jobs (correlation-worker's page)
with completions written in batches ("batched", ``bench/graphile/batched.config.js``), or the same with a local
queue of 500 ("batched 500"); its concurrency is given where correlation-worker's lanes are (8 by default, 32 for
the slow target), its pool of connections left at its default (10: 34 gave the same slow target, batched).

1. **latency**: sequential, 500 after 20 to warm up, from sending the INSERT (or the ``add_job``) to the call
   starting; graphile-worker at its defaults (one job at a time), each job in a queue of its own as each message
   has a hint of its own, and without a queue. Reference: the INSERT until its NOTIFY reaches a listener.
2. **slow target**: a call of 10 ms, 32 at a time, 5 000 over 1 000 hints made runnable at once (for
   correlation-worker the release of ``run.py``; for graphile-worker one transaction adding them all, timed from
   its commit) to the last call's end. Reference: Little's limit, 32 / 10 ms.
3. **cold start**: 20 000 no-op calls over 1 000 hints already in the table, from starting the process to the
   first and to the last call (correlation-worker on defaults as in ``run.py``; graphile-worker with 8 jobs at a
   time, correlation-worker's default lanes); the drain's rate after the first call is printed beside it.

Every figure is measured twice, the second pass in the reverse order, and quoted as the mean with both.
``--quick`` divides the counts by ten (a check of the harness, not figures to quote).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import psycopg
from drain import PostgresDriver, bench_database, libpq_conninfo, migrate
from latency import percentile
from latency import run as latency_run
from run import CALL_MS, SLOW_LANES, ColdStart, both, cold_start_seconds, parse_args, print_footer, slow_target_rate

GRAPHILE_DIR = Path(__file__).resolve().parent / "graphile"
GRAPHILE_CLI = GRAPHILE_DIR / "node_modules" / "graphile-worker" / "dist" / "cli.js"
READY_LINE = "Worker connected and looking for jobs"
DEFAULT_LANES = 8  # correlation-worker's CORRELATION_POLL__CONCURRENCY default
CONFIGS = {"plain": "plain.config.js", "batched": "batched.config.js", "batched 500": "batched500.config.js"}
WARMUP = 20

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the table: one figure, correlation-worker's value beside graphile-worker's."""

    figure: str
    ours: str
    graphile: str
    reference: str


class Graphile:
    """One ``graphile-worker`` process on the benchmark's database, its log in a file."""

    def __init__(self, url: str, jobs: int, config: str, env: dict[str, str], log_dir: Path) -> None:
        self.log_path = log_dir / f"graphile-{config.replace(' ', '-')}-{jobs}.log"
        self.started = time.time()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                ["node", str(GRAPHILE_CLI), "-c", url, "-j", str(jobs), "-C", str(GRAPHILE_DIR / CONFIGS[config])],
                env={**os.environ, **env}, cwd=GRAPHILE_DIR, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until it logs that it listens for jobs; stop the benchmark with its log if it exits or does not."""
        deadline = time.monotonic() + timeout
        while READY_LINE not in self.log_path.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"graphile-worker did not start:\n{self.log_path.read_text(errors='replace')}")
            time.sleep(0.01)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@contextmanager
def graphile(url: str, jobs: int, config: str, env: dict[str, str], log_dir: Path) -> Iterator[Graphile]:
    worker = Graphile(url, jobs, config, env, log_dir)
    try:
        yield worker
    finally:
        worker.stop()


@contextmanager
def datagrams() -> Iterator[socket.socket]:
    """A UDP socket on the loopback for the tasks' reports."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock
    finally:
        sock.close()


def receive(sock: socket.socket, deadline: float, what: str) -> tuple[str, float]:
    """The next report ``<key> <seconds>``."""
    sock.settimeout(max(0.001, deadline - time.time()))
    try:
        key, at = sock.recv(200).decode().split()
    except TimeoutError:
        raise SystemExit(f"graphile-worker: {what} did not happen in time") from None
    return key, float(at)


def graphile_latency(url: str, count: int, queues: bool, log_dir: Path) -> list[float]:
    """Seconds from sending each ``add_job`` (autocommit) to its task starting, graphile-worker's defaults."""
    with datagrams() as sock, graphile(url, 1, "plain", {"BENCH_PORT": str(sock.getsockname()[1])},
                                       log_dir) as worker, psycopg.connect(url, autocommit=True) as producer:
        worker.wait_ready()
        latencies, seen = [], {}
        for number in range(count + WARMUP):
            sent = time.time()
            row = producer.execute("SELECT (graphile_worker.add_job('record', '{}'::json, queue_name => %s)).id",
                                   (f"hint-{number}" if queues else None,)).fetchone()
            assert row is not None
            key = str(row[0])
            while key not in seen:
                got, at = receive(sock, sent + 30, f"job {key}")
                seen[got] = at
            if number >= WARMUP:
                latencies.append(seen[key] - sent)
        return latencies


# One call of add_jobs, graphile-worker's bulk API, as a producer adding a batch would: one statement, one
# notification saying how many jobs came.
_ADD_JOBS = """
    SELECT count(*) FROM graphile_worker.add_jobs(ARRAY(
        SELECT ROW('drain', json_build_object('n', i), 'hint-' || (i %% %(hints)s),
                   NULL, NULL, NULL, NULL, NULL)::graphile_worker.job_spec
          FROM generate_series(0, %(count)s - 1) AS i))"""


def add_jobs(url: str, count: int, hints: int) -> float:
    """Add ``count`` jobs over ``hints`` queues in one transaction; the time its commit returned."""
    with psycopg.connect(url) as connection:
        connection.execute(_ADD_JOBS, {"count": count, "hints": hints})
        connection.commit()
        return time.time()


def graphile_jobs_left(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as connection:
        row = connection.execute("SELECT count(*) FROM graphile_worker.jobs").fetchone()
        return int(row[0]) if row else 0


def graphile_slow_target(url: str, count: int, config: str, log_dir: Path, call_url: str = "") -> float:
    """Calls a second, from the commit adding ``count`` jobs over 1 000 queues to the last call's end; each call
    waits CALL_MS, or POSTs the job's payload to ``call_url``."""
    with datagrams() as sock:
        env = {"BENCH_PORT": str(sock.getsockname()[1]), "BENCH_COUNT": str(count), "BENCH_CALL_MS": f"{CALL_MS:g}",
               "BENCH_CALL_URL": call_url}
        with graphile(url, SLOW_LANES, config, env, log_dir) as worker:
            worker.wait_ready()
            committed = add_jobs(url, count, min(1000, count))
            deadline = time.time() + 60 + count / 100
            while (report := receive(sock, deadline, f"the {count:,}th job"))[0] != "last":
                pass
    if graphile_jobs_left(url):
        raise SystemExit("graphile-worker: jobs left after the slow target")
    return count / (report[1] - committed)


def graphile_cold_start(url: str, count: int, config: str, log_dir: Path) -> ColdStart:
    """Seconds from starting the process to its first and its ``count``-th call, the jobs added before."""
    add_jobs(url, count, min(1000, count))
    with datagrams() as sock:
        env = {"BENCH_PORT": str(sock.getsockname()[1]), "BENCH_COUNT": str(count)}
        with graphile(url, DEFAULT_LANES, config, env, log_dir) as worker:
            reports: dict[str, float] = {}
            deadline = time.time() + 60 + count / 100
            while "last" not in reports:
                key, at = receive(sock, deadline, f"the {count:,}th job")
                reports[key] = at
    if graphile_jobs_left(url):
        raise SystemExit("graphile-worker: jobs left after the cold start")
    return ColdStart(reports["first"] - worker.started, reports["last"] - worker.started, float("nan"))


def _ms(values: Sequence[float]) -> str:
    return f"p50 {percentile(list(values), 0.5) * 1000:.2f} ms, p99 {percentile(list(values), 0.99) * 1000:.2f} ms"


def _cold(starts: Sequence[ColdStart], count: int) -> str:
    return (f"{both([count / start.last for start in starts], 'msgs/s')}; first call at "
            f"{' / '.join(f'{start.first:.2f}' for start in starts)} s, then "
            f"{both([count / (start.last - start.first) for start in starts], 'msgs/s')}")


def twice(measures: dict[str, Callable[[], T]]) -> dict[str, list[T]]:
    """Each measure twice, the second pass in the reverse order."""
    results: dict[str, list[T]] = {name: [] for name in measures}
    for order in (list(measures), list(reversed(measures))):
        for name in order:
            results[name].append(measures[name]())
            print(f"{name}: done", file=sys.stderr)
    return results


def check_graphile() -> None:
    if shutil.which("node") is None:
        raise SystemExit("bench/versus_graphile.py needs Node.js (node on PATH)")
    if not GRAPHILE_CLI.exists():
        raise SystemExit(f"graphile-worker is not installed: run `npm ci --prefix {GRAPHILE_DIR}` first")


def print_table(rows: Sequence[Row]) -> None:
    headers = ("figure", "correlation-worker", "graphile-worker 0.18", "reference in the same run")
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print(f"| {row.figure} | {row.ours} | {row.graphile} | {row.reference} |")


def main(argv: Sequence[str] | None = None) -> int:
    args, url, scale = parse_args(argv, __doc__, "bench/versus_graphile.py")
    check_graphile()
    latency_count, slow_count, cold_count = 500 // scale, 5000 // scale, 20_000 // scale
    with ExitStack() as stack:
        database_url = stack.enter_context(bench_database(url))
        plain_url = libpq_conninfo(database_url)
        slots = migrate(database_url)
        subprocess.run(["node", str(GRAPHILE_CLI), "-c", plain_url, "--schema-only"], cwd=GRAPHILE_DIR,
                       check=True, capture_output=True)
        driver = PostgresDriver(database_url)
        stack.callback(driver.close)
        if driver.count():
            raise SystemExit("the database holds messages: give an empty one")
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cw-versus-")))

        floor: list[float] = []  # the NOTIFY round trips measured beside correlation-worker's latency

        def ours_latency() -> list[float]:
            engine, notify = latency_run(database_url, latency_count)
            floor.extend(notify)
            return engine

        def ours_slow() -> float:
            rate = slow_target_rate(database_url, driver, slow_count, log_dir, slots)
            driver.purge()
            return rate

        latency_measures: dict[str, Callable[[], list[float]]] = {
            "correlation-worker": ours_latency,
            "a queue a job": lambda: graphile_latency(plain_url, latency_count, True, log_dir),
            "no queue": lambda: graphile_latency(plain_url, latency_count, False, log_dir),
        }
        latency = twice(latency_measures)
        slow_measures: dict[str, Callable[[], float]] = {
            config: partial(graphile_slow_target, plain_url, slow_count, config, log_dir) for config in CONFIGS
        }
        slow = twice({"correlation-worker": ours_slow, **slow_measures})
        hints = min(1000, cold_count)
        cold_measures: dict[str, Callable[[], ColdStart]] = {
            "correlation-worker": partial(cold_start_seconds, database_url, driver, cold_count, hints, log_dir, slots),
            **{config: partial(graphile_cold_start, plain_url, cold_count, config, log_dir) for config in CONFIGS},
        }
        cold = twice(cold_measures)

    def all_of(runs: list[list[float]]) -> list[float]:
        return [value for run in runs for value in run]

    ours = "correlation-worker"
    rows = [
        Row(f"insert → call latency, defaults, {latency_count} sequential, twice", _ms(all_of(latency[ours])),
            f"a queue a job {_ms(all_of(latency['a queue a job']))}; no queue {_ms(all_of(latency['no queue']))}",
            f"NOTIFY round trip {_ms(floor)}"),
        Row(f"{CALL_MS:g} ms target, {SLOW_LANES} at a time, {slow_count:,} msgs / {min(1000, slow_count):,} hints",
            both(slow[ours], "calls/s"), "; ".join(f"{config} {both(slow[config], 'calls/s')}" for config in CONFIGS),
            f"Little's limit {SLOW_LANES / (CALL_MS / 1000):,.0f} calls/s"),
        Row(f"no-op drain, {cold_count:,} msgs / {hints:,} hints, from process start to last call",
            _cold(cold[ours], cold_count),
            "; ".join(f"{config} {_cold(cold[config], cold_count)}" for config in CONFIGS), ""),
    ]
    print_table(rows)
    return print_footer(rows, "graphile-worker 0.18.0", url, "real worker processes of both", quick=args.quick,
                        as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())
