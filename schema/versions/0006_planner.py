"""The planner's estimate of how many messages a hint holds (PostgreSQL).

The DDL is in ``schema/ddl/0006_<dialect>.sql``.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

from worker.migrations.sqlfiles import apply

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    apply(revision)


def downgrade() -> None:
    raise NotImplementedError("revision 0006 cannot be undone; restore a backup taken before the upgrade")
