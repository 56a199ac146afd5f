"""The console's indexes of live messages are partial on ``finished_at IS NULL`` (PostgreSQL).

Out of the engine's reach: see ``schema/ddl/0013_postgresql.sql``.

The DDL is in ``schema/ddl/0013_<dialect>.sql`` (SQLite: none).

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

from worker.migrations.sqlfiles import apply

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    apply(revision)


def downgrade() -> None:
    raise NotImplementedError("revision 0013 cannot be undone; restore a backup taken before the upgrade")
