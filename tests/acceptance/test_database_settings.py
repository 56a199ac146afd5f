"""A database or role with session settings of its own (ALTER DATABASE / ALTER ROLE ... SET): the worker sets what it
depends on in every session, and refuses with one line what no session can change (the database's encoding, a
search path that misses the tables another schema holds).

Real ``correlation-worker`` processes against databases altered as an operator would; waits are on conditions
with deadlines.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from harness import Database, PostgresDatabase, StartWorker, cli, wait_until, worker_env
from sqlalchemy.engine import make_url

import worker

# -- handlers the worker imports as test_database_settings:NAME ----------------------------------------------


def fails_once(message: worker.Message) -> None:
    """Fail the first attempt of a message without a time-to-live (a failure recorded, a retry due), succeed the
    next; a message with one must read it as it was sent (PT1H30M)."""
    if message.time_to_live is not None:
        if message.time_to_live != timedelta(hours=1, minutes=30):
            raise RuntimeError(f"time-to-live read as {message.time_to_live}")
    elif message.attempt == 0:
        raise RuntimeError(f"first attempt of {message.hint} refused on purpose")


# -- helpers ----------------------------------------------------------------------------------------------------


def http_get(url: str) -> tuple[int, str]:
    """The status and body of a GET (error statuses included)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode()


def alter_database(database: Database, setting: str) -> str:
    """``ALTER DATABASE <the test's> SET <setting>``: sessions opened from now on start with it. Its name."""
    name = str(database.execute("SELECT current_database() AS name")[0]["name"])
    database.execute(f'ALTER DATABASE "{name}" SET {setting}')
    return name


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The one error line of a command that refused (exit 2, no traceback); a run's log may hold lines before it."""
    assert result.returncode == 2, f"exit {result.returncode}: {result.stdout}{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("correlation-worker: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def run_to_exit(database: Database, **settings: str) -> subprocess.CompletedProcess[str]:
    """``run`` a worker that is expected to stop by itself (a startup error)."""
    return subprocess.run(
        [sys.executable, "-m", "worker", "run"], env=worker_env(database, **settings), stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=60, check=False,
    )


# -- session settings set per session -------------------------------------------------------------------------

# Each a setting a database or role may carry that would otherwise reach the worker's sessions: how dates,
# intervals, strings, arrays and floats read, its own time zone, and timeouts far below any statement's time.
SESSION_SETTINGS = {
    "DateStyle SQL, DMY": "DateStyle = 'SQL, DMY'",
    "DateStyle German": "DateStyle = 'German'",
    "DateStyle Postgres, YMD": "DateStyle = 'Postgres, YMD'",
    "IntervalStyle sql_standard": "IntervalStyle = 'sql_standard'",
    "IntervalStyle iso_8601": "IntervalStyle = 'iso_8601'",
    "IntervalStyle postgres_verbose": "IntervalStyle = 'postgres_verbose'",
    "TimeZone Pacific/Chatham": "TimeZone = 'Pacific/Chatham'",
    "standard_conforming_strings off": "standard_conforming_strings = off",
    "array_nulls off": "array_nulls = off",
    "extra_float_digits -15": "extra_float_digits = -15",
    "bytea_output escape": "bytea_output = 'escape'",
    "client_encoding LATIN1": "client_encoding = 'LATIN1'",
    "statement_timeout tiny": "statement_timeout = '1ms'",
    "lock_timeout tiny": "lock_timeout = '1ms'",
    "idle_in_transaction_session_timeout tiny": "idle_in_transaction_session_timeout = '1ms'",
    "idle_session_timeout tiny": "idle_session_timeout = '1ms'",
    "default_transaction_isolation serializable": "default_transaction_isolation = 'serializable'",
    "exit_on_error on": "exit_on_error = on",
}


