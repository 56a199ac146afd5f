"""A message's hint stays as it is while it is being called.

The DDL is in ``schema/ddl/0015_<dialect>.sql``.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

from worker.migrations.sqlfiles import apply

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    apply(revision)


def downgrade() -> None:
    raise NotImplementedError("revision 0015 cannot be undone; restore a backup taken before the upgrade")
