"""Reads the DDL of a revision for the database at hand from ``schema/ddl/<revision>_<dialect>.sql``."""

from __future__ import annotations

from importlib import resources

from alembic import op


def statements(revision: str, dialect: str) -> list[str]:
    """The statements of one DDL file, comments dropped, split on semicolons."""
    text = (resources.files("worker.migrations") / "ddl" / f"{revision}_{dialect}.sql").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("--")]
    return [statement.strip() for statement in "\n".join(lines).split(";") if statement.strip()]


def apply(revision: str) -> None:
    """Run a revision's DDL for the database the migration is connected to."""
    for statement in statements(revision, op.get_bind().dialect.name):
        op.execute(statement)
