"""Initial schema: correlation_message and correlation_lock.

The DDL itself is in ``schema/ddl/0001_<dialect>.sql`` so that it can be read as documentation.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

from importlib import resources

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _statements(dialect: str) -> list[str]:
    text = (resources.files("worker.migrations") / "ddl" / f"0001_{dialect}.sql").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("--")]
    return [stmt.strip() for stmt in "\n".join(lines).split(";") if stmt.strip()]


def upgrade() -> None:
    for statement in _statements(op.get_bind().dialect.name):
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TABLE correlation_lock")
    op.execute("DROP TABLE correlation_message")
