"""Console benchmark: how long the console's pages take with 1 000 000 messages in mixed states.

One run::

    1. create a throwaway database ``cw_bench_console_<random>`` (or use --url's database) and migrate it
    2. insert N messages (default 1 000 000) over 50 000 hints and 20 names: 60 % ready, 10 % waiting for a
       retry, 5 % paused, 20 % dead (with an error text), 5 % expired; then ANALYZE
    3. serve the console on the real endpoint (uvicorn on a thread, the console's own store and statement
       timeout) and time each page over HTTP from a client on the same machine: a few warm-up requests,
       then --runs requests; report the median and the slowest per page against the 200 ms target

Usage::

    .venv/bin/python bench/console.py [--url URL] [--messages 1000000] [--runs 10] [--keep]

``--url`` (default: ``CORRELATION_BENCH_DATABASE_URL``, else the local PostgreSQL server): a URL without a
database name gets a throwaway database (dropped at the end unless --keep); a URL naming a database that
already holds messages is used as it is (no insert).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence

import psycopg
from pydantic import SecretStr
from sqlalchemy.engine import make_url

from worker.admin.auth import Caller
from worker.admin.console import Console
from worker.admin.routes import console_routes
from worker.config import AdminSettings, DatabaseSettings, Mode
from worker.db.store import Store
from worker.service.endpoint import Endpoint, Heartbeat
from worker.service.metrics import Metrics

URL_ENV = "CORRELATION_BENCH_DATABASE_URL"
LOCAL_SERVER = "postgresql://postgres@127.0.0.1:5432/"
TOKEN = "bench-console-token-0123456789"
TARGET_MS = 200.0
HINTS = 50_000
NAMES = 20

FILL = """
INSERT INTO correlation_message (message_name, correlation_hint, payload, state, attempt, next_attempt_at,
                                 last_error, created_at, expires_at)
SELECT 'name-' || (n % {names}),
       'hint-' || (n % {hints}),
       jsonb_build_object('n', n, 'order', 'order-' || n),
       CASE WHEN n % 20 = 0 THEN 'paused' WHEN n % 5 = 1 THEN 'dead' ELSE 'ready' END,
       CASE WHEN n % 5 = 1 THEN 5 WHEN n % 10 = 2 THEN 2 ELSE 0 END,
       CASE WHEN n % 10 = 2 THEN now() + interval '1 hour' END,
       CASE WHEN n % 5 = 1 THEN 'RuntimeError: ' || (CASE WHEN n % 3 = 0 THEN 'timeout' ELSE 'refused' END)
                                 || ' calling the engine for order-' || n END,
       now() - interval '2 hours' + n * interval '1 millisecond',
       CASE WHEN n % 20 = 3 THEN now() - interval '1 minute' END
  FROM generate_series({first}, {last}) AS n
