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
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence

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
from prometheus_client.core import HistogramMetricFamily, Metric

from worker import __version__
from worker.db.errors import (
    DatabaseAccessDenied,
    DatabaseBusy,
    DatabaseReadOnly,
    DatabaseUnavailable,
    PermissionDenied,
    SchemaIncomplete,
)

DATABASE_ERROR_KINDS = ("unavailable", "timeout", "refused", "read_only", "schema", "other")

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
        self.call_duration = CallDurations(r, self._call_names)
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
        self.target_auth_failures = Counter(
            "correlation_target_auth_failures",
            "Correlator calls the target refused for the worker's credentials (HTTP 401 or 403), by message "
            "name: each is retried; alert on any increase.",
            ["message_name"],
            registry=r,
        )
        # Network targets, labelled by destination (a route's URL or engine address: set by configuration).
        self.target_open = Gauge(
            "correlation_target_open",
            "1 while the circuit of a network target is open or half-open (no call goes there but a probe).",
            ["target"], registry=r,
        )
        self.target_transitions = Counter(
            "correlation_target_transitions",
            "Times a network target's circuit changed, by the state it went to (open, half_open, closed).",
            ["target", "state"], registry=r,
        )
        self.target_answers = Counter(
            "correlation_target_answers",
            "Answers of network targets by what they said of the target: success, message (the message's own "
            "failure), failure (a timeout or 5xx, charged), unavailable (refused, reset, 502/503/504: not charged), "
            "busy (429, RESOURCE_EXHAUSTED: not charged).",
            ["target", "answer"], registry=r,
        )
        self.target_held = Counter(
            "correlation_target_held",
            "Calls held back because of their target, no attempt charged: open (its circuit is open), busy or "
            "unavailable (it refused the call; the message is due again at its Retry-After).",
            ["target", "reason"], registry=r,
        )
        self.target_limit = Gauge(
            "correlation_target_concurrency_limit",
            "Calls a network target may have in flight from this replica now (lowered by back-pressure).",
            ["target"], registry=r,
        )
        self.replicas_routing_differently = Gauge(
            "correlation_replicas_routing_differently",
            "Live replicas whose routes differ from this replica's: messages of the names they route differently "
            "wait, uncharged, until the replicas agree.",
            registry=r,
        )
        self.route_holds = Counter(
            "correlation_route_holds",
            "Calls held back because the live replicas route their message name differently (no attempt charged).",
            registry=r,
        )
        self.settings_differing = Gauge(
            "correlation_cluster_settings_differing",
            "Cluster-wide settings (delivery retention, leases, policies, ...) another live replica runs with a "
            "different value.",
            registry=r,
        )
        self.batch_duration = Histogram(
            "correlation_batch_duration_seconds",
            "Time to correlate one batch (the messages of one hint taken in one page).",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.fetch_duration = Histogram(
            "correlation_fetch_duration_seconds",
            "Time to read one slot's candidate hints and their batches.",
            buckets=POLL_BUCKETS,
            registry=r,
        )
        self.busy_lanes = Gauge(
            "correlation_busy_lanes", "Correlator calls running now (at most poll.concurrency).", registry=r
        )
        self.handler_timeouts = Counter(
            "correlation_handler_timeouts",
            "Correlator calls that did not return within their handler timeout, by message name (each charged as "
            "a failed attempt).",
            ["message_name"],
            registry=r,
        )
        self.slot_progress_age = Gauge(
            "correlation_slot_progress_age_seconds",
            "Seconds since the held slot that has waited longest last drained or gave out work.",
            registry=r,
        )
        self.stalled_slots = Gauge(
            "correlation_stalled_slots",
            "Held slots that neither drained nor gave out work for longer than max(60 s, 3 poll intervals).",
            registry=r,
        )
        self.hung_calls = Gauge(
            "correlation_hung_calls",
            "Correlator calls given up on after their handler timeout that have not returned yet.",
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
        self.record_failures = Counter(
            "correlation_record_failures",
            "Flushes of outcomes and in-flight marks that failed and were retried (nothing is lost).",
            registry=r,
        )
        self.deferred_outcomes = Counter(
            "correlation_deferred_outcomes",
            "Outcomes not written at once because another session held their row locked (written later).",
            registry=r,
        )
        self.unrecordable = Counter(
            "correlation_unrecordable_outcomes",
            "Outcomes the database refused to store; their messages were made dead with the reason.",
            registry=r,
        )
        self.unreadable = Counter(
            "correlation_unreadable_messages",
            "Rows the worker could not read (e.g. a payload it cannot decode); made dead with the reason.",
            registry=r,
        )
        self.lost_calls = Counter(
            "correlation_lost_calls",
            "Calls found in flight when a slot was taken over (their replica died or lost its lease).",
            registry=r,
        )
        self.poison_messages = Counter(
            "correlation_poison_messages",
            "Messages made dead because their replica died during poison_after of their calls.",
            ["message_name"],
            registry=r,
        )
        self.order_waits = Counter(
            "correlation_order_waits",
            "Fetches that held messages back because a producer transaction with an earlier id was still open.",
            registry=r,
        )
        self.order_wait_timeouts = Counter(
            "correlation_order_wait_timeouts",
            "Producer transactions open longer than order.max_wait that stopped holding later messages back.",
            registry=r,
        )
        self.fetch_errors = Counter(
            "correlation_fetch_errors", "Fetches of a slot that failed (retried after a backoff).", registry=r
        )
        self.listener_up = Gauge(
            "correlation_listener_up",
            "1 while the wake-up listener is connected (PostgreSQL LISTEN or the SQLite watcher), else 0.",
            registry=r,
        )
        self.listener_reconnects = Counter(
            "correlation_listener_reconnects",
            "Times the wake-up listener reconnected (each followed by a re-scan of every slot).",
            registry=r,
        )
        self.database_errors = Counter(
            "correlation_database_errors",
            "Database operations that failed, by kind: unavailable (connection refused or lost), timeout (a lock "
            "or statement timeout, a deadlock), refused (a login or privilege refused), read_only (a write refused by "
            "a read-only database), schema (a table or column of the schema is gone), other.",
            ["kind"],
            registry=r,
        )
        for kind in DATABASE_ERROR_KINDS:
            self.database_errors.labels(kind)
        self.cleanup_removed = Counter(
            "correlation_cleanup_removed_messages", "Expired messages removed by cleanup.", registry=r
        )
        self.records_removed = Counter(
            "correlation_cleanup_removed_records",
            "Delivery records removed by cleanup once older than CORRELATION_DELIVERY__RETENTION.", registry=r,
        )
        # Schedules (DESIGN.md §7). Schedule names are operator-defined and few: a bounded label.
        self.schedule_fires = Counter(
            "correlation_schedule_fires",
            "Messages published by schedules' fire times on this replica, by schedule.",
            ["schedule"],
            registry=r,
        )
        self.schedule_singleton_skips = Counter(
            "correlation_schedule_singleton_skips",
            "Fire times skipped because the schedule's last message was still pending (singleton), by schedule.",
            ["schedule"],
            registry=r,
        )
        self.schedule_misfires = Counter(
            "correlation_schedule_misfires",
            "Missed fire times the schedule's misfire policy skipped, by schedule.",
            ["schedule"],
            registry=r,
        )
        self.scheduler_enabled = Gauge(
            "correlation_scheduler_enabled",
            "1 while the scheduler is switched on (the correlation_scheduler row), else 0.",
            registry=r,
        )
        self.schedule_next_fire = Gauge(
            "correlation_schedule_next_fire_timestamp_seconds",
            "The next fire time of each schedule that has one (Unix time), as this replica last saw it.",
            ["schedule"],
            registry=r,
        )
        self.schedules_invalid = Gauge(
            "correlation_schedules_invalid",
            "Schedules that cannot fire because their cron expression or time zone is invalid.",
            registry=r,
        )
        self.schedule_nonexistent_times = Counter(
            "correlation_schedule_nonexistent_times_total",
            "Fire times a schedule's expression allows that its time zone skips (clocks springing forward); "
            "skipped, as Quartz does.",
            ["schedule"],
            registry=r,
        )
        self.build_info = Info("correlation_build", "Version of correlation-worker.", registry=r)
        self.build_info.info({"version": __version__})

    def database_error(self, error: BaseException | None) -> None:
        """Count a failed database operation by its kind."""
        if isinstance(error, DatabaseBusy):
            kind = "timeout"
        elif isinstance(error, DatabaseUnavailable):
            kind = "unavailable"
        elif isinstance(error, DatabaseAccessDenied | PermissionDenied):
            kind = "refused"
        elif isinstance(error, DatabaseReadOnly):
            kind = "read_only"
        elif isinstance(error, SchemaIncomplete):
            kind = "schema"
        else:
            kind = "other"
        self.database_errors.labels(kind).inc()

    def observe_call(self, message_name: str, seconds: float) -> None:
        """Count one correlator call's duration under its (bounded) message name."""
        self.call_duration.observe_many(message_name, (seconds,))

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


class CallDurations:
    """``correlation_call_duration_seconds``: a histogram by message name, observed a run of calls at a time.

    A lane makes many short calls in a row; counting them per run instead of per call (two locked increments
    each, in the stock histogram) keeps the metric off the path of fast correlators.
    """

    NAME = "correlation_call_duration_seconds"

    def __init__(
        self, registry: CollectorRegistry, names: NameLabels, buckets: Sequence[float] = CALL_BUCKETS
    ) -> None:
        self._names = names
        self._bounds = [*buckets, float("inf")]
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = {}
        self._sums: dict[str, float] = {}
        registry.register(self)

    def observe_many(self, message_name: str, durations: Sequence[float]) -> None:
        """Count calls of one message name that took these many seconds."""
        local = [0] * len(self._bounds)
        for seconds in durations:
            local[bisect_left(self._bounds, seconds)] += 1
        label = self._names.label(message_name)
        with self._lock:
            counts = self._counts.setdefault(label, [0] * len(self._bounds))
            for index, count in enumerate(local):
                if count:
                    counts[index] += count
            self._sums[label] = self._sums.get(label, 0.0) + sum(durations)

    def collect(self) -> Iterator[Metric]:
        """The histogram as Prometheus exposes it (cumulative buckets, sum and count per message name)."""
        family = HistogramMetricFamily(
            self.NAME,
            f"Time of one correlator call by message name (at most {NAME_LABELS} names, the rest as 'other').",
            labels=["message_name"],
        )
        with self._lock:
            snapshot = {name: (list(counts), self._sums[name]) for name, counts in self._counts.items()}
        for name, (counts, total) in sorted(snapshot.items()):
            cumulative, buckets = 0, []
            for bound, count in zip(self._bounds, counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
            family.add_metric([name], buckets, total)
        yield family

