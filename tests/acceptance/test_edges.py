"""The edges a user meets, tried as a user does: real ``correlation-worker`` processes with bad settings, bad
arguments, taken ports, a schema from the future, a wrong password, secrets in every form, hostile text.

Each case must end in one clear line on stderr (and a non-zero exit) or in the documented behaviour; none in a
traceback. Waits are on conditions with deadlines.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
from harness import Database, PostgresDatabase, StartWorker, WorkerProcess, cli, run_cli, wait_until, worker_env
from sqlalchemy.engine import make_url

import worker

if TYPE_CHECKING:  # not imported at run time: the worker process imports this module for its handlers
    from tests.conftest import ThrowawayServer

SECRET = "s3cr3t-edge"
RFC3339_MS_UTC = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
LINE_CAP = 64 * 1024  # no log line may come near a big payload's or error's size


# -- handlers the worker imports as test_edges:NAME ------------------------------------------------------------


def huge_error(message: worker.Message) -> None:
    """Fail with a 5 MB exception message."""
    raise RuntimeError("x" * 5_000_000 + f" end of error {message.id}")


def always_fails(message: worker.Message) -> None:
    """Fail naming its payload's note (which may carry control characters)."""
    raise RuntimeError(f"refused {message.hint}: {message.payload.get('note')}")


# -- helpers ----------------------------------------------------------------------------------------------------


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a command that failed as a user's mistake should: exit 2, nothing else."""
    assert result.returncode == 2, f"exit {result.returncode}: {result.stdout}{result.stderr}"
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("correlation-worker: "), lines[0]
    return lines[0]


