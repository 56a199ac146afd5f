"""The samples behind the console's charts (``correlation_sample``, schema revision 0009).

Every replica writes its own cumulative call counts by outcome once per gauges interval; the census holder adds
the table's census to its row. Reads return the rows of a time window in time order; old rows leave in chunks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, insert, select, tuple_
from sqlalchemy.engine import Connection

from worker.db.base import StateCounts, StoreBase
from worker.db.schema import sample_table

OUTCOMES = ("success", "retry", "buffered", "rescheduled", "dead")


@dataclass(frozen=True, slots=True)
class SampleRow:
    """One row: a replica's counts at a moment, and the census if that replica held the census lock."""

    taken_at: datetime
    replica: str
    calls: Mapping[str, int]  # by outcome, cumulative since the replica started
    inserted_total: int | None = None
    backlog: Mapping[str, int] | None = None  # ready, waiting, paused, dead, expired
    oldest_eligible_seconds: float | None = None


class SampleStatements(StoreBase):
    """Writing, reading and pruning samples."""

    def samples_record(
        self, replica: str, calls: Mapping[str, int], census: StateCounts | None = None,
        inserted_total: int | None = None,
    ) -> datetime:
        """Write this replica's row now (database clock); returns its time."""

        def work(connection: Connection) -> datetime:
            now = self._now(connection)
            values: dict[str, object] = {"taken_at": now, "replica": replica}
            values.update({outcome: int(calls.get(outcome, 0)) for outcome in OUTCOMES})
            if census is not None:
                age = census.oldest_eligible_age
                values.update(
                    inserted_total=inserted_total, ready=census.ready, waiting=census.waiting, paused=census.paused,
                    dead_messages=census.dead, expired=census.expired,
                    oldest_eligible_seconds=None if age is None else age.total_seconds(),
                )
            connection.execute(insert(sample_table).values(**values))
            return now

        return self._write(work)

    def samples_read(self, since: timedelta) -> tuple[datetime, list[SampleRow]]:
        """The database time now and the rows of the last ``since``, oldest first."""

        def work(connection: Connection) -> tuple[datetime, list[SampleRow]]:
            now = self._now(connection)
            c = sample_table.c
            rows = connection.execute(
                select(sample_table).where(c.taken_at >= now - since).order_by(c.taken_at, c.replica)
            ).mappings()
            return now, [_row(row) for row in rows]

        return self._run(work)

    def samples_prune(self, older_than: timedelta, chunk: int = 1000) -> int:
        """Remove rows older than ``older_than`` (at most ``chunk`` of them); how many left."""

        def work(connection: Connection) -> int:
            c = sample_table.c
            cutoff = self._now(connection) - older_than
            oldest = (
                select(c.taken_at, c.replica).where(c.taken_at < cutoff).order_by(c.taken_at).limit(chunk).subquery()
            )
            # By the whole key: rows of several replicas may share a moment (SQLite keeps milliseconds).
            statement = delete(sample_table).where(
                tuple_(c.taken_at, c.replica).in_(select(oldest.c.taken_at, oldest.c.replica))
            )
            return int(connection.execute(statement).rowcount or 0)

        return self._write(work)


def _row(row: Mapping[Any, Any]) -> SampleRow:
    census = row["inserted_total"] is not None or row["ready"] is not None
    backlog = None
    if census:
        backlog = {
            "ready": _int(row["ready"]), "waiting": _int(row["waiting"]), "paused": _int(row["paused"]),
            "dead": _int(row["dead_messages"]), "expired": _int(row["expired"]),
        }
    oldest = row["oldest_eligible_seconds"]
    return SampleRow(
        taken_at=row["taken_at"],
        replica=str(row["replica"]),
        calls={outcome: _int(row[outcome]) for outcome in OUTCOMES},
        inserted_total=None if row["inserted_total"] is None else _int(row["inserted_total"]),
        backlog=backlog,
        oldest_eligible_seconds=None if oldest is None else float(oldest),
    )


def _int(value: object) -> int:
    return int(value) if value is not None else 0  # type: ignore[call-overload]
