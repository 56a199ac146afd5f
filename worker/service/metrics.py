"""Every metric correlation-worker exports, on an injected registry.

Names are ``correlation_*`` with unit suffixes and ``_total`` for counters. Labels are bounded: the message
name (configured by the operator's producers, a small set) and the outcome; never a hint or an id. Where a
label takes message names from the table or the calls (the backlog gauge, the call duration histogram), at
most :data:`NAME_LABELS` distinct names are exported and the rest are counted under ``other``.

The registry also carries the standard process, platform and GC collectors (``process_cpu_seconds_total``,
``process_resident_memory_bytes``, ``process_open_fds``, ``process_start_time_seconds``, ...). Counters and
histograms export no ``*_created`` series (they would double every counter's series for no use).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from prometheus_client import (
    GC_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)

from worker import __version__

BATCH_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
POLL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
NAME_LABELS = 50  # distinct message_name label values per name-labelled metric; the rest are "other"
OTHER = "other"
BACKLOG_STATES = ("ready", "waiting", "paused", "dead", "expired")


class NameLabels:
    """Bounds the message names one metric exports: the first ``limit`` names seen keep their own label."""

    def __init__(self, limit: int = NAME_LABELS) -> None:
        self.limit = limit
        self._names: set[str] = set()
        self._lock = threading.Lock()

    def label(self, name: str) -> str:
        """The label value for this name: itself while there is room, else ``other``."""
        if name in self._names:
            return name
        with self._lock:
            if len(self._names) < self.limit:
                self._names.add(name)
                return name
        return OTHER


def top_names(
    counts: Mapping[tuple[str, str], int], limit: int = NAME_LABELS
) -> dict[tuple[str, str], int]:
    """Backlog counts by (message_name, state) with only the ``limit`` largest names kept, the rest summed as
    ``other`` (pure: the census decides which names an operator sees)."""
    totals: dict[str, int] = {}
    for (name, _state), count in counts.items():
        totals[name] = totals.get(name, 0) + count
    kept = set(sorted(totals, key=lambda name: (-totals[name], name))[:limit])
    bounded: dict[tuple[str, str], int] = {}
    for (name, state), count in counts.items():
        key = (name if name in kept else OTHER, state)
        bounded[key] = bounded.get(key, 0) + count
    return bounded


class Metrics:
    """The metric objects; services count through this, the HTTP endpoint exposes the registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # process-wide in prometheus_client; no *_created series anywhere
        self.registry = registry or CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        if GC_COLLECTOR is not None:
            GCCollector(registry=r)
        self._call_names = NameLabels()
        self._backlog_labels: set[tuple[str, str]] = set()
        self._backlog_lock = threading.Lock()
        self.call_duration = Histogram(
            "correlation_call_duration_seconds",
            f"Time of one correlator call by message name (at most {NAME_LABELS} names, the rest as 'other').",
            ["message_name"],
            buckets=CALL_BUCKETS,
            registry=r,
        )
        self.backlog = Gauge(
            "correlation_backlog_messages",
            f"Messages in the table by message name and state; the {NAME_LABELS} largest names, the rest as "
            "'other'; computed by one replica.",
            ["message_name", "state"],
            registry=r,
        )
        self.messages = Counter(
            "correlation_messages",
            "Correlator calls by message name and outcome "
            "(success, retry, dead, buffered, rescheduled, abandoned).",
            ["message_name", "outcome"],
            registry=r,
        )
        self.batch_duration = Histogram(
            "correlation_batch_duration_seconds",
            "Time to correlate one batch (the messages of one hint taken in one page).",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.poll_duration = Histogram(
            "correlation_poll_duration_seconds",
            "Time of one poll cycle over every slot this replica holds.",
            buckets=POLL_BUCKETS,
            registry=r,
        )
        self.messages_by_state = Gauge(
            "correlation_messages_by_state",
            "Messages in the table by state (ready, waiting, paused, dead, expired); computed by one replica.",
            ["state"],
            registry=r,
        )
        self.oldest_eligible_age = Gauge(
            "correlation_oldest_eligible_message_age_seconds",
            "Age of the oldest message that could be correlated now (0 when none); computed by one replica.",
            registry=r,
        )
        self.slots_held = Gauge(
            "correlation_slots_held", "Slots this replica holds a lease on.", registry=r
        )
        self.lease_acquisitions = Counter(
            "correlation_lease_acquisitions", "Slot leases acquired by this replica.", registry=r
        )
        self.lease_losses = Counter(
            "correlation_lease_losses",
            "Slot leases this replica lost before releasing them (expired or taken over).",
            registry=r,
        )
        self.redeliveries = Counter(
            "correlation_redeliveries",
            "Messages delivered again after a replica died or lost its lease mid-batch.",
            registry=r,
        )
        self.fenced_commits = Counter(
            "correlation_fenced_commits",
            "Result commits refused because the lease had been lost (nothing was written).",
            registry=r,
        )
        self.database_errors = Counter(
            "correlation_database_errors", "Database operations that failed (connection lost, timeout).", registry=r
        )
        self.cleanup_removed = Counter(
            "correlation_cleanup_removed_messages", "Expired messages removed by cleanup.", registry=r
        )
        self.build_info = Info("correlation_build", "Version of correlation-worker.", registry=r)
        self.build_info.info({"version": __version__})

    def observe_call(self, message_name: str, seconds: float) -> None:
        """Count one correlator call's duration under its (bounded) message name."""
        self.call_duration.labels(self._call_names.label(message_name)).observe(seconds)

    def set_backlog(self, counts: Iterable[tuple[tuple[str, str], int]]) -> None:
        """Set the backlog gauge to these (message_name, state) counts; series no longer present go."""
        with self._backlog_lock:
            current = dict(counts)
            for name, state in self._backlog_labels - set(current):
                self.backlog.remove(name, state)
            for (name, state), count in current.items():
                self.backlog.labels(name, state).set(count)
            self._backlog_labels = set(current)

    def clear_census(self) -> None:
        """Export no census figures (another replica computes them)."""
        with self._backlog_lock:
            self.messages_by_state.clear()
            self.backlog.clear()
            self._backlog_labels = set()
        self.oldest_eligible_age.set(0)
