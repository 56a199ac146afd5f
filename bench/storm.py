"""Kill storm: how soon a dead replica's slots are leased again and their waiting work called.

Four ``correlation-worker run`` replicas (lease PT6S, renewed every PT2S) correlate a steady stream of messages
in every slot; every 3 s one of them is SIGKILLed and a new one started in its place, for 60 s. For each
death the benchmark reads, from outside:

- **re-taken**: from the SIGKILL until every slot the victim held is leased by another replica (the lock table,
  looked at every 50 ms);
- **called**: from the SIGKILL until a message of each of those slots is called again (the correlator tells the
  benchmark each call's slot and start time over UDP on the loopback).

A slot taken over by a replica that is itself killed before it calls the slot's work is counted in that
replica's death, from its own SIGKILL (two deaths in a row cannot keep one death's bound); the output says how
many slots each death passed on so.

The bound both should keep: ``LEASE__DURATION + LEASE__RENEW_INTERVAL`` (8 s): a term lapses at most a lease after
its last renewal, and some live replica's next round comes within a renew interval::

    .venv/bin/python bench/storm.py [--url URL] [--seconds 60] [--every 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import psycopg
from cluster import Replica, slot_terms, spread, wait_for, worker_env
from drain import LOCAL_SERVER, URL_ENV, PostgresDriver, bench_database, libpq_conninfo, migrate

from worker.db.store import normalise_url

LEASE_SECONDS, RENEW_SECONDS = 6.0, 2.0
SETTINGS = {
    "CORRELATION_CORRELATORS": json.dumps({"*": "storm_correlator:record"}),
    "CORRELATION_LEASE__DURATION": f"PT{LEASE_SECONDS:g}S",
    "CORRELATION_LEASE__RENEW_INTERVAL": f"PT{RENEW_SECONDS:g}S",
    "CORRELATION_LEASE__SAFETY_MARGIN": "PT1S",
    "CORRELATION_LEASE__DRAIN": "PT1S",
    "CORRELATION_POLICY__HANDLER_TIMEOUT": "PT2S",  # within the lease, less a renewal and the margin
}
RATE = 640  # messages a second, over 64 x 4 hints: every slot has work all the time
SLOTS = 64


@dataclass(frozen=True, slots=True)
class Death:
    """One SIGKILL and how long its slots waited."""

    victim: str
    slots: int
    retaken: float | None  # seconds until the last of its slots was leased by another replica
    called: float | None  # seconds until each of its slots had a call again
    passed_on: int = 0  # slots taken by a replica killed before it called them (counted in that death)


def hints_by_slot(connection: psycopg.Connection[tuple[object, ...]]) -> list[str]:
    """Four hints per slot (the database's own hashing decides the slot)."""
    rows = connection.execute(
        "SELECT h, ((hashtext(h) % 64) + 64) % 64 FROM (SELECT 'storm-' || n AS h FROM generate_series(0, 4999) n) x"
    ).fetchall()
    chosen: dict[int, list[str]] = {}
    for hint, slot in rows:
        if len(chosen.setdefault(cast(int, slot), [])) < 4:
            chosen[cast(int, slot)].append(str(hint))
    if len(chosen) < SLOTS:
        raise SystemExit("could not find hints for every slot")
    return [hint for hints in chosen.values() for hint in hints]


def produce(conninfo: str, hints: Sequence[str], stop: threading.Event) -> None:
    """RATE messages a second, round-robin over the hints, in batches of a tenth of a second."""
    connection = psycopg.connect(conninfo, autocommit=True)
    batch = RATE // 10
    position = 0
    try:
        while not stop.wait(0.1):
            chosen = [hints[(position + n) % len(hints)] for n in range(batch)]
            position += batch
            connection.execute(
                "INSERT INTO correlation_message (message_name, correlation_hint)"
                " SELECT 'storm', h FROM unnest(%s::text[]) h",
                (chosen,),
            )
    finally:
        connection.close()


def listen(calls: socket.socket, seen: dict[int, list[float]], stop: threading.Event) -> None:
    calls.settimeout(0.2)
    while not stop.is_set():
        try:
            datagram = calls.recv(100)
        except TimeoutError:
            continue
        slot, at = datagram.decode().split()
        seen.setdefault(int(slot), []).append(float(at))


def run(url: str, seconds: float, every: float, log_dir: Path) -> list[Death]:
    """The storm on a migrated, empty database; one Death per SIGKILL."""
    conninfo = libpq_conninfo(url)
    driver = PostgresDriver(url)
    calls = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    calls.bind(("127.0.0.1", 0))
    settings = {**SETTINGS, "STORM_PORT": str(calls.getsockname()[1])}
    seen: dict[int, list[float]] = {}
    stop = threading.Event()
    hints = hints_by_slot(driver.connection)
    threads = [threading.Thread(target=listen, args=(calls, seen, stop), daemon=True),
               threading.Thread(target=produce, args=(conninfo, hints, stop), daemon=True)]
    replicas: list[Replica] = []
    counter = 0

    def start() -> Replica:
        nonlocal counter
        counter += 1
        env = worker_env(url, f"storm-{counter}", 100, 8, settings)
        for key in ("POLL__INTERVAL", "POLL__PAGE_SIZE", "POLL__CONCURRENCY", "LEASE__DRAIN"):
            env.pop(f"CORRELATION_{key}", None)
        env.update(settings)
        replica = Replica(f"storm-{counter}", env, log_dir)
        replicas.append(replica)
        return replica

    deaths: list[tuple[str, float, set[int]]] = []
    watch: list[tuple[float, dict[int, tuple[str, int]]]] = []
    try:
        live = [start() for _ in range(4)]
        for thread in threads:
            thread.start()
        wait_for(lambda: spread(slot_terms(driver), live, SLOTS), time.monotonic() + 120, "the slots spread", live)
        time.sleep(2 * RENEW_SECONDS)
        random.seed(7)
        ends = time.time() + seconds
        next_kill = time.time()
        while time.time() < ends + LEASE_SECONDS + 3 * RENEW_SECONDS:
            now = time.time()
            watch.append((now, slot_terms(driver)))
            if now >= next_kill and now < ends:
                victim = random.choice(live)
                terms = watch[-1][1]
                held = {slot for slot, (holder, _fence) in terms.items() if victim.owns(holder)}
                victim.process.send_signal(signal.SIGKILL)
                victim.process.wait()
                killed_at = time.time()
                deaths.append((victim.name, killed_at, held))
                live.remove(victim)
                live.append(start())
                next_kill = killed_at + every
            time.sleep(0.05)
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
        for replica in replicas:
            if replica.process.poll() is None:
                replica.stop()
        calls.close()
        driver.close()
    return _deaths(deaths, watch, seen)


def _deaths(
    deaths: Sequence[tuple[str, float, set[int]]],
    watch: Sequence[tuple[float, dict[int, tuple[str, int]]]],
    seen: dict[int, list[float]],
) -> list[Death]:
    """Each death's delays, from the lock table's samples and the calls per slot.

    A victim's slots are those it held at its last sample before the SIGKILL and at the first one after it (a
    slot it took in between is its too). A slot taken over by a replica that was itself killed before the slot
    had a call is counted in that replica's death, from its own SIGKILL: two deaths in a row cannot keep one
    bound.
    """
    killed = {victim: killed_at for victim, killed_at, _held in deaths}

    def owner(holder: str) -> str:
        return holder.rsplit("-", 1)[0]

    results = []
    for victim, killed_at, held in deaths:
        after = next((terms for at, terms in watch if at > killed_at), {})
        slots = held | {slot for slot, (holder, _fence) in after.items() if owner(holder) == victim}
        taken: list[float | None] = []
        first_calls: list[float | None] = []
        passed_on = 0
        for slot in sorted(slots):
            taker = next(((at, terms[slot][0]) for at, terms in watch
                          if at > killed_at and slot in terms and owner(terms[slot][0]) != victim), None)
            call = next((at for at in sorted(seen.get(slot, [])) if at > killed_at), None)
            taker_death = killed.get(owner(taker[1])) if taker is not None else None
            if taker_death is not None and taker_death > killed_at and (call is None or taker_death < call):
                passed_on += 1  # its taker died before calling: counted in that death
                continue
            taken.append(None if taker is None else taker[0])
            first_calls.append(call)
        results.append(
            Death(victim, len(slots) - passed_on, _last(taken, killed_at), _last(first_calls, killed_at), passed_on)
        )
    return results


def _last(times: Sequence[float | None], since: float) -> float | None:
    """Seconds from ``since`` to the latest of ``times``; None when one never came (or there were none)."""
    if not times or None in times:
        return None
    return max(at for at in times if at is not None) - since


def summary(deaths: Sequence[Death]) -> tuple[str, str]:
    """The spans of the two delays over the deaths of replicas that held slots (one killed before it took any
    has nothing to hand on)."""
    bound = LEASE_SECONDS + RENEW_SECONDS
    holding = [d for d in deaths if d.slots]
    retaken = [d.retaken for d in holding if d.retaken is not None]
    called = [d.called for d in holding if d.called is not None]
    missing = sum(1 for d in holding if d.retaken is None or d.called is None)

    def span(values: list[float]) -> str:
        over = sum(1 for value in values if value > bound)
        return f"{min(values):.1f} to {max(values):.1f} s ({over} over {bound:g} s)" if values else "none"

    tail = f", {missing} never" if missing else ""
    return f"re-taken {span(retaken)}{tail}", f"called {span(called)}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--url", default=os.environ.get(URL_ENV, LOCAL_SERVER))
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--every", type=float, default=3.0)
    args = parser.parse_args(argv)
    with ExitStack() as stack:
        url = stack.enter_context(bench_database(normalise_url(args.url)))
        migrate(url)
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cw-storm-")))
        deaths = run(url, args.seconds, args.every, log_dir)
    for death in deaths:
        passed = f" ({death.passed_on} more taken by a replica killed before calling them)" if death.passed_on else ""
        print(f"{death.victim}: {death.slots} slots{passed}, re-taken after "
              f"{'never' if death.retaken is None else f'{death.retaken:.2f} s'}, called after "
              f"{'never' if death.called is None else f'{death.called:.2f} s'}")
    retaken, called = summary(deaths)
    holding = sum(1 for death in deaths if death.slots)
    print(f"{len(deaths)} deaths ({holding} holding slots): {retaken}; {called}; bound DURATION + RENEW_INTERVAL = "
          f"{LEASE_SECONDS + RENEW_SECONDS:g} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