@pytest.mark.parametrize("setting", SESSION_SETTINGS.values(), ids=SESSION_SETTINGS.keys())
def test_a_database_with_session_settings_of_its_own_correlates_as_any_other(
    pg_db: Database, start_worker: StartWorker, setting: str
) -> None:
    """Leases, fetches, a recorded failure and its retry, the gauges, the scheduler, the status command: none
    fails, none is counted as a database error, and the replica is ready."""
    alter_database(pg_db, setting)  # the test's own connection keeps its session as it began
    process = start_worker(
        pg_db, correlators=json.dumps({"*": "test_database_settings:fails_once"}), policy__backoff_unit="PT0S",
    )
    row_id = pg_db.insert("order.paid", "order-1", {"amount": 1.1})
    sent = cli(pg_db, "send", "order.paid", "order-2", "--payload", '{"n": 2}', "--ttl", "PT1H30M")
    assert sent.returncode == 0, sent.stderr
    wait_until(lambda: pg_db.gone(row_id) and not pg_db.messages(), what="both messages correlated",
               workers=[process])
    record = pg_db.record(row_id)
    assert record is not None and record["outcome"] == "correlated" and record["attempt"] == 1, record
    shown = cli(pg_db, "status", "--output", "json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["messages_by_state"]["total"] == 0
    base = f"http://127.0.0.1:{process.metrics_port()}"
    assert http_get(base + "/readyz") == (200, "ready\n")
    wait_until(lambda: pg_db.execute("SELECT count(*) AS n FROM correlation_sample")[0]["n"] > 0,
               what="the gauges' census and sample", workers=[process])
    assert process.metric("correlation_database_errors_total") == 0
    assert process.metric("correlation_fetch_errors_total") == 0
    assert "Traceback" not in process.log() and " ERROR " not in process.log(), process.log()


def test_a_role_with_session_settings_of_its_own_correlates_as_any_other(
    pg_db: Database, start_worker: StartWorker
) -> None:
    """The same settings on the worker's role (ALTER ROLE ... SET), several at once, for a user that does not own
    the tables."""
    role = f"cw_role_{uuid.uuid4().hex[:12]}"
    pg_db.execute(f"CREATE ROLE {role} LOGIN")
    try:
        pg_db.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        pg_db.execute(f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {role}")
        for setting in ("DateStyle = 'German'", "IntervalStyle = 'iso_8601'", "TimeZone = 'Pacific/Chatham'",
                        "statement_timeout = '1ms'", "idle_in_transaction_session_timeout = '1ms'",
                        "standard_conforming_strings = off", "client_encoding = 'LATIN1'"):
            pg_db.execute(f"ALTER ROLE {role} SET {setting}")
        url = make_url(pg_db.url).set(username=role, password=None).render_as_string(hide_password=False)
        process = start_worker(pg_db, database__url=url, correlators=json.dumps({"*": "log"}))
        row_id = pg_db.insert("order.paid", "order-1", {})
        sent = cli(pg_db, "send", "order.paid", "order-2", "--ttl", "PT1H30M", database__url=url)
        assert sent.returncode == 0, sent.stderr
        wait_until(lambda: pg_db.gone(row_id) and not pg_db.messages(), what="both messages correlated",
                   workers=[process])
        assert http_get(f"http://127.0.0.1:{process.metrics_port()}/readyz") == (200, "ready\n")
        assert process.metric("correlation_database_errors_total") == 0
        assert "Traceback" not in process.log() and " ERROR " not in process.log(), process.log()
        assert process.stop() == 0
    finally:
        pg_db.execute(f"DROP OWNED BY {role}")
        pg_db.execute(f"DROP ROLE {role}")


# A trigger of the operator's refusing the rows of the console's charts: every gauges run fails with an error the
# store does not know (as every run did under a DateStyle the driver could not read).
REFUSING_TRIGGERS = {
    "postgresql": [
        "CREATE FUNCTION refuse_samples() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "RAISE EXCEPTION 'samples are frozen for maintenance'; END $$",
        "CREATE TRIGGER refuse_samples BEFORE INSERT ON correlation_sample "
        "FOR EACH ROW EXECUTE FUNCTION refuse_samples()",
    ],
    "sqlite": [
        "CREATE TRIGGER refuse_samples BEFORE INSERT ON correlation_sample "
        "BEGIN SELECT RAISE(ABORT, 'samples are frozen for maintenance'); END",
    ],
}


def test_a_background_loop_whose_every_run_fails_makes_the_replica_not_ready(
    any_db: Database, start_worker: StartWorker
) -> None:
    """Messages are still correlated, but /readyz says which loop fails and why, in one line, until it works again."""
    kind = "postgresql" if isinstance(any_db, PostgresDatabase) else "sqlite"
    for statement in REFUSING_TRIGGERS[kind]:
        any_db.execute(statement)
    process = start_worker(any_db, correlators=json.dumps({"*": "log"}), metrics__gauges_interval="PT0.5S")
    base = f"http://127.0.0.1:{process.metrics_port()}"
    row_id = any_db.insert("order.paid", "order-1", {})
    wait_until(lambda: any_db.gone(row_id), what="the message correlated", workers=[process])

    _, reason = wait_until(lambda: (probe := http_get(base + "/readyz"))[0] == 503 and probe, timeout=60,
                           what="/readyz to turn red", workers=[process])
    assert reason.startswith("every gauges run has failed for ") and "samples are frozen for maintenance" in reason
    assert len(reason.strip().splitlines()) == 1, reason
    assert http_get(base + "/healthz")[0] == 200
    assert process.metric("correlation_database_errors_total") >= 3, "each failed run is counted"

    any_db.execute("DROP TRIGGER refuse_samples" + (" ON correlation_sample" if kind == "postgresql" else ""))
    wait_until(lambda: http_get(base + "/readyz") == (200, "ready\n"), what="/readyz green again", workers=[process])


# -- what no session can change --------------------------------------------------------------------------------


@pytest.fixture
def sql_ascii_db(pg_url: str) -> Iterator[Database]:
    """A database created ENCODING 'SQL_ASCII' on the test server (dropped at the end)."""
    name = f"cw_ascii_{uuid.uuid4().hex[:12]}"
    admin_url = make_url(pg_url).set(drivername="postgresql", database="postgres")
    admin = admin_url.render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {name} ENCODING 'SQL_ASCII' LOCALE 'C' TEMPLATE template0")
    database = PostgresDatabase(make_url(pg_url).set(database=name).render_as_string(hide_password=False))
    try:
        yield database
    finally:
        database.close()
        with psycopg.connect(admin, autocommit=True) as connection:
            connection.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.mark.parametrize("command", ["migrate", "run", "status"])
def test_a_database_not_in_utf8_is_refused_in_one_line(sql_ascii_db: Database, command: str) -> None:
    result = run_to_exit(sql_ascii_db) if command == "run" else cli(sql_ascii_db, command)
    line = one_line_error(result)
    assert "the database's encoding is SQL_ASCII; correlation-worker needs UTF8" in line, line
    tables = sql_ascii_db.execute("SELECT count(*) AS n FROM pg_tables WHERE tablename LIKE 'correlation%%'")
    assert tables[0]["n"] == 0  # nothing created


# -- the search path ---------------------------------------------------------------------------------------------


def tables_in(database: Database, schema: str) -> int:
    """How many correlation_* tables schema ``schema`` holds."""
    rows = database.execute(
        "SELECT count(*) AS n FROM pg_tables WHERE schemaname = %s AND tablename LIKE 'correlation%%'", (schema,)
    )
    return int(rows[0]["n"])


@pytest.mark.parametrize(
    "path", ["other", "\"$user\", other", "nowhere"], ids=["other", "user-then-other", "no-schema"]
)
def test_a_search_path_that_misses_the_tables_is_refused_not_migrated_again(
    pg_db: Database, start_worker: StartWorker, path: str
) -> None:
    """The database was migrated into public; its search path changed since. ``run`` and ``status`` refuse in one
    line naming the search path and the schema holding the tables (``run`` creates no second set); the URL's options
    (or ALTER ROLE) point the sessions back at them; ``migrate``, asked to, creates a separate set where the path
    says and names that schema."""
    pg_db.execute("CREATE SCHEMA other")
    alter_database(pg_db, f"search_path = {path}")
    for result in (run_to_exit(pg_db), cli(pg_db, "status")):
        line = one_line_error(result)
        assert f"search_path of the worker's sessions ({path}) finds no correlation-worker tables, but schema " \
               "public holds them" in line, line
    assert tables_in(pg_db, "other") == 0

    url = make_url(pg_db.url).update_query_dict({"options": "-c search_path=public"})
    process = start_worker(pg_db, database__url=url.render_as_string(hide_password=False),
                           correlators=json.dumps({"*": "log"}))
    row_id = pg_db.insert("order.paid", "order-1", {})
    wait_until(lambda: pg_db.gone(row_id), what="the message correlated", workers=[process])
    assert process.stop() == 0

    migrated = cli(pg_db, "migrate")
    if path == "nowhere":
        assert "names no schema that exists" in one_line_error(migrated)
        return
    assert migrated.returncode == 0, migrated.stderr
    assert "schema migrated from nothing to " in migrated.stdout, migrated.stdout
    assert " on schema other of postgresql" in migrated.stdout, migrated.stdout
    assert tables_in(pg_db, "other") > 0
    shown = cli(pg_db, "status", "--output", "json")
    assert shown.returncode == 0, shown.stderr
