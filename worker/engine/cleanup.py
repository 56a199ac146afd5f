"""Cleanup: removes expired messages and delivery records past their retention, in bounded chunks. Run by one
replica at a time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from worker.config import CleanupSettings
from worker.db.store import Store
from worker.service.metrics import Metrics


@dataclass(frozen=True, slots=True)
class CleanupResult:
    """What one cleanup run removed."""

    expired_removed: int
    chunks: int
    records_removed: int = 0


class Cleanup:
    """Removes expired messages (each becomes its delivery record while records are kept), then deletes the
    records older than the retention, ``chunk_size`` rows per statement, until none is left."""

    def __init__(
        self,
        store: Store,
        settings: CleanupSettings,
        metrics: Metrics | None = None,
        retention: timedelta = timedelta(0),
    ) -> None:
        self.store = store
        self.chunk_size = settings.chunk_size
        self.metrics = metrics or Metrics()
        self.retention = retention

    def run_once(self, max_chunks: int = 1000) -> CleanupResult:
        """Remove expired messages and old records (at most ``max_chunks`` chunks of each, so one run stays
        bounded)."""
        now = self.store.now()
        removed, chunks = self._chunks(lambda: self.store.messages_delete_expired(now=now, limit=self.chunk_size),
                                       max_chunks)
        self.metrics.cleanup_removed.inc(removed)
        records = 0
        if self.retention > timedelta(0):
            before = now - self.retention
            records, more = self._chunks(
                lambda: self.store.messages_delete_records(before=before, limit=self.chunk_size), max_chunks
            )
            chunks += more
            self.metrics.records_removed.inc(records)
        return CleanupResult(removed, chunks, records)

    def _chunks(self, remove: Callable[[], int], max_chunks: int) -> tuple[int, int]:
        removed = chunks = 0
        while chunks < max_chunks:
            deleted = remove()
            chunks += 1
            removed += deleted
            if deleted < self.chunk_size:
                break
        return removed, chunks
