"""The delivery record and the deduplication window (correlation_message's 'delivered' rows).

The DDL is in ``schema/ddl/0010_<dialect>.sql``. On SQLite the state rule, a CHECK constraint, gains
'delivered' here: SQLite cannot alter a constraint, and a rule that admits more values leaves every stored row
valid, so the table's definition is rewritten in place (SQLite's documented procedure for such changes:
``writable_schema``, then the schema version incremented so every connection reads the new definition).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text
from worker.migrations.sqlfiles import apply

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_OLD_RULE = "CHECK (state IN ('ready', 'paused', 'dead'))"
_NEW_RULE = "CHECK (state IN ('ready', 'paused', 'dead', 'delivered'))"


def upgrade() -> None:
    apply(revision)
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        return
    definition = bind.execute(
        text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'correlation_message'")
    ).scalar_one()
    if _OLD_RULE not in definition:
        raise RuntimeError("revision 0010: correlation_message's state rule is not the one revision 0003 wrote")
    version = int(bind.execute(text("PRAGMA schema_version")).scalar_one())
    bind.execute(text("PRAGMA writable_schema = ON"))
    bind.execute(
        text("UPDATE sqlite_master SET sql = :sql WHERE type = 'table' AND name = 'correlation_message'"),
        {"sql": definition.replace(_OLD_RULE, _NEW_RULE)},
    )
    bind.execute(text(f"PRAGMA schema_version = {version + 1}"))
    bind.execute(text("PRAGMA writable_schema = OFF"))


def downgrade() -> None:
    raise NotImplementedError("revision 0010 cannot be undone; restore a backup taken before the upgrade")
