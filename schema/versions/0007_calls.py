"""Calls in flight, one row per call (correlation_call); SQLite messages are all in slot 0.

The DDL is in ``schema/ddl/0007_<dialect>.sql``.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

from worker.migrations.sqlfiles import apply

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    apply(revision)


def downgrade() -> None:
    raise NotImplementedError("revision 0007 cannot be undone; restore a backup taken before the upgrade")
