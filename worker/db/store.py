"""The one seam to the database: :class:`Store` puts every table's statements together.

Methods read noun-then-verb (``messages_fetch_batches``, ``lock_try_acquire``) and return the project's own
frozen values, never driver rows. The statements live by concern: :mod:`worker.db.messages` (messages, for
producers and operators), :mod:`worker.db.fetch` (the engine's reads of a slot's work and the durable pauses),
:mod:`worker.db.calls` (calls in flight and their outcomes), :mod:`worker.db.locks` (leases and named locks),
:mod:`worker.db.schedules` (schedules and the scheduler's switch) and :mod:`worker.db.console` (the console's
paged reads, bounded counts, bulk actions, pauses and audit); rows become messages in :mod:`worker.db.rows`; the
plumbing, the clock and the translation of driver errors are in :mod:`worker.db.base` and
:mod:`worker.db.errors`.
"""

from __future__ import annotations

from sqlalchemy.engine import Engine

from worker.config import DatabaseSettings
from worker.db.base import Fence, LockRow, MessageFilter, NewMessage, StateCounts, build_engine, normalise_url
from worker.db.calls import CallStatements
from worker.db.console import ConsoleStatements
from worker.db.errors import (
    AuthenticationFailed,
    DatabaseAccessDenied,
    DatabaseBusy,
    DatabaseUnavailable,
    InvalidLockName,
    LeaseLost,
    MessageRejected,
    PermissionDenied,
    SchemaTooNew,
    StoreError,
    ValueRefused,
)
from worker.db.fetch import FetchStatements
from worker.db.locks import HOLDER_MAX_LENGTH, LockStatements
from worker.db.messages import MessageStatements
from worker.db.schedules import ScheduleStatements
from worker.db.schema import SLOT_COUNT


class Store(ConsoleStatements, MessageStatements, FetchStatements, CallStatements, LockStatements, ScheduleStatements):
    """Every statement correlation-worker runs, on one engine."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)

    @classmethod
    def from_settings(cls, settings: DatabaseSettings) -> Store:
        """A store on a new engine for these settings."""
        return cls(build_engine(settings))

    @property
    def slot_count(self) -> int:
        """How many slots hints are spread over (one on SQLite: one process at a time works on the file)."""
        return SLOT_COUNT if self.dialect == "postgresql" else 1


__all__ = [
    "HOLDER_MAX_LENGTH",
    "AuthenticationFailed",
    "DatabaseAccessDenied",
    "DatabaseBusy",
    "DatabaseUnavailable",
    "Fence",
    "InvalidLockName",
    "LeaseLost",
    "LockRow",
    "MessageFilter",
    "MessageRejected",
    "NewMessage",
    "PermissionDenied",
    "SchemaTooNew",
    "StateCounts",
    "Store",
    "StoreError",
    "ValueRefused",
    "build_engine",
    "normalise_url",
]
