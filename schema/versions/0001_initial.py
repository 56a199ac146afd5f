"""Initial schema: correlation_message and correlation_lock.

The DDL itself is in ``schema/ddl/0001_<dialect>.sql`` so that it can be read as documentation.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

from alembic import op
from worker.migrations.sqlfiles import apply

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    apply(revision)


def downgrade() -> None:
    op.execute("DROP TABLE correlation_lock")
    op.execute("DROP TABLE correlation_message")
