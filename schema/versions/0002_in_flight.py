"""Remember, per slot lease, which messages were handed to a correlator and not yet recorded.

A replica that takes over a slot whose previous holder died reads them and counts their redelivery.
The DDL is in ``schema/ddl/0002_<dialect>.sql``.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from alembic import op
from worker.migrations.sqlfiles import apply

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    apply(revision)


def downgrade() -> None:
    op.execute("ALTER TABLE correlation_lock DROP COLUMN in_flight")
