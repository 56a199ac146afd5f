"""A small OTLP/HTTP trace receiver on loopback: decodes each ``POST /v1/traces`` (protobuf) into plain spans."""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tests.engines import LoopbackServer


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


@dataclass
class ReceivedSpan:
    """One exported span, its ids as lower-case hex."""

    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    links: list[tuple[str, str]]
    status: str
    events: list[tuple[str, dict[str, Any]]]
    resource: dict[str, Any] = field(default_factory=dict)


class OtlpReceiver(LoopbackServer):
    """Collects the spans exporters send; the endpoint to give them is :attr:`url`."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        super().__init__()

    def handle(self, path: str, raw: bytes, headers: dict[str, str]) -> tuple[int, Any, dict[str, str]]:
        if headers.get("Content-Encoding") == "gzip":
            raw = gzip.decompress(raw)
        if path == "/v1/traces":
            self.take(ExportTraceServiceRequest.FromString(raw))
        return 200, ExportTraceServiceResponse().SerializeToString(), {"Content-Type": "application/x-protobuf"}

    def take(self, request: ExportTraceServiceRequest) -> None:
        """Decode one export into spans."""
        found = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(
                        ReceivedSpan(
                            name=span.name,
                            kind=Span.SpanKind.Name(span.kind),
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                            status=Status.StatusCode.Name(span.status.code),
                            events=[(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in span.events],
                            resource=resource,
                        )
                    )
        with self.lock:
            self.spans.extend(found)

    def named(self, name: str) -> list[ReceivedSpan]:
        """The spans of this name received so far."""
        with self.lock:
            return [span for span in self.spans if span.name == name]

