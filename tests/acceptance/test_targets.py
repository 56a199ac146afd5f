"""Network targets seen from outside: a real worker process calling an engine served by another process
(``bench/fake_engine.py``) that is down, refuses connections, is slow, pushes back, breaks on one message, or is
one of two. DESIGN.md §5 "Targets have a state"."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Database, StartWorker, WorkerProcess, run_cli, wait_until

FAKE_ENGINE = Path(__file__).resolve().parents[2] / "bench" / "fake_engine.py"
FAST = {"poll__interval": "PT0.2S", "policy__backoff_unit": "PT0.2S"}
OPENED = "is unavailable"
CLOSED = "answers again"


class Engine:
    """fake_engine.py in a process of its own."""

    def __init__(self, *options: str) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.process = subprocess.Popen(
            [sys.executable, str(FAKE_ENGINE), "--port", str(self.port), *options],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        assert self.process.stdout is not None
        assert "listening" in self.process.stdout.readline()
        self.refusing = "refuse" in options

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/correlate"

    def statuses(self) -> dict[str, int]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/stats", timeout=5) as response:
            return dict(json.loads(response.read())["statuses"])

    def up(self) -> None:
        self.process.send_signal(signal.SIGUSR2)
        if self.refusing:
            wait_until(self._listens, what="the engine listening again")

    def _listens(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            return False
        return True

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(10)


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    started: list[Engine] = []

    def start(*options: str) -> Engine:
        engine = Engine(*options)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.close()


def http(engine: Engine, **keys: Any) -> dict[str, Any]:
    return {"type": "http", "url": engine.url, **keys}


def rows(db: Database, name: str | None = None) -> list[dict[str, Any]]:
    where = "" if name is None else f" WHERE message_name = '{name}'"
    return db.execute(f"SELECT id, state, attempt, last_error, outcome FROM correlation_message{where} ORDER BY id")


def all_delivered(db: Database, name: str | None = None) -> bool:
    return all(row["state"] == "delivered" for row in rows(db, name))


def lines_with(process: WorkerProcess, text: str) -> list[str]:
    return [line for line in process.log().splitlines() if text in line]


def metric(process: WorkerProcess, name: str) -> dict[str, float]:
    base = re.search(r"serving /metrics\S* .*? on (\S+):(\d+)", process.log())
    assert base is not None
    with urllib.request.urlopen(f"http://{base.group(1)}:{base.group(2)}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {labels: float(value) for labels, value in re.findall(rf"^{name}(\{{[^}}]*\}}) (\S+)$", text, re.M)}


@pytest.mark.parametrize("mode", ["503", "refuse"])
def test_an_engine_down_costs_no_attempt_one_warning_and_the_backlog_flows_when_it_is_back(
    pg_db: Database, start_worker: StartWorker, engines: Callable[..., Engine], mode: str
) -> None:
    engine = engines("--latency-ms", "5", "--down", "--down-mode", mode)
    process = start_worker(pg_db, correlators=json.dumps({"*": http(engine)}), metrics__port="0", **FAST)
    ids = [pg_db.insert("order.paid", f"order-{n % 8}", {"n": n}) for n in range(40)]
    wait_until(lambda: lines_with(process, OPENED), what="the circuit opened", workers=[process])
    held = metric(process, "correlation_target_held_total")
    wait_until(lambda: sum(metric(process, "correlation_target_held_total").values()) > sum(held.values()) + 8,
               what="messages held while it is open", workers=[process])
    calls_while_down = engine.statuses().get("503", 0) if mode == "503" else None
    assert all(row["attempt"] == 0 and row["state"] == "ready" for row in rows(pg_db))  # nothing charged
    if calls_while_down is not None:  # the failures that opened it, and a probe or two: not a call per message
        assert calls_while_down <= 12, calls_while_down
    opened = metric(process, "correlation_target_open")
    assert list(opened.values()) == [1.0] and "127.0.0.1" in next(iter(opened))

    def shown_open() -> dict[str, Any] | None:  # as `status` (and the API, the console) show it
        shown = json.loads(run_cli(pg_db, "status", "--output", "json").stdout)["targets"]
        return shown[0] if shown and shown[0]["circuit"] != "closed" else None

    target = wait_until(shown_open, what="the open circuit in status", workers=[process])
    assert target["target"] == engine.url and target["reason"] and target["replica"].startswith("acceptance")
    engine.up()
    wait_until(lambda: all_delivered(pg_db), what="the backlog delivered", workers=[process])
    assert all(row["attempt"] == 0 and row["outcome"] == "correlated" for row in rows(pg_db))
    assert len(lines_with(process, OPENED)) == 1 and len(lines_with(process, CLOSED)) == 1
    assert " WARNING " in lines_with(process, OPENED)[0] and " INFO " in lines_with(process, CLOSED)[0]
    assert not [line for line in process.log().splitlines() if " WARNING " in line and OPENED not in line]
    assert list(metric(process, "correlation_target_open").values()) == [0.0]
    wait_until(lambda: json.loads(run_cli(pg_db, "status", "--output", "json").stdout)["targets"][0]["circuit"]
               == "closed", what="the closed circuit in status", workers=[process])
    assert len(ids) == 40


def test_a_slow_engine_times_calls_out_as_charged_retries_and_opens_its_circuit(
    pg_db: Database, start_worker: StartWorker, engines: Callable[..., Engine]
) -> None:
    engine = engines("--latency-ms", "3000")
    route = http(engine, timeout="PT0.3S", breaker_failures=3)
    process = start_worker(pg_db, correlators=json.dumps({"*": route}), metrics__port="0", **FAST)
    first = [pg_db.insert("order.paid", f"order-{n}", {"n": n}) for n in range(8)]
    wait_until(lambda: lines_with(process, OPENED), what="the circuit opened", workers=[process])
    # A timeout may have reached the engine: the calls that timed out are charged (a slow start sends 4 at first).
    wait_until(lambda: len([row for row in rows(pg_db) if row["id"] in first and row["attempt"] == 1]) >= 3,
               what="the timeouts recorded", workers=[process])
    assert all("timed out after 0.3s" in row["last_error"] for row in rows(pg_db) if row["attempt"])
    held = sum(metric(process, "correlation_target_held_total").values())
    later = [pg_db.insert("order.paid", f"later-{n}", {"n": n}) for n in range(6)]
    wait_until(lambda: sum(metric(process, "correlation_target_held_total").values()) >= held + 6,
               what="the later messages held", workers=[process])
    # While it is open they wait uncharged; a probe (one call at a time) may have taken one of them.
    assert len([row for row in rows(pg_db) if row["id"] in later and row["attempt"] > 0]) <= 1
    assert all(row["state"] == "ready" for row in rows(pg_db))


def test_a_busy_engine_is_paced_without_an_attempt_and_retry_after_is_kept(
    pg_db: Database, start_worker: StartWorker, engines: Callable[..., Engine]
) -> None:
    engine = engines("--latency-ms", "40", "--capacity", "2", "--retry-after", "1")
    process = start_worker(pg_db, correlators=json.dumps({"*": http(engine)}), metrics__port="0",
                           poll__concurrency="16", **FAST)
    for n in range(60):
        pg_db.insert("order.paid", f"order-{n % 30}", {"n": n})
    wait_until(lambda: all_delivered(pg_db), what="every message delivered", workers=[process], timeout=60)
    assert all(row["attempt"] == 0 for row in rows(pg_db))  # a 429 is a pace, never an attempt
    statuses = engine.statuses()
    assert statuses.get("429", 0) > 0 and statuses["200"] == 60
    limit = metric(process, "correlation_target_concurrency_limit")
    assert next(iter(limit.values())) < 16  # lowered from the lanes' 16 by the 429s
    assert process.stop() == 0
    assert not lines_with(process, " WARNING ") and not lines_with(process, " ERROR ")  # its connections closed


def test_one_message_the_engine_always_fails_dies_alone_while_its_neighbours_go_through(
    pg_db: Database, start_worker: StartWorker, engines: Callable[..., Engine]
) -> None:
    engine = engines("--latency-ms", "5", "--fail-when", "poison")
    process = start_worker(pg_db, correlators=json.dumps({"*": http(engine, breaker_failures=2)}),
                           policy__max_retries="3", **FAST)
    bad = pg_db.insert("order.paid", "order-bad", {"poison": True})
    good = [pg_db.insert("order.paid", f"order-{n % 5}", {"n": n}) for n in range(30)]

    def settled() -> bool:
        states = {row["id"]: row["state"] for row in rows(pg_db)}
        return states[bad] == "dead" and all(states[g] == "delivered" for g in good)

    wait_until(settled, what="the bad message dead and the others delivered", workers=[process])
    dead = next(row for row in rows(pg_db) if row["id"] == bad)
    assert dead["attempt"] == 3 and "500" in dead["last_error"]  # max_retries, as any failing message
    assert not lines_with(process, OPENED)  # one message's failures are not the target's


def test_two_targets_one_down_the_other_route_goes_on_at_full_pace(
    pg_db: Database, start_worker: StartWorker, engines: Callable[..., Engine]
) -> None:
    down = engines("--latency-ms", "5", "--down")
    healthy = engines("--latency-ms", "5")
    routes = {"a.down": http(down), "b.up": http(healthy)}
    process = start_worker(pg_db, correlators=json.dumps(routes), **FAST)
    for n in range(40):
        pg_db.insert("a.down", f"a-{n % 10}", {"n": n})
        pg_db.insert("b.up", f"b-{n % 10}", {"n": n})
    wait_until(lambda: all_delivered(pg_db, "b.up"), what="the healthy route's messages", workers=[process])
    assert all(row["state"] == "ready" and row["attempt"] == 0 for row in rows(pg_db, "a.down"))
    assert len(lines_with(process, OPENED)) == 1 and str(down.port) in lines_with(process, OPENED)[0]
    down.up()
    wait_until(lambda: all_delivered(pg_db, "a.down"), what="the other route's backlog", workers=[process])


def test_a_hint_refused_with_retry_after_goes_when_its_rest_ends_whatever_its_slot_fetches_meanwhile(
    pg_db: Database, start_worker: StartWorker, engines: Callable[..., Engine]
) -> None:
    """A refused hint rests until Retry-After; fetches of its slot meanwhile (other hints' messages arriving) pass
    it over, and must not push its turn back to the slot's next poll (a minute here)."""
    engine = engines("--latency-ms", "100", "--capacity", "1", "--retry-after", "3")
    process = start_worker(pg_db, correlators=json.dumps({"*": http(engine)}), poll__interval="PT60S",
                           poll__concurrency="4")
    first, second = pg_db.hint_in_slot(5, "rest-a"), pg_db.hint_in_slot(5, "rest-b")
    pg_db.insert("order.paid", first, {"n": 0})
    pg_db.insert("order.paid", second, {"n": 0})  # called beside the first: one of them is refused
    for n in range(1, 6):  # the slot is fetched again while the refused hint rests, then nothing happens there
        time.sleep(0.1)
        pg_db.insert("order.paid", first, {"n": n})
    wait_until(lambda: all_delivered(pg_db), what="every message delivered well before the next poll",
               workers=[process], timeout=20)
    assert engine.statuses().get("429", 0) > 0
    assert all(row["attempt"] == 0 for row in rows(pg_db))
