"""The console's overview: bounded counts by state, the oldest eligible message's age, throughput, and the
replicas with their slots and lease expiry (``GET /api/v1/status`` and the overview page)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from worker.admin.errors import BadRequest
from worker.admin.operations import routing, targets
from worker.config import Mode
from worker.db.store import Store
from worker.engine.leases import MEMBER_PREFIX, SLOT_PREFIX
from worker.policy.charts import WINDOWS, series, shown_span, step_for

OLDEST_BUDGET = 10  # hints per slot looked at for the oldest eligible message (beyond: a lower bound)
RATE_WINDOW = 60.0  # seconds over which throughput is averaged


@dataclass(frozen=True, slots=True)
class Sample:
    """Cumulative counters at a moment (monotonic seconds)."""

    at: float
    correlated: float | None
    inserted: int


class Throughput:
    """Rates from cumulative counters sampled whenever the overview is read (it refreshes itself every few
    seconds while someone watches): messages this replica's correlator calls ended in success, and messages
    inserted into the table cluster-wide (the id sequence), per second over the last minute."""

    def __init__(self, window: float = RATE_WINDOW, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self._monotonic = monotonic
        self._samples: deque[Sample] = deque()
        self._lock = threading.Lock()

    def observe(self, correlated: float | None, inserted: int) -> dict[str, Any]:
        """Record the counters now; the rates since the oldest sample of the window (None until two samples
        at least a second apart)."""
        now = self._monotonic()
        with self._lock:
            self._samples.append(Sample(now, correlated, inserted))
            while len(self._samples) > 2 and now - self._samples[1].at >= self.window:
                self._samples.popleft()
            first, last = self._samples[0], self._samples[-1]
        span = last.at - first.at
        if span < 1.0:
            return {"correlated_per_second": None, "inserted_per_second": None, "over_seconds": round(span, 1)}
        correlated_rate = None
        if first.correlated is not None and last.correlated is not None:
            correlated_rate = round((last.correlated - first.correlated) / span, 2)
        return {
            "correlated_per_second": correlated_rate,
            "inserted_per_second": round(max(0, last.inserted - first.inserted) / span, 2),
            "over_seconds": round(span, 1),
        }


def replicas(store: Store) -> list[dict[str, Any]]:
    """Live replicas (holding a slot lease or a membership row), each with its slots and lease expiry."""
    now = store.now()
    found: dict[str, dict[str, Any]] = {}
    for lock in store.locks_list_held():
        if not lock.name.startswith((SLOT_PREFIX, MEMBER_PREFIX)) or not lock.locked_by:
            continue
        entry = found.setdefault(lock.locked_by, {"replica": lock.locked_by, "slots": [], "lease_until": None})
        if lock.name.startswith(SLOT_PREFIX):
            entry["slots"].append(int(lock.name.removeprefix(SLOT_PREFIX)))
            if entry["lease_until"] is None or lock.lock_until < entry["lease_until"]:
                entry["lease_until"] = lock.lock_until
    shown = []
    for entry in sorted(found.values(), key=lambda e: e["replica"]):
        until = entry["lease_until"]
        shown.append(
            {
                "replica": entry["replica"],
                "slot_count": len(entry["slots"]),
                "slots": sorted(entry["slots"]),
                "lease_expires_at": None if until is None else until.isoformat(),
                "lease_expires_in_seconds": None if until is None else round((until - now).total_seconds(), 1),
            }
        )
    return shown


def overview(
    store: Store,
    mode: Mode,
    count_limit: int,
    throughput: Throughput | None = None,
    correlated: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """Everything the overview shows, JSON-ready.

    ``messages``: counts by state, each a number or e.g. ``"10000+"`` past ``count_limit``
    (``waiting``: ready, due later; ``expired``: past ``expires_at``). ``oldest_eligible_age_seconds``: how long
    the oldest message that could be correlated now has waited (a lower bound past a few hints per slot).
    ``throughput``: see :class:`Throughput`. ``replicas``: live replicas, their slots and earliest lease expiry.
    ``targets``: the network targets' circuits as each replica sees them. ``routing``: whether the replicas route
    alike (see :func:`~worker.admin.operations.routing`). ``scheduler``: whether the
    cluster-wide switch of the schedules is on.
    """
    census = store.console_census(count_limit)
    oldest = store.console_oldest_eligible(mode, OLDEST_BUDGET)
    age = None if oldest is None else max(0.0, (census.now - oldest).total_seconds())
    rates = None
    if throughput is not None:
        rates = throughput.observe(correlated() if correlated is not None else None, store.messages_last_id())
    pauses = store.pauses_list()
    routes = routing(store)
    fingerprints = {entry["replica"]: entry["routes"] for entry in routes["replicas"]}
    live = [{**entry, "routes": fingerprints.get(entry["replica"])} for entry in replicas(store)]
    return {
        "messages": {name: count.shown() for name, count in census.counts.items()},
        "count_limit": count_limit,
        "oldest_eligible_age_seconds": None if age is None else round(age, 3),
        "throughput": rates,
        "replicas": live,
        "targets": targets(store),
        "routing": routes,
        "slots": store.slot_count,
        "pauses": len(pauses),
        "paused_everything": any(pause.scope == "all" for pause in pauses),
        "scheduler": {"enabled": store.scheduler_is_enabled()},
        "mode": mode.value,
        "database_time": census.now.isoformat(),
    }


def charts(store: Store, window: str, sample_interval: timedelta) -> dict[str, Any]:
    """The charts' series over ``window`` (``1h`` or ``24h``) from the samples every replica reads alike
    (``GET /api/v1/charts`` and the overview's charts): see :mod:`worker.policy.charts`."""
    span = WINDOWS.get(window)
    if span is None:
        raise BadRequest(f"window {window!r} is not one of {', '.join(WINDOWS)}")
    now, samples = store.samples_read(span + sample_interval * 2)  # the rows just before the window set baselines
    shown = shown_span(samples, now, span, sample_interval)
    step = step_for(shown, sample_interval)
    return {"window": window, "now": now.isoformat(), **series(samples, now, shown, step)}
