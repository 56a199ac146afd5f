"""The worker run as a service: metrics, probes, signals, logs and configuration, with real processes.

DESIGN.md §6. Each test starts ``correlation-worker run`` (or another command) as a process, reaches it the way
an operator's tools do (an HTTP client on the metrics port, signals, its stderr) and waits on conditions with a
deadline. The only time bounds are the generous shutdown ones.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from effects import EFFECT_TABLE_DDL
from harness import Database, PostgresDatabase, StartWorker, WorkerProcess, cli, wait_until, worker_env
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from psycopg.rows import dict_row
from sqlalchemy.engine import make_url

import worker
from worker.config import parse_duration

if TYPE_CHECKING:  # not imported at run time: the worker process imports this module for its handler
    from tests.conftest import ThrowawayServer

PASSWORD = "s3cr3t-pw"
ENDPOINT_LINE = re.compile(r"serving /metrics.* on ([0-9A-Za-z.\-]+):(\d+)")
POLLING_LINE = re.compile(r"replica (\S+) polling ")

# Every documented metric, as exported, and its type as the Prometheus text format states it.
DOCUMENTED = {
    "correlation_messages_total": "counter",
    "correlation_batch_duration_seconds": "histogram",
    "correlation_fetch_duration_seconds": "histogram",
    "correlation_call_duration_seconds": "histogram",
    "correlation_busy_lanes": "gauge",
    "correlation_hung_calls": "gauge",
    "correlation_handler_timeouts_total": "counter",
    "correlation_replicas_routing_differently": "gauge",
    "correlation_route_holds_total": "counter",
    "correlation_cluster_settings_differing": "gauge",
    "correlation_record_failures_total": "counter",
    "correlation_deferred_outcomes_total": "counter",
    "correlation_unrecordable_outcomes_total": "counter",
    "correlation_unreadable_messages_total": "counter",
    "correlation_lost_calls_total": "counter",
    "correlation_poison_messages_total": "counter",
    "correlation_order_waits_total": "counter",
    "correlation_order_wait_timeouts_total": "counter",
    "correlation_fetch_errors_total": "counter",
    "correlation_listener_up": "gauge",
    "correlation_listener_reconnects_total": "counter",
    "correlation_messages_by_state": "gauge",
    "correlation_oldest_eligible_message_age_seconds": "gauge",
    "correlation_slots_held": "gauge",
    "correlation_lease_acquisitions_total": "counter",
    "correlation_lease_losses_total": "counter",
    "correlation_redeliveries_total": "counter",
    "correlation_fenced_commits_total": "counter",
    "correlation_database_errors_total": "counter",
    "correlation_cleanup_removed_messages_total": "counter",
    "correlation_build_info": "gauge",  # an info metric: a gauge of 1 whose labels carry the facts
    "correlation_backlog_messages": "gauge",
    # The standard process collectors, on the worker's own registry.
    "process_cpu_seconds_total": "counter",
    "process_resident_memory_bytes": "gauge",
    "process_open_fds": "gauge",
    "process_start_time_seconds": "gauge",
}
# The worker's labels, and those of the standard python_info and GC collectors (all bounded).
BOUNDED_LABELS = {"message_name", "outcome", "state", "version", "le"}
BOUNDED_LABELS |= {"implementation", "major", "minor", "patchlevel", "generation"}
BOUNDED_LABELS |= {"kind"}  # of a database error: unavailable, timeout, refused, other


# -- a handler that logs its own failure (the worker imports it as test_service:noisy) -----------------------


def noisy(message: worker.Message) -> None:
    """Fail, logging the exception with its traceback (and a message of two lines) as handlers often do."""
    try:
        raise RuntimeError(f"target refused message {message.id}")
    except RuntimeError:
        logging.getLogger("shop.handlers").exception("could not correlate %s:\nwill retry", message.name)
        raise


# -- helpers -------------------------------------------------------------------------------------------------


class ReconnectingDatabase(PostgresDatabase):
    """A PostgreSQL database reached with a new connection per statement, so that it outlives a restart.

    It has no recorder journal: workers on it use the ``log`` correlator.
    """

    def __init__(self, url: str) -> None:  # no long-lived connection, no journal table
        self.url = url
        self.dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        self.recorder_env = {}

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[dict[str, Any]]:
        """Run one statement on a new connection (autocommit) and return its rows as dicts."""
        with psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row) as connection:
            cursor = connection.execute(sql, params)
            return cursor.fetchall() if cursor.description else []

    def close(self) -> None:
        """Nothing stays open."""


def with_password(url: str) -> str:
    """The URL with a password (the local servers trust every connection, so any password works)."""
    return make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


def endpoint(process: WorkerProcess) -> str:
    """The base URL of the worker's metrics endpoint, read from its log (it was started on port 0)."""

    def announced() -> re.Match[str] | None:
        return ENDPOINT_LINE.search(process.log())

    found = wait_until(announced, what="the metrics endpoint to be announced", workers=[process])
    assert found is not None
    return f"http://{found.group(1)}:{found.group(2)}"


def replica_of(process: WorkerProcess) -> str:
    """The replica id (``locked_by``) the worker announced when it started polling."""
    found = POLLING_LINE.search(process.log())
    assert found, "the worker never said which replica it is"
    return found.group(1)


