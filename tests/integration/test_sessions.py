"""The sessions the worker opens against real PostgreSQL: what they set over the database's and role's settings,
and what the first login of a process learns of the server."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from worker.config import DatabaseSettings
from worker.db.base import _LATER_SESSION_SETTINGS, SESSION_SETTINGS, PostgresLogin, build_engine
from worker.db.store import Store

# Each setting the worker sets, with a value of the database's that differs from the worker's.
DATABASE_VALUES = {
    "timezone": "'Pacific/Chatham'",
    "datestyle": "'German'",
    "intervalstyle": "'sql_standard'",
    "standard_conforming_strings": "off",
    "array_nulls": "off",
    "transform_null_equals": "on",
    "extra_float_digits": "-15",
    "bytea_output": "'escape'",
    "exit_on_error": "on",
    "default_transaction_isolation": "'serializable'",
    "idle_in_transaction_session_timeout": "'1ms'",
    "idle_session_timeout": "'1ms'",
    "statement_timeout": "'1ms'",
    "lock_timeout": "'1ms'",
    "client_encoding": "'LATIN1'",
}


def _conninfo(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _show(store: Store, name: str) -> str:
    return str(store._run(lambda c: c.execute(text(f"SELECT current_setting('{name}')")).scalar_one()))


def test_every_setting_the_worker_sets_is_one_the_database_may_set_otherwise() -> None:
    later = {name for name, _, _ in _LATER_SESSION_SETTINGS if name != "transaction_timeout"}  # 17 and later
    assert {name for name, _ in SESSION_SETTINGS} | later | {"statement_timeout", "lock_timeout",
                                                             "client_encoding"} == set(DATABASE_VALUES)


@pytest.mark.parametrize("name", DATABASE_VALUES)
def test_each_session_sets_what_the_worker_depends_on_over_the_databases_setting(pg_url: str, name: str) -> None:
    settings = DatabaseSettings(url=pg_url)
    expected = dict(SESSION_SETTINGS) | {later: value for later, value, _ in _LATER_SESSION_SETTINGS} | {
        "statement_timeout": f"{int(settings.statement_timeout.total_seconds() * 1000)}ms",
        "lock_timeout": f"{int(settings.lock_timeout.total_seconds() * 1000)}ms",
        "client_encoding": "UTF8",
    }
    with psycopg.connect(_conninfo(pg_url), autocommit=True) as admin:
        database = admin.execute("SELECT current_database()").fetchone()
        assert database is not None
        admin.execute(f'ALTER DATABASE "{database[0]}" SET {name} = {DATABASE_VALUES[name]}')
        # Both values as the server spells them, in the session opened before (ALTER DATABASE passes it by).
        theirs = admin.execute("SELECT set_config(%s, %s, true)", (name, DATABASE_VALUES[name].strip("'"))).fetchone()
        wanted = admin.execute("SELECT set_config(%s, %s, true)", (name, expected[name])).fetchone()
    assert theirs is not None and wanted is not None and theirs != wanted
    store = Store(build_engine(settings))
    try:
        assert _show(store, name) == wanted[0]
    finally:
        store.close()


def test_a_login_refused_for_a_setting_the_server_does_not_know_is_made_again_without_it(pg_url: str) -> None:
    """The first login of a process learns the server's release; a later one to an older server (a failover)
    that refuses a setting of a later release logs in again without it, and learns the release again."""
    login = PostgresLogin(DatabaseSettings(url=pg_url))
    conninfo = _conninfo(pg_url)
    first = login.connect(lambda options: psycopg.connect(conninfo, autocommit=True, options=options))
    with first:
        release = first.info.server_version
    assert login.server_version == release
    login.server_version = 999999  # as if a newer release had answered before
    again = login.connect(lambda options: psycopg.connect(conninfo, autocommit=True, options=options))
    with again:
        assert again.execute("SELECT current_setting('datestyle')").fetchone() == ("ISO, MDY",)
    assert login.server_version == release
