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

from sqlalchemy.engine import Connection, Engine

from worker.config import DatabaseSettings
from worker.db.base import Fence, LockRow, MessageFilter, NewMessage, StateCounts, build_engine, normalise_url
from worker.db.calls import CallStatements
from worker.db.console import ConsoleStatements
from worker.db.errors import (
    AuthenticationFailed,
    DatabaseAccessDenied,
    DatabaseBusy,
    DatabaseUnavailable,
    DatabaseUnsuitable,
    InvalidLockName,
    LeaseLost,
    MessageRejected,
    PermissionDenied,
    SchemaIncomplete,
    SchemaTooNew,
    StoreError,
    ValueRefused,
)
from worker.db.fetch import FetchStatements
from worker.db.locks import HOLDER_MAX_LENGTH, LockStatements
from worker.db.messages import MessageStatements
from worker.db.replicas import ReplicaStatements
from worker.db.samples import SampleStatements
from worker.db.schedules import ScheduleStatements
from worker.db.schedules import metadata as schedule_metadata
from worker.db.schema import SLOT_COUNT, head_revision, metadata, table_columns
from worker.db.targets import TargetStatements

# Tables the statements name in SQL text rather than as Table objects, with the columns they use.
_TEXT_TABLES = {"correlation_session_end": ("nonce_digest", "expires_at")}


class Store(
    ConsoleStatements, MessageStatements, FetchStatements, CallStatements, LockStatements, ScheduleStatements,
    SampleStatements, TargetStatements, ReplicaStatements,
):
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

    def schema_missing(self) -> list[str]:
        """The tables and columns of the schema this version uses that the database lacks (``table x``,
        ``column x.y``); [] when all are there. A revision recorded as current says nothing about tables dropped or
        altered by hand since; this looks at the tables themselves."""
        expected: dict[str, tuple[str, ...]] = {
            table.name: tuple(column.name for column in table.columns)
            for table in (*metadata.tables.values(), *schedule_metadata.tables.values())
        }
        expected.update(_TEXT_TABLES)

        def work(connection: Connection) -> list[str]:
            present = table_columns(connection, expected)  # one read of the catalog, every table's columns
            missing: list[str] = []
            for table, columns in sorted(expected.items()):
                if table not in present:
                    missing.append(f"table {table}")
                    continue
                missing.extend(f"column {table}.{column}" for column in columns if column not in present[table])
            return missing

        return self._run(work)

    def schema_check_complete(self) -> None:
        """Raise :class:`SchemaIncomplete` naming what is missing when the database is at the newest revision but
        lacks tables or columns of it."""
        missing = self.schema_missing()
        if missing and self.schema_revision() == head_revision():
            raise SchemaIncomplete(
                f"the database schema is recorded at revision {head_revision()} but lacks {', '.join(missing)} "
                "(dropped or altered by hand): `correlation-worker migrate` does not recreate them; restore the "
                "database from a backup, or drop every correlation_* table with correlation_schema_version and run "
                "`correlation-worker migrate` on the empty database"
            )


__all__ = [
    "HOLDER_MAX_LENGTH",
    "AuthenticationFailed",
    "DatabaseAccessDenied",
    "DatabaseBusy",
    "DatabaseUnavailable",
    "DatabaseUnsuitable",
    "Fence",
    "InvalidLockName",
    "LeaseLost",
    "LockRow",
    "MessageFilter",
    "MessageRejected",
    "NewMessage",
    "PermissionDenied",
    "SchemaIncomplete",
    "SchemaTooNew",
    "StateCounts",
    "Store",
    "StoreError",
    "ValueRefused",
    "build_engine",
    "normalise_url",
]
