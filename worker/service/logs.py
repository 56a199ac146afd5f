"""Logging: one event per line, as text or JSON, every line carrying the replica id.

Every line, in both formats:

- starts from an RFC 3339 UTC timestamp with milliseconds (``2026-11-22T13:40:05.815Z``);
- is **bounded**: the message and each field carry at most :data:`FIELD_LIMIT` characters, and a traceback at
  most as many (its head and its tail, where the exception is), each cut marked ``…[N characters cut]``, so
  that a 5 MB exception message or payload never becomes a 5 MB line;
- has its **control characters escaped** (ESC as ``\\x1b``, CR as ``\\r``, …), whatever a hint, a payload or an
  error carries, so that no input can rewrite a terminal or forge a line; in text, a line break becomes `` | ``
  so that one event stays one line (JSON escapes it as ``\\n``);
- has credentials in URLs masked (:mod:`worker.redact`).

**Structured fields.** JSON lines carry the fields a log call passes as ``extra``; text lines show the message
alone. Build ``extra`` with :func:`log_fields`, which names a message's fields the same way everywhere::

    logger.warning("%s id=%s: %s", m.name, m.id, outcome, extra=log_fields(m, outcome=outcome, next_attempt_at=t))

gives, in JSON, ``message_name``, ``message_id``, ``id``, ``hint``, ``attempt``, ``slot`` and ``outcome``,
``next_attempt_at`` (RFC 3339); ``replica`` is on every line.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from pythonjsonlogger.json import JsonFormatter

from worker.config import LogSettings, format_duration
from worker.message import Message
from worker.redact import redact_text

TEXT_FORMAT = "%(asctime)s %(levelname)s %(replica)s %(name)s: %(message)s"
FIELD_LIMIT = 8192  # characters of one message, one field, one traceback

# C0 controls but tab and line feed, DEL, C1 controls, the Unicode line and paragraph separators, and the invisible
# formatting characters that make text print as something it is not (U+202E turns the rest of a line around).
_CONTROLS = [
    *range(0x00, 0x09), *range(0x0B, 0x20), 0x7F, *range(0x80, 0xA0), 0xAD, 0x061C, 0x180E,
    *range(0x200B, 0x2010), *range(0x2028, 0x202F), *range(0x2060, 0x2070), 0xFEFF,
]
_ESCAPES = {code: f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" for code in _CONTROLS}
_ESCAPES.update({0x0D: "\\r", 0x1B: "\\x1b"})

# Attributes of every LogRecord: an ``extra`` key among them would make logging raise.
_RESERVED = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


def escape_controls(text: str) -> str:
    """The text with every control character but tab and line feed written as an escape (``\\x1b``, ``\\r``)."""
    return text.translate(_ESCAPES)


def bound(text: str, limit: int = FIELD_LIMIT) -> str:
    """At most ``limit`` characters of the text, its head kept, the cut marked."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…[{len(text) - limit} characters cut]"


def bound_middle(text: str, limit: int = FIELD_LIMIT) -> str:
    """At most ``limit`` characters, the head and the tail kept (a traceback's tail names the exception)."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}…[{len(text) - 2 * half} characters cut]…{text[-half:]}"


def clean(text: str, limit: int = FIELD_LIMIT) -> str:
    """Text fit for a log line: credentials masked, bounded, control characters escaped."""
    return escape_controls(bound(redact_text(text), limit))


def rfc3339(timestamp: float) -> str:
    """A POSIX timestamp as RFC 3339 in UTC with milliseconds: ``2026-11-22T13:40:05.815Z``."""
    seconds = int(timestamp)
    millis = int((timestamp - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def _field_value(value: object) -> object:
    if isinstance(value, datetime):
        return rfc3339(value.timestamp())
    if isinstance(value, timedelta):
        return format_duration(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple | set | frozenset):
        return [_field_value(item) for item in value]
    return safe_text(value)


def safe_text(value: object) -> str:
    """``str(value)``, or a note naming its type when that raises (a handler's exception may refuse it)."""
    try:
        return str(value)
    except BaseException as failure:  # an object whose __str__ fails must not break a log call
        return f"<{type(value).__name__}: str() raised {type(failure).__name__}>"


def log_fields(message: Message | None = None, **fields: object) -> dict[str, object]:
    """``extra`` for a log call: a message's identity (name, ids, hint, attempt, slot) and any other fields.

    Datetimes become RFC 3339 text and durations ISO-8601; a name that a log record reserves (``name``,
    ``msg``, ...) gets a trailing underscore instead of breaking the call.
    """
    extra: dict[str, object] = {}
    if message is not None:
        extra.update(
            message_name=message.name,
            message_id=message.message_id,
            id=message.id,
            hint=message.hint,
            attempt=message.attempt,
            slot=message.slot,
        )
    for key, value in fields.items():
        extra[f"{key}_" if key in _RESERVED else key] = _field_value(value)
    return extra


class _ReplicaFilter(logging.Filter):
    def __init__(self, replica: str) -> None:
        super().__init__()
        self.replica = replica

    def filter(self, record: logging.LogRecord) -> bool:
        record.replica = self.replica
        return True


def _bounded_copy(record: logging.LogRecord) -> logging.LogRecord:
    """A copy of the record whose message is formatted and bounded (the original is left to other handlers)."""
    copy = logging.makeLogRecord(record.__dict__)
    copy.msg = bound(redact_text(record.getMessage()))
    copy.args = None
    return copy


class _TextFormatter(logging.Formatter):
    """Text lines, one per event: tracebacks folded onto the line, everything bounded and escaped."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """RFC 3339 UTC with milliseconds."""
        return rfc3339(record.created)

    def formatException(self, ei: Any) -> str:
        """The traceback, bounded around its middle."""
        return bound_middle(redact_text(super().formatException(ei)))

    def formatStack(self, stack_info: str) -> str:
        """The stack, bounded around its middle."""
        return bound_middle(redact_text(super().formatStack(stack_info)))

    def format(self, record: logging.LogRecord) -> str:
        """One line: the message and traceback bounded, credentials masked, control characters escaped."""
        line = super().format(_bounded_copy(record))
        return escape_controls(line).replace("\n", " | ")


class _JsonFormatter(JsonFormatter):
    """One JSON object per line with the record's ``extra`` fields, every text value bounded and escaped."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """RFC 3339 UTC with milliseconds."""
        return rfc3339(record.created)

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        """Bound and escape every value (JSON escapes C0 controls itself; C1 and separators it would not)."""
        return {key: _clean_value(key, value) for key, value in log_data.items()}


def _clean_value(key: str, value: object) -> object:
    if isinstance(value, str):
        if key in ("exc_info", "stack_info"):
            return escape_controls(bound_middle(redact_text(value)))
        return clean(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, Mapping):
        return {str(k): _clean_value(str(k), v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean_value(key, item) for item in value[:1000]]
    return clean(safe_text(value))


def configure_logging(settings: LogSettings, replica: str) -> None:
    """Send every log record to stderr, one line each, in the configured format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ReplicaFilter(replica))
    if settings.format == "json":
        handler.setFormatter(
            _JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(replica)s %(message)s",
                rename_fields={"levelname": "level", "asctime": "time", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(_TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level)
    # Alembic announces its context on every revision check (each /readyz probe): keep only its warnings.
    logging.getLogger("alembic").setLevel(max(logging.WARNING, root.level))
