"""Samples behind the console's charts (correlation_sample).

The DDL is in ``schema/ddl/0009_<dialect>.sql``.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

from worker.migrations.sqlfiles import apply

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    apply(revision)


def downgrade() -> None:
    raise NotImplementedError("revision 0009 cannot be undone; restore a backup taken before the upgrade")
