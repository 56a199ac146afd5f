"""Schedules: correlation_schedule (Quartz cron that publishes messages) and correlation_scheduler (the switch).

The DDL is in ``schema/ddl/0004_<dialect>.sql``.

Revision ID: 0004
Revises: 0002
"""

from __future__ import annotations

from alembic import op
from worker.migrations.sqlfiles import apply

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    apply(revision)


def downgrade() -> None:
    op.execute("DROP TABLE correlation_scheduler")
    op.execute("DROP TABLE correlation_schedule")
