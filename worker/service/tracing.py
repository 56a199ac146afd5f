"""OpenTelemetry traces (the ``otel`` extra): a span per correlator call, the producer's context carried through.

Off, at no cost, unless the extra is installed and an exporter is configured by the SDK's own environment
variables (``OTEL_TRACES_EXPORTER`` other than ``none``, or an ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``); then
``OTEL_SERVICE_NAME`` (default ``correlation-worker``), ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``,
``OTEL_EXPORTER_OTLP_*`` and ``OTEL_BSP_*`` apply as the SDK reads them.

- Each call is a ``CONSUMER`` span ``process <message_name>`` with the messaging semantic conventions'
  attributes; its status and an exception event tell the outcome (retry, not yet, dead, timeout).
- A W3C ``traceparent`` (and ``tracestate``) in the message's ``headers`` is the producer's context: linked to the
  call span by default, or its parent with ``CORRELATION_TRACING__PRODUCER_CONTEXT=parent``. A message delivered
  again links to the same producer.
- The aiohttp client is instrumented: the http, camunda7 and camunda8 correlators' requests are ``CLIENT`` spans
  under the call span and carry its ``traceparent`` onward.
- A schedule's fire is a ``PRODUCER`` span ``publish <message_name>`` whose context the message carries.
- Log lines written while a span is current carry ``trace_id`` and ``span_id``.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from worker.message import Message

logger = logging.getLogger(__name__)

SYSTEM = "correlation_worker"
TRACEPARENT, TRACESTATE = "traceparent", "tracestate"


def exporters_configured(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The span exporters the environment asks for (none: tracing stays off)."""
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names and (environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        names = ["otlp"]
    return [n for n in names if n != "none"]


class Tracing:
    """Spans of one process, on its own tracer provider."""

    def __init__(self, provider: Any, *, replica: str, producer_context: str = "link") -> None:
        from opentelemetry import trace
        from opentelemetry.propagate import extract, inject

        self.provider = provider
        self.tracer = provider.get_tracer("correlation-worker")
        self.replica = replica
        self.parent = producer_context == "parent"
        self._trace, self._extract, self._inject = trace, extract, inject

    @classmethod
    def from_environment(cls, *, replica: str, producer_context: str = "link") -> Tracing | None:
        """Tracing as the OTEL_* variables configure it, or None when it is off (nothing imported)."""
        wanted = exporters_configured()
        if not wanted:
            return None
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            logger.warning(
                "OTEL_TRACES_EXPORTER asks for traces but the otel extra is not installed: "
                "pip install '.[otel]' in a clone of correlation-worker; no traces are sent"
            )
            return None
        exporters = {name: exporter for name in wanted if (exporter := _exporter(name)) is not None}
        if not exporters:  # each name said why it was refused: no spans would go anywhere
            return None
        attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "correlation-worker"}
        provider = TracerProvider(resource=Resource.create(attributes))  # the sampler from OTEL_TRACES_SAMPLER
        for exporter in exporters.values():
            provider.add_span_processor(BatchSpanProcessor(exporter))
        tracing = cls(provider, replica=replica, producer_context=producer_context)
        tracing.instrument_client()
        logger.info("tracing on: spans go to %s", ", ".join(exporters))
        return tracing

    def instrument_client(self) -> None:
        """Client spans for every request of the network correlators (aiohttp), carrying the current context
        onward (``traceparent``)."""
        try:
            from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor
        except ImportError:
            logger.warning("opentelemetry-instrumentation-aiohttp-client is missing: engine calls get no client spans")
            return
        AioHttpClientInstrumentor().instrument(tracer_provider=self.provider)

    def producer(self, message: Message) -> Any:
        """The producer's span context from the message's ``traceparent`` header, or None."""
        carrier = {
            key: value for key in (TRACEPARENT, TRACESTATE)
            if isinstance(value := message.headers.get(key), str)
        }
        if TRACEPARENT not in carrier:
            return None
        context = self._extract(carrier)
        span_context = self._trace.get_current_span(context).get_span_context()
        return (context, span_context) if span_context.is_valid else None

    @contextmanager
    def call(self, message: Message) -> Iterator[CallSpan]:
        """The span of one correlator call, current while it runs; ended when the block ends."""
        from opentelemetry.trace import Link, SpanKind

        producer = self.producer(message)
        context, links = None, []
        if producer is not None:
            if self.parent:
                context = producer[0]
            else:
                links = [Link(producer[1])]
        attributes = {
            "messaging.system": SYSTEM,
            "messaging.operation.name": "process",
            "messaging.operation.type": "process",
            "messaging.destination.name": message.name,
            "messaging.message.id": message.message_id or str(message.id),
            "messaging.message.conversation_id": message.hint,
            "correlation_worker.message.row_id": message.id,
            "correlation_worker.attempt": message.attempt,
            "correlation_worker.redelivered": message.redelivered,
            "correlation_worker.slot": message.slot,
            "correlation_worker.replica": self.replica,
        }
        span = self.tracer.start_span(
            f"process {message.name}", context=context, kind=SpanKind.CONSUMER, links=links, attributes=attributes
        )
        handle = CallSpan(span)
        try:
            with self._trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                yield handle
        finally:
            span.end()

    @contextmanager
    def publish(self, message_name: str, schedule: str) -> Iterator[dict[str, str]]:
        """A schedule's publish span; yields the headers (``traceparent``) its messages carry."""
        from opentelemetry.trace import SpanKind

        attributes = {
            "messaging.system": SYSTEM,
            "messaging.operation.name": "publish",
            "messaging.operation.type": "send",
            "messaging.destination.name": message_name,
            "correlation_worker.schedule": schedule,
            "correlation_worker.replica": self.replica,
        }
        with self.tracer.start_as_current_span(
            f"publish {message_name}", kind=SpanKind.PRODUCER, attributes=attributes
        ):
            carrier: dict[str, str] = {}
            self._inject(carrier)
            yield {key: carrier[key] for key in (TRACEPARENT, TRACESTATE) if key in carrier}

    def shutdown(self) -> None:
        """Send the spans still buffered, then stop."""
        self.provider.shutdown()


