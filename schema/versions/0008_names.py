"""Names that read as they match: no blank at either end of a name, no control or invisible formatting character.

The DDL is in ``schema/ddl/0008_<dialect>.sql``.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from worker.migrations.sqlfiles import apply

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    apply(revision)


def downgrade() -> None:
    raise NotImplementedError("revision 0008 cannot be undone; restore a backup taken before the upgrade")
