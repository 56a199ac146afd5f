"""What the lease table costs one database: N replicas' slot leasers running their rounds side by side.

For each client count N (default 10, 50, 100), in a fresh database each time::

    1. create a database (or use the one given) and migrate it (64 slot rows, all free)
    2. start N real ``SlotLeaser`` objects (worker.engine.leases), each with a holder of its own, in threads
       of this process; each runs its rounds as a replica's lease thread does: a round, then a wait of the
       renew interval, or less when another holder's term may lapse sooner (``next_round_in``)
    3. settling: time from the start until the 64 slots are all held and spread into fair shares (every
       client holds floor(64/N) or one more), unchanged for two renew intervals
    4. the window (--seconds): every round's duration, the server's CPU (the scheduler's CPU time of this
       database's backends from /proc/<pid>/schedstat, else utime + stime from /proc/<pid>/stat, in ticks of
       10 ms; pg_stat_statements needs the server to preload it, /proc does not), the
       database's transactions (pg_stat_database: commits and rollbacks), and the lock table: its rows, dead
       tuples (pg_stat_user_tables.n_dead_tup) and size at the end
    5. print one line per N: rounds per second served, round latency p50 / p99, server CPU and transactions
       per round, lock rows, dead tuples, settle time, leases lost (terms found expired or taken over at a
       renewal) and rounds that failed; with --json, one JSON object as well

Usage::

    .venv/bin/python bench/lease_clients.py [--url URL] [--clients 10,50,100] [--seconds 40]
                                            [--renew-interval 5] [--connections 60] [--json]

``--renew-interval S``: seconds between two rounds (the default, 5, is the setting's default); the term, the
safety margin and the hand-back drain are scaled with it in the defaults' ratios (8, 1 and 1 renew intervals:
40 s, 5 s and 5 s at the default), so a shorter interval is the same cluster run faster.

``--connections C``: at most C stores (each a pool of one connection). Up to C clients each get a store of their
own; with more clients the leasers share the C stores round robin, as replicas behind a connection pooler do
(a server with the default ``max_connections = 100`` cannot give 100 clients one connection each plus this
benchmark's own). A round holds a connection for a few milliseconds every renew interval, so a shared store
is rarely waited for; the round latency shows it when it is.

Why threads and not processes: a round is a few small statements and a few hundred microseconds of Python,
so even 100 clients at one round each per second use a fraction of one core of this process (printed as
"client CPU"); with the interpreter lock far from saturated, threads measure the rounds as separate processes
would, without starting 100 interpreters on the machine the database runs on.

``--url`` as in drain.py (default: ``CORRELATION_BENCH_DATABASE_URL``, else the local PostgreSQL server): a
URL without a database name gets a throwaway database ``cw_bench_<random>`` for each N, dropped at its end.
PostgreSQL only, and the server must run on this machine for its CPU to be read (else it is left out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import process_cpu_seconds
from drain import LOCAL_SERVER, URL_ENV, bench_database, libpq_conninfo, migrate

from worker.config import DatabaseSettings
from worker.db.store import Store, build_engine, normalise_url
from worker.engine.leases import SLOT_PREFIX, SlotLeaseConfig, SlotLeaser

WATCH_INTERVAL = 0.1  # seconds between two looks at the lock table while the slots settle
SETTLE_DEADLINE_ROUNDS = 40  # renew intervals the slots may take to settle before the run gives up waiting
OWN = "/* lease_clients */ "


@dataclass
class Client:
    """One lease client: a leaser, its round times and what went wrong."""

    leaser: SlotLeaser
    durations: list[tuple[float, float]] = field(default_factory=list)  # (ended at, seconds) per round
    lost: int = 0
    failed: int = 0


@dataclass(frozen=True, slots=True)
class Figures:
    """One client count's measurements."""

    clients: int
    stores: int
    renew_interval: float
    settle_seconds: float | None  # None: the slots did not settle before the deadline
    window_seconds: float
    rounds: int
    rounds_per_second: float
    p50_ms: float
    p99_ms: float
    server_cpu_us_per_round: float | None
    transactions_per_round: float  # commits and rollbacks in this database (pg_stat_database), per round
    client_cpu_share: float  # this process's CPU over the window, as a share of one core
    lock_rows: int
    dead_tuples: int
    lock_table_kb: int
    autovacuums: int
    lost: int
    failed: int
    holders_with_slots: int


def lease_config(renew: float) -> SlotLeaseConfig:
    """The defaults' ratios (lease 8, safety margin 1, drain 1 renew intervals) at this renew interval."""
    return SlotLeaseConfig(
        lease=timedelta(seconds=8 * renew),
        renew_interval=timedelta(seconds=renew),
        safety_margin=timedelta(seconds=renew),
        drain=timedelta(seconds=renew),
    )


