"""The message as handlers and the store see it: an immutable value, and the limits a row must keep."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

# Limits of a row, enforced by named constraints of the schema and kept by everything the worker writes.
PAYLOAD_MAX_BYTES = 1_048_576  # correlation_message_payload_at_most_1_mib (JSON text, UTF-8)
HEADERS_MAX_BYTES = 65_536  # correlation_message_headers_at_most_64_kib
COUNTER_MAX = 1_000_000_000  # attempt, reschedule_count, lost_calls: correlation_message_…_at_most_a_billion
# The latest next_attempt_at the worker writes: the schema refuses 9999-12-31 and later, which some drivers
# cannot read in every time zone.
NEXT_ATTEMPT_MAX = datetime(9999, 12, 30, tzinfo=UTC)


def thaw(value: Any) -> Any:
    """Read-only payload and header values (mappings, tuples) back to plain JSON-ready dicts and lists."""
    if isinstance(value, Mapping):
        return {str(key): thaw(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [thaw(item) for item in value]
    return value


class MessageState(StrEnum):
    """The ``state`` column. Waiting for a retry is ``ready`` with a future ``next_attempt_at``."""

    READY = "ready"
    PAUSED = "paused"
    DEAD = "dead"
    # Left the table (correlated, expired or deleted): kept as a record for the delivery retention.
    DELIVERED = "delivered"


@dataclass(frozen=True, slots=True)
class Delivery:
    """How a message left the table, kept on its record (state ``delivered``) for the delivery retention.

    ``outcome`` is ``correlated``, ``expired`` or ``deleted`` (by an operator); ``result`` is the correlator's
    answer on success (decoded JSON, or None); ``finished_by`` the replica (or operator) that recorded it.
    """

    outcome: str
    finished_at: datetime
    finished_by: str | None = None
    result: Any = None


@dataclass(frozen=True, slots=True)
class Message:
    """One row of ``correlation_message``. ``payload`` and ``headers`` are read-only mappings.

    ``lost_calls`` counts earlier calls of this message whose outcome was never recorded (their replica died
    or lost its lease): a handler that sees ``redelivered`` may already have acted on the message once.
    """

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
    lost_calls: int = 0
    crashed_calls: int = 0
    delivery: Delivery | None = None  # on a record (state ``delivered``) only

    @property
    def redelivered(self) -> bool:
        """True when an earlier call of this message may have reached the target without being recorded."""
        return self.lost_calls > 0

    def is_expired(self, now: datetime) -> bool:
        """True once ``expires_at`` has passed: the message is never correlated again."""
        return self.expires_at is not None and self.expires_at <= now

    def is_waiting(self, now: datetime) -> bool:
        """True while a retry, reschedule or buffering delay has not passed yet."""
        return self.next_attempt_at is not None and self.next_attempt_at > now
