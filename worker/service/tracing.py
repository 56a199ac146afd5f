"""OpenTelemetry traces (the ``otel`` extra): a span per correlator call, the producer's context carried through.

Off, at no cost, unless the extra is installed and an exporter is configured by the SDK's own environment
variables (``OTEL_TRACES_EXPORTER`` other than ``none``, or an ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``); then
``OTEL_SERVICE_NAME`` (default ``correlation-worker``), ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``,
``OTEL_EXPORTER_OTLP_*`` and ``OTEL_BSP_*`` apply as the SDK reads them. ``OTEL_SDK_DISABLED=true`` keeps it off.
Every ``OTEL_*`` variable is checked first (:func:`check_environment`): a value the SDK would refuse with a
traceback or silently replace is a ConfigError naming the variable, as is a name close to a known one. At stop,
the last spans get :data:`SHUTDOWN_BOUND` seconds to leave.

- Each call is a ``CONSUMER`` span ``process <message_name>`` with the messaging semantic conventions'
  attributes; its status and an exception event tell the outcome (retry, not yet, dead, timeout).
- A W3C ``traceparent`` (and ``tracestate``) in the message's ``headers`` is the producer's context: linked to the
  call span by default, or its parent with ``CORRELATION_TRACING__PRODUCER_CONTEXT=parent``. A message delivered
  again links to the same producer.
- The http, camunda7 and camunda8 correlators' requests are ``CLIENT`` spans under the call span and carry its
  ``traceparent`` onward.
- A schedule's fire is a ``PRODUCER`` span ``publish <message_name>`` whose context the message carries.
- Log lines written while a span is current carry ``trace_id`` and ``span_id``.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import math
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from worker.config import ConfigError, kubernetes_service_link
from worker.message import Message
from worker.redact import redact_url

logger = logging.getLogger(__name__)

SYSTEM = "correlation_worker"
TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
SHUTDOWN_BOUND = 3.0  # seconds the last spans may take to leave as the replica stops


# -- the OTEL_* variables, checked at startup -------------------------------------------------------------------

BOOLEANS = ("true", "false")
EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("grpc", "http/protobuf")  # OpenTelemetry's Python OTLP exporters have no http/json
COMPRESSIONS = ("gzip", "deflate", "none")
SAMPLERS = (
    "always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
    "parentbased_traceidratio",
)
# Each variable of traces this worker's SDK reads, by the kind of value it takes; every other OTEL_* name it knows
# is taken as given (metrics, logs: not sent by the worker).
SIGNALS = ("", "TRACES_", "METRICS_", "LOGS_")
KINDS: dict[str, str] = {
    "OTEL_SDK_DISABLED": "boolean",
    "OTEL_TRACES_EXPORTER": "exporters",
    "OTEL_TRACES_SAMPLER": "sampler",
    "OTEL_TRACES_SAMPLER_ARG": "ratio",
    "OTEL_PROPAGATORS": "propagators",
    "OTEL_SERVICE_NAME": "text",
    "OTEL_RESOURCE_ATTRIBUTES": "pairs",
    **{f"OTEL_{p}_SCHEDULE_DELAY": "positive" for p in ("BSP", "BLRP")},
    **{f"OTEL_{p}_EXPORT_TIMEOUT": "count" for p in ("BSP", "BLRP")},
    **{f"OTEL_{p}_MAX_QUEUE_SIZE": "positive" for p in ("BSP", "BLRP")},
    **{f"OTEL_{p}_MAX_EXPORT_BATCH_SIZE": "positive" for p in ("BSP", "BLRP")},
    **{
        f"OTEL_{name}_LIMIT": "count"
        for name in (
            "ATTRIBUTE_COUNT", "ATTRIBUTE_VALUE_LENGTH", "EVENT_ATTRIBUTE_COUNT", "LINK_ATTRIBUTE_COUNT",
            "SPAN_ATTRIBUTE_COUNT", "SPAN_ATTRIBUTE_VALUE_LENGTH", "SPAN_EVENT_COUNT", "SPAN_LINK_COUNT",
        )
    },
    **{f"OTEL_EXPORTER_OTLP_{signal}ENDPOINT": "url" for signal in SIGNALS},
    **{f"OTEL_EXPORTER_OTLP_{signal}PROTOCOL": "protocol" for signal in SIGNALS},
    **{f"OTEL_EXPORTER_OTLP_{signal}TIMEOUT": "seconds" for signal in SIGNALS},
    **{f"OTEL_EXPORTER_OTLP_{signal}COMPRESSION": "compression" for signal in SIGNALS},
    **{f"OTEL_EXPORTER_OTLP_{signal}INSECURE": "boolean" for signal in SIGNALS},
    **{f"OTEL_EXPORTER_OTLP_{signal}HEADERS": "pairs" for signal in SIGNALS},
    **{f"OTEL_EXPORTER_OTLP_{signal}{file}": "file" for signal in SIGNALS
       for file in ("CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE")},
}
# Names other OpenTelemetry components read (instrumentations, the operator's injected variables): passed, unless
# a name is close to one of the known ones.
OTHER_PREFIXES = ("OTEL_PYTHON_", "OTEL_INSTRUMENTATION_", "OTEL_SEMCONV_")


def check_environment(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Refuse a malformed or misspelt ``OTEL_*`` variable (ConfigError, one line naming it) before tracing starts;
    returns a warning for each unknown name that is not close to a known one (e.g. ``OTEL_POD_IP`` from the
    OpenTelemetry Operator)."""
    known: set[str] = set()
    warnings = []
    for name in sorted(environ):
        if not name.startswith("OTEL_"):
            continue
        value = environ[name]
        if name in KINDS:
            problem = _value_problem(KINDS[name], value.strip())
            if problem is not None:
                raise ConfigError(f"invalid setting {name}: {problem}")
        elif (
            not name.startswith(OTHER_PREFIXES)
            and not kubernetes_service_link(name)
            and name not in (known := known or _known_names())
        ):
            guess = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
            if guess:
                raise ConfigError(f"invalid setting {name}: is not an OpenTelemetry setting; did you mean {guess[0]}?")
            warnings.append(f"{name} is not an OpenTelemetry setting the worker knows: ignored")
    problem = _batch_problem(environ)
    if problem is not None:
        raise ConfigError(problem)
    return warnings


