"""Cleanup: removes expired messages in bounded chunks. Run by one replica at a time."""

from __future__ import annotations

from dataclasses import dataclass

from worker.config import CleanupSettings
from worker.db.store import Store
from worker.service.metrics import Metrics


@dataclass(frozen=True, slots=True)
class CleanupResult:
    """What one cleanup run removed."""

    expired_removed: int
    chunks: int


class Cleanup:
    """Deletes expired messages, ``chunk_size`` rows per statement, until none is left."""

    def __init__(self, store: Store, settings: CleanupSettings, metrics: Metrics | None = None) -> None:
        self.store = store
        self.chunk_size = settings.chunk_size
        self.metrics = metrics or Metrics()

    def run_once(self, max_chunks: int = 1000) -> CleanupResult:
        """Remove expired messages (at most ``max_chunks`` chunks, so one run stays bounded)."""
        removed = chunks = 0
        now = self.store.now()
        while chunks < max_chunks:
            deleted = self.store.messages_delete_expired(now=now, limit=self.chunk_size)
            chunks += 1
            removed += deleted
            self.metrics.cleanup_removed.inc(deleted)
            if deleted < self.chunk_size:
                break
        return CleanupResult(removed, chunks)