def run_client(client: Client, stop: threading.Event, renew: float) -> None:
    """Rounds as the worker's lease thread runs them, until ``stop``."""
    leaser = client.leaser
    while not stop.is_set():
        started = time.perf_counter()
        try:
            result = leaser.run_once()
            client.lost += result.lost
        except Exception:  # a round that failed: counted, and the next one comes as usual
            client.failed += 1
        ended = time.perf_counter()
        client.durations.append((ended, ended - started))
        sooner = leaser.next_round_in()
        stop.wait(renew if sooner is None else min(renew, sooner))


def slot_counts(monitor: psycopg.Connection) -> Counter[str]:
    """Slots held now (by the database clock), per holder."""
    rows = monitor.execute(
        OWN + "SELECT locked_by, count(*) FROM correlation_lock WHERE name LIKE %s AND lock_until > now() "
        "AND locked_by IS NOT NULL AND locked_by <> '' GROUP BY locked_by",
        (SLOT_PREFIX + "%",),
    ).fetchall()
    return Counter({holder: int(count) for holder, count in rows})


def settled(counts: Counter[str], holders: list[str], slot_count: int) -> bool:
    """Every slot held and each client at floor(S/N) or one more."""
    if sum(counts.values()) != slot_count:
        return False
    share = slot_count // len(holders)
    return all(share <= counts.get(holder, 0) <= share + 1 for holder in holders)


def wait_settled(monitor: psycopg.Connection, holders: list[str], slot_count: int, renew: float,
                 started: float) -> float | None:
    """Seconds from ``started`` until the shares settled and held for two renew intervals."""
    since: float | None = None
    last: Counter[str] | None = None
    deadline = started + SETTLE_DEADLINE_ROUNDS * renew
    while time.perf_counter() < deadline:
        counts = slot_counts(monitor)
        now = time.perf_counter()
        if settled(counts, holders, slot_count) and counts == last:
            if since is None:
                since = now
            if now - since >= 2 * renew:
                return since - started
        elif settled(counts, holders, slot_count):
            since = now
        else:
            since = None
        last = counts
        time.sleep(WATCH_INTERVAL)
    return None


def cpu_seconds(pid: int) -> float | None:
    """CPU so far of a local server process: the scheduler's nanoseconds (/proc/<pid>/schedstat) where the kernel
    keeps them, else utime + stime (/proc/<pid>/stat, in clock ticks of 10 ms: too coarse for a few rounds)."""
    if process_cpu_seconds(pid, "postgres") is None:  # gone, not a server process, or no /proc
        return None
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return process_cpu_seconds(pid, "postgres")