def _known_names() -> set[str]:
    """Every OTEL_* variable of the specification's SDK environment this worker's SDK names (its own list when
    the otel extra is installed)."""
    names = set(KINDS) | {
        "OTEL_LOG_LEVEL", "OTEL_METRICS_EXPORTER", "OTEL_LOGS_EXPORTER", "OTEL_CONFIG_FILE",
        "OTEL_EXPORTER_ZIPKIN_ENDPOINT", "OTEL_EXPORTER_ZIPKIN_TIMEOUT", "OTEL_METRIC_EXPORT_INTERVAL",
        "OTEL_METRIC_EXPORT_TIMEOUT", "OTEL_METRICS_EXEMPLAR_FILTER", "OTEL_EXPERIMENTAL_RESOURCE_DETECTORS",
    }
    for module in ("opentelemetry.environment_variables", "opentelemetry.sdk.environment_variables"):
        try:
            constants = vars(importlib.import_module(module))
        except ImportError:
            continue
        names |= {value for key, value in constants.items() if key.startswith("OTEL_") and isinstance(value, str)}
    return names


def _value_problem(kind: str, value: str) -> str | None:
    """Why ``value`` is not one of ``kind`` (one clause), or None. A value that may be a secret is never shown."""
    shown = repr(value[:60])
    if kind == "boolean":
        return None if value.lower() in BOOLEANS else f"{shown} is neither true nor false"
    if kind in ("exporters", "propagators"):
        allowed = EXPORTERS if kind == "exporters" else _propagators()
        for item in (part.strip() for part in value.split(",")):
            if item and item not in allowed:
                return f"{item!r} is not one of {', '.join(allowed)}"
        return None
    if kind in ("sampler", "protocol", "compression"):
        allowed = {"sampler": SAMPLERS, "protocol": PROTOCOLS, "compression": COMPRESSIONS}[kind]
        return None if value in allowed else f"{shown} is not one of {', '.join(allowed)}"
    if kind in ("positive", "count"):
        least = 1 if kind == "positive" else 0
        if not value.isdigit() or int(value) < least:
            return f"{shown} is not a whole number of at least {least}"
        return None
    if kind in ("ratio", "seconds"):
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number < 0 or (kind == "ratio" and number > 1):
            return f"{shown} is not a number from 0 to 1" if kind == "ratio" else f"{shown} is not a number of seconds"
        return None
    if kind == "url":
        return _url_problem(value)
    if kind == "pairs":
        for pair in filter(None, (part.strip() for part in value.split(","))):
            if not pair.partition("=")[0].strip() or "=" not in pair:
                return "is not a comma-separated list of key=value pairs"
        return None
    if kind == "file":
        return None if os.path.isfile(value) else f"{shown} is not a readable file"
    return None


