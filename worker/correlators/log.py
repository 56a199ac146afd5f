"""The ``log`` correlator: logs each message and succeeds. The default, for a first run."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from worker.message import Message
from worker.service.logs import log_fields

logger = logging.getLogger("worker.correlators.log")


class LogCorrelator:
    """Logs the message (name, hint, id, payload) at INFO."""

    def __call__(self, message: Message) -> None:
        """Log one message."""
        logger.info(
            "correlated %s hint=%s id=%s attempt=%s payload=%s",
            message.name,
            message.hint,
            message.id,
            message.attempt,
            _json(message.payload),
            extra=log_fields(message),
        )


def _json(value: Any) -> str:
    """The payload as JSON text (the log line bounds its length: a huge payload is cut, marked)."""
    return json.dumps(value, ensure_ascii=False, default=_plain)


def _plain(value: Any) -> Any:
    """Read-only payload values (mappings, tuples) back to JSON-ready ones."""
    if isinstance(value, Mapping):
        return dict(value)
    return str(value)
