"""Network targets: how fast a real ``correlation-worker run`` calls an engine, and what an engine that is down,
refusing connections or pushing back costs. Every engine is ``fake_engine.py`` in a process of its own.

Rows (``--rows``, all by default), each in the same run, one fresh worker process each:

1. **speed**: 5 000 messages over 1 000 hints, 32 lanes, a target answering after 10 ms, released at once (as
   ``cluster.py`` releases them) and timed to the last delivery; for the Python correlator that sleeps 10 ms
   (``sleep_correlator.py``), an ``http`` route, a ``camunda8`` correlate route (``CAMUNDA_AUTH_STRATEGY=NONE``) and
   a ``camunda7`` route. Reference: Little's limit, 32 / 10 ms. With each: the worker's CPU a call and the log lines
   the drain wrote at the default level (INFO). Beside them, when ``npm ci --prefix bench/graphile`` installed it,
   graphile-worker 0.18 calling the same engine with Node's ``fetch``, 32 at a time, a local queue of 500.
2. **down**: the engine answers 503 from before the worker starts; 2 000 messages over 500 hints are inserted
   over ``--outage`` seconds (60); then the engine is back. Calls made while it was down (its own count), attempts
   charged, dead messages, WARNING lines, and the seconds from its return to the last delivery.
3. **refused**: the same, with nothing listening on the engine's port for ``--outage`` / 2 seconds (30).
4. **busy**: an engine serving 4 calls at a time, 20 ms each (capacity 200 calls/s), answering 429
   ``Retry-After: 1`` beyond; 2 000 messages over 500 hints released at once. Calls/s against its capacity, the
   share of 429s among its requests, attempts charged.
5. **two**: two ``http`` routes, one engine answering 503 all along, the other 10 ms: 2 500 messages for each,
   released at once; the healthy route's rate beside its rate alone (the same 2 500 messages, no other route).
6. **payload**: ``cluster.py``'s no-op drain of 20 000 messages by one replica, with ``{"n": i}`` payloads and
   with 1.5 KB JSON orders: the worker's CPU a message for each.

::

    .venv/bin/python bench/targets.py [--url URL] [--rows speed,down,refused,busy,two,payload] [--quick] [--json]

``--quick`` divides the counts and the outage by five (a check of the harness, not figures to quote). ``--url`` as
in ``drain.py``: a URL without a database name gets a throwaway database per row. PostgreSQL only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cluster import (
    BENCH_DIR,
    Replica,
    load_paused,
    release,
    run_cluster,
    slot_terms,
    wait_for,
    worker_env,
)
from drain import LOCAL_SERVER, URL_ENV, PostgresDriver, bench_database, libpq_conninfo, migrate
from versus_graphile import GRAPHILE_CLI, GRAPHILE_DIR, graphile_slow_target

LANES = 32
CALL_MS = 10.0
SLOTS = 64
ROWS = ("speed", "down", "refused", "busy", "two", "payload")


def free_port() -> int:
    """A port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class FakeEngine:
    """``fake_engine.py`` in its own process."""

    def __init__(self, *options: str) -> None:
        self.port = free_port()
        self.down_mode = options[options.index("--down-mode") + 1] if "--down-mode" in options else "503"
        self.process = subprocess.Popen(
            [sys.executable, str(BENCH_DIR / "fake_engine.py"), "--port", str(self.port), *options],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if "listening" not in line:
            raise SystemExit(f"the fake engine did not start: {line}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, Any]:
        """Its counts so far (requests by status)."""
        with urllib.request.urlopen(f"{self.url}/stats", timeout=5) as response:
            return dict(json.loads(response.read()))

    def served(self, status: int) -> int:
        return int(self.stats()["statuses"].get(str(status), 0))

    def down(self) -> None:
        self.process.send_signal(signal.SIGUSR1)

    def up(self) -> None:
        self.process.send_signal(signal.SIGUSR2)
        if self.down_mode == "refuse":  # listening again
            wait_until(lambda: _connects(self.port), 10, "the fake engine listening again")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def wait_until(predicate: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not happen in {seconds:g}s")
        time.sleep(0.02)


def routes_for(kind: str, engine: FakeEngine | None) -> tuple[dict[str, Any], dict[str, str]]:
    """The CORRELATION_CORRELATORS route of a kind, and the environment it needs."""
    if kind == "python":
        return {"*": "sleep_correlator:call"}, {"BENCH_CALL_MS": str(CALL_MS)}
    assert engine is not None
    if kind == "http":
        return {"*": {"type": "http", "url": f"{engine.url}/correlate"}}, {}
    if kind == "camunda8":
        return {"*": {"type": "camunda8", "url": engine.url}}, {"CAMUNDA_AUTH_STRATEGY": "NONE"}
    if kind == "camunda7":
        return {"*": {"type": "http", "preset": "camunda7", "url": f"{engine.url}/engine-rest"}}, {}
    raise ValueError(kind)


@contextmanager
def worker(url: str, name: str, routes: Mapping[str, Any], env: Mapping[str, str], log_dir: Path,
           concurrency: int = LANES) -> Iterator[Replica]:
    """One ``correlation-worker run`` at the default log level, its slots all held before it is yielded."""
    settings = {"CORRELATION_CORRELATORS": json.dumps(routes), "CORRELATION_LOG__LEVEL": "INFO", **env}
    replica = Replica(name, worker_env(url, name, 1000, concurrency, settings), log_dir)
    try:
        driver = PostgresDriver(url)
        try:
            wait_for(replica.metrics_port, time.monotonic() + 60, "the worker's /metrics", [replica])
            wait_for(lambda: len(slot_terms(driver)) == SLOTS or None, time.monotonic() + 60,
                     "every slot held", [replica])
        finally:
            driver.close()
        yield replica
    finally:
        code = replica.stop()
        if code != 0:
            print(f"{name} exited with {code}:\n{replica.log()[-3000:]}", file=sys.stderr)


def lines(replica: Replica) -> list[str]:
    return replica.log().splitlines()


def outstanding(driver: PostgresDriver) -> int:
    row = driver.connection.execute(
        "SELECT count(*) FROM correlation_message WHERE state NOT IN ('delivered', 'dead')"
    ).fetchone()
    return int(row[0]) if row else 0


def charged(driver: PostgresDriver) -> tuple[int, int]:
    """(attempts charged over every message, dead messages)."""
    row = driver.connection.execute(
        "SELECT coalesce(sum(attempt), 0), count(*) FILTER (WHERE state = 'dead') FROM correlation_message"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def drained(driver: PostgresDriver, seconds: float, replica: Replica) -> float:
    """Wait until nothing is left to deliver; the time it took."""
    started = time.perf_counter()
    wait_for(lambda: outstanding(driver) == 0 or None, time.monotonic() + seconds, "the drain", [replica])
    return time.perf_counter() - started


@contextmanager
def database(args: argparse.Namespace) -> Iterator[tuple[str, PostgresDriver]]:
    with bench_database(args.url) as url:
        migrate(url)
        driver = PostgresDriver(url)
        try:
            yield url, driver
        finally:
            driver.close()


# -- the rows -------------------------------------------------------------------------------------------------


def speed(args: argparse.Namespace, log_dir: Path) -> list[dict[str, Any]]:
    messages, hints = 5000 // args.divide, 1000 // args.divide
    little = LANES / (CALL_MS / 1000)
    rows = []
    for kind in ("python", "http", "camunda8", "camunda7"):
        engine = FakeEngine("--latency-ms", str(CALL_MS)) if kind != "python" else None
        try:
            with database(args) as (url, driver):
                routes, env = routes_for(kind, engine)
                load_paused(driver, messages, hints)
                with worker(url, f"speed-{kind}", routes, env, log_dir) as replica:
                    before_lines, before_cpu = len(lines(replica)), replica.cpu_seconds() or 0.0
                    release(driver)
                    seconds = drained(driver, 120 + messages / 50, replica)
                    cpu = (replica.cpu_seconds() or 0.0) - before_cpu
                    logged = len(lines(replica)) - before_lines
                attempts, dead = charged(driver)
        finally:
            if engine is not None:
                engine.stop()
        rate = messages / seconds
        rows.append({"row": "speed", "route": kind, "calls_per_s": round(rate), "of_little": round(rate / little, 2),
                     "cpu_us_per_call": round(cpu / messages * 1e6), "log_lines": logged,
                     "attempts": attempts, "dead": dead})
    if GRAPHILE_CLI.exists():
        rows.append(graphile_speed(args, log_dir, messages, little))
    else:
        print("speed: graphile-worker skipped (npm ci --prefix bench/graphile installs it)", file=sys.stderr)
    return rows


def graphile_speed(args: argparse.Namespace, log_dir: Path, messages: int, little: float) -> dict[str, Any]:
    """graphile-worker 0.18 calling the same fake engine with Node's fetch, 32 at a time, a local queue of 500."""
    engine = FakeEngine("--latency-ms", str(CALL_MS))
    try:
        with database(args) as (url, _driver):
            plain = libpq_conninfo(url)
            subprocess.run(["node", str(GRAPHILE_CLI), "-c", plain, "--schema-only"], cwd=GRAPHILE_DIR, check=True,
                           capture_output=True)
            rate = graphile_slow_target(plain, messages, "batched 500", log_dir, call_url=f"{engine.url}/correlate")
    finally:
        engine.stop()
    return {"row": "speed", "route": "graphile-worker (fetch, 32, batched 500)", "calls_per_s": round(rate),
            "of_little": round(rate / little, 2)}


def outage(args: argparse.Namespace, log_dir: Path, mode: str) -> dict[str, Any]:
    messages, hints = 2000 // args.divide, 500 // args.divide
    seconds = args.outage / args.divide / (1 if mode == "503" else 2)
    engine = FakeEngine("--latency-ms", str(CALL_MS), "--down", "--down-mode", mode)
    try:
        with database(args) as (url, driver):
            routes, env = routes_for("http", engine)
            with worker(url, f"outage-{mode}", routes, env, log_dir) as replica:
                before = len(lines(replica))
                batches = 40
                started = time.monotonic()
                for batch in range(batches):  # the messages arrive while the engine is down
                    rows = [(f"hint-{(batch * (messages // batches) + i) % hints}", json.dumps({"n": i}))
                            for i in range(messages // batches)]
                    with driver.connection.cursor() as cursor:
                        cursor.executemany(
                            "INSERT INTO correlation_message (message_name, correlation_hint, payload)"
                            " VALUES ('order.paid', %s, %s)", rows)
                    time.sleep(max(0.0, started + (batch + 1) * seconds / batches - time.monotonic()))
                down_calls = engine.served(503) if mode == "503" else None
                scrape_down = scrape_answers(replica)
                engine.up()
                back = time.perf_counter()
                wait_for(lambda: outstanding(driver) == 0 or None, time.monotonic() + 300, "the backlog", [replica])
                after_back = time.perf_counter() - back
                logged = lines(replica)[before:]
            attempts, dead = charged(driver)
    finally:
        engine.stop()
    warnings = sum(1 for line in logged if " WARNING " in line or '"WARNING"' in line)
    return {"row": "down" if mode == "503" else "refused", "outage_s": round(seconds, 1), "messages": messages,
            "calls_while_down": down_calls if down_calls is not None else scrape_down.get("unavailable", 0),
            "attempts": attempts, "dead": dead, "warning_lines": warnings,
            "delivered_after_back_s": round(after_back, 2)}


def scrape_answers(replica: Replica) -> dict[str, int]:
    """correlation_target_answers_total by answer, from the replica's /metrics."""
    port = replica.metrics_port()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    answers: dict[str, int] = {}
    for match in re.finditer(r'^correlation_target_answers_total\{[^}]*answer="(\w+)"[^}]*\} (\S+)$', text, re.M):
        answers[match[1]] = answers.get(match[1], 0) + int(float(match[2]))
    return answers


def busy(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    messages, hints = 2000 // args.divide, 500 // args.divide
    capacity, latency = 4, 20.0
    engine = FakeEngine("--latency-ms", str(latency), "--capacity", str(capacity), "--retry-after", "1")
    try:
        with database(args) as (url, driver):
            routes, env = routes_for("http", engine)
            load_paused(driver, messages, hints)
            with worker(url, "busy", routes, env, log_dir) as replica:
                release(driver)
                seconds = drained(driver, 300, replica)
            attempts, dead = charged(driver)
        stats = engine.stats()["statuses"]
    finally:
        engine.stop()
    requests = sum(stats.values())
    rate = messages / seconds
    limit = capacity / (latency / 1000)
    return {"row": "busy", "calls_per_s": round(rate), "capacity_per_s": round(limit),
            "of_capacity": round(rate / limit, 2), "share_429": round(stats.get("429", 0) / requests, 3),
            "requests": requests, "attempts": attempts, "dead": dead}


def two(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """The healthy route's drain beside a route whose engine is down, and alone (the same messages), in one run."""
    alone = _healthy_drain(args, log_dir, with_down=False)
    beside, attempts, dead = _healthy_drain(args, log_dir, with_down=True)
    return {"row": "two", "healthy_calls_per_s": round(beside), "alone_calls_per_s": round(alone[0]),
            "of_alone": round(beside / alone[0], 2), "attempts": attempts, "dead": dead}


def _healthy_drain(args: argparse.Namespace, log_dir: Path, with_down: bool) -> tuple[float, int, int]:
    each, hints = 2500 // args.divide, 500 // args.divide
    down = FakeEngine("--latency-ms", str(CALL_MS), "--down")
    healthy = FakeEngine("--latency-ms", str(CALL_MS))
    try:
        with database(args) as (url, driver):
            routes = {"a.down": {"type": "http", "url": f"{down.url}/a"},
                      "b.up": {"type": "http", "url": f"{healthy.url}/b"}}
            with driver.connection.cursor() as cursor:
                for name, prefix in (("a.down", "a"), ("b.up", "b")) if with_down else (("b.up", "b"),):
                    cursor.executemany(
                        "INSERT INTO correlation_message (message_name, correlation_hint, payload, state)"
                        " VALUES (%s, %s, '{}', 'paused')",
                        [(name, f"{prefix}-{i % hints}") for i in range(each)])
            with worker(url, "two" if with_down else "one", routes, {}, log_dir) as replica:
                release(driver)
                started = time.perf_counter()

                def healthy_done() -> bool | None:
                    row = driver.connection.execute(
                        "SELECT count(*) FROM correlation_message WHERE message_name = 'b.up'"
                        " AND state NOT IN ('delivered', 'dead')").fetchone()
                    return (row is not None and row[0] == 0) or None

                wait_for(healthy_done, time.monotonic() + 300, "the healthy route's drain", [replica])
                seconds = time.perf_counter() - started
            attempts, dead = charged(driver)
    finally:
        down.stop()
        healthy.stop()
    return each / seconds, attempts, dead


def payload(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    figures = {}
    for size in (0, 1500):
        options = argparse.Namespace(messages=20000 // args.divide, hints=1000 // args.divide, page_size=1000,
                                     concurrency=8, payload_bytes=size, slots=SLOTS, settings={}, statements=False)
        with database(args) as (url, driver):
            run = run_cluster(url, driver, 1, options, log_dir)
        assert run.cpu is not None
        figures[size] = run.cpu.replicas / options.messages * 1e6
    return {"row": "payload", "cpu_us_small": round(figures[0], 1), "cpu_us_1500": round(figures[1500], 1),
            "ratio": round(figures[1500] / figures[0], 2)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get(URL_ENV, LOCAL_SERVER))
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--outage", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.divide = 5 if args.quick else 1
    wanted = [row.strip() for row in args.rows.split(",") if row.strip()]
    unknown = set(wanted) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows: {', '.join(sorted(unknown))} (known: {', '.join(ROWS)})")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cw-targets-") as log_dir:
        for row in wanted:
            print(f"row {row} …", file=sys.stderr)
            if row == "speed":
                found = speed(args, Path(log_dir))
            elif row in ("down", "refused"):
                found = [outage(args, Path(log_dir), "503" if row == "down" else "refuse")]
            else:
                found = [{"busy": busy, "two": two, "payload": payload}[row](args, Path(log_dir))]
            for figures in found:
                print("  ".join(f"{key}={value}" for key, value in figures.items()), flush=True)
            results += found
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
