"""A delivery record's name and hint are not checked again at its update (PostgreSQL).

The DDL is in ``schema/ddl/0011_<dialect>.sql`` (SQLite: none).

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

from worker.migrations.sqlfiles import apply

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    apply(revision)


def downgrade() -> None:
    raise NotImplementedError("revision 0011 cannot be undone; restore a backup taken before the upgrade")