def backend_cpu(monitor: psycopg.Connection) -> dict[int, float]:
    """CPU so far of this database's server processes, the benchmark's own connection left out."""
    rows = monitor.execute(
        OWN + "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    ).fetchall()
    seconds = {int(pid): cpu_seconds(int(pid)) for (pid,) in rows}
    return {pid: cpu for pid, cpu in seconds.items() if cpu is not None}


def transactions(monitor: psycopg.Connection) -> int:
    """Transactions committed or rolled back in this database so far (the statistics lag a second at most)."""
    row = monitor.execute(
        OWN + "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()
    assert row is not None
    return int(row[0])


def table_state(monitor: psycopg.Connection) -> tuple[int, int, int, int]:
    """The lock table's rows, dead tuples, size in kB and autovacuum count."""
    rows = monitor.execute(OWN + "SELECT count(*) FROM correlation_lock").fetchone()
    stats = monitor.execute(
        OWN + "SELECT n_dead_tup, autovacuum_count, pg_total_relation_size(relid) FROM pg_stat_user_tables "
        "WHERE relname = 'correlation_lock'"
    ).fetchone()
    assert rows is not None and stats is not None
    return int(rows[0]), int(stats[0]), int(stats[2]) // 1024, int(stats[1])


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def run(url: str, clients: int, seconds: float, renew: float, connections: int) -> Figures:
    """N clients against a freshly migrated database."""
    slot_count = migrate(url)
    stores = [Store(build_engine(DatabaseSettings(url=url, pool_size=1))) for _ in range(min(clients, connections))]
    for store in stores:
        store.now()  # open every pool's connection before the start
    config = lease_config(renew)
    team = [Client(SlotLeaser(stores[i % len(stores)], f"lease-client-{i:03d}", config)) for i in range(clients)]
    holders = [client.leaser.holder for client in team]
    stop = threading.Event()
    threads = [threading.Thread(target=run_client, args=(c, stop, renew), daemon=True) for c in team]
    monitor = psycopg.connect(libpq_conninfo(url), autocommit=True)
    try:
        monitor.execute(OWN + "SET statement_timeout = '10s'")
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        settle = wait_settled(monitor, holders, slot_count, renew, started)
        lost_before = sum(c.lost for c in team)
        failed_before = sum(c.failed for c in team)
        cpu_before, client_before = backend_cpu(monitor), time.process_time()
        monitor.execute(OWN + "SELECT pg_stat_clear_snapshot()")
        xacts_before = transactions(monitor)
        window_start = time.perf_counter()
        time.sleep(seconds)
        window_end = time.perf_counter()
        cpu_after, client_after = backend_cpu(monitor), time.process_time()
        time.sleep(1.0)  # the backends report their counts at most a second late
        monitor.execute(OWN + "SELECT pg_stat_clear_snapshot()")
        xacts = transactions(monitor) - xacts_before
        rows, dead, size_kb, autovacuums = table_state(monitor)
        counts = slot_counts(monitor)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=2 * renew + 10)
        for client in team:
            client.leaser.release_all()
        for store in stores:
            store.close()
        monitor.close()
    durations = [d for c in team for ended, d in c.durations if window_start <= ended <= window_end]
    window = window_end - window_start
    server = sum(cpu - cpu_before.get(pid, 0.0) for pid, cpu in cpu_after.items()) if cpu_after else None
    return Figures(
        clients=clients,
        stores=len(stores),
        renew_interval=renew,
        settle_seconds=None if settle is None else round(settle, 2),
        window_seconds=round(window, 2),
        rounds=len(durations),
        rounds_per_second=round(len(durations) / window, 2),
        p50_ms=round(statistics.median(durations) * 1000, 2),
        p99_ms=round(percentile(durations, 0.99) * 1000, 2),
        server_cpu_us_per_round=None if server is None or not durations else round(server / len(durations) * 1e6),
        transactions_per_round=round(xacts / len(durations), 2) if durations else 0.0,
        client_cpu_share=round((client_after - client_before) / window, 3),
        lock_rows=rows,
        dead_tuples=dead,
        lock_table_kb=size_kb,
        autovacuums=autovacuums,
        lost=sum(c.lost for c in team) - lost_before,
        failed=sum(c.failed for c in team) - failed_before,
        holders_with_slots=len(counts),
    )


HEADER = (f"{'clients':>7} {'stores':>6} {'settle s':>8} {'rounds/s':>8} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'srv us/rnd':>10} {'tx/rnd':>6} {'client cpu':>10} {'lock rows':>9} {'dead tup':>8} {'kB':>5} "
          f"{'holders':>7} {'lost':>4} {'failed':>6}")


def line(f: Figures) -> str:
    settle = "-" if f.settle_seconds is None else f"{f.settle_seconds:.1f}"
    cpu = "-" if f.server_cpu_us_per_round is None else f"{f.server_cpu_us_per_round:.0f}"
    return (f"{f.clients:>7} {f.stores:>6} {settle:>8} {f.rounds_per_second:>8.2f} {f.p50_ms:>7.2f} "
            f"{f.p99_ms:>7.2f} {cpu:>10} {f.transactions_per_round:>6.1f} {f.client_cpu_share:>10.1%} "
            f"{f.lock_rows:>9} {f.dead_tuples:>8} "
            f"{f.lock_table_kb:>5} {f.holders_with_slots:>7} {f.lost:>4} {f.failed:>6}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", help="PostgreSQL URL (without a database name: a throwaway database per N)")
    parser.add_argument("--clients", default="10,50,100", help="comma-separated client counts (default 10,50,100)")
    parser.add_argument("--seconds", type=float, default=40.0, help="the measured window, after settling")
    parser.add_argument("--renew-interval", type=float, default=5.0, help="seconds between rounds (default 5)")
    parser.add_argument("--connections", type=int, default=60, help="at most this many stores (default 60)")
    parser.add_argument("--json", action="store_true", help="also print one JSON object")
    args = parser.parse_args()
    base = normalise_url(args.url or os.environ.get(URL_ENV) or LOCAL_SERVER)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"renew interval {args.renew_interval:g} s, window {args.seconds:g} s, 1-minute load {load:.2f}",
          flush=True)
    print(HEADER, flush=True)
    results = []
    for clients in (int(n) for n in args.clients.split(",")):
        with bench_database(base) as url:
            figures = run(url, clients, args.seconds, args.renew_interval, args.connections)
        results.append(figures)
        print(line(figures), flush=True)
    if args.json:
        print(json.dumps({"load": load, "runs": [asdict(f) for f in results]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
