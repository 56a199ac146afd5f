"""One rule for printable names and hints (Unicode's categories, NFC, White_Space), records that cannot be finished
in the future, and SQLite's type errors named by their column.

The DDL is in ``schema/ddl/0016_<dialect>.sql``.

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

from worker.migrations.sqlfiles import apply

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    apply(revision)


def downgrade() -> None:
    raise NotImplementedError("revision 0016 cannot be undone; restore a backup taken before the upgrade")