"""


def conninfo(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def fill(url: str, messages: int) -> None:
    """Insert the messages in chunks (one statement per 100 000), then ANALYZE."""
    with psycopg.connect(conninfo(url), autocommit=True) as connection:
        for first in range(1, messages + 1, 100_000):
            last = min(messages, first + 99_999)
            connection.execute(FILL.format(names=NAMES, hints=HINTS, first=first, last=last).encode())
            print(f"  inserted {last} messages", file=sys.stderr)
        connection.execute("VACUUM ANALYZE correlation_message")


def timed(url: str, headers: dict[str, str], body: bytes | None) -> float:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST" if body else "GET")
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status}")
    return (time.perf_counter() - started) * 1000


def pages(dead_hint: str, dead_id: int) -> list[tuple[str, str, bytes | None]]:
    """(what, path, POST body) of every page timed."""
    return [
        ("API status (bounded counts, oldest eligible, replicas)", "/api/v1/status", None),
        ("overview page", "/ui/", None),
        ("API messages: state=dead&name=name-7", "/api/v1/messages?state=dead&name=name-7", None),
        ("messages page: state=dead&name=name-7", "/ui/messages?state=dead&name=name-7", None),
        ("API messages: name=name-3 (all states, merged)", "/api/v1/messages?name=name-3", None),
        ("API messages: name=name-3, a page deep in the table",
         f"/api/v1/messages?name=name-3&after={dead_id}", None),
        ("API messages: state=ready", "/api/v1/messages?state=ready", None),
        ("API messages: error=timeout&state=dead (scan window)", "/api/v1/messages?state=dead&error=timeout", None),
        ("dead letters page", "/ui/dead", None),
        ("hint page (blocker and reason)", f"/ui/hints/{dead_hint}", None),
        ("API message by id", f"/api/v1/messages/{dead_id}", None),
        ("bulk dry run: requeue state=dead (bounded count)", "/api/v1/messages/requeue",
         b'{"state": "dead", "dry_run": true}'),
        ("audit page", "/ui/audit", None),
    ]


def run(url: str, runs: int) -> list[dict[str, object]]:
    settings = AdminSettings(token=SecretStr(TOKEN))
    database = DatabaseSettings(url=url, statement_timeout=settings.statement_timeout, pool_size=2)
    console = Console(Store.from_settings(database), Mode.FAIL_FIRST, settings, correlated=lambda: 0.0)
    endpoint = Endpoint("127.0.0.1", 0, Metrics(), Heartbeat(), 60.0, lambda: None, console=console_routes(console))
    base = f"http://127.0.0.1:{endpoint.port}"
    cookie = console.auth.new_session(Caller("admin", "ui", can_write=True))
    with psycopg.connect(conninfo(url), autocommit=True) as connection:
        row = connection.execute(
            "SELECT id, correlation_hint FROM correlation_message WHERE state = 'dead' "
            "AND id > (SELECT max(id) / 2 FROM correlation_message) ORDER BY id LIMIT 1"
        ).fetchone()
    assert row is not None
    dead_id, dead_hint = int(row[0]), str(row[1])
    results = []
    try:
        for what, path, body in pages(dead_hint, dead_id):
            headers = {"Authorization": f"Bearer {TOKEN}", "Cookie": f"cw_session={cookie}"}
            if body:
                headers["Content-Type"] = "application/json"
            for _ in range(2):
                timed(base + path, headers, body)
            samples = sorted(timed(base + path, headers, body) for _ in range(runs))
            median = statistics.median(samples)
            results.append({"page": what, "path": path, "median_ms": round(median, 1),
                            "max_ms": round(samples[-1], 1), "within_target": median <= TARGET_MS})
    finally:
        endpoint.close()
        console.close()
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Fill a database, time the pages, print a table (and JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--url", default=os.environ.get(URL_ENV, LOCAL_SERVER))
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--keep", action="store_true", help="keep the throwaway database")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    parsed = make_url(args.url)
    throwaway = None
    url = args.url
    if not parsed.database or parsed.database == "postgres":
        throwaway = f"cw_bench_console_{secrets.token_hex(4)}"
        with psycopg.connect(conninfo(args.url), autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{throwaway}"')
        url = parsed.set(database=throwaway).render_as_string(hide_password=False)
    try:
        store = Store.from_settings(DatabaseSettings(url=url))
        store.schema_migrate()
        empty = store.messages_last_id() == 0
        store.close()
        if empty:
            started = time.perf_counter()
            fill(url, args.messages)
            print(f"  filled in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        results = run(url, args.runs)
    finally:
        if throwaway and not args.keep:
            with psycopg.connect(conninfo(args.url), autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{throwaway}" WITH (FORCE)')
    width = max(len(str(r["page"])) for r in results)
    print(f"{'page':<{width}}  median ms  max ms  ≤ {TARGET_MS:.0f} ms")
    for r in results:
        print(f"{r['page']!s:<{width}}  {r['median_ms']:>9}  {r['max_ms']:>6}  {'yes' if r['within_target'] else 'NO'}")
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
