"""What each replica routes and the settings it runs with (``correlation_replica``, schema revision 0017).

A replica replaces its row every lease renewal and deletes it when it stops; readers take the rows seen within a
lease term, so a replica that died without deleting its row drops out of the picture once its leases would have.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, insert, select
from sqlalchemy.engine import Connection

from worker.db.base import StoreBase
from worker.db.schema import replica_table


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    """One replica's routes (route key -> digest) and cluster-wide settings (name -> value)."""

    replica: str
    routes: Mapping[str, str]
    settings: Mapping[str, str]
    seen_at: datetime | None = None


class ReplicaStatements(StoreBase):
    """Writing and reading the replicas' routes and settings."""

    def replicas_record(self, row: ReplicaRow) -> None:
        """Replace this replica's row, seen now by the database's clock."""

        def work(connection: Connection) -> None:
            c = replica_table.c
            connection.execute(delete(replica_table).where(c.replica == row.replica))
            connection.execute(insert(replica_table), {
                "replica": row.replica, "routes": json.dumps(dict(row.routes), sort_keys=True),
                "settings": json.dumps(dict(row.settings), sort_keys=True), "seen_at": self._now(connection),
            })

        self._write(work)

    def replicas_read(self, fresh: timedelta) -> list[ReplicaRow]:
        """The rows written within ``fresh`` of now, by replica; a row whose JSON does not read counts as routing
        nothing and running with no setting (it differs from every replica that routes)."""

        def work(connection: Connection) -> list[ReplicaRow]:
            c = replica_table.c
            statement = select(replica_table).where(c.seen_at >= self._now(connection) - fresh).order_by(c.replica)
            return [
                ReplicaRow(row.replica, _object(row.routes), _object(row.settings), row.seen_at)
                for row in connection.execute(statement)
            ]

        return self._run(work)

    def replicas_forget(self, replica: str) -> None:
        """Delete this replica's row (it stops)."""
        self._write(lambda connection: connection.execute(
            delete(replica_table).where(replica_table.c.replica == replica)
        ))


def _object(document: str) -> dict[str, str]:
    try:
        value = json.loads(document)
    except ValueError:
        return {}
    return {str(key): str(item) for key, item in value.items()} if isinstance(value, dict) else {}
