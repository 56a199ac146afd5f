"""The ``log`` correlator: logs each message and succeeds. The default, for a first run."""

from __future__ import annotations

import logging

from worker.message import Message

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
            dict(message.payload) if hasattr(message.payload, "items") else message.payload,
            extra={"message_name": message.name, "message_row_id": message.id},
        )
