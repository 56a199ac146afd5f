"""The message as handlers and the store see it: an immutable value, and the limits a row must keep."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
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


def slot_constructor(cls: type, count: int) -> Callable[..., Any]:
    """A function making an instance of a frozen slots dataclass from its first ``count`` fields' values, given
    positionally (the others at their defaults), each slot set through its descriptor.

    The dataclass's own ``__init__`` sets each field through ``object.__setattr__`` (the class is frozen): for
    the engine's messages and outcomes, made for every message, that was twice the cost (a tenth of a replica's
    CPU at full drain). ``cls`` must have no ``__post_init__`` and plain defaults for the fields left out.
    """
    fields = dataclasses.fields(cls)
    if hasattr(cls, "__post_init__") or any(field.default is dataclasses.MISSING for field in fields[count:]):
        raise TypeError(f"{cls.__name__} has a __post_init__ or no plain default for a field after the first {count}")
    setters = {f"_set{index}": cls.__dict__[field.name].__set__ for index, field in enumerate(fields)}
    defaults = {f"_default{index}": field.default for index, field in enumerate(fields) if index >= count}
    given = ", ".join(f"v{index}" for index in range(count))
    bound = ", ".join(f"{name}={name}" for name in [*setters, *defaults])
    lines = [f"def make({given}, *, _new=object.__new__, _cls=cls, {bound}):", "    made = _new(_cls)"]
    lines += [f"    _set{index}(made, v{index})" for index in range(count)]
    lines += [f"    _set{index}(made, _default{index})" for index in range(count, len(fields))]
    lines.append("    return made")
    namespace: dict[str, Any] = {"cls": cls, **setters, **defaults}
    exec("\n".join(lines), namespace)  # the source is built above from the class's own fields
    return namespace["make"]  # type: ignore[no-any-return]
