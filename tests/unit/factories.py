"""Messages for pure tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from worker.message import Message, MessageState

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def message(id: int, hint: str = "h", **fields: Any) -> Message:
    values: dict[str, Any] = {
        "id": id,
        "message_id": None,
        "name": "order.paid",
        "hint": hint,
        "payload": {},
        "headers": {},
        "created_at": T0,
        "time_to_live": None,
        "expires_at": None,
        "attempt": 0,
        "next_attempt_at": None,
        "reschedule_count": 0,
        "last_error": None,
        "state": MessageState.READY,
        "slot": 0,
    }
    values.update(fields)
    return Message(**values)


def seconds(n: float) -> timedelta:
    return timedelta(seconds=n)
