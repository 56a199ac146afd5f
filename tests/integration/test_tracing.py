"""The call and publish spans, with OpenTelemetry's in-memory exporter: attributes, the producer as a link or the
parent, outcomes as status and exception events, trace ids on log lines; and tracing off unless configured."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.unit.factories import message
from worker.config import ConfigError
from worker.policy.outcomes import HandlerTimeout, PermanentError, Reschedule, Retry
from worker.service.tracing import TraceFilter, Tracing, check_environment, exporters_configured

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{SPAN}-01"


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    exporter.clear()


def tracing(exporter: InMemorySpanExporter, producer_context: str = "link") -> Tracing:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, replica="pod-1-abcd", producer_context=producer_context)


def test_a_call_span_carries_the_messaging_attributes_and_links_the_producer(exported: InMemorySpanExporter) -> None:
    row = message(42, "order-7", message_id="shop-42", headers={"traceparent": TRACEPARENT}, attempt=2, slot=9)
    with tracing(exported).call(row) as span:
        span.outcome("success", None)
    [call] = exported.get_finished_spans()
    assert call.name == "process order.paid" and call.kind is SpanKind.CONSUMER
    assert dict(call.attributes or {}) == {
        "messaging.system": "correlation_worker",
        "messaging.operation.name": "process",
        "messaging.operation.type": "process",
        "messaging.destination.name": "order.paid",
        "messaging.message.id": "shop-42",
        "messaging.message.conversation_id": "order-7",
        "correlation_worker.message.row_id": 42,
        "correlation_worker.attempt": 2,
        "correlation_worker.redelivered": False,
        "correlation_worker.slot": 9,
        "correlation_worker.replica": "pod-1-abcd",
        "correlation_worker.outcome": "success",
    }
    [link] = call.links
    assert format(link.context.trace_id, "032x") == TRACE and format(link.context.span_id, "016x") == SPAN
    assert call.parent is None and format(call.context.trace_id, "032x") != TRACE
    assert call.status.status_code is StatusCode.UNSET


def test_a_message_delivered_again_links_the_same_producer(exported: InMemorySpanExporter) -> None:
    spans = tracing(exported)
    for lost in (0, 1):
        with spans.call(message(1, headers={"traceparent": TRACEPARENT}, lost_calls=lost)) as span:
            span.outcome("success", None)
    first, again = exported.get_finished_spans()
    assert again.attributes is not None and again.attributes["correlation_worker.redelivered"] is True
    assert [link.context.span_id for link in first.links] == [link.context.span_id for link in again.links]


def test_parent_mode_makes_the_producer_the_parent(exported: InMemorySpanExporter) -> None:
    with tracing(exported, "parent").call(message(1, headers={"traceparent": TRACEPARENT})) as span:
        span.outcome("success", None)
    [call] = exported.get_finished_spans()
    assert format(call.context.trace_id, "032x") == TRACE and call.parent is not None
    assert format(call.parent.span_id, "016x") == SPAN and call.links == ()


@pytest.mark.parametrize("traceparent", [None, "", "00-zz-yy-01", "00-" + "0" * 32 + "-" + "0" * 16 + "-01", 7])
def test_no_or_a_broken_traceparent_is_a_span_without_a_link(
    exported: InMemorySpanExporter, traceparent: object
) -> None:
    headers = {} if traceparent is None else {"traceparent": traceparent}
    with tracing(exported).call(message(1, headers=headers)) as span:
        span.outcome("success", None)
    assert exported.get_finished_spans()[0].links == ()


@pytest.mark.parametrize(
    ("outcome", "error", "status", "error_type"),
    [
        ("retry", Retry("engine busy"), StatusCode.ERROR, "Retry"),
        ("buffered", ConnectionError("refused"), StatusCode.ERROR, "ConnectionError"),
        ("dead", PermanentError("bad request"), StatusCode.ERROR, "PermanentError"),
        ("timeout", HandlerTimeout("no answer in PT30S"), StatusCode.ERROR, "timeout"),
        ("rescheduled", Reschedule("no process waits yet"), StatusCode.UNSET, "Reschedule"),
    ],
)
def test_an_outcome_is_the_spans_status_and_exception_event(
    exported: InMemorySpanExporter, outcome: str, error: BaseException, status: StatusCode, error_type: str
) -> None:
    with tracing(exported).call(message(1)) as span:
        span.outcome(outcome, error)
    [call] = exported.get_finished_spans()
    assert call.status.status_code is status
    assert call.attributes is not None and call.attributes["error.type"] == error_type
    assert call.attributes["correlation_worker.outcome"] == outcome
    [event] = call.events
    assert event.name == "exception" and event.attributes is not None
    assert event.attributes["exception.message"] == str(error)


def test_a_publish_span_gives_its_context_to_the_message(exported: InMemorySpanExporter) -> None:
    with tracing(exported).publish("tick", "ticker") as headers:
        pass
    [publish] = exported.get_finished_spans()
    assert publish.name == "publish tick" and publish.kind is SpanKind.PRODUCER
    trace_id, span_id = format(publish.context.trace_id, "032x"), format(publish.context.span_id, "016x")
    assert headers["traceparent"].startswith(f"00-{trace_id}-{span_id}-")  # then the flags: sampled


def test_log_lines_inside_a_span_carry_its_ids(exported: InMemorySpanExporter) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign,assignment]
    handler.addFilter(TraceFilter(text=True))
    log = logging.getLogger("test.tracing")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        log.info("outside")
        with tracing(exported).call(message(1)) as span:
            log.info("inside %s", "the call")
            span.outcome("success", None)
    finally:
        log.removeHandler(handler)
    [call] = exported.get_finished_spans()
    outside, inside = records
    assert not hasattr(outside, "trace_id") and outside.getMessage() == "outside"
    ids = format(call.context.trace_id, "032x"), format(call.context.span_id, "016x")
    assert (inside.__dict__["trace_id"], inside.__dict__["span_id"]) == ids
    assert inside.getMessage() == f"inside the call [trace_id={ids[0]} span_id={ids[1]}]"


@pytest.mark.parametrize(
    ("environ", "wanted"),
    [
        ({}, []),
        ({"OTEL_TRACES_EXPORTER": "none"}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "otlp, console"}, ["otlp", "console"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, []),
    ],
)
def test_tracing_is_on_only_when_an_exporter_is_configured(environ: dict[str, str], wanted: list[str]) -> None:
    assert exporters_configured(environ) == wanted


def test_off_by_default_without_importing_the_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert Tracing.from_environment(replica="r") is None


def test_an_exception_whose_text_cannot_be_read_still_ends_its_span_with_the_outcome(
    exported: InMemorySpanExporter,
) -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    with tracing(exported).call(message(1)) as span:
        span.outcome("retry", Unprintable())
    [call] = exported.get_finished_spans()
    assert call.status.status_code is StatusCode.ERROR and call.attributes is not None
    assert call.attributes["error.type"] == "Unprintable"
    assert [event.name for event in call.events] == ["exception"]


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("OTEL_BSP_MAX_QUEUE_SIZE", "-1", "'-1' is not a whole number of at least 1"),
        ("OTEL_BSP_MAX_QUEUE_SIZE", "0", "'0' is not a whole number of at least 1"),
        ("OTEL_BSP_SCHEDULE_DELAY", "abc", "'abc' is not a whole number of at least 1"),
        ("OTEL_BSP_EXPORT_TIMEOUT", "-5", "'-5' is not a whole number of at least 0"),
        ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4096", "4096 is more than the queue holds (OTEL_BSP_MAX_QUEUE_SIZE, 2048)"),
        ("OTEL_BLRP_MAX_QUEUE_SIZE", "many", "'many' is not a whole number"),
        ("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "-1", "'-1' is not a whole number of at least 0"),
        ("OTEL_SDK_DISABLED", "yes", "'yes' is neither true nor false"),
        ("OTEL_EXPORTER_OTLP_INSECURE", "1", "'1' is neither true nor false"),
        ("OTEL_TRACES_EXPORTER", "zipkin", "'zipkin' is not one of otlp, console, none"),
        ("OTEL_TRACES_EXPORTER", "otlp,jaeger", "'jaeger' is not one of otlp, console, none"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "bogus", "'bogus' is not one of grpc, http/protobuf"),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json", "'http/json' is not one of grpc, http/protobuf"),
        ("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd", "'zstd' is not one of gzip, deflate, none"),
        ("OTEL_TRACES_SAMPLER", "sometimes", "'sometimes' is not one of always_on"),
        ("OTEL_TRACES_SAMPLER_ARG", "1.5", "'1.5' is not a number from 0 to 1"),
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "ten", "'ten' is not a number of seconds"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "notaurl", "'notaurl' is not an http(s) URL with a host"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318", "'collector:4318' is not an http(s) URL"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:99999/v1/traces", "is not a URL"),
        ("OTEL_EXPORTER_OTLP_HEADERS", "Bearer s3cret-token", "is not a comma-separated list of key=value pairs"),
        ("OTEL_RESOURCE_ATTRIBUTES", "=eu", "is not a comma-separated list of key=value pairs"),
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/nonexistent/ca.pem", "'/nonexistent/ca.pem' is not a readable file"),
        ("OTEL_PROPAGATORS", "b3", "'b3' is not one of baggage, tracecontext, none"),
        ("OTEL_EXPORTER_OTLP_ENDPONT", "http://c:4318", "is not an OpenTelemetry setting; did you mean "
         "OTEL_EXPORTER_OTLP_ENDPOINT?"),
        ("OTEL_SERVICENAME", "orders", "did you mean OTEL_SERVICE_NAME?"),
        ("OTEL_TRACE_EXPORTER", "otlp", "did you mean OTEL_TRACES_EXPORTER?"),
        ("OTEL_BSP_MAX_QUEUE", "10", "did you mean OTEL_BSP_MAX_QUEUE_SIZE?"),
    ],
)
def test_a_malformed_or_misspelt_otel_variable_is_refused_in_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, said: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as raised:
        Tracing.from_environment(replica="r")  # whether tracing would be on or not
    text = str(raised.value)
    assert text.startswith("invalid setting OTEL_") and name in text and said in text, text
    assert "\n" not in text and "s3cret" not in text


@pytest.mark.parametrize(
    "environ",
    [
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector.example.com:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
         "OTEL_BSP_MAX_QUEUE_SIZE": "4096", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4096", "OTEL_SDK_DISABLED": "FALSE",
         "OTEL_EXPORTER_OTLP_HEADERS": "api-key=abc,x-team=orders", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
         "OTEL_TRACES_SAMPLER_ARG": "0.25", "OTEL_EXPORTER_OTLP_TIMEOUT": "2.5",
         "OTEL_PROPAGATORS": "tracecontext,baggage", "OTEL_PYTHON_LOG_CORRELATION": "true",
         "OTEL_METRICS_EXPORTER": "none"},
    ],
)
def test_well_formed_otel_variables_pass_without_a_word(environ: dict[str, str]) -> None:
    assert check_environment(environ) == []


def test_kubernetes_service_links_of_a_service_named_otel_pass_without_a_word() -> None:
    links = {"OTEL_SERVICE_HOST": "10.0.0.9", "OTEL_PORT": "tcp://10.0.0.9:4318", "OTEL_PORT_4318_TCP_ADDR": "10.0.0.9",
             "OTEL_COLLECTOR_SERVICE_PORT_OTLP_HTTP": "4318"}
    assert check_environment(links) == []


def test_an_otel_name_far_from_any_known_one_is_a_warning_not_a_refusal() -> None:
    """The OpenTelemetry Operator injects OTEL_POD_IP and OTEL_NODE_IP into pods it instruments."""
    assert check_environment({"OTEL_POD_IP": "10.0.0.7"}) == [
        "OTEL_POD_IP is not an OpenTelemetry setting the worker knows: ignored"
    ]


def test_otel_sdk_disabled_means_no_tracing_even_with_an_exporter(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "True")
    with caplog.at_level(logging.INFO, logger="worker.service.tracing"):
        assert Tracing.from_environment(replica="r") is None
    assert "tracing off: OTEL_SDK_DISABLED=true" in caplog.text and "tracing on" not in caplog.text
