"""The table census behind the state gauges: messages by state and the oldest eligible message's age.

It reads the whole table's counts, so in a cluster one replica at a time runs it (through a named lock) and the
others leave their gauges unset rather than scrape the same numbers from every pod.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.config import Mode
from worker.db.store import StateCounts, Store
from worker.service.metrics import Metrics


@dataclass(frozen=True, slots=True)
class GaugesResult:
    """The counts the gauges were set to."""

    counts: StateCounts


class Gauges:
    """Sets ``correlation_messages_by_state`` and ``correlation_oldest_eligible_message_age_seconds``."""

    def __init__(self, store: Store, metrics: Metrics, mode: Mode = Mode.FAIL_FIRST) -> None:
        self.store = store
        self.metrics = metrics
        self.mode = mode

    def run_once(self) -> GaugesResult:
        """Count once and set the gauges."""
        oldest = self.store.messages_oldest_eligible(range(self.store.slot_count), self.mode)
        counts = self.store.messages_count_by_state(oldest)
        for state in ("ready", "waiting", "paused", "dead", "expired"):
            self.metrics.messages_by_state.labels(state).set(getattr(counts, state))
        age = counts.oldest_eligible_age
        self.metrics.oldest_eligible_age.set(0 if age is None else age.total_seconds())
        return GaugesResult(counts)