def run_to_exit(database: Database, timeout: float = 60, **settings: str) -> subprocess.CompletedProcess[str]:
    """``run`` a worker that is expected to stop by itself (a startup error)."""
    return subprocess.run(
        [sys.executable, "-m", "worker", "run"],
        env=worker_env(database, **settings),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def startup_error(result: subprocess.CompletedProcess[str]) -> str:
    """The one error line of a worker that could not start (its log may hold lines before it)."""
    assert result.returncode == 2, f"exit {result.returncode}: {result.stderr}"
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("correlation-worker: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


# -- settings ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "named", "said"),
    [
        ({"cleanup__interval": "PT0S"}, "CORRELATION_CLEANUP__INTERVAL", "busy loop"),
        ({"metrics__gauges_interval": "PT0S"}, "CORRELATION_METRICS__GAUGES_INTERVAL", "busy loop"),
        ({"lease__renew_interval": "PT0S"}, "CORRELATION_LEASE__RENEW_INTERVAL", "below the least it may be, PT0.1S"),
        ({"policy__backoff_cap": "PT0S"}, "CORRELATION_POLICY__BACKOFF_CAP", "every poll"),
        ({"policy__backoff_cap": "PT10S"}, "CORRELATION_POLICY__BACKOFF_CAP", "below the backoff unit PT1M"),
        (
            {"policies": '{"invoice.sent": {"backoff_unit": "PT5H"}}'},
            "CORRELATION_POLICIES[invoice.sent].backoff_cap",
            "below the backoff unit PT5H",
        ),
        ({"database__url": f"postgres://app:{SECRET}@db:54x2/app"}, "CORRELATION_DATABASE__URL", "'54x2'"),
        ({"database__url": f"postgresql://app:{SECRET}@db:99999/app"}, "CORRELATION_DATABASE__URL", "'99999'"),
        ({"database__url": "sqlite://"}, "CORRELATION_DATABASE__URL", "in-memory"),
        ({"database__url": "sqlite:///:memory:"}, "CORRELATION_DATABASE__URL", "in-memory"),
        ({"correlators": '{"*": 5}'}, "CORRELATION_CORRELATORS[*]", "5 is not a route"),
        # Loops that would spin, waits that never end, numbers no clock or backoff can use.
        ({"poll__interval": "PT0.0001S"}, "CORRELATION_POLL__INTERVAL", "below the least it may be, PT0.1S"),
        ({"policy__reschedule_delay": "PT0S"}, "CORRELATION_POLICY__RESCHEDULE_DELAY", "PT1S"),
        ({"cleanup__initial_delay": "P36000D"}, "CORRELATION_CLEANUP__INITIAL_DELAY", "above the most it may be, P1D"),
        ({"policy__handler_timeout": "P99999999D"}, "CORRELATION_POLICY__HANDLER_TIMEOUT", "100 years"),
        ({"policy__backoff_base": "inf"}, "CORRELATION_POLICY__BACKOFF_BASE", "finite"),
        ({"database__connect_timeout": "PT0.5S"}, "CORRELATION_DATABASE__CONNECT_TIMEOUT", "PT1S"),
        # A route name no message name could match (worker/policy/text.py): named, with what hides in it escaped.
        ({"correlators": '{"order.paid\\u00a0": "log"}'}, "CORRELATION_CORRELATORS", "'order.paid\\u00a0' starts"),
        ({"correlators": '{"cafe\\u0301": "log"}'}, "CORRELATION_CORRELATORS", "'cafe\\u0301' is not in Unicode"),
        ({"correlators": '{"x\\udb40\\udc41": "log"}'}, "CORRELATION_CORRELATORS", "U+E0041"),
    ],
)
def test_a_setting_that_cannot_work_is_refused_by_check_config_with_one_line(
    pg_db: Database, settings: dict[str, str], named: str, said: str
) -> None:
    line = one_line_error(cli(pg_db, "check-config", **settings))
    assert f"invalid setting {named}: " in line and said in line, line
    assert SECRET not in line and "pydantic" not in line


@pytest.mark.parametrize("subcommand", ["run", "status", "migrate"])
@pytest.mark.parametrize(
    "settings",
    [
        {"cleanup__interval": "PT0S"}, {"database__url": "postgres://app@db:54x2/app"}, {"correlators": '{"*": 5}'},
        {"poll__interval": "PT0.0001S"},
    ],
    ids=["zero-interval", "bad-port", "route-of-wrong-type", "spinning-poll"],
)
def test_every_command_refuses_such_a_setting_before_doing_anything(
    pg_db: Database, subcommand: str, settings: dict[str, str]
) -> None:
    assert one_line_error(cli(pg_db, subcommand, **settings)).startswith("correlation-worker: invalid setting ")


CAMUNDA8_ROUTE = json.dumps({"*": {"type": "camunda8"}})


@pytest.mark.parametrize("command", ["check-config", "run"])
@pytest.mark.parametrize(
    ("environ", "said"),
    [
        ({"OTEL_BSP_MAX_QUEUE_SIZE": "-1"}, "OTEL_BSP_MAX_QUEUE_SIZE: '-1' is not a whole number of at least 1"),
        ({"OTEL_BSP_SCHEDULE_DELAY": "abc"}, "OTEL_BSP_SCHEDULE_DELAY: 'abc' is not a whole number"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "bogus"}, "OTEL_EXPORTER_OTLP_PROTOCOL: 'bogus' is not one of"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "notaurl"}, "OTEL_EXPORTER_OTLP_ENDPOINT: 'notaurl' is not an http(s) URL"),
        ({"OTEL_TRACES_EXPORTR": "otlp"}, "OTEL_TRACES_EXPORTR: is not an OpenTelemetry setting; did you mean "
         "OTEL_TRACES_EXPORTER?"),
        ({"CAMUNDA_REST_ADRESS": "http://camunda:8080"}, "CAMUNDA_REST_ADRESS: is not a setting of the Camunda SDK, "
         "which would ignore it; did you mean CAMUNDA_REST_ADDRESS?"),
        ({"CAMUNDA_REST_ADDRESS": "notaurl"}, "CAMUNDA_REST_ADDRESS: 'notaurl' is not an http(s) URL"),
        ({"CAMUNDA_REST_ADDRESS": "http://camunda:8080/?x=1"}, "CAMUNDA_REST_ADDRESS: 'http://camunda:8080/?x=1' has "
         "a query"),
        ({"CAMUNDA_AUTH_STRATEGY": "oauth"}, "CAMUNDA_AUTH_STRATEGY: the Camunda SDK refused it"),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else None,
)
def test_an_engine_or_tracing_variable_that_cannot_work_is_one_line_for_check_config_and_run(
    pg_db: Database, monkeypatch: pytest.MonkeyPatch, command: str, environ: dict[str, str], said: str
) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    if command == "run":
        line = startup_error(run_to_exit(pg_db, correlators=CAMUNDA8_ROUTE))
    else:
        line = one_line_error(cli(pg_db, command, correlators=CAMUNDA8_ROUTE))
    assert line.startswith(f"correlation-worker: invalid setting {said}"), line