def _url_problem(url: str) -> str | None:
    shown = repr(redact_url(url))
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a port out of range raises here
    except ValueError as error:
        return f"{shown} is not a URL ({error})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{shown} is not an http(s) URL with a host, e.g. http://otel-collector:4318"
    return None


def _propagators() -> tuple[str, ...]:
    """The propagators installed (entry points of OpenTelemetry's API), and ``none``."""
    from importlib.metadata import entry_points

    return (*sorted({point.name for point in entry_points(group="opentelemetry_propagator")}), "none")


def _batch_problem(environ: Mapping[str, str]) -> str | None:
    """An export batch larger than the queue it is taken from (the SDK refuses it with a traceback)."""
    for processor in ("BSP", "BLRP"):
        queue = environ.get(f"OTEL_{processor}_MAX_QUEUE_SIZE", "").strip()
        batch = environ.get(f"OTEL_{processor}_MAX_EXPORT_BATCH_SIZE", "").strip()
        queue_size = int(queue) if queue.isdigit() else 2048
        if batch.isdigit() and int(batch) > queue_size:
            return (
                f"invalid setting OTEL_{processor}_MAX_EXPORT_BATCH_SIZE: {batch} is more than the queue holds "
                f"(OTEL_{processor}_MAX_QUEUE_SIZE, {queue_size})"
            )
    return None


def tracing_disabled(environ: Mapping[str, str] = os.environ) -> bool:
    """True when ``OTEL_SDK_DISABLED=true``: no tracing at all, whatever else is set."""
    return environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


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
        """Tracing as the OTEL_* variables configure it, or None when it is off (nothing imported). A malformed
        or misspelt OTEL_* variable is a ConfigError naming it."""
        for warning in check_environment():
            logger.warning("%s", warning)
        wanted = exporters_configured()
        if not wanted:
            return None
        if tracing_disabled():
            logger.info("tracing off: OTEL_SDK_DISABLED=true")
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
        # The sampler from OTEL_TRACES_SAMPLER; shut down by the replica as it stops (bounded), not again at exit.
        provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=False)
        for exporter in exporters.values():
            provider.add_span_processor(BatchSpanProcessor(exporter))
        tracing = cls(provider, replica=replica, producer_context=producer_context)
        tracing.instrument_client()
        logger.info("tracing on: spans go to %s", ", ".join(exporters))
        return tracing

    def instrument_client(self) -> None:
        """Client spans for every request of the network correlators, carrying the current context onward
        (``traceparent``)."""
        from worker.correlators.network import trace_requests

        trace_requests(self.tracer, self._inject)

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

    def shutdown(self, bound: float = SHUTDOWN_BOUND) -> None:
        """Send the spans still buffered, then stop; given up after ``bound`` seconds (an exporter that does not
        answer must not hold the replica's exit past its grace: those spans are lost, and the log says so)."""
        done = threading.Event()

        def flush() -> None:
            try:
                self.provider.shutdown()
            except Exception as error:  # an exporter failing at its end: the replica stops all the same
                logger.warning("tracing: the exporter failed as it stopped: %s", error)
            finally:
                done.set()

        threading.Thread(target=flush, name="tracing-shutdown", daemon=True).start()
        if not done.wait(bound):
            logger.warning(
                "tracing: the span exporter did not take the last spans within %gs; stopping without them", bound
            )


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
