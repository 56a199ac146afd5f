"""Cluster drain benchmark: 1, 2, 4 … real worker processes emptying one table together, against a raw-SQL floor.

One run, on one PostgreSQL database::

    1. create a database (or use the one given) and migrate it
    2. floor: insert N messages over H hints (drain.py's loader) and drain them with drain.py's raw-SQL loop
    3. for each replica count R:
       a. insert the same N messages with drain.py's loader, set them 'paused' and VACUUM ANALYZE
       b. start R `correlation-worker run` processes (no-op correlator, default poll interval, metrics on any
          free port)
       c. wait until the lock table shows the 64 slots spread over the R replicas (64/R each, rounded),
          unchanged for a few lease rounds
       d. release the work in one transaction (UPDATE ... SET state = 'ready', and a notification of its slots,
          as an operator's resume sends) and time from its commit until no slot holds work (probed every 50 ms,
          per slot, so each replica's finishing time is known too)
       e. scrape every replica's /metrics, SIGTERM them and check that each exits 0
       f. check: table empty, successes over all replicas = N, no slot changed hands during the drain
    4. print msgs/s per replica count next to the floor (with --json, one JSON object as well)

Usage::

    .venv/bin/python bench/cluster.py [--url URL] [--messages 100000] [--hints 1000] [--replicas 1,2,4]
                                      [--page-size 1000] [--concurrency 8] [--payload-bytes 0] [--statements]
                                      [--json]

``--payload-bytes N``: every payload about N bytes of JSON (an order with line items, as a process engine's
message carries) instead of ``{"n": i}``, for the floor and the drains alike: what decoding payloads costs.

``--statements``: where the server's time went during each drain, statement by statement, from the
``pg_stat_statements`` extension (the server must load it: ``shared_preload_libraries = 'pg_stat_statements'``);
its counters are reset just before the release and read when the drain is over, for this database only, and the
benchmark's own statements (the release, its looks at the table) are left out.

``--url`` as in drain.py (default: ``CORRELATION_BENCH_DATABASE_URL``, else the local PostgreSQL server): a
URL without a database name gets a throwaway database ``cw_bench_<random>``, dropped at the end; a URL naming
a database is used as it is and must hold no messages and no live replica. PostgreSQL only: on SQLite one
replica owns the only slot.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import psycopg
from drain import LOCAL_SERVER, URL_ENV, PostgresDriver, bench_database, migrate
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import make_url

from worker.db.store import StoreError, normalise_url
from worker.engine.leases import SLOT_PREFIX

BENCH_DIR = Path(__file__).resolve().parent
CORRELATOR = "noop_correlator:correlate"  # bench/noop_correlator.py, on the workers' PYTHONPATH
# Only the lease rounds are sped up, so that a cluster balances in seconds rather than half a minute; the
# term (40 s) and the safety margin (5 s) keep their defaults. During a drain this costs each replica one
# lease round (three or four small statements) a second.
LEASE_RENEW_INTERVAL = "PT1S"
LEASE_DRAIN = "PT1S"
RENEW_SECONDS = 1.0
WATCH_INTERVAL = 0.05  # seconds between two looks at the table while it drains: the drain time is this exact
STABLE_FOR = 2.5 * RENEW_SECONDS  # the slot spread must hold this long (two lease rounds and more) to count
BALANCE_DEADLINE = 120.0  # seconds for the replicas to start and spread the slots
STOP_DEADLINE = 30.0  # seconds a replica may take to exit after SIGTERM
SUCCESS = "success"
METRICS_ENABLED = "CORRELATION_METRICS__ENABLED"
RETENTION = "CORRELATION_DELIVERY__RETENTION"
MESSAGES_METRIC = "correlation_messages_total"
TROUBLE_METRICS = (
    "correlation_lease_losses_total",
    "correlation_fenced_commits_total",
    "correlation_redeliveries_total",
)

T = TypeVar("T")

OWN = "/* cluster.py */ "  # begins the text of the benchmark's own statements during a drain (see --statements)


# -- the worker processes ------------------------------------------------------------------------------------


def worker_command() -> list[str]:
    """``correlation-worker run`` of this virtualenv (``python -m worker run`` if the script is missing)."""
    script = Path(sys.executable).with_name("correlation-worker")
    return [str(script), "run"] if script.exists() else [sys.executable, "-m", "worker", "run"]


def worker_env(
    url: str, name: str, page_size: int, concurrency: int, settings: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of one replica: this process's, minus its CORRELATION_ settings, plus the benchmark's
    (and ``settings``, CORRELATION_ variables that replace the benchmark's)."""
    env = {key: value for key, value in os.environ.items() if not key.upper().startswith("CORRELATION_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH_DIR), os.environ.get("PYTHONPATH")]))
    env.update(
        {
            "CORRELATION_DATABASE__URL": url,
            "CORRELATION_CORRELATORS": json.dumps({"*": CORRELATOR}),
            "CORRELATION_REPLICA__NAME": name,
            "CORRELATION_METRICS__HOST": "127.0.0.1",
            "CORRELATION_METRICS__PORT": "0",
            "CORRELATION_POLL__INITIAL_DELAY": "PT0S",
            "CORRELATION_POLL__PAGE_SIZE": str(page_size),
            "CORRELATION_POLL__CONCURRENCY": str(concurrency),
            "CORRELATION_LEASE__RENEW_INTERVAL": LEASE_RENEW_INTERVAL,
            "CORRELATION_LEASE__DRAIN": LEASE_DRAIN,
            "CORRELATION_LOG__LEVEL": "WARNING",
        }
    )
    env.update(settings or {})
    return env


@dataclass(frozen=True, slots=True)
class Scrape:
    """What one replica's /metrics said."""

    outcomes: dict[str, float]  # correlation_messages_total by outcome
    trouble: dict[str, float]  # lease losses, fenced commits, redeliveries

    @property
    def successes(self) -> int:
        """Messages this replica correlated and committed."""
        return round(self.outcomes.get(SUCCESS, 0.0))


class Replica:
    """One ``correlation-worker run`` process, its log in a file."""

    def __init__(self, name: str, env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                worker_command(), env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=log_dir,  # outside the repository: its source tree must not shadow the installed package
            )
        self._port: int | None = None

    def owns(self, holder: str) -> bool:
        """True for this process's ``locked_by`` (its name plus a per-boot suffix)."""
        return holder.startswith(f"{self.name}-")

    def log(self) -> str:
        """Everything the process wrote so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def check_running(self) -> None:
        """Stop the benchmark, with the replica's log, if it exited."""
        code = self.process.poll()
        if code is not None:
            raise SystemExit(f"replica {self.name} exited with {code}:\n{_tail(self.log())}")

    def metrics_port(self) -> int | None:
        """The port of its /metrics endpoint, from its start-up line (None until it is logged)."""
        if self._port is None:
            for line in self.log().splitlines():
                if "serving /metrics" in line and " on " in line:
                    self._port = int(line.rsplit(":", 1)[1])
                    break
        return self._port

    def scrape(self) -> Scrape:
        """Its counters now."""
        port = self.metrics_port()
        if port is None:
            raise SystemExit(f"replica {self.name} never logged its /metrics endpoint:\n{_tail(self.log())}")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        outcomes: dict[str, float] = {}
        trouble = dict.fromkeys(TROUBLE_METRICS, 0.0)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == MESSAGES_METRIC:
                    outcome = sample.labels.get("outcome", "")
                    outcomes[outcome] = outcomes.get(outcome, 0.0) + sample.value
                elif sample.name in trouble:
                    trouble[sample.name] += sample.value
        return Scrape(outcomes, trouble)

    def cpu_seconds(self) -> float | None:
        """User plus system CPU the process used so far (None where /proc is missing)."""
        return process_cpu_seconds(self.process.pid)

    def stop(self) -> int:
        """SIGTERM, then its exit code (SIGKILLed, and -9 returned, after the deadline)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_DEADLINE)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return -9


def _replicas(count: int) -> str:
    return f"{count} replica" if count == 1 else f"{count} replicas"


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


@contextmanager
def replicas_running(count: int, url: str, args: argparse.Namespace, log_dir: Path) -> Iterator[list[Replica]]:
    """``count`` replicas named ``cluster-<count>x-<i>``; any still running on the way out are stopped."""
    replicas: list[Replica] = []
    try:
        for number in range(1, count + 1):
            name = f"cluster-{count}x-{number}"
            env = worker_env(url, name, args.page_size, args.concurrency, args.settings)
            replicas.append(Replica(name, env, log_dir))
        yield replicas
    finally:
        for replica in replicas:
            if replica.process.poll() is None:
                replica.stop()


# -- the database, seen from outside ---------------------------------------------------------------------------


def load_paused(driver: PostgresDriver, messages: int, hints: int, payload_bytes: int = 0) -> None:
    """drain.py's rows, held back as 'paused', then vacuumed so that the table is as fresh as drain.py's."""
    driver.insert(messages, hints, payload_bytes)
    driver.connection.execute("UPDATE correlation_message SET state = 'paused' WHERE state = 'ready'")
    driver.connection.execute("VACUUM ANALYZE correlation_message")


def release(driver: PostgresDriver) -> int:
    """Make every paused message eligible at once, in one transaction that wakes the replicas as an operator's
    resume does (a notification naming the slots), so that they work on their default poll interval."""
    with driver.connection.transaction():
        cursor = driver.connection.execute(
            OWN + "UPDATE correlation_message SET state = 'ready' WHERE state = 'paused' RETURNING slot"
        )
        slots = sorted({row[0] for row in cursor.fetchall()})
        driver.connection.execute(OWN + "SELECT pg_notify('correlation_message', %s)", (",".join(map(str, slots)),))
    return cursor.rowcount


def slot_terms(driver: PostgresDriver) -> dict[int, tuple[str, int]]:
    """Every slot whose lease runs now (by the database clock): its holder and fence."""
    rows = driver.connection.execute(
        OWN + "SELECT name, locked_by, fence FROM correlation_lock WHERE name LIKE %s AND lock_until > now()",
        (SLOT_PREFIX + "%",),
    )
    return {int(name.removeprefix(SLOT_PREFIX)): (str(holder), int(fence)) for name, holder, fence in rows}


# Slots with a message still to correlate (fresh, or delayed and due): one probe of each of the poll's two
# slot indexes per slot, about a millisecond, where count(*) scans the whole table (some 17 ms at 100 000 rows:
# a sixth of a database CPU at ten looks a second). Paused, dead and waiting messages are not seen; the final
# count(*) is what proves the table empty.
# Each slot probed the way the engine's candidates probe it (worker.db.fetch._slot_fetch_sql): through the slot's
# own indexes, in (slot, …) order with sorts priced out, whatever the statistics say. Written as a plain EXISTS,
# the probes took the index of every slot's ready rows once the statistics (taken while the backlog was paused)
# priced both at one row, and the watcher's look at the table cost 25-130 ms of the server's CPU every 50 ms of
# a drain it was timing.
_SLOTS_WITH_WORK = OWN + """
    SELECT s.slot FROM generate_series(0, %(last)s) AS s (slot)
     WHERE (SELECT m.correlation_hint FROM correlation_message m
             WHERE m.slot = ANY(ARRAY[CAST(s.slot AS smallint)]) AND m.state = 'ready' AND m.next_attempt_at IS NULL
             ORDER BY m.slot, m.correlation_hint LIMIT 1) IS NOT NULL
        OR (SELECT m.next_attempt_at FROM correlation_message m
             WHERE m.slot = ANY(ARRAY[CAST(s.slot AS smallint)]) AND m.state = 'ready'
               AND m.next_attempt_at IS NOT NULL
             ORDER BY m.slot, m.next_attempt_at LIMIT 1) IS NOT NULL"""


def slots_with_work(driver: PostgresDriver, slot_count: int) -> set[int]:
    """The slots that still hold a ready message (see ``_SLOTS_WITH_WORK``)."""
    with driver.connection.transaction():
        driver.connection.execute(OWN + "SET LOCAL enable_sort = off")
        rows = driver.connection.execute(_SLOTS_WITH_WORK, {"last": slot_count - 1}).fetchall()
    return {int(slot) for (slot,) in rows}


# -- where the CPU goes (Linux /proc; left out elsewhere) ----------------------------------------------------


def process_cpu_seconds(pid: int, command: str | None = None) -> float | None:
    """User plus system CPU of a local process so far; None without /proc, or if it is not named ``command``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    head, _, tail = stat.rpartition(")")
    if command is not None and head.partition("(")[2] != command:
        return None
    fields = tail.split()  # state, ppid, … : utime and stime are the 12th and 13th after the command
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def backend_cpu_seconds(driver: PostgresDriver) -> dict[int, float] | None:
    """CPU so far of this database's server processes but the benchmark's own; None if the server is not local."""
    rows = driver.connection.execute(
        OWN + "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    seconds = {int(pid): process_cpu_seconds(int(pid), "postgres") for (pid,) in rows}
    known = {pid: cpu for pid, cpu in seconds.items() if cpu is not None}
    return known if known or not seconds else None


def machine_ticks() -> tuple[int, int] | None:
    """(busy, all) CPU ticks of the whole machine since boot (None where /proc is missing)."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    ticks = [int(value) for value in first[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


@dataclass(frozen=True, slots=True)
class CpuSample:
    """CPU used so far by the replicas, the database's server processes and the whole machine."""

    replicas: tuple[float | None, ...]
    backends: dict[int, float] | None
    machine: tuple[int, int] | None

    @classmethod
    def take(cls, replicas: Sequence[Replica], driver: PostgresDriver) -> CpuSample:
        """Read every counter now."""
        return cls(tuple(r.cpu_seconds() for r in replicas), backend_cpu_seconds(driver), machine_ticks())


@dataclass(frozen=True, slots=True)
class CpuFigures:
    """Where the machine's CPU went during a drain, in CPU seconds."""

    replicas: float  # the worker processes
    database: float | None  # the server processes serving this database (None: the server is not local)
    machine_busy: float  # every process on the machine, the benchmark and other work included
    machine_capacity: float  # what all the CPUs could have given meanwhile

    @classmethod
    def between(cls, before: CpuSample, after: CpuSample) -> CpuFigures | None:
        """The CPU used between two samples (None where /proc is missing)."""
        if before.machine is None or after.machine is None or None in before.replicas + after.replicas:
            return None
        replicas = sum(
            a - b for a, b in zip(after.replicas, before.replicas, strict=True) if a is not None and b is not None
        )
        database = None
        if before.backends is not None and after.backends is not None:  # a connection opened meanwhile counts whole
            database = sum(cpu - before.backends.get(pid, 0.0) for pid, cpu in after.backends.items())
        tick = os.sysconf("SC_CLK_TCK")
        busy = (after.machine[0] - before.machine[0]) / tick
        capacity = (after.machine[1] - before.machine[1]) / tick
        return cls(round(replicas, 3), None if database is None else round(database, 3), busy, capacity)


def wait_for(predicate: Callable[[], T | None], deadline: float, what: str, replicas: Sequence[Replica]) -> T:
    """Poll until ``predicate`` returns a value; stop the benchmark if a replica exits or time runs out."""
    while True:
        value = predicate()
        if value is not None:
            return value
        for replica in replicas:
            replica.check_running()
        if time.monotonic() >= deadline:
            raise SystemExit(f"{what} did not happen in time")
        time.sleep(WATCH_INTERVAL)


def spread(terms: Mapping[int, tuple[str, int]], replicas: Sequence[Replica], slot_count: int) -> list[int] | None:
    """Slots held per replica when every slot is held by one of them and each has 64/R (rounded); else None."""
    held = [0] * len(replicas)
    for holder, _fence in terms.values():
        owners = [index for index, replica in enumerate(replicas) if replica.owns(holder)]
        if not owners:
            return None
        held[owners[0]] += 1
    fair = (slot_count // len(replicas), -(-slot_count // len(replicas)))
    if sum(held) != slot_count or any(count not in fair for count in held):
        return None
    return held


# -- one replica count -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplicaFigures:
    """One replica's part of a drain."""

    name: str
    slots: int
    messages: int  # successes on its /metrics
    done_at: float  # seconds after the release when its slots were empty
    cpu_seconds: float | None  # CPU the process used during the drain


@dataclass(frozen=True, slots=True)
class StatementFigures:
    """One statement's part of the server's time during a drain (``pg_stat_statements``)."""

    query: str  # its text as the extension keeps it (constants as $1, $2 …), on one line
    calls: int
    rows: int
    milliseconds: float  # total execution time


# The workers' statements during a drain: this database's, the benchmark's own (the release, its watch, its looks
# at the leases and at the server's processes, the reset itself) left out by their text. The transactions of its
# watch (a BEGIN and a COMMIT every WATCH_INTERVAL) cannot be told from the workers' and stay in, a few µs each.
_STATEMENTS = """
    SELECT regexp_replace(query, '\\s+', ' ', 'g'), calls, rows, total_exec_time
      FROM pg_stat_statements
     WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
       AND query NOT LIKE '/* cluster.py */%' AND query NOT LIKE '%pg_stat_statements%'
     ORDER BY total_exec_time DESC"""


def statements_reset(driver: PostgresDriver) -> None:
    """Zero this database's ``pg_stat_statements`` counters."""
    driver.connection.execute(
        "SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database WHERE datname = current_database()), 0)"
    )


def statements_read(driver: PostgresDriver) -> tuple[StatementFigures, ...]:
    """The workers' statements since :func:`statements_reset`, the costliest first."""
    rows = driver.connection.execute(_STATEMENTS).fetchall()
    return tuple(StatementFigures(str(query).strip(), int(calls), int(count), round(float(ms), 3))
                 for query, calls, count, ms in rows)


def statements_check(driver: PostgresDriver) -> None:
    """Stop with one line unless the server loads ``pg_stat_statements``; create it in this database."""
    (loaded,) = driver.connection.execute("SELECT current_setting('shared_preload_libraries')").fetchone() or ("",)
    if "pg_stat_statements" not in str(loaded):
        raise SystemExit("--statements: the server does not load pg_stat_statements (shared_preload_libraries = "
                         f"{loaded!r}); add it and restart the server")
    driver.connection.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")


@dataclass(frozen=True, slots=True)
class ClusterFigures:
    """One replica count's measurements."""

    replicas: int
    seconds: float
    rate: float
    balance_seconds: float  # from starting the processes to a stable spread of the slots
    cpu: CpuFigures | None
    members: tuple[ReplicaFigures, ...]
    statements: tuple[StatementFigures, ...] = ()  # with --statements


def run_cluster(
    url: str, driver: PostgresDriver, count: int, args: argparse.Namespace, log_dir: Path
) -> ClusterFigures:
    """Load paused, start ``count`` replicas, wait for the spread, release, time the drain, stop, verify."""
    metrics_on = (args.settings or {}).get(METRICS_ENABLED, "true").strip().lower() not in ("false", "0", "no")
    if not metrics_on and (args.settings or {}).get(RETENTION, "").strip().upper() in ("PT0S", "P0D"):
        raise SystemExit("a drain with the metrics off is counted from its delivery records: keep them")
    load_paused(driver, args.messages, args.hints, args.payload_bytes)
    with replicas_running(count, url, args, log_dir) as replicas:
        started = time.monotonic()
        deadline = started + BALANCE_DEADLINE
        for replica in replicas if metrics_on else ():
            wait_for(replica.metrics_port, deadline, f"replica {replica.name}'s /metrics endpoint", replicas)

        stable: list[tuple[dict[int, tuple[str, int]], float]] = []  # the spread seen, since when

        def balanced() -> dict[int, tuple[str, int]] | None:
            terms = slot_terms(driver)
            if spread(terms, replicas, args.slots) is None:
                stable.clear()
                return None
            if not stable or stable[0][0] != terms:
                stable[:] = [(terms, time.monotonic())]
            return terms if time.monotonic() - stable[0][1] >= STABLE_FOR else None

        terms = wait_for(balanced, deadline, f"an even spread of the slots over {count} replicas", replicas)
        balance_seconds = time.monotonic() - started
        slots_of = {
            replica.name: {slot for slot, (holder, _fence) in terms.items() if replica.owns(holder)}
            for replica in replicas
        }
        if getattr(args, "statements", False):
            statements_reset(driver)  # before the release: the replicas' first fetches it wakes are counted whole
        released = release(driver)
        released_at = time.perf_counter()
        cpu_before = CpuSample.take(replicas, driver)  # after the release, whose own second is not the drain's
        if released != args.messages:
            raise SystemExit(f"released {released} messages, expected {args.messages}")
        print(f"{_replicas(count)}: slots spread in {balance_seconds:.1f} s; draining", file=sys.stderr)
        done_at: dict[str, float] = {}
        drain_deadline = time.monotonic() + 60.0 + args.messages / 500

        def drained() -> float | None:
            looked_at = time.perf_counter() - released_at  # the probe's snapshot is no older than this
            left = slots_with_work(driver, args.slots)
            for name, slots in slots_of.items():
                if name not in done_at and not slots & left:
                    done_at[name] = looked_at
            return looked_at if not left else None

        seconds = wait_for(drained, drain_deadline, f"the drain by {count} replicas", replicas)

        cpu_after = CpuSample.take(replicas, driver)
        statements = statements_read(driver) if getattr(args, "statements", False) else ()
        terms_after = slot_terms(driver)
        scrapes = [replica.scrape() if metrics_on else recorded(driver, replica) for replica in replicas]
        codes = [replica.stop() for replica in replicas]
        logs = [replica.log() for replica in replicas]

    for replica, code, log in zip(replicas, codes, logs, strict=True):
        if code != 0:
            raise SystemExit(f"replica {replica.name} exited with {code} after SIGTERM:\n{_tail(log)}")
    verify(driver, args.messages, terms, terms_after, [(r.name, s) for r, s in zip(replicas, scrapes, strict=True)])
    driver.purge()  # the delivery records the drain left: the next replica count starts from the same table

    members = tuple(
        ReplicaFigures(
            name=replica.name,
            slots=len(slots_of[replica.name]),
            messages=scrape.successes,
            done_at=done_at[replica.name],
            cpu_seconds=round(after - before, 3) if after is not None and before is not None else None,
        )
        for replica, scrape, before, after in zip(
            replicas, scrapes, cpu_before.replicas, cpu_after.replicas, strict=True
        )
    )
    cpu = CpuFigures.between(cpu_before, cpu_after)
    return ClusterFigures(count, seconds, args.messages / seconds, balance_seconds, cpu, members, statements)


def recorded(driver: PostgresDriver, replica: Replica) -> Scrape:
    """What a replica without /metrics (``CORRELATION_METRICS__ENABLED=false``) did, from its delivery records: its
    successes; nothing on lease losses or redeliveries (the slots' terms are still compared before and after)."""
    rows = driver.connection.execute(
        "SELECT outcome, count(*) FROM correlation_message WHERE state = 'delivered' AND finished_by LIKE %s"
        " GROUP BY outcome",
        (f"{replica.name}-%",),
    ).fetchall()
    return Scrape({SUCCESS if outcome == "correlated" else str(outcome): float(n) for outcome, n in rows}, {})


def verify(
    driver: PostgresDriver,
    messages: int,
    terms_before: Mapping[int, tuple[str, int]],
    terms_after: Mapping[int, tuple[str, int]],
    scrapes: Sequence[tuple[str, Scrape]],
) -> None:
    """The table is empty, every message was correlated exactly once, and no slot changed hands meanwhile."""
    left = driver.count()
    if left:
        raise SystemExit(f"verification failed: {left} messages left after the drain")
    successes = sum(scrape.successes for _name, scrape in scrapes)
    if successes != messages:
        raise SystemExit(f"verification failed: {successes} successes over all replicas for {messages} messages")
    for name, scrape in scrapes:
        others = {outcome: n for outcome, n in scrape.outcomes.items() if outcome != SUCCESS and n}
        trouble = {metric: n for metric, n in scrape.trouble.items() if n}
        if others or trouble:
            raise SystemExit(f"verification failed: replica {name} reported {others or ''} {trouble or ''}")
    moved = sorted(slot for slot in terms_before if terms_after.get(slot) != terms_before[slot])
    if moved:
        raise SystemExit(f"verification failed: slots {moved} changed hands (or lapsed) during the drain")


def measure_floor(
    driver: PostgresDriver, messages: int, hints: int, page_size: int, *, record: bool = False, payload_bytes: int = 0
) -> float:
    """drain.py's floor on the same rows: msgs/s of SELECT id, name, hint, payload, headers ... LIMIT page;
    DELETE ... = ANY; COMMIT (``record``: an UPDATE making them delivery records instead of the DELETE)."""
    driver.insert(messages, hints, payload_bytes)
    started = time.perf_counter()
    drained = driver.record_floor(page_size) if record else driver.drain_floor(page_size)
    seconds = time.perf_counter() - started
    if drained != messages:
        raise SystemExit(f"the floor loop drained {drained} of {messages} messages")
    return messages / seconds


# -- the command ---------------------------------------------------------------------------------------------


def _replica_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers, e.g. 1,2,4") from None
    if not counts or any(count < 1 for count in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: every replica count must be at least 1")
    return counts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument(
        "--url",
        default=os.environ.get(URL_ENV, LOCAL_SERVER),
        help=f"PostgreSQL server or database URL (default: ${URL_ENV} or {LOCAL_SERVER})",
    )
    parser.add_argument("--messages", type=int, default=100_000, help="messages per drain (default 100000)")
    parser.add_argument("--hints", type=int, default=1000, help="distinct hints (default 1000)")
    parser.add_argument(
        "--replicas", type=_replica_counts, default=[1, 2, 4], help="replica counts to run, in order (default 1,2,4)"
    )
    parser.add_argument("--page-size", type=int, default=1000, help="poll page size, also the floor's (default 1000)")
    parser.add_argument(
        "--payload-bytes", type=int, default=0,
        help='each payload about this many bytes of JSON, an order with line items (default 0: {"n": i})',
    )
    parser.add_argument(
        "--concurrency", type=int, default=8, help="CORRELATION_POLL__CONCURRENCY: lanes per replica (default 8)"
    )
    parser.add_argument(
        "--statements", action="store_true",
        help="also print where the server's time went, statement by statement (needs pg_stat_statements loaded)",
    )
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    args = parser.parse_args(argv)
    args.settings = None  # CORRELATION_ variables of run.py's rows; this command runs the benchmark's own
    if args.messages < 1 or args.hints < 1 or args.page_size < 1 or args.concurrency < 1:
        parser.error("--messages, --hints, --page-size and --concurrency must be at least 1")
    if not 0 <= args.payload_bytes <= 1_000_000:
        parser.error("--payload-bytes must be between 0 and 1000000 (a payload is at most 1 MiB)")
    return args


STATEMENTS_SHOWN = 8


def print_statements(statements: Sequence[StatementFigures], messages: int) -> None:
    """The costliest statements of a drain: time in all, per message drained, and share of the workers' total."""
    total = max(sum(statement.milliseconds for statement in statements), 1e-9)
    print(f"  the workers' statements: {total:,.0f} ms of execution in all, {total * 1000 / messages:.1f} µs per "
          "message (time inside the server, waits for a CPU and for locks included)")
    for statement in statements[:STATEMENTS_SHOWN]:
        print(f"  {statement.milliseconds:>9,.0f} ms {statement.milliseconds / total:>4.0%} "
              f"{statement.milliseconds * 1000 / messages:>6.1f} µs/msg {statement.calls:>6} calls "
              f"{statement.rows:>7} rows  {statement.query[:90]}")
    rest = statements[STATEMENTS_SHOWN:]
    if rest:
        print(f"  {sum(s.milliseconds for s in rest):>9,.0f} ms in {len(rest)} other statements")


def report(runs: Sequence[ClusterFigures], floor: float, args: argparse.Namespace, server: str) -> None:
    """Each run's replicas, then the table of msgs/s against one replica and the floor."""
    for run in runs:
        print(
            f"{_replicas(run.replicas)}: {args.messages:,} messages in {run.seconds:.2f} s = {run.rate:,.0f} msgs/s"
            f" (slots spread in {run.balance_seconds:.1f} s)"
        )
        if run.cpu is not None:
            cpu = run.cpu
            database = f", database {cpu.database:.2f} s" if cpu.database is not None else ""
            rest = cpu.machine_busy - cpu.replicas - (cpu.database or 0.0)
            print(
                f"  CPU during the drain: replicas {cpu.replicas:.2f} s{database}, everything else {rest:.2f} s;"
                f" busy {cpu.machine_busy:.2f} s of the {cpu.machine_capacity:.2f} s that {os.cpu_count()} CPUs"
                f" offered ({cpu.machine_busy / cpu.machine_capacity:.0%})"
            )
        for member in run.members:
            used = f", CPU {member.cpu_seconds:.2f} s" if member.cpu_seconds is not None else ""
            print(
                f"  {member.name:<16} {member.slots:>2} slots {member.messages:>9,} messages "
                f"({member.messages / args.messages:6.1%}), its slots empty at {member.done_at:.2f} s{used}"
            )
        if run.statements:
            print_statements(run.statements, args.messages)
    base = next((run.rate for run in runs if run.replicas == 1), None)
    print()
    print(f"{'replicas':>8} {'msgs/s':>10} {'vs 1':>6} {'vs floor':>9}  per-replica share of the messages")
    for run in runs:
        versus_one = f"{run.rate / base:.2f}" if base else "-"
        shares = " ".join(f"{member.messages / args.messages:.0%}" for member in run.members)
        print(f"{run.replicas:>8} {run.rate:>10,.0f} {versus_one:>6} {run.rate / floor:>9.2f}  {shares}")
    print(f"{'floor':>8} {floor:>10,.0f}  (drain.py's loop: SELECT id, name, hint, payload, headers ... LIMIT page; "
          "DELETE ... = ANY(...); COMMIT)")
    print(
        f"verified: each drain left the table empty, its replicas counted exactly {args.messages:,} successes "
        "(no retries, lease losses, fenced commits or redeliveries), no slot changed hands, every replica exited 0"
    )
    print(
        f"params: server={server} slots={args.slots} messages={args.messages} hints={args.hints} "
        f"page_size={args.page_size} concurrency={args.concurrency} payload_bytes={args.payload_bytes} "
        f"cpus={os.cpu_count()} "
        f"lease_renew_interval={LEASE_RENEW_INTERVAL} watch={WATCH_INTERVAL}s"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "floor_msgs_per_s": round(floor, 1),
                    "runs": [
                        asdict(run)
                        | {
                            "rate": round(run.rate, 1),
                            "ratio_to_1": round(run.rate / base, 4) if base else None,
                            "ratio_to_floor": round(run.rate / floor, 4),
                        }
                        for run in runs
                    ],
                    "server": server,
                    "slots": args.slots,
                    "messages": args.messages,
                    "hints": args.hints,
                    "page_size": args.page_size,
                    "concurrency": args.concurrency,
                    "payload_bytes": args.payload_bytes,
                    "cpus": os.cpu_count(),
                }
            )
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the figures."""
    args = parse_args(argv)
    url = normalise_url(args.url)
    if not url.startswith("postgresql"):
        raise SystemExit("the cluster benchmark needs PostgreSQL: on SQLite one replica owns the only slot")
    runs: list[ClusterFigures] = []
    with ExitStack() as stack:
        database_url = stack.enter_context(bench_database(url))
        args.slots = migrate(database_url)
        driver = PostgresDriver(database_url)
        stack.callback(driver.close)
        if args.statements:
            statements_check(driver)
        present = driver.count()
        if present:
            raise SystemExit(f"the database already holds {present} messages; give an empty one")
        if slot_terms(driver):
            raise SystemExit("slot leases are held in this database: is a replica running on it?")
        version = driver.connection.execute("SHOW server_version").fetchone()
        server = str(version[0]) if version else "?"
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cw-cluster-")))

        floor = measure_floor(driver, args.messages, args.hints, args.page_size, payload_bytes=args.payload_bytes)
        print(f"floor: {floor:,.0f} msgs/s", file=sys.stderr)
        for count in args.replicas:
            runs.append(run_cluster(database_url, driver, count, args, log_dir))
            print(f"{_replicas(count)}: {runs[-1].rate:,.0f} msgs/s", file=sys.stderr)
    report(runs, floor, args, f"PostgreSQL {server} ({make_url(url).host or 'local socket'})")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (StoreError, psycopg.Error, OSError) as error:
        sys.exit(f"cluster benchmark: {error}")