def http_get(url: str) -> tuple[int, str]:
    """GET with a real HTTP client: the status and the body (error statuses included)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode()


def scrape(base: str) -> list[Sample]:
    """Every sample of /metrics, parsed by the Prometheus client's own parser."""
    status, body = http_get(base + "/metrics")
    assert status == 200, body
    return [sample for family in text_string_to_metric_families(body) for sample in family.samples]


def value(samples: Sequence[Sample], name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels`` (0 when there is none)."""
    return sum(
        sample.value
        for sample in samples
        if sample.name == name and all(sample.labels.get(key) == wanted for key, wanted in labels.items())
    )


def states(base: str) -> dict[str, float]:
    """correlation_messages_by_state, by state."""
    return {
        sample.labels["state"]: sample.value
        for sample in scrape(base)
        if sample.name == "correlation_messages_by_state"
    }


def held_slot_locks(database: Database, replica: str) -> list[str]:
    """Slot leases this replica still holds (rows whose term has not ended)."""
    rows = database.execute(
        "SELECT name FROM correlation_lock WHERE name LIKE 'slot:%%' AND locked_by = %s AND lock_until > now()",
        (replica,),
    )
    return [str(row["name"]) for row in rows]


def database_now(database: Database) -> datetime:
    rows = database.execute("SELECT clock_timestamp() AS now")
    now: datetime = rows[0]["now"]
    return now


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def call_started(database: Database, row_id: int) -> bool:
    return bool(database.calls_of(row_id))


# -- /metrics ------------------------------------------------------------------------------------------------


def test_the_metrics_endpoint_exports_every_documented_metric_with_its_type(
    pg_db: Database, start_worker: StartWorker
) -> None:
    process = start_worker(pg_db)
    base = endpoint(process)

    status, body = http_get(base + "/metrics")
    assert status == 200
    families = {family.name: family for family in text_string_to_metric_families(body)}
    for name, kind in DOCUMENTED.items():
        family = name.removesuffix("_total") if kind == "counter" else name  # the parser's family name
        assert family in families, f"{name} is not exported"
        assert families[family].type == kind, f"{name} is a {families[family].type}, not a {kind}"
    build = families["correlation_build_info"].samples
    assert [(sample.labels, sample.value) for sample in build] == [({"version": worker.__version__}, 1.0)]
    # One replica on PostgreSQL leases every slot.
    wait_until(
        lambda: (
            value(scrape(base), "correlation_slots_held") == 64
            and value(scrape(base), "correlation_lease_acquisitions_total") >= 64
        ),
        what="the slot gauges to show 64 slots",
        workers=[process],
    )


def test_counters_and_histograms_move_as_messages_are_correlated(pg_db: Database, start_worker: StartWorker) -> None:
    process = start_worker(pg_db, policy__backoff_unit="PT1H")
    base = endpoint(process)
    before = scrape(base)
    assert value(before, "correlation_batch_duration_seconds_count") == 0
    fetches_before = value(before, "correlation_fetch_duration_seconds_count")

    succeeding = [pg_db.insert("order.paid", f"order-{n}", {"seq": n}) for n in range(5)]
    failing = [pg_db.insert("order.refunded", f"refund-{n}", {"seq": n, "fail": True}) for n in range(3)]

    def counted() -> bool:
        samples = scrape(base)
        return (
            value(samples, "correlation_messages_total", message_name="order.paid", outcome="success") >= 5
            and value(samples, "correlation_messages_total", message_name="order.refunded", outcome="retry") >= 3
            and value(samples, "correlation_call_duration_seconds_count") >= 8
            # a hint's batch is observed when its work is over, just after its outcomes are counted
            and value(samples, "correlation_batch_duration_seconds_count") >= 8
        )

    wait_until(counted, what="the outcomes to be counted", workers=[process])
    after = scrape(base)
    assert pg_db.gone(*succeeding)
    assert all((pg_db.message(row_id) or {}).get("attempt") == 1 for row_id in failing)
    counts = {
        (sample.labels["message_name"], sample.labels["outcome"]): sample.value
        for sample in after
        if sample.name == "correlation_messages_total"
    }
    assert counts == {("order.paid", "success"): 5, ("order.refunded", "retry"): 3}
    batches = value(after, "correlation_batch_duration_seconds_count")
    assert batches >= 8, "one batch per hint, each observed"
    assert value(after, "correlation_batch_duration_seconds_bucket", le="+Inf") == batches
    assert value(after, "correlation_batch_duration_seconds_sum") > 0
    assert value(after, "correlation_fetch_duration_seconds_count") > fetches_before
    # Every correlator call is timed by message name.
    assert value(after, "correlation_call_duration_seconds_count", message_name="order.paid") == 5
    assert value(after, "correlation_call_duration_seconds_count", message_name="order.refunded") == 3
    # No *_created series doubling the counters and histograms.
    assert not [sample.name for sample in after if sample.name.endswith("_created")]

    # Labels are bounded: names and outcomes, never a hint or an id.
    hints_and_ids = {f"order-{n}" for n in range(5)} | {f"refund-{n}" for n in range(3)}
    hints_and_ids |= {str(row_id) for row_id in succeeding + failing}
    for sample in after:
        assert set(sample.labels) <= BOUNDED_LABELS, f"{sample.name} has labels {sorted(sample.labels)}"
        worker_labels = {sample.labels.get(key) for key in ("message_name", "outcome", "state")}
        assert not hints_and_ids.intersection(worker_labels), sample


def test_messages_by_state_reflects_the_table(pg_db: Database, start_worker: StartWorker) -> None:
    def insert(hint: str, state: str = "ready", due: str = "NULL", expires: str = "NULL") -> None:
        pg_db.execute(
            "INSERT INTO correlation_message"
            " (message_name, correlation_hint, state, next_attempt_at, created_at, expires_at)"
            f" VALUES ('order.paid', %s, %s, {due}, now() - interval '1 minute', {expires})",
            (hint, state),
        )

    insert("order-held", "paused")  # a paused head holds back the two ready messages behind it
    insert("order-held")
    insert("order-held")
    insert("order-later", due="now() + interval '1 hour'")
    insert("order-dead", "dead")
    insert("order-expired", expires="now() - interval '1 second'")
    process = start_worker(pg_db, metrics__gauges_interval="PT0.5S", cleanup__initial_delay="PT1H")
    base = endpoint(process)

    expected = {"ready": 2, "waiting": 1, "paused": 1, "dead": 1, "expired": 1}
    wait_until(lambda: states(base) == expected, what=f"the gauges to show {expected}", workers=[process])
    backlog = {
        (sample.labels["message_name"], sample.labels["state"]): sample.value
        for sample in scrape(base)
        if sample.name == "correlation_backlog_messages"
    }
    assert backlog == {("order.paid", state): count for state, count in expected.items()}

    pg_db.execute("UPDATE correlation_message SET state = 'ready' WHERE state = 'paused'")
    pg_db.execute("DELETE FROM correlation_message WHERE state = 'dead'")
    expected = {"ready": 0, "waiting": 1, "paused": 0, "dead": 0, "expired": 1}
    wait_until(lambda: states(base) == expected, what=f"the gauges to show {expected}", workers=[process])
    assert [row["correlation_hint"] for row in pg_db.messages()] == ["order-later", "order-expired"]


# -- /healthz and /readyz ------------------------------------------------------------------------------------


def readiness_turns_red(base: str, process: WorkerProcess) -> tuple[int, str]:
    """The first /readyz answer that is not 200 (status, body), waited for."""

    def not_ready() -> tuple[int, str] | None:
        probe = http_get(base + "/readyz")
        return probe if probe[0] != 200 else None

    answer = wait_until(not_ready, what="/readyz to turn red", workers=[process])
    assert answer is not None
    return answer


def test_readiness_follows_the_database_while_liveness_stays_green(
    private_pg: tuple[ThrowawayServer, str], start_worker: StartWorker
) -> None:
    server, url = private_pg
    database = ReconnectingDatabase(with_password(url))
    process = start_worker(database, correlators=json.dumps({"*": "log"}), poll__interval="PT0.2S")
    base = endpoint(process)
    assert http_get(base + "/healthz") == (200, "ok\n")
    assert http_get(base + "/readyz") == (200, "ready\n")
    first = database.insert("order.paid", "order-1", {})
    wait_until(lambda: database.gone(first), what="a message correlated", workers=[process])

    server.stop("fast")

    status, reason = readiness_turns_red(base, process)
    assert status == 503
    assert len(lines(reason)) == 1 and "database unavailable" in reason, reason
    wait_until(
        lambda: value(scrape(base), "correlation_database_errors_total") >= 3,
        what="database errors to be counted",
        workers=[process],
    )
    assert http_get(base + "/healthz") == (200, "ok\n")
    assert process.running()

    server.start()
    wait_until(lambda: http_get(base + "/readyz") == (200, "ready\n"), what="/readyz green again", workers=[process])
    later = [database.insert("order.paid", f"order-{n}", {}) for n in range(2, 5)]
    wait_until(lambda: database.gone(*later), what="messages inserted after the restart", workers=[process])
    assert http_get(base + "/healthz") == (200, "ok\n")
    assert PASSWORD not in process.log()


def readme_grants() -> list[str]:
    """The GRANT statements of the "Database user" section of docs/deployment.md."""
    page = (Path(__file__).parents[2] / "docs" / "deployment.md").read_text()
    section = page.split("## Database user", 1)[1].split("```sql", 1)[1].split("```", 1)[0]
    statements = [line.split("--")[0].strip().rstrip(";") for line in section.splitlines()]
    return [statement for statement in statements if statement.startswith("GRANT")]


def test_a_user_allowed_only_to_read_is_not_ready_says_which_privileges_it_lacks_and_loses_nothing(
    pg_db: Database, start_worker: StartWorker
) -> None:
    role = f"reader_{uuid.uuid4().hex[:8]}"
    pg_db.execute(f"CREATE ROLE {role} LOGIN")
    try:
        pg_db.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
        url = make_url(pg_db.url).set(username=role).render_as_string(hide_password=False)
        waiting = pg_db.insert("order.paid", "order-1", {})
        process = start_worker(  # short lease rounds: the one after the grants takes the slots
            pg_db, database__url=url, lease__duration="PT3S", lease__renew_interval="PT1S",
            lease__safety_margin="PT0.5S", lease__drain="PT0.5S", policy__handler_timeout="PT1S",
        )
        base = endpoint(process)
        status, reason = http_get(base + "/readyz")
        assert status == 503 and len(lines(reason)) == 1, reason
        for privilege in ("UPDATE on correlation_message", "DELETE on correlation_message",
                          "INSERT on correlation_lock", "UPDATE on correlation_lock"):
            assert privilege in reason, reason
        wait_until(lambda: "permission denied" in process.log(), what="a lease round refused", workers=[process])
        assert http_get(base + "/healthz")[0] == 200, "alive: a restart cannot grant a privilege"
        assert value(scrape(base), "correlation_database_errors_total", kind="refused") >= 1
        assert pg_db.message(waiting) is not None and pg_db.calls() == []
        assert "Traceback" not in process.log(), "each refusal is one line"

        for grant in readme_grants():  # what the deployment guide says a replica's user needs is enough
            pg_db.execute(grant.replace(" TO worker", f" TO {role}"))
        wait_until(lambda: http_get(base + "/readyz") == (200, "ready\n"), what="ready once granted",
                   workers=[process])
        wait_until(lambda: pg_db.gone(waiting), what="the waiting message correlated", workers=[process])
        process.stop()
    finally:
        pg_db.execute(f"DROP OWNED BY {role}")
        pg_db.execute(f"DROP ROLE {role}")


def test_a_worker_refuses_an_out_of_date_schema_in_one_line_naming_the_migrate_command(
    empty_pg_url: str,
) -> None:
    database = ReconnectingDatabase(empty_pg_url)
    result = cli(database, "run", database__auto_migrate="false", log__level="WARNING")

    assert result.returncode != 0
    assert len(lines(result.stderr)) == 1, result.stderr
    assert "`correlation-worker migrate`" in result.stderr
    assert database.execute("SELECT to_regclass('correlation_message') AS t") == [{"t": None}]


# -- signals ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_lets_the_current_call_finish_then_exits_0_and_releases_the_slots(
    pg_db: Database, start_worker: StartWorker, signum: signal.Signals
) -> None:
    grace = 10.0
    process = start_worker(pg_db, shutdown__grace=f"PT{grace:.0f}S")
    replica = replica_of(process)
    wait_until(lambda: held_slot_locks(pg_db, replica), what="slot leases taken", workers=[process])
    row_id = pg_db.insert("order.paid", "order-1", {"sleep_seconds": 2})
    wait_until(lambda: call_started(pg_db, row_id), what="the call to start", workers=[process])

    process.process.send_signal(signum)
    signalled = database_now(pg_db)
    code = process.process.wait(timeout=grace + 5)

    assert code == 0
    [call] = pg_db.calls_of(row_id)
    assert call.outcome == "ok" and call.ended_at is not None and call.ended_at > signalled
    assert pg_db.gone(row_id), "the finished call was not recorded"
    assert held_slot_locks(pg_db, replica) == []
    log = process.log()
    assert f"{signum.name}: finishing the current message" in log
    assert "released 64 slot leases" in log


def test_sigusr1_writes_every_threads_stack_to_stderr_and_the_replica_goes_on(
    pg_db: Database, start_worker: StartWorker
) -> None:
    process = start_worker(pg_db)
    replica = replica_of(process)
    wait_until(lambda: held_slot_locks(pg_db, replica), what="slot leases taken", workers=[process])
    process.send(signal.SIGUSR1)
    wait_until(lambda: "_fetch_forever" in process.log(), what="the stacks in the log", workers=[process])
    log = process.log()
    assert "Thread fetcher-1 (most recent call last):" in log
    assert "Task lane-1 on the call loop" in log and "_serve_forever" in log  # the lanes too
    row_id = pg_db.insert("order.paid", "order-1", {})
    wait_until(lambda: pg_db.gone(row_id), what="the message correlated after the dump", workers=[process])
    assert process.running()


def test_a_call_longer_than_the_grace_is_abandoned_untouched_and_delivered_again(
    pg_db: Database, start_worker: StartWorker
) -> None:
    grace = 1.0
    # Short leases: the slot of the call given up on keeps its lease until it expires (no other replica may
    # call the hint while the call may still run), then the successor takes it over.
    leases = {"lease__duration": "PT6S", "lease__renew_interval": "PT1S", "lease__safety_margin": "PT0.5S",
              "policy__handler_timeout": "PT4S"}
    process = start_worker(pg_db, shutdown__grace="PT1S", **leases)
    replica = replica_of(process)
    row_id = pg_db.insert("order.paid", "order-1", {"sleep_seconds": 20})
    wait_until(lambda: call_started(pg_db, row_id), what="the call to start", workers=[process])

    signalled = time.monotonic()
    process.process.send_signal(signal.SIGTERM)
    code = process.process.wait(timeout=grace + 5)
    took = time.monotonic() - signalled

    assert code == 0
    assert took >= grace, f"exited {took:.2f}s after SIGTERM, before the grace of {grace}s ended"
    row = pg_db.message(row_id)
    assert row is not None, "an abandoned message was deleted"
    assert (row["state"], row["attempt"], row["next_attempt_at"], row["last_error"]) == ("ready", 0, None, None)
    [call] = pg_db.calls_of(row_id)
    assert call.ended_at is None
    assert held_slot_locks(pg_db, replica) == [f"slot:{row['slot']}"]  # only the slot of the running call

    # Delivered again by the next replica (the producer's payload now lets it finish at once).
    pg_db.execute("UPDATE correlation_message SET payload = '{}' WHERE id = %s", (row_id,))
    successor = start_worker(pg_db, **leases)
    wait_until(lambda: pg_db.gone(row_id), what="the message delivered again", workers=[successor])
    assert [(c.attempt, c.outcome) for c in pg_db.calls_of(row_id)] == [(0, None), (0, "ok")]
    assert value(scrape(endpoint(successor)), "correlation_redeliveries_total") == 1


def test_a_second_stop_signal_during_the_grace_exits_at_once(pg_db: Database, tmp_path: Path) -> None:
    grace = 30.0
    process = WorkerProcess(worker_env(pg_db, shutdown__grace="PT30S"), tmp_path / "worker.log", tmp_path)
    try:
        process.wait_ready()
        row_id = pg_db.insert("order.paid", "order-1", {"sleep_seconds": 20})
        wait_until(lambda: call_started(pg_db, row_id), what="the call to start", workers=[process])
        process.process.send_signal(signal.SIGTERM)
        wait_until(
            lambda: "finishing the current message" in process.log(),
            what="the first SIGTERM to be taken",
            workers=[process],
        )

        signalled = time.monotonic()
        process.process.send_signal(signal.SIGTERM)
        process.process.wait(timeout=grace / 3)
        took = time.monotonic() - signalled
    finally:
        if process.running():
            process.process.kill()
            process.process.wait()
    assert took < grace / 3
    row = pg_db.message(row_id)
    assert row is not None and (row["state"], row["attempt"]) == ("ready", 0)


# -- logs ------------------------------------------------------------------------------------------------------


def test_json_logs_are_one_object_per_line_with_time_level_logger_replica_and_message(
    pg_db: Database, start_worker: StartWorker
) -> None:
    routes = {"*": "recorder:handle", "order.noisy": "test_service:noisy"}
    process = start_worker(pg_db, log__format="json", correlators=json.dumps(routes), policy__backoff_unit="PT1H")
    done = pg_db.insert("order.paid", "order-1", {})
    failed = pg_db.insert("order.noisy", "order-2", {})
    wait_until(
        lambda: pg_db.gone(done) and (pg_db.message(failed) or {}).get("attempt") == 1,
        what="both messages correlated",
        workers=[process],
    )
    assert process.stop() == 0

    records = []
    for line in lines(process.log()):
        try:
            record = json.loads(line)
        except ValueError:
            pytest.fail(f"not a JSON object: {line!r}")
        assert isinstance(record, dict), line
        records.append(record)
    assert len(records) >= 5
    replica = records[0]["replica"]
    assert re.fullmatch(r"acceptance-[0-9a-f]{8}", replica), replica
    for record in records:
        missing = {"time", "level", "logger", "replica", "message"} - set(record)
        assert not missing, f"{record} lacks {missing}"
        assert record["replica"] == replica
        assert record["level"] in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}
    noisy_records = [record for record in records if record["logger"] == "shop.handlers"]
    assert len(noisy_records) == 1 and "RuntimeError: target refused message" in json.dumps(noisy_records)
    assert any(record["message"] == f"replica {replica} stopped" for record in records)


TEXT_LINE = re.compile(
    r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) acceptance-[0-9a-f]{8} [\w.]+: "
)


def test_text_logs_keep_each_event_with_its_traceback_on_one_line(pg_db: Database, start_worker: StartWorker) -> None:
    routes = {"*": "recorder:handle", "order.noisy": "test_service:noisy"}
    process = start_worker(pg_db, log__format="text", correlators=json.dumps(routes), policy__backoff_unit="PT1H")
    failed = pg_db.insert("order.noisy", "order-2", {})
    wait_until(
        lambda: (pg_db.message(failed) or {}).get("attempt") == 1, what="the failure recorded", workers=[process]
    )
    assert process.stop() == 0

    log_lines = lines(process.log())
    for line in log_lines:
        assert TEXT_LINE.match(line), f"not a log event of its own: {line!r}"
    [event] = [line for line in log_lines if " shop.handlers: " in line]
    assert "could not correlate order.noisy:" in event and "will retry" in event
    assert "Traceback (most recent call last):" in event
    assert f"RuntimeError: target refused message {failed}" in event


def test_the_database_password_never_appears_in_logs_or_in_check_config(
    pg_db: Database, start_worker: StartWorker
) -> None:
    secret_url = with_password(pg_db.url)
    process = start_worker(pg_db, database__url=secret_url)
    row_id = pg_db.insert("order.paid", "order-1", {})
    wait_until(lambda: pg_db.gone(row_id), what="a message correlated", workers=[process])
    assert process.stop() == 0
    log = process.log()
    assert "postgres:***@" in log, "the database is named in the log, its password hidden"
    assert PASSWORD not in log

    checked = cli(pg_db, "check-config", database__url=secret_url)
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout)["database"]["url"] == with_password(pg_db.url).replace(PASSWORD, "***")
    assert PASSWORD not in checked.stdout + checked.stderr

    refused = cli(pg_db, "check-config", database__url=f"mysql://shop:{PASSWORD}@db.example/shop")
    assert refused.returncode == 2
    assert "CORRELATION_DATABASE__URL" in refused.stderr
    assert PASSWORD not in refused.stdout + refused.stderr


# -- configuration -------------------------------------------------------------------------------------------


def test_check_config_prints_the_effective_configuration_with_defaults_and_overrides(pg_db: Database) -> None:
    result = cli(pg_db, "check-config", policy__max_retries="7", policies='{"order.paid": {"max_retries": 3}}')

    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    # Overrides from the environment...
    assert config["poll"]["interval"] == "PT0.1S"
    assert parse_duration(config["poll"]["initial_delay"]) == timedelta(0)
    assert config["policy"]["max_retries"] == 7
    assert config["policies"]["order.paid"]["max_retries"] == 3
    assert config["replica"]["name"] == "acceptance"
    assert config["metrics"]["port"] == 0
    # ...and the defaults of DESIGN.md §6.
    assert config["poll"]["page_size"] == 100
    assert (config["cleanup"]["initial_delay"], config["cleanup"]["interval"]) == ("PT1M", "PT1M")
    assert (config["policy"]["mode"], config["policy"]["batch_size"]) == ("fail_first", -1)
    assert config["policy"]["time_to_live"] is None
    assert config["policy"]["backoff_unit"] == "PT1M" and config["policy"]["backoff_base"] == 2.0
    assert config["policy"]["backoff_cap"] == "PT3H" and config["policy"]["jitter"] == "none"
    assert config["policy"]["handler_timeout"] == "PT30S"
    assert config["correlators"] == {"*": "recorder:handle"}


@pytest.mark.parametrize("subcommand", ["run", "check-config"])
def test_a_bad_setting_stops_the_command_with_exit_2_and_one_line_naming_it(pg_db: Database, subcommand: str) -> None:
    result = cli(pg_db, subcommand, poll__interval="P1M")

    assert result.returncode == 2
    assert result.stdout == ""
    [line] = lines(result.stderr)
    assert "CORRELATION_POLL__INTERVAL" in line and "P1M" in line


# -- the console -------------------------------------------------------------------------------------------------


def test_without_a_token_the_console_is_off_and_the_log_says_how_to_turn_it_on(
    pg_db: Database, start_worker: StartWorker
) -> None:
    process = start_worker(pg_db)
    base = endpoint(process)
    assert http_get(base + "/api/v1/status")[0] == 404
    assert http_get(base + "/ui/")[0] == 404
    assert http_get(base + "/healthz") == (200, "ok\n")
    assert "the console (/api/v1 and /ui) is off: set CORRELATION_ADMIN__TOKEN" in process.log()


def test_with_a_token_the_replica_serves_the_console_beside_the_metrics(
    pg_db: Database, start_worker: StartWorker
) -> None:
    token = "acceptance-token-0123456789"
    process = start_worker(pg_db, admin__token=token)
    base = endpoint(process)
    pg_db.insert("order.paid", "order-1", {})
    request = urllib.request.Request(base + "/api/v1/status", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        shown = json.loads(response.read())
    assert set(shown["messages"]) == {"ready", "waiting", "paused", "dead", "expired"}
    assert http_get(base + "/api/v1/status")[0] == 401
    assert http_get(base + "/metrics")[0] == 200
    assert token not in process.log()


def test_readiness_turns_red_naming_a_table_dropped_under_a_running_worker(
    any_db: Database, start_worker: StartWorker
) -> None:
    process = start_worker(any_db, correlators=json.dumps({"*": "log"}), poll__interval="PT0.2S")
    base = endpoint(process)
    assert http_get(base + "/readyz") == (200, "ready\n")
    any_db.execute("DROP TABLE correlation_message")

    status, reason = readiness_turns_red(base, process)
    assert status == 503
    assert len(lines(reason)) == 1 and "lacks table correlation_message" in reason, reason


def test_sessions_ended_under_the_pool_leave_a_healthy_database_ready(
    pg_db: Database, start_worker: StartWorker
) -> None:
    # The sessions of the pool's idle connections end (a server restart, a failover, an operator ending them)
    # while the database itself is fine: the probe that meets such a connection first asks again on a fresh
    # one instead of calling the replica unready (the pool replaces the connections opened before).
    process = start_worker(pg_db, correlators=json.dumps({"*": "log"}), poll__interval="PT30S",
                           lease__duration="PT60S", lease__renew_interval="PT20S")
    base = endpoint(process)
    name = pg_db.execute("SELECT current_database() AS name")[0]["name"]
    others = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()"
    for _ in range(3):
        assert http_get(base + "/readyz") == (200, "ready\n")
        pg_db.execute(others, (name,))
        assert http_get(base + "/readyz") == (200, "ready\n")
    assert process.running()


def test_a_read_only_database_makes_the_replica_not_ready_and_its_failed_writes_counted(
    pg_db: Database, start_worker: StartWorker
) -> None:
    process = start_worker(pg_db, correlators=json.dumps({"*": "log"}), poll__interval="PT0.2S",
                           lease__renew_interval="PT0.5S")
    base = endpoint(process)
    first = pg_db.insert("order.paid", "order-1", {})
    wait_until(lambda: pg_db.gone(first), what="a message correlated", workers=[process])
    name = pg_db.execute("SELECT current_database() AS name")[0]["name"]
    others = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()"

    # A failover onto a standby, as the replica sees it: its new sessions cannot write.
    pg_db.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
    pg_db.execute(others, (name,))

    def not_ready() -> tuple[int, str] | None:
        probe = http_get(base + "/readyz")
        return probe if probe[0] != 200 else None

    answer = wait_until(not_ready, what="/readyz to turn red", workers=[process])
    assert answer is not None and answer[0] == 503
    assert len(lines(answer[1])) == 1 and "read-only" in answer[1], answer
    wait_until(
        lambda: value(scrape(base), "correlation_database_errors_total", kind="read_only") >= 1,
        what="failed writes counted as read_only",
        workers=[process],
    )
    assert process.running()

    pg_db.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
    pg_db.execute(others, (name,))
    wait_until(lambda: http_get(base + "/readyz") == (200, "ready\n"), what="/readyz green again", workers=[process])
    later = pg_db.insert("order.paid", "order-2", {})
    wait_until(lambda: pg_db.gone(later), what="a message correlated after the failover", workers=[process])
    assert "Traceback" not in process.log()


def test_a_thread_of_the_replica_that_dies_stops_it_with_exit_code_1_never_left_running_crippled(
    pg_db: Database, tmp_path: Path
) -> None:
    """Every long-lived thread is supervised: one that dies of an unhandled exception (here the gauges loop, broken
    by the route module's import) is logged once, makes the replica unhealthy and stops it with code 1, so that its
    supervisor starts a whole one. What it had is handed back as at any stop: nothing is lost."""
    waiting = pg_db.insert("order.paid", "order-1", {})
    process = WorkerProcess(worker_env(pg_db, correlators=json.dumps({"*": "dying_gauges:handle"})),
                            tmp_path / "worker.log", tmp_path)
    try:
        process.process.wait(timeout=30)
    finally:
        if process.running():
            process.process.kill()
    log = process.log()
    assert process.returncode() == 1, log
    assert len(lines_with(log, "the gauges thread died")) >= 1 and "ThreadKiller" in log, log
    assert "CRITICAL" in log and "released " in log  # a stop, leases handed back
    left = pg_db.message(waiting)  # delivered before the thread died, or left as it was: never charged or dead
    assert left is None or (left["state"] == "ready" and left["attempt"] == 0), left


def lines_with(log: str, text: str) -> list[str]:
    return [line for line in log.splitlines() if text in line]


def test_a_transactional_call_longer_than_the_grace_is_rolled_back_abandoned_and_delivered_again_uncounted(
    pg_db: Database, start_worker: StartWorker
) -> None:
    """Its transaction holds the call's row: it is ended first (the handler's writes roll back), so that the stop
    writes the abandon mark and the next holder delivers the message again without counting a crash; rolling
    restarts never make a healthy message poison."""
    pg_db.execute(EFFECT_TABLE_DDL)
    route = json.dumps({"*": {"type": "python", "handler": "effects:apply", "transactional": True}})
    leases = {"lease__duration": "PT8S", "lease__renew_interval": "PT1S", "lease__safety_margin": "PT0.5S",
              "policy__handler_timeout": "PT6S", "policy__poison_after": "2", "correlators": route}
    row_id = pg_db.insert("order.paid", "order-1", {"sleep_seconds": 30})
    for restart in range(2):  # two rolling restarts in the middle of the call: with poison_after 2, a crash each
        process = start_worker(pg_db, shutdown__grace="PT1S", **leases)
        wait_until(lambda: bool(pg_db.execute(
            "SELECT 1 FROM correlation_call WHERE message_id = %s AND state <> 'abandoned'", (row_id,))),
            what=f"the call under way ({restart + 1})", workers=[process])
        wait_until(lambda: bool(pg_db.execute("SELECT 1 FROM pg_stat_activity WHERE state = 'idle in transaction'"
                                              " AND query LIKE '%%shop_effect%%'")),
                   what="the handler's write", workers=[process])
        assert process.stop() == 0
        [call] = pg_db.execute("SELECT state FROM correlation_call WHERE message_id = %s", (row_id,))
        assert call["state"] == "abandoned", process.log()
        assert pg_db.execute("SELECT count(*) AS n FROM shop_effect")[0]["n"] == 0  # rolled back
    left = pg_db.message(row_id)
    assert left is not None and (left["state"], left["attempt"], left["crashed_calls"]) == ("ready", 0, 0), left
    pg_db.execute("UPDATE correlation_message SET payload = '{}' WHERE id = %s", (row_id,))
    successor = start_worker(pg_db, **leases)
    wait_until(lambda: pg_db.gone(row_id), what="the message delivered again (not poison)", workers=[successor])
    assert pg_db.execute("SELECT count(*) AS n FROM shop_effect")[0]["n"] == 1


def test_an_outcome_the_database_refuses_to_record_is_called_once_and_shown_on_readyz(
    pg_db: Database, start_worker: StartWorker
) -> None:
    """A BEFORE UPDATE trigger (an audit rule) refuses every update of one hint's messages: neither the outcome
    nor the dead letter can be written. The hint is not called again every poll; /readyz says why; the other
    hints carry on."""
    pg_db.execute(
        "CREATE FUNCTION audit_refuses() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "RAISE EXCEPTION 'audit: hint %% may not change', OLD.correlation_hint; END $$"
    )
    pg_db.execute(
        "CREATE TRIGGER audit BEFORE UPDATE ON correlation_message FOR EACH ROW "
        "WHEN (OLD.correlation_hint = 'audited') EXECUTE FUNCTION audit_refuses()"
    )
    refused = pg_db.insert("order.paid", "audited", {})
    process = start_worker(pg_db, poll__interval="PT0.2S")
    base = endpoint(process)
    wait_until(lambda: http_get(base + "/readyz")[0] == 503, what="not ready", workers=[process])
    status, reason = http_get(base + "/readyz")
    assert status == 503 and "could not be recorded" in reason and "audit: hint audited may not change" in reason
    assert len(lines(reason)) == 1, reason
    others = [pg_db.insert("order.paid", f"order-{n}", {}) for n in range(5)]
    wait_until(lambda: pg_db.gone(*others), what="the other hints correlated", workers=[process])
    time.sleep(1.0)  # five poll intervals: the refused hint is not fetched again meanwhile
    assert len(pg_db.calls_of(refused)) == 1
    assert http_get(base + "/healthz")[0] == 200


def test_a_replica_frozen_in_a_transactional_call_lets_go_of_its_rows_within_the_lease_bound(
    pg_db: Database, start_worker: StartWorker, start_replicas: Any
) -> None:
    """SIGSTOP in the middle of a transactional call: the server ends its session once it sat idle in the
    transaction past the handler timeout, so that the slot's next holder calls the message after the lease,
    not after the freeze; the effect is written once."""
    pg_db.execute(EFFECT_TABLE_DDL)
    route = json.dumps({"*": {"type": "python", "handler": "effects:apply", "transactional": True}})
    settings = {"lease__duration": "PT6S", "lease__renew_interval": "PT1S", "lease__safety_margin": "PT0.5S",
                "policy__handler_timeout": "PT3S", "correlators": route}
    replicas = start_replicas(pg_db, 2, **settings)
    row_id = pg_db.insert("order.paid", "order-1", {"sleep_seconds": 1})
    wait_until(lambda: pg_db.execute("SELECT holder FROM correlation_call WHERE message_id = %s", (row_id,)),
               what="the call under way", workers=replicas)
    [call] = pg_db.execute("SELECT holder FROM correlation_call WHERE message_id = %s", (row_id,))
    frozen = next(process for process in replicas if process.holder() == call["holder"])
    other = next(process for process in replicas if process is not frozen)
    frozen.process.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: pg_db.gone(row_id), what="the message delivered by the other replica", timeout=20,
                   workers=[other])
    finally:
        frozen.process.send_signal(signal.SIGCONT)
    [effect] = pg_db.execute("SELECT replica FROM shop_effect WHERE message = %s", (row_id,))
    assert effect["replica"] == other.name


def test_transactional_calls_on_every_lane_get_a_connection_each_with_the_default_pool(
    pg_db: Database, start_worker: StartWorker
) -> None:
    """Each transactional call holds a connection for its length: 16 lanes of them with the default pool (5 and
    5 more) waited for connections past their handler timeout. The pool holds one per lane when a route is."""
    pg_db.execute(EFFECT_TABLE_DDL)
    route = json.dumps({"*": {"type": "python", "handler": "effects:apply", "transactional": True}})
    process = start_worker(pg_db, correlators=route, poll__concurrency="16", policy__handler_timeout="PT1.5S")
    for n in range(64):
        pg_db.insert("order.paid", f"order-{n % 32}", {"sleep_seconds": 0.8})
    wait_until(lambda: pg_db.execute("SELECT count(*) AS n FROM shop_effect")[0]["n"] == 64,
               what="every effect", workers=[process], timeout=60)
    wait_until(lambda: pg_db.gone(*[row["id"] for row in pg_db.execute("SELECT id FROM correlation_message")]),
               what="every message recorded", workers=[process])
    assert "did not return within" not in process.log(), process.log()[-3000:]
    assert all(row["attempt"] == 0 for row in pg_db.execute("SELECT attempt FROM correlation_message"))


def test_a_transactional_route_on_sqlite_makes_one_call_at_a_time_and_charges_no_timeout(
    sqlite_db: Database, start_worker: StartWorker
) -> None:
    """A transactional call holds SQLite's one write lock for its length: lanes beside it waited for it past their
    handler timeouts and were charged. The replica makes one call at a time, and says so."""
    sqlite_db.execute(EFFECT_TABLE_DDL)
    route = json.dumps({"*": {"type": "python", "handler": "effects:apply", "transactional": True}})
    process = start_worker(sqlite_db, correlators=route, poll__concurrency="4", policy__handler_timeout="PT1.5S")
    for n in range(6):
        sqlite_db.insert("order.paid", f"order-{n}", {"sleep_seconds": 0.8})
    wait_until(lambda: sqlite_db.execute("SELECT count(*) AS n FROM shop_effect")[0]["n"] == 6,
               what="every effect", workers=[process], timeout=60)
    assert "did not return within" not in process.log(), process.log()[-3000:]
    assert all(row["attempt"] == 0 for row in sqlite_db.execute("SELECT attempt FROM correlation_message"))
    assert "transactional route on SQLite: one call at a time" in process.log()
