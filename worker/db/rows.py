"""Rows of ``correlation_message`` as the project's :class:`~worker.message.Message` values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any

from sqlalchemy.engine import Row

from worker.db.base import UnreadableJson, json_loads
from worker.message import HEADERS_MAX_BYTES, PAYLOAD_MAX_BYTES, Delivery, Message, MessageState, slot_constructor
from worker.policy.outcomes import storable_text
from worker.policy.text import hint_problem, name_problem, shown


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A row the worker cannot turn into a message, and why."""

    id: int
    hint: str
    slot: int
    reason: str


_STATES = {state.value: state for state in MessageState}
_make_message = slot_constructor(Message, 17)  # the engine's columns: all but ``delivery`` (None)
_FLAT = frozenset({str, int, float, bool, type(None)})  # JSON's scalars: nothing to freeze
_EMPTY: MappingProxyType[str, Any] = MappingProxyType({})


def freeze(value: Any) -> Any:
    """Decoded JSON made read-only: objects as read-only mappings, arrays as tuples (scalars as they are).

    ``value`` is freshly decoded, held by no one else: the nested values of an object or an array are frozen in
    place, then the object is wrapped and the array copied into a tuple in one step (a payload is frozen on every
    message fetched: a tuple built from a generator cost a third of the freezing of a kilobyte's order)."""
    kind = type(value)
    if kind is dict or (kind not in _FLAT and isinstance(value, dict)):
        if not value:
            return _EMPTY
        for key, item in value.items():
            if type(item) not in _FLAT:
                value[key] = freeze(item)  # a value replaced, no key added: the iteration stays valid
        return MappingProxyType(value)
    if kind is list or (kind not in _FLAT and isinstance(value, list)):
        for index, item in enumerate(value):
            if type(item) not in _FLAT:
                value[index] = freeze(item)
        return tuple(value)
    return value


def sqlite_time(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    parsed = datetime.fromisoformat(str(value).replace("T", " ").removesuffix("Z"))
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed


# The engine's columns of correlation_message, in the order decode_row takes them. Those in TEXT_COLUMNS are read
# as JSON text (decoded here, row by row, so that one row the driver could not decode never fails a whole page).
ENGINE_COLUMNS = (
    "id", "message_id", "message_name", "correlation_hint", "payload", "headers", "created_at", "time_to_live",
    "expires_at", "attempt", "next_attempt_at", "reschedule_count", "last_error", "state", "slot", "lost_calls",
    "crashed_calls",
)
TEXT_COLUMNS = frozenset({"payload", "headers"})


def decode_row(values: Sequence[Any], sqlite: bool) -> Message | Unreadable:
    """A message from the engine's columns, or an :class:`Unreadable` saying why it cannot be one."""
    (
        id_, message_id, name, hint, payload_text, headers_text, created_at, time_to_live, expires_at, attempt,
        next_attempt_at, reschedule_count, last_error, state, slot, lost_calls, crashed_calls,
    ) = values
    try:
        # The schema refuses such a name or hint at insert, save where its SQL cannot tell (NFC on SQLite) and in
        # rows written before the rule: called, it would go to the wrong route or conversation.
        problem = name_problem(name)
        if problem is not None:
            raise ValueError(f"its message_name {shown(name)} {problem}; a route is named by a message_name exactly")
        problem = hint_problem(hint)
        if problem is not None:
            raise ValueError(f"its correlation_hint {shown(hint)} {problem}")
        if len(payload_text) > PAYLOAD_MAX_BYTES or len(headers_text) > HEADERS_MAX_BYTES:
            raise ValueError(
                f"payload or headers larger than {PAYLOAD_MAX_BYTES} / {HEADERS_MAX_BYTES} bytes"
            )
        payload = json_loads(payload_text)
        headers = json_loads(headers_text) if headers_text != "{}" else {}
        if isinstance(payload, UnreadableJson) or isinstance(headers, UnreadableJson):
            raise ValueError("the JSON is nested too deeply to decode")
        if not isinstance(headers, dict):
            raise ValueError("headers are not a JSON object")
        if sqlite:
            created_at = sqlite_time(created_at)
            expires_at = sqlite_time(expires_at)
            next_attempt_at = sqlite_time(next_attempt_at)
            time_to_live = None if time_to_live is None else timedelta(seconds=float(time_to_live))
        return _make_message(  # type: ignore[no-any-return]
            id_, message_id, name, hint, freeze(payload), freeze(headers), created_at, time_to_live, expires_at,
            attempt, next_attempt_at, reschedule_count, last_error, _STATES.get(state) or MessageState(state),
            slot, lost_calls, crashed_calls,
        )
    except (ValueError, TypeError, OverflowError, RecursionError) as error:
        reason = f"the worker cannot read this message: {type(error).__name__}: {str(error)[:300]}"
        return Unreadable(int(id_), str(hint), int(slot), storable_text(reason))


def message_of_row(row: Row[Any]) -> Message:
    """A message from a row of ``select(message_table)`` (admin reads)."""
    mapping = row._mapping
    return Message(
        id=mapping["id"],
        message_id=mapping["message_id"],
        name=mapping["message_name"],
        hint=mapping["correlation_hint"],
        payload=freeze(mapping["payload"]),
        headers=freeze(mapping["headers"] or {}),
        created_at=mapping["created_at"],
        time_to_live=mapping["time_to_live"],
        expires_at=mapping["expires_at"],
        attempt=mapping["attempt"],
        next_attempt_at=mapping["next_attempt_at"],
        reschedule_count=mapping["reschedule_count"],
        last_error=mapping["last_error"],
        state=_STATES.get(mapping["state"]) or MessageState(mapping["state"]),
        slot=mapping["slot"],
        lost_calls=mapping["lost_calls"],
        crashed_calls=mapping["crashed_calls"],
        delivery=_delivery(mapping),
    )


def _delivery(mapping: Any) -> Delivery | None:
    outcome = mapping.get("outcome")
    if outcome is None:
        return None
    return Delivery(outcome, mapping["finished_at"], mapping.get("finished_by"), freeze(mapping.get("result")))


