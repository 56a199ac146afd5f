"""Every metric correlation-worker exports, on an injected registry.

Names are ``correlation_*`` with unit suffixes and ``_total`` for counters. Labels are bounded: the message
name (configured by the operator's producers, a small set) and the outcome; never a hint or an id.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from worker import __version__

BATCH_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
POLL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics:
    """The metric objects; services count through this, the HTTP endpoint exposes the registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
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
        self.build_info = Info("correlation_build", "Version of correlation-worker.", registry=r)
        self.build_info.info({"version": __version__})
