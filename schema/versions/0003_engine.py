"""The engine's schema: lost and crashed calls, durable pauses, the commit-order horizon, wake-ups, limits.

The DDL is in ``schema/ddl/0003_<dialect>.sql``.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from worker.migrations.sqlfiles import apply

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    apply(revision)


def downgrade() -> None:
    raise NotImplementedError("revision 0003 cannot be undone; restore a backup taken before the upgrade")