class CallSpan:
    """What a call's outcome writes on its span."""

    def __init__(self, span: Any) -> None:
        self.span = span

    def outcome(self, outcome: str, error: BaseException | None) -> None:
        """The outcome (success, retry, buffered, rescheduled, dead, timeout) and, unless success, its error."""
        from opentelemetry.trace import Status, StatusCode

        self.span.set_attribute("correlation_worker.outcome", outcome)
        if error is None:
            return
        error_type = "timeout" if outcome == "timeout" else type(error).__name__
        self.span.set_attribute("error.type", error_type)
        try:
            self.span.record_exception(error, attributes={"correlation_worker.outcome": outcome})
        except Exception:  # an exception whose str() fails: the span says what it can, the call's outcome stands
            attributes = {"exception.type": type(error).__name__, "correlation_worker.outcome": outcome}
            self.span.add_event("exception", attributes)
        if outcome != "rescheduled":  # not yet is no error: the process was not waiting
            self.span.set_status(Status(StatusCode.ERROR, f"{outcome}: {type(error).__name__}"))


def _exporter(name: str) -> Any:
    """The span exporter an OTEL_TRACES_EXPORTER name stands for (otlp by its protocol, console)."""
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        logger.warning("OTEL_TRACES_EXPORTER %r is not known here (otlp, console, none): ignored", name)
        return None
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    try:
        module = "grpc" if protocol == "grpc" else "http"
        exporters = importlib.import_module(f"opentelemetry.exporter.otlp.proto.{module}.trace_exporter")
    except ImportError:
        logger.warning("the OTLP exporter for protocol %r is not installed: no traces are sent", protocol)
        return None
    return exporters.OTLPSpanExporter()


class TraceFilter(logging.Filter):
    """Adds ``trace_id`` and ``span_id`` to a log record written while a span is current (JSON: two fields; text:
    appended to the message)."""

    def __init__(self, *, text: bool) -> None:
        super().__init__()
        from opentelemetry import trace

        self._current = trace.get_current_span
        self._text = text

    def filter(self, record: logging.LogRecord) -> bool:
        """Never drops a record; only adds the ids."""
        context = self._current().get_span_context()
        if context.is_valid and not hasattr(record, "trace_id"):
            trace_id, span_id = format(context.trace_id, "032x"), format(context.span_id, "016x")
            record.__dict__.update(trace_id=trace_id, span_id=span_id)
            if self._text:
                record.msg = f"{record.msg} [trace_id={trace_id} span_id={span_id}]"
        return True


def add_trace_ids(*, text: bool) -> None:
    """Every log handler of the process adds the current span's ids to its lines."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(TraceFilter(text=text))
