"""The network targets' states as each replica sees them (``correlation_target``).

The DDL is in ``schema/ddl/0014_<dialect>.sql``.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

from worker.migrations.sqlfiles import apply

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    apply(revision)


def downgrade() -> None:
    raise NotImplementedError("revision 0014 cannot be undone; restore a backup taken before the upgrade")
