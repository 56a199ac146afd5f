"""The table census behind the state gauges: messages by state (also by message name, the largest names and
``other``) and the oldest eligible message's age.

It reads the whole table's counts, so in a cluster one replica at a time runs it (through a named lock) and the
others leave their gauges unset rather than scrape the same numbers from every pod.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.config import Mode
from worker.db.store import StateCounts, Store
from worker.service.metrics import BACKLOG_STATES, Metrics, top_names


@dataclass(frozen=True, slots=True)
class GaugesResult:
    """The counts the gauges were set to."""

    counts: StateCounts
    by_name: dict[tuple[str, str], int]


class Gauges:
    """Sets ``correlation_messages_by_state``, ``correlation_backlog_messages`` and
    ``correlation_oldest_eligible_message_age_seconds``."""

    def __init__(self, store: Store, metrics: Metrics, mode: Mode = Mode.FAIL_FIRST) -> None:
        self.store = store
        self.metrics = metrics
        self.mode = mode

    def run_once(self) -> GaugesResult:
        """Count once and set the gauges."""
        oldest = self.store.messages_oldest_eligible(range(self.store.slot_count), self.mode)
        counts = self.store.messages_count_by_state(oldest)
        by_name = top_names(self.store.messages_count_by_name_and_state())
        for state in BACKLOG_STATES:
            self.metrics.messages_by_state.labels(state).set(getattr(counts, state))
        self.metrics.set_backlog(by_name.items())
        age = counts.oldest_eligible_age
        self.metrics.oldest_eligible_age.set(0 if age is None else age.total_seconds())
        return GaugesResult(counts, by_name)

    def clear(self) -> None:
        """Export nothing: another replica holds the census lock and reports the table."""
        self.metrics.clear_census()
