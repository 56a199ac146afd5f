"""What each replica routes and the settings it runs with (``correlation_replica``).

The DDL is in ``schema/ddl/0017_<dialect>.sql``.

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

from worker.migrations.sqlfiles import apply

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    apply(revision)


def downgrade() -> None:
    raise NotImplementedError("revision 0017 cannot be undone; restore a backup taken before the upgrade")
