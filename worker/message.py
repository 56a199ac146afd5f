"""The message as handlers and the store see it: an immutable value."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any


class MessageState(StrEnum):
    """The ``state`` column. Waiting for a retry is ``ready`` with a future ``next_attempt_at``."""

    READY = "ready"
    PAUSED = "paused"
    DEAD = "dead"


@dataclass(frozen=True, slots=True)
class Message:
    """One row of ``correlation_message``. ``payload`` and ``headers`` are read-only mappings."""

    id: int
    message_id: str | None
    name: str
    hint: str
    payload: Any
    headers: Mapping[str, Any]
    created_at: datetime
    time_to_live: timedelta | None
    expires_at: datetime | None
    attempt: int
    next_attempt_at: datetime | None
    reschedule_count: int
    last_error: str | None
    state: MessageState
    slot: int

    def is_expired(self, now: datetime) -> bool:
        """True once ``expires_at`` has passed: the message is never correlated again."""
        return self.expires_at is not None and self.expires_at <= now

    def is_waiting(self, now: datetime) -> bool:
        """True while a retry, reschedule or buffering delay has not passed yet."""
        return self.next_attempt_at is not None and self.next_attempt_at > now
