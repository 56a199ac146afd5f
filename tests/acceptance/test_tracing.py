"""Traces from a real ``run`` process to an OTLP/HTTP receiver: the call span tied to the producer's
``traceparent``, the engine call's client span and the context it carries onward, outcomes on the span, a
schedule's publish span in its message, trace ids in the log."""

from __future__ import annotations

import json
import secrets
import socket
import time
from collections.abc import Iterator

import pytest
from harness import Database, StartWorker, wait_until

from tests.engines import Answer, FakeCamunda7, FakeCamunda8
from tests.otlp import OtlpReceiver, ReceivedSpan

FAST = {"poll__interval": "PT0.1S", "policy__backoff_unit": "PT0.1S"}


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    collector = OtlpReceiver()
    for name, value in {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": "orders-correlation",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }.items():
        monkeypatch.setenv(name, value)
    yield collector
    collector.close()


@pytest.fixture
def engine() -> Iterator[FakeCamunda7]:
    fake = FakeCamunda7()
    yield fake
    fake.close()


def producer_context() -> tuple[str, str, str]:
    """A producer's trace id, span id and the traceparent header carrying them."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def insert(db: Database, name: str, hint: str, headers: dict[str, str]) -> int:
    rows = db.execute(
        "INSERT INTO correlation_message (message_name, correlation_hint, payload, headers)"
        " VALUES (%s, %s, '{}'::jsonb, %s::jsonb) RETURNING id",
        (name, hint, json.dumps(headers)),
    )
    return int(rows[0]["id"])


def one(spans: list[ReceivedSpan]) -> ReceivedSpan:
    assert len(spans) == 1, spans
    return spans[0]


def test_the_call_span_links_the_producer_and_the_engine_call_carries_its_context_onward(
    pg_db: Database, start_worker: StartWorker, receiver: OtlpReceiver, engine: FakeCamunda7
) -> None:
    route = {"type": "http", "preset": "camunda7", "url": engine.rest}
    # At DEBUG: a success's line (none at the default level) carries the ids of the span it was written in.
    process = start_worker(pg_db, correlators=json.dumps({"*": route}), log__level="DEBUG", **FAST)
    trace_id, span_id, traceparent = producer_context()
    instance = engine.wait_for("invoice.paid", "inv-1")
    row_id = insert(pg_db, "invoice.paid", "inv-1", {"traceparent": traceparent, "tracestate": "shop=1"})
    wait_until(lambda: pg_db.gone(row_id), what="correlated", workers=[process])
    call = wait_until(lambda: receiver.named("process invoice.paid"), what="the call span exported")[0]
    assert call.kind == "SPAN_KIND_CONSUMER" and call.status == "STATUS_CODE_UNSET"
    assert call.links == [(trace_id, span_id)] and call.trace_id != trace_id  # a link, not the parent
    assert call.resource["service.name"] == "orders-correlation"
    attributes = call.attributes
    assert attributes["messaging.system"] == "correlation_worker"
    assert attributes["messaging.operation.name"] == "process" and attributes["messaging.operation.type"] == "process"
    assert attributes["messaging.destination.name"] == "invoice.paid"
    assert attributes["messaging.message.id"] == str(row_id)
    assert attributes["messaging.message.conversation_id"] == "inv-1"
    assert attributes["correlation_worker.attempt"] == 0 and attributes["correlation_worker.redelivered"] is False
    assert attributes["correlation_worker.outcome"] == "success" and "correlation_worker.replica" in attributes
    client = wait_until(
        lambda: [s for s in receiver.spans if s.kind == "SPAN_KIND_CLIENT" and s.parent_span_id == call.span_id],
        what="the engine call's client span",
    )[0]
    assert client.trace_id == call.trace_id and client.attributes.get("http.response.status_code", 200) == 200
    sent = engine.recorded(FakeCamunda7.MESSAGE)[-1].headers["traceparent"]
    assert sent.split("-")[1] == call.trace_id and sent.split("-")[2] == client.span_id
    # The success line (at DEBUG, with the result) names the span it was written in.
    line = next(x for x in process.log().splitlines() if f'"processInstanceId":"{instance}"' in x)
    assert f"trace_id={call.trace_id} span_id={call.span_id}" in line


def test_parent_mode_puts_the_call_in_the_producers_trace_and_a_retry_is_an_error_span(
    pg_db: Database, start_worker: StartWorker, receiver: OtlpReceiver, engine: FakeCamunda7
) -> None:
    route = {"type": "http", "preset": "camunda7", "url": engine.rest}
    engine.queued.append(Answer(500, {"type": "ProcessEngineException", "message": "database busy"}))
    process = start_worker(
        pg_db, correlators=json.dumps({"*": route}), tracing__producer_context="parent", **FAST
    )
    trace_id, span_id, traceparent = producer_context()
    engine.wait_for("invoice.paid", "inv-2")
    row_id = insert(pg_db, "invoice.paid", "inv-2", {"traceparent": traceparent})
    wait_until(lambda: pg_db.gone(row_id), what="correlated after the retry", workers=[process])
    calls = wait_until(lambda: [s for s in receiver.named("process invoice.paid") if len(receiver.named(
        "process invoice.paid")) >= 2], what="both call spans exported")
    failed, succeeded = sorted(calls, key=lambda s: s.attributes["correlation_worker.attempt"])
    for span in (failed, succeeded):
        assert span.trace_id == trace_id and span.parent_span_id == span_id and span.links == []
    assert failed.status == "STATUS_CODE_ERROR" and failed.attributes["error.type"] == "Retry"
    assert failed.attributes["correlation_worker.outcome"] == "retry"
    assert failed.events[0][0] == "exception" and "database busy" in failed.events[0][1]["exception.message"]
    assert succeeded.attributes["correlation_worker.attempt"] == 1 and succeeded.status == "STATUS_CODE_UNSET"


def test_a_schedule_fire_publishes_its_message_with_the_context_of_its_publish_span(
    pg_db: Database, start_worker: StartWorker, receiver: OtlpReceiver
) -> None:
    pg_db.execute(
        "INSERT INTO correlation_schedule (name, cron, message_name, payload) VALUES ('ticker', '* * * * * ?', "
        "'tick', '{}'::jsonb)"
    )
    process = start_worker(pg_db, correlators=json.dumps({"*": "log"}), scheduler__reload_interval="PT0.5S", **FAST)
    publish = wait_until(lambda: receiver.named("publish tick"), what="a publish span", workers=[process])[0]
    assert publish.kind == "SPAN_KIND_PRODUCER" and publish.attributes["correlation_worker.schedule"] == "ticker"
    call = wait_until(
        lambda: [s for s in receiver.named("process tick") if (publish.trace_id, publish.span_id) in s.links],
        what="the published message's call span linked to the publish span", workers=[process],
    )[0]
    assert call.kind == "SPAN_KIND_CONSUMER"


def test_without_an_exporter_no_span_is_made_and_nothing_is_sent(
    pg_db: Database, start_worker: StartWorker, receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    process = start_worker(pg_db, correlators=json.dumps({"*": "log"}), **FAST)
    row_id = insert(pg_db, "invoice.paid", "inv-3", {"traceparent": producer_context()[2]})
    wait_until(lambda: pg_db.gone(row_id), what="correlated", workers=[process])
    process.stop()  # a tracing process sends what it buffered at shutdown: nothing may come
    assert receiver.spans == [] and "trace_id=" not in process.log() and "tracing on" not in process.log()


def test_the_camunda8_correlator_carries_the_context_through_the_sdks_client(
    pg_db: Database, start_worker: StartWorker, receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = FakeCamunda8()
    try:
        for name, value in cluster.env().items():
            monkeypatch.setenv(name, value)
        route = {"type": "camunda8", "mode": "publish"}
        process = start_worker(pg_db, correlators=json.dumps({"*": route}), **FAST)
        trace_id, span_id, traceparent = producer_context()
        row_id = insert(pg_db, "order.created", "o-1", {"traceparent": traceparent})
        wait_until(lambda: pg_db.gone(row_id), what="published", workers=[process])
        call = wait_until(lambda: receiver.named("process order.created"), what="the call span")[0]
        assert call.links == [(trace_id, span_id)]
        client = wait_until(
            lambda: [s for s in receiver.spans if s.kind == "SPAN_KIND_CLIENT" and s.parent_span_id == call.span_id],
            what="the SDK request's client span",
        )[0]
        sent = cluster.recorded(FakeCamunda8.PUBLISH)[-1].headers["traceparent"]
        assert sent.split("-")[1:3] == [call.trace_id, client.span_id]
    finally:
        cluster.close()


def test_a_black_holed_exporter_does_not_hold_sigterm_past_a_few_seconds(
    pg_db: Database, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collector that takes the connection and never answers: the last spans are given up after a bounded wait
    (the exporter's own timeout and retries would hold the exit for half a minute, past Kubernetes' grace)."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as hole:  # listens, never accepts, never answers
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{hole.getsockname()[1]}")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # the call's span waits in the buffer until the stop
        process = start_worker(pg_db, shutdown__grace="PT1S")
        row_id = pg_db.insert("order.paid", "k-1", {})
        wait_until(lambda: pg_db.gone(row_id), what="correlated", workers=[process])
        started = time.monotonic()
        code = process.stop()
        took = time.monotonic() - started
    assert code == 0 and took < 8, f"exit {code} after {took:.1f}s"
    assert "the span exporter did not take the last spans within 3s" in process.log()


def test_otel_sdk_disabled_turns_tracing_off_whatever_else_is_set(
    pg_db: Database, start_worker: StartWorker, receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    process = start_worker(pg_db)
    row_id = pg_db.insert("order.paid", "k-2", {})
    wait_until(lambda: pg_db.gone(row_id), what="correlated", workers=[process])
    assert process.stop() == 0
    assert receiver.spans == [] and "tracing off: OTEL_SDK_DISABLED=true" in process.log()