def test_postgres_urls_work_like_postgresql_ones_in_every_command_and_the_engine(
    pg_db: Database, start_worker: StartWorker
) -> None:
    url = make_url(pg_db.url).set(drivername="postgres").render_as_string(hide_password=False)
    assert url.startswith("postgres://")
    checked = cli(pg_db, "check-config", database__url=url)
    assert checked.returncode == 0, checked.stderr
    migrated = cli(pg_db, "migrate", database__url=url)
    assert migrated.returncode == 0 and "schema is current" in migrated.stdout, migrated.stderr
    process = start_worker(pg_db, database__url=url)
    row_id = pg_db.insert("order.paid", "order-1", {})
    wait_until(lambda: pg_db.gone(row_id), what="the message correlated", workers=[process])
    shown = cli(pg_db, "status", "--output", "json", database__url=url)
    assert shown.returncode == 0 and json.loads(shown.stdout)["messages_by_state"]["total"] == 0, shown.stderr


# -- startup errors ----------------------------------------------------------------------------------------------


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_a_taken_metrics_port_is_named_with_its_setting(pg_db: Database, taken_port: int) -> None:
    line = startup_error(run_to_exit(pg_db, metrics__port=str(taken_port)))
    assert f"port {taken_port}" in line and "already in use" in line
    assert "CORRELATION_METRICS__PORT" in line


def test_an_unresolvable_metrics_host_is_named_and_not_taken_for_a_database_problem(pg_db: Database) -> None:
    line = startup_error(run_to_exit(pg_db, metrics__host="no-such-host.invalid"))
    assert "CORRELATION_METRICS__HOST" in line and "no-such-host.invalid" in line
    assert "database" not in line


@pytest.mark.parametrize("auto_migrate", ["true", "false"])
def test_a_schema_newer_than_the_code_is_one_line_for_run_and_migrate(pg_db: Database, auto_migrate: str) -> None:
    pg_db.execute("UPDATE correlation_schema_version SET version_num = '9999_from_the_future'")
    for result in (
        run_to_exit(pg_db, database__auto_migrate=auto_migrate),
        cli(pg_db, "migrate"),
        cli(pg_db, "status"),
    ):
        line = startup_error(result)
        assert "'9999_from_the_future'" in line and "newer release" in line, line
        assert "run `correlation-worker migrate`" not in line


@pytest.fixture
def password_pg(private_pg: tuple[ThrowawayServer, str]) -> PostgresDatabase:
    """A server of this test's own that checks passwords (scram) on TCP; its user's password is SECRET."""
    server, url = private_pg
    database = PostgresDatabase(url)
    database.execute(f"ALTER USER postgres PASSWORD '{SECRET}'")
    (server.data / "pg_hba.conf").write_text(
        "local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\nhost all all ::1/128 scram-sha-256\n"
    )
    server._run([str(server.bin / "pg_ctl"), "-D", str(server.data), "reload"])
    database.close()
    right = make_url(url).set(password=SECRET).render_as_string(hide_password=False)

    def refuses_without_password() -> bool:
        try:
            psycopg.connect(make_url(url).set(drivername="postgresql").render_as_string(), connect_timeout=3).close()
        except psycopg.OperationalError:
            return True
        return False

    wait_until(refuses_without_password, what="the server to ask for passwords")
    return PostgresDatabase(right)


def test_a_wrong_password_stops_run_and_migrate_with_an_authentication_failure(password_pg: PostgresDatabase) -> None:
    wrong = make_url(password_pg.url).set(password="wrong-" + SECRET).render_as_string(hide_password=False)
    for result in (run_to_exit(password_pg, database__url=wrong), cli(password_pg, "migrate", database__url=wrong)):
        line = startup_error(result)
        assert "authentication failed" in line and "CORRELATION_DATABASE__URL" in line, line
        assert "unavailable" not in result.stderr and SECRET not in result.stderr
    assert cli(password_pg, "migrate").returncode == 0  # the right one works
    password_pg.close()


