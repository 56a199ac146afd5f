"""A transactional correlator for the acceptance tests (``effects:apply``, route ``{"type": "python",
"handler": "effects:apply", "transactional": true}``).

It inserts one row per call into ``shop_effect`` (no unique constraint: a second commit of the same message
would show as a second row) with the connection of the transaction that records the outcome, then sleeps
``sleep_seconds`` of the payload, so that a replica killed, frozen or cut off from the database is caught with
the row written and not committed.
"""

from __future__ import annotations

import os
import time
from typing import Any

from sqlalchemy import text

from worker import Message

EFFECT_TABLE_DDL = "CREATE TABLE IF NOT EXISTS shop_effect (message bigint NOT NULL, replica text NOT NULL)"


def apply(message: Message, connection: Any) -> dict[str, Any]:
    """Write the message's effect, wait, answer which replica wrote it."""
    replica = os.environ.get("CORRELATION_REPLICA__NAME", "")
    connection.execute(
        text("INSERT INTO shop_effect (message, replica) VALUES (:message, :replica)"),
        {"message": message.id, "replica": replica},
    )
    time.sleep(float(message.payload.get("sleep_seconds", 0)))
    return {"replica": replica}
