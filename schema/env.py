"""Alembic environment: runs the migrations on the connection the worker hands over (or on the URL)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

config = context.config


def run_migrations_online() -> None:
    """Run the migrations on ``config.attributes['connection']``, else on ``sqlalchemy.url``."""
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, version_table="correlation_schema_version")
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
    with engine.connect() as conn:
        context.configure(connection=conn, version_table="correlation_schema_version")
        with context.begin_transaction():
            context.run_migrations()


def run_migrations_offline() -> None:
    """Print the migrations as SQL (``alembic upgrade --sql``)."""
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        version_table="correlation_schema_version",
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