# -- secrets ---------------------------------------------------------------------------------------------------


def test_no_credential_is_printed_in_any_form_by_run_migrate_or_check_config(
    pg_db: Database, start_worker: StartWorker
) -> None:
    database_url = pg_db.url + f"?password={SECRET}-1&application_name=edges"
    route = {
        "type": "http",
        # Nothing listens on port 9: every call fails, and its error names the URL.
        "url": f"http://bot:{SECRET}-2@127.0.0.1:9/hook?token={SECRET}-3&tenant=acme",
        "headers": {"X-Api-Key": f"{SECRET}-5", "X-Tenant": "acme"},
        "timeout": "PT2S",
    }
    # Credentials in the url and an Authorization header are refused together: the header has its own route.
    authorized = {**route, "url": "http://127.0.0.1:9/hook", "headers": {"Authorization": f"Bearer {SECRET}-4"}}
    settings = {
        "database__url": database_url,
        "correlators": json.dumps({"*": "recorder:handle", "order.http": route, "order.auth": authorized}),
        "policy__backoff_unit": "PT1H",
    }
    checked = cli(pg_db, "check-config", **settings)
    assert checked.returncode == 0, checked.stderr
    shown = json.loads(checked.stdout)
    assert shown["database"]["url"].endswith("?password=***&application_name=edges")
    assert "bot:***@127.0.0.1:9" in shown["correlators"]["order.http"]
    assert "token=***&tenant=acme" in shown["correlators"]["order.http"]
    assert '"X-Api-Key": "***"' in shown["correlators"]["order.http"]
    assert '"Authorization": "***"' in shown["correlators"]["order.auth"]
    migrated = cli(pg_db, "migrate", **settings)
    assert migrated.returncode == 0, migrated.stderr

    process = start_worker(pg_db, **settings)
    row_id = pg_db.insert("order.http", "order-1", {})
    # Nothing listens: the target is unavailable, its circuit opens with one line naming it; the message waits.
    opened = wait_until(
        lambda: next((line for line in process.log().splitlines() if "is unavailable" in line), None),
        what="the target's circuit opened", workers=[process],
    )
    assert process.stop() == 0
    assert "http://127.0.0.1:9/hook?token=***&tenant=acme" in opened  # its credentials went to a header
    assert (pg_db.message(row_id) or {}).get("attempt") == 0  # the target's outage is no attempt of the message
    for text in (checked.stdout, checked.stderr, migrated.stdout, migrated.stderr, process.log()):
        assert SECRET not in text


# -- logs -------------------------------------------------------------------------------------------------------


def json_records(process: WorkerProcess) -> list[dict[str, object]]:
    records = []
    for line in process.log().splitlines():
        if line.strip():
            record = json.loads(line)
            assert isinstance(record, dict)
            records.append(record)
    return records


