"""The console: the audit table, and indexes for its filtered pages.

The DDL is in ``schema/ddl/0005_<dialect>.sql``.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from worker.migrations.sqlfiles import apply

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    apply(revision)


def downgrade() -> None:
    raise NotImplementedError("revision 0005 cannot be undone; restore a backup taken before the upgrade")
