"""Logging: one event per line, as text or JSON, every line carrying the replica id."""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter

from worker.config import LogSettings

TEXT_FORMAT = "%(asctime)s %(levelname)s %(replica)s %(name)s: %(message)s"


class _ReplicaFilter(logging.Filter):
    def __init__(self, replica: str) -> None:
        super().__init__()
        self.replica = replica

    def filter(self, record: logging.LogRecord) -> bool:
        record.replica = self.replica
        return True


class _OneLineFormatter(logging.Formatter):
    """Text lines with tracebacks folded onto the same line, so that one event stays one line."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", " | ")


def configure_logging(settings: LogSettings, replica: str) -> None:
    """Send every log record to stderr, one line each, in the configured format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ReplicaFilter(replica))
    if settings.format == "json":
        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(replica)s %(message)s",
                rename_fields={"levelname": "level", "asctime": "time", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(_OneLineFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level)
    # Alembic announces its context on every revision check (each /readyz probe): keep only its warnings.
    logging.getLogger("alembic").setLevel(max(logging.WARNING, root.level))