def test_a_json_failure_line_carries_the_message_s_fields(pg_db: Database, start_worker: StartWorker) -> None:
    process = start_worker(
        pg_db, log__format="json", correlators=json.dumps({"*": "test_edges:always_fails"}),
        policy__backoff_unit="PT1H",
    )
    row_id = pg_db.insert("order.paid", "order-7", {})
    wait_until(lambda: (pg_db.message(row_id) or {}).get("attempt") == 1, what="the failure recorded",
               workers=[process])
    assert process.stop() == 0
    records = json_records(process)
    for record in records:
        assert re.fullmatch(RFC3339_MS_UTC, str(record["time"])), record["time"]
    [failure] = [r for r in records if r.get("outcome") == "retry"]
    assert (failure["message_name"], failure["id"], failure["hint"], failure["attempt"]) == (
        "order.paid", row_id, "order-7", 1)
    assert re.fullmatch(RFC3339_MS_UTC, str(failure["next_attempt_at"]))
    assert isinstance(failure["slot"], int) and failure["replica"] == records[0]["replica"]


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_huge_errors_and_payloads_make_bounded_lines_marked_as_cut(
    pg_db: Database, start_worker: StartWorker, log_format: str
) -> None:
    routes = {"order.huge": "test_edges:huge_error", "*": "log"}
    process = start_worker(pg_db, log__format=log_format, correlators=json.dumps(routes),
                           policy__backoff_unit="PT1H")
    failing = pg_db.insert("order.huge", "order-1", {})
    logged = pg_db.insert("order.big", "order-2", {"blob": "y" * 1_000_000})  # near the 1 MiB limit
    wait_until(
        lambda: pg_db.gone(logged) and (pg_db.message(failing) or {}).get("attempt") == 1,
        what="both messages handled",
        workers=[process],
    )
    assert process.stop() == 0
    lines = process.log().splitlines()
    assert max(len(line) for line in lines) < LINE_CAP
    assert any("characters cut]" in line and "order.big" in line for line in lines)
    assert any("characters cut]" in line and f"order.huge id={failing}" in line for line in lines)


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_control_characters_from_hints_payloads_and_errors_are_escaped(
    pg_db: Database, start_worker: StartWorker, log_format: str
) -> None:
    routes = {"order.fails": "test_edges:always_fails", "*": "log"}
    process = start_worker(pg_db, log__format=log_format, correlators=json.dumps(routes),
                           policy__backoff_unit="PT1H")
    # Hints refuse control characters (schema 0008); payloads and the errors made of them carry them to the log.
    hostile = "\x1b[2J\rFAKE ERROR line\x07"
    failing = pg_db.insert("order.fails", "order-1", {"note": hostile})
    logged = pg_db.insert("order.paid", "order-2", {"note": "\x1b[31mred\x1b]0;title\x07"})
    wait_until(
        lambda: pg_db.gone(logged) and (pg_db.message(failing) or {}).get("attempt") == 1,
        what="both messages handled",
        workers=[process],
    )
    assert process.stop() == 0
    raw = process.log_path.read_bytes()
    for control in (b"\x1b", b"\r", b"\x07"):
        assert control not in raw
    assert "\\x1b[2J" in process.log()


# -- the command line ------------------------------------------------------------------------------------------


BAD_ARGUMENTS = [
    ("send", "order.paid", "order-1", "--headers", "[1]"),
    ("send", "order.paid", "order-1", "--headers", "{"),
    ("send", "order.paid", "order-1", "--payload", "{not json"),
    ("send", "order.paid", "order-1", "--payload", '"nul \\u0000 byte"'),
    ("send", "order.paid", "order-1", "--ttl", "P1M"),
    ("send", "order.paid", "order-1", "--ttl", "-PT1S"),
    ("send", "order.paid", "order-1", "--expires-at", "tomorrow"),
    ("send", "order.paid", "order-1", "--expires-at", "2001-01-01T00:00:00Z"),
    ("send", "", "order-1"),
    ("send", "order.paid", "h" * 300),
    ("send", "order.paid", "order-1", "--message-id", ""),
    ("send", "order.paid"),
    ("send",),
    ("messages", "list", "--limit", "-1"),
    ("messages", "list", "--limit", "0"),
    ("messages", "list", "--limit", "many"),
    ("messages", "list", "--after", "-5"),
    ("messages", "list", "--after", "99999999999999999999999"),
    ("messages", "list", "--state", "sleeping"),
    ("messages", "list", "--output", "yaml"),
    ("messages", "show", "abc", "--by", "id"),
    ("messages", "show", "4711"),
    ("messages", "show", "99999999999999999999999"),
    ("messages", "show"),
    ("status", "--output", "xml"),
    ("requeue", "abc"),
    ("requeue", "0"),
    ("pause", "-1"),
    ("resume", "99999999999999999999999"),
    ("delete",),
    ("pause", "--state", "gone"),
    ("statuss",),
    ("status", "--verbose"),
]


