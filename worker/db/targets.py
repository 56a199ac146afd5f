"""The network targets' states as each replica sees them (``correlation_target``, schema revision 0014).

A replica replaces its own rows when a state changes and refreshes them now and then (``seen_at``); readers take
the fresh rows only, so a replica that died without deleting its rows drops out of the picture on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, insert, select
from sqlalchemy.engine import Connection

from worker.db.base import StoreBase
from worker.db.schema import target_table

# A replica refreshes its rows every 30 s at least: rows older than this are a dead replica's.
FRESH = timedelta(seconds=90)


@dataclass(frozen=True, slots=True)
class TargetRow:
    """One destination as one replica sees it."""

    replica: str
    target: str
    circuit: str  # closed, open, half_open
    reason: str  # why it is open
    concurrency_limit: int
    in_flight: int
    since: datetime | None = None  # written by the store (the database's clock)
    seen_at: datetime | None = None


class TargetStatements(StoreBase):
    """Writing and reading the targets' states."""

    def targets_record(self, replica: str, rows: Sequence[TargetRow]) -> None:
        """Replace this replica's rows with ``rows``; a target whose circuit did not change keeps its ``since``."""

        def work(connection: Connection) -> None:
            now = self._now(connection)
            c = target_table.c
            before = {
                (target, circuit): since for target, circuit, since in connection.execute(
                    select(c.target, c.circuit, c.since).where(c.replica == replica)
                )
            }
            connection.execute(delete(target_table).where(c.replica == replica))
            if rows:
                connection.execute(insert(target_table), [
                    {"replica": replica, "target": row.target, "circuit": row.circuit, "reason": row.reason,
                     "concurrency_limit": row.concurrency_limit, "in_flight": row.in_flight,
                     "since": before.get((row.target, row.circuit), now), "seen_at": now}
                    for row in rows
                ])

        self._write(work)

    def targets_read(self, fresh: timedelta = FRESH) -> list[TargetRow]:
        """The rows written within ``fresh`` of now, by target and replica."""

        def work(connection: Connection) -> list[TargetRow]:
            now = self._now(connection)
            c = target_table.c
            statement = select(target_table).where(c.seen_at >= now - fresh).order_by(c.target, c.replica)
            return [
                TargetRow(row.replica, row.target, row.circuit, row.reason, row.concurrency_limit, row.in_flight,
                          row.since, row.seen_at)
                for row in connection.execute(statement)
            ]

        return self._run(work)
