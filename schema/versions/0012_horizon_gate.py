"""The commit-order horizon reads the server's locks only when a producer transaction is registered (PostgreSQL).

The DDL is in ``schema/ddl/0012_<dialect>.sql`` (SQLite: none).

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

from worker.migrations.sqlfiles import apply

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    apply(revision)


def downgrade() -> None:
    raise NotImplementedError("revision 0012 cannot be undone; restore a backup taken before the upgrade")