@pytest.mark.parametrize(
    ("name", "hint", "said"),
    [
        ("order.paid\u00a0", "o-1", "Invalid value for NAME: 'order.paid\\u00a0' starts or ends with whitespace"),
        ("cafe\u0301", "o-1", "Invalid value for NAME: 'cafe\\u0301' is not in Unicode normalisation form NFC"),
        ("x\U000e0041", "o-1", "Invalid value for NAME: 'x\\U000e0041' holds the invisible or control character"),
        ("order.paid", "\u3000", "Invalid value for HINT: '\\u3000' is only whitespace"),
        ("order.paid", "Zo\u0308e", "Invalid value for HINT: 'Zo\\u0308e' is not in Unicode normalisation form NFC"),
    ],
)
def test_send_refuses_a_name_or_hint_the_rule_refuses_naming_the_argument(
    any_db: Database, name: str, hint: str, said: str
) -> None:
    """The same rule as the schema's, before the database is asked, on SQLite too (whose SQL cannot tell NFC)."""
    assert cli(any_db, "migrate").returncode == 0
    line = one_line_error(cli(any_db, "send", name, hint))
    assert said in line, line
    family = "\U0001f468\u200d\U0001f469\u200d\U0001f467"  # joiners between two characters are taken
    assert cli(any_db, "send", family, "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645").returncode == 0


@pytest.mark.parametrize("arguments", BAD_ARGUMENTS, ids=lambda a: " ".join(a)[:60] or "none")
def test_every_argument_error_is_one_line_with_a_non_zero_exit(pg_db: Database, arguments: tuple[str, ...]) -> None:
    result = cli(pg_db, *arguments)
    one_line_error(result)
    assert result.stdout == ""
    assert "SELECT" not in result.stderr and "INSERT" not in result.stderr


def test_version_prints_the_version(pg_db: Database) -> None:
    for flag in ("--version", "-V"):
        result = cli(pg_db, flag)
        assert result.returncode == 0 and result.stdout == f"correlation-worker {worker.__version__}\n"


def test_show_finds_a_message_by_its_id_or_its_producer_s_message_id(pg_db: Database) -> None:
    sent = cli(pg_db, "send", "order.paid", "order-1", "--message-id", "shop-4711-paid")
    row_id = int(sent.stdout.split()[-1])
    by_message_id = json.loads(cli(pg_db, "messages", "show", "shop-4711-paid").stdout)
    by_id = json.loads(cli(pg_db, "messages", "show", str(row_id)).stdout)
    assert by_message_id == by_id and by_id["message_id"] == "shop-4711-paid"
    # A numeric message_id that is also another row's id is ambiguous: said so in one line.
    cli(pg_db, "send", "order.paid", "order-2", "--message-id", str(row_id + 5))
    for _ in range(5):
        cli(pg_db, "send", "order.paid", "order-3")
    assert "--by id or --by message_id" in one_line_error(cli(pg_db, "messages", "show", str(row_id + 5)))
    assert json.loads(cli(pg_db, "messages", "show", str(row_id + 5), "--by", "message_id").stdout)[
        "correlation_hint"] == "order-2"


def test_outputs_are_json_when_piped_and_tables_when_asked(pg_db: Database) -> None:
    cli(pg_db, "send", "order.paid", "order-1", "--message-id", "m-1")
    # Names and hints refuse control characters; a message_id may hold them and is shown escaped.
    cli(pg_db, "send", "order.paid", "order-2", "--message-id", "m-2\x1b[2J")
    piped = cli(pg_db, "status")
    status = json.loads(piped.stdout)
    assert set(status) == {
            "messages_by_state", "oldest_eligible_age_seconds", "slots", "slots_per_replica", "targets", "routing"
        }
    assert status["messages_by_state"]["ready"] == 2 and status["slots"] == 64
    table = cli(pg_db, "status", "--output", "table").stdout
    assert "state" in table and "messages" in table and "slot leases: 0 of 64 slots" in table
    listed = cli(pg_db, "messages", "list", "-o", "table").stdout
    assert "message_id" in listed and "m-1" in listed and "\x1b" not in listed and "\\x1b[2J" in listed
    shown = cli(pg_db, "messages", "show", "m-1", "-o", "table").stdout
    assert re.search(r"^message_name\s+order\.paid$", shown, re.MULTILINE)
    assert json.loads(cli(pg_db, "messages", "list", "-o", "json").stdout)[0]["message_id"] == "m-1"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("pause", "--hint", ""), "the hint to pause is empty"),
        (("pause", "--name", "  "), "the name to pause is empty"),
        (("pause", "--name", "order.paid\u00a0"), "the name to pause 'order.paid\\u00a0' starts or ends with"),
        (("pause", "--hint", "cafe\u0301"), "the hint to pause 'cafe\\u0301' is not in Unicode normalisation"),
        (("requeue", "--state", "ready"), "requeue acts on dead messages only"),
        (("resume", "--state", "dead"), "resume acts on paused messages only"),
    ],
)
def test_an_operator_command_that_could_do_nothing_says_why_in_one_line(
    pg_db: Database, args: tuple[str, ...], said: str
) -> None:
    assert cli(pg_db, "migrate").returncode == 0
    line = one_line_error(cli(pg_db, *args))
    assert said in line and "constraint" not in line, line


def test_messages_list_takes_the_states_status_reports(pg_db: Database) -> None:
    assert cli(pg_db, "migrate").returncode == 0
    with psycopg.connect(pg_db.url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as connection:
        connection.execute(
            "INSERT INTO correlation_message (message_name, correlation_hint, next_attempt_at, created_at, expires_at) "
            "VALUES ('n', 'soon', now() + interval '1 hour', now(), NULL), "
            "('n', 'gone', NULL, now() - interval '1 hour', now() - interval '1 minute'), "
            "('n', 'now', NULL, now(), NULL)"
        )
    for state, hint in (("waiting", "soon"), ("expired", "gone")):
        listed = cli(pg_db, "messages", "list", "--state", state)
        assert listed.returncode == 0, listed.stderr
        assert [row["correlation_hint"] for row in json.loads(listed.stdout)] == [hint]


# -- a schema changed by hand ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("DROP TABLE correlation_message", "table correlation_message"),
        ("DROP TABLE correlation_session_end", "table correlation_session_end"),
        ("ALTER TABLE correlation_audit DROP COLUMN error", "column correlation_audit.error"),
    ],
)
def test_a_schema_missing_tables_or_columns_is_named_by_migrate_run_and_the_commands(
    any_db: Database, change: str, named: str
) -> None:
    assert "schema is current" in run_cli(any_db, "migrate").stdout
    any_db.execute(change)
    for result in (cli(any_db, "migrate"), run_to_exit(any_db), run_to_exit(any_db, database__auto_migrate="true"),
                   cli(any_db, "status")):
        line = startup_error(result)
        assert named in line and "lacks" in line, line
    assert "schema is current" not in cli(any_db, "migrate").stdout


@pytest.mark.parametrize("arguments", [("send", "order.paid", "order-1"), ("status",), ("messages", "list"),
                                       ("schedules", "list")])
def test_commands_on_a_missing_sqlite_file_say_so_without_creating_it(
    sqlite_db: Database, tmp_path: Path, arguments: tuple[str, ...]
) -> None:
    missing = tmp_path / "elsewhere" / "nothing-here.db"
    missing.parent.mkdir()
    result = cli(sqlite_db, *arguments, database__url=f"sqlite:///{missing}")
    line = startup_error(result)
    assert str(missing) in line and "does not exist" in line and "migrate" in line, line
    assert list(missing.parent.iterdir()) == []  # no empty file (nor a -wal or -shm) left behind


def test_a_worker_whose_sqlite_file_is_deleted_says_so_once_and_exits_to_be_restarted(
    sqlite_db: Database, tmp_path: Path
) -> None:
    worker = WorkerProcess(worker_env(sqlite_db, correlators=json.dumps({"*": "log"})), tmp_path / "w.log", tmp_path)
    try:
        worker.wait_ready()
        first = sqlite_db.insert("order.paid", "order-1", {})
        wait_until(lambda: sqlite_db.gone(first), what="a message correlated", workers=[worker])
        path = Path(make_url(sqlite_db.url).database or "")
        for leftover in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            leftover.unlink(missing_ok=True)
        wait_until(lambda: not worker.running(), what="the worker to exit")
        assert worker.returncode() == 1
    finally:
        if worker.running():
            worker.kill()
    log = worker.log()
    assert "Traceback" not in log
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and str(path) in errors[0] and "deleted or replaced" in errors[0], errors
