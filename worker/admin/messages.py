"""The console's operations on messages: filters, keyset pages, one message, bulk actions, a hint's view.

Shared by the JSON API, the pages and the CLI. Every read is O(page) (see :mod:`worker.db.console`); a bulk
action runs in chunks of ``chunk`` rows and writes one audit row with what it changed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from worker.admin.auth import Caller
from worker.admin.errors import BadRequest, Forbidden, Interrupted, NotFound
from worker.admin.operations import message_as_dict
from worker.admin.pauses import pause_infos
from worker.config import Mode
from worker.db.console import ACTION_STATE, BULK_ACTIONS, ConsoleFilter, Listed
from worker.db.store import MessageFilter, Store, StoreError
from worker.message import Message, MessageState
from worker.policy.holdback import hint_holdback, message_note

MAX_ID = 2**63 - 1
DEFAULT_LIMIT = 50
MAX_LIMIT = 500
MAX_IDS = 10_000
SCAN_WINDOW = 5_000  # rows a filter without an index (error text, time range) looks at per page
TEXT_MAX = 255
ERROR_SHOWN = 300  # characters of last_error in a list

FILTER_KEYS = ("ids", "name", "hint", "state", "all")


def is_row_id(text: str) -> bool:
    """True when the text is a row id: ASCII digits, from 1 to the largest bigint (a longer run of digits is
    not converted: that would be quadratic, and Python refuses beyond 4300 digits)."""
    return whole_number(text, MAX_ID)


def whole_number(text: str, largest: int) -> bool:
    """True when the text is a whole number from 1 to ``largest``, in ASCII digits."""
    return text.isascii() and text.isdigit() and len(text) <= len(str(largest)) and 1 <= int(text) <= largest


# -- parsing what operators send ---------------------------------------------------------------------------------


def _text(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value or len(value) > TEXT_MAX:
        raise BadRequest(f"{key!r} must be a non-empty text of at most {TEXT_MAX} characters")
    if "\x00" in value:  # PostgreSQL text cannot hold it: no row could match, and the driver would refuse it
        raise BadRequest(f"{key!r} holds a NUL character, which no stored text can contain")
    return value


# States the status reports beside the column's, which a listing may filter on (not a bulk action: they change
# with the clock).
CENSUS_STATES = ("waiting", "expired")


def _state(value: Any) -> MessageState:
    try:
        return MessageState(value)
    except ValueError:
        known = ", ".join(state.value for state in MessageState)
        raise BadRequest(f"'state' must be one of {known}, not {json.dumps(value, default=str)}") from None


def _row_id(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise BadRequest(f"{key!r} must be a message id (a whole number from 1), not {json.dumps(value, default=str)}")
    text = str(value).strip()
    if not is_row_id(text):
        raise BadRequest(f"{key!r} must be a message id (a whole number from 1 to {MAX_ID}), not {text!r}")
    return int(text)


def parse_selection(data: Mapping[str, Any]) -> tuple[MessageFilter, bool]:
    """The filter of a bulk action from its JSON body (``ids``, ``name``, ``hint``, ``state``, ``all``) and
    whether it asked for every message; refuses unknown keys and an empty filter without ``"all": true``."""
    unknown = sorted(set(data) - set(FILTER_KEYS) - {"dry_run"})
    if unknown:
        raise BadRequest(f"unknown filter field(s) {', '.join(unknown)}; use {', '.join(FILTER_KEYS)} or dry_run")
    ids: tuple[int, ...] = ()
    if "ids" in data and data["ids"] is not None:
        if not isinstance(data["ids"], list):
            raise BadRequest("'ids' must be a list of message ids such as [4711, 4712]")
        if len(data["ids"]) > MAX_IDS:
            raise BadRequest(f"'ids' lists {len(data['ids'])} ids; at most {MAX_IDS} at a time (or use a filter)")
        ids = tuple(dict.fromkeys(_row_id(value, "ids") for value in data["ids"]))
    name = _text(data["name"], "name") if data.get("name") is not None else None
    hint = _text(data["hint"], "hint") if data.get("hint") is not None else None
    state = _state(data["state"]) if data.get("state") is not None else None
    everything = data.get("all", False)
    if not isinstance(everything, bool):
        raise BadRequest("'all' must be true or false")
    selection = MessageFilter(ids=ids, name=name, hint=hint, state=state)
    if selection.is_empty() and not everything:
        raise BadRequest('the filter is empty: give ids, name, hint or state, or "all": true for every message')
    return selection, everything


def _timestamp(value: str, key: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise BadRequest(f"{key!r} must be an ISO-8601 time such as 2026-11-22T13:40:00Z, not {value!r}") from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed


def parse_listing(params: Mapping[str, str]) -> tuple[ConsoleFilter, int, int]:
    """A page request from query parameters: the filter, the ``after`` cursor and the ``limit``."""
    known = {"state", "name", "hint", "message_id", "error", "after", "limit", "created_from", "created_to"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise BadRequest(f"unknown parameter(s) {', '.join(unknown)}; use {', '.join(sorted(known))}")
    value = {key: raw for key, raw in params.items() if raw != ""}
    census_state = value.pop("state") if value.get("state") in CENSUS_STATES else None
    selection = MessageFilter(
        name=_text(value["name"], "name") if "name" in value else None,
        hint=_text(value["hint"], "hint") if "hint" in value else None,
        state=_state(value["state"]) if "state" in value else (
            MessageState.READY if census_state == "waiting" else None
        ),
    )
    after = 0 if value.get("after", "0").strip() == "0" else _row_id(value["after"], "after")  # 0: the start
    limit = DEFAULT_LIMIT
    if "limit" in value:
        if not whole_number(value["limit"], MAX_LIMIT):
            raise BadRequest(f"'limit' must be a whole number from 1 to {MAX_LIMIT}, not {value['limit']!r}")
        limit = int(value["limit"])
    wanted = ConsoleFilter(
        selection=selection,
        message_id=_text(value["message_id"], "message_id") if "message_id" in value else None,
        error=_text(value["error"], "error") if "error" in value else None,
        created_from=_timestamp(value["created_from"], "created_from") if "created_from" in value else None,
        created_to=_timestamp(value["created_to"], "created_to") if "created_to" in value else None,
        census_state=census_state,
    )
    if wanted.created_from is not None and wanted.created_to is not None and wanted.created_from > wanted.created_to:
        raise BadRequest(
            f"'created_from' ({value['created_from']}) is after 'created_to' ({value['created_to']}): no message "
            "could match; swap them"
        )
    return wanted, after, limit


def selection_as_dict(selection: MessageFilter, everything: bool = False) -> dict[str, Any]:
    """A filter as JSON (the audit's ``target``)."""
    shown: dict[str, Any] = {}
    if selection.ids:
        shown["ids"] = list(selection.ids)
    for key in ("name", "hint"):
        if getattr(selection, key) is not None:
            shown[key] = getattr(selection, key)
    if selection.state is not None:
        shown["state"] = selection.state.value
    if everything or not shown:
        shown["all"] = True
    return shown


# -- reading -------------------------------------------------------------------------------------------------------


def listed_as_dict(listed: Listed, *, whole: bool = False) -> dict[str, Any]:
    """A message as the console shows it: in a list without payload and headers (and the error cut), whole
    on its own page; with the pause that paused it."""
    data = message_as_dict(listed.message)
    data["pause_id"] = listed.pause_id
    data["lost_calls"] = listed.message.lost_calls
    if not whole:
        del data["payload"], data["headers"]
        error = data["last_error"]
        if error is not None and len(error) > ERROR_SHOWN:
            data["last_error"] = error[:ERROR_SHOWN] + "…"
    return data


def messages_page(store: Store, wanted: ConsoleFilter, after: int, limit: int) -> dict[str, Any]:
    """A keyset page: ``{"items": [...], "next": cursor or None}``; pass ``next`` as ``after`` for the next."""
    page = store.console_messages(wanted, after=after, limit=limit, scan=SCAN_WINDOW)
    return {"items": [listed_as_dict(row) for row in page.rows], "next": page.next}


def message_detail(store: Store, reference: str) -> dict[str, Any]:
    """One message, whole, by its id or (when it is no id) its producer's ``message_id``."""
    listed = None
    if is_row_id(reference):
        listed = store.console_message(int(reference))
    if listed is None:
        listed = store.console_message_by_message_id(reference)
    if listed is None:
        raise NotFound(f"no message with id or message_id {reference!r}")
    data = listed_as_dict(listed, whole=True)
    message = listed.message
    data["due"] = "now" if message.next_attempt_at is None else message.next_attempt_at.isoformat()
    return data


def resolve_references(store: Store, references: Sequence[str]) -> tuple[int, ...]:
    """The row ids of messages named by id (4711) or by their producer's ``message_id`` (shop-4711-paid), as
    ``messages show`` takes them: a number is an id unless it is only the ``message_id`` of another message; a
    message_id that no message holds, or a number that names two messages, is refused."""
    ids: list[int] = []
    for reference in references:
        by_message_id = store.messages_get_by_message_id(reference)
        if not is_row_id(reference):
            if by_message_id is None:
                raise NotFound(f"no message with message_id {reference!r} (nor is it an id, a whole number from 1)")
            ids.append(by_message_id.id)
        elif by_message_id is None or by_message_id.id == int(reference):
            ids.append(int(reference))
        elif store.messages_get(int(reference)) is None:  # a number only as a message_id
            ids.append(by_message_id.id)
        else:
            raise BadRequest(
                f"{reference!r} is the id of message {reference} and the message_id of message {by_message_id.id}: "
                f"name the latter by its id {by_message_id.id}"
            )
    return tuple(dict.fromkeys(ids))


def held_message_id(message_id: str, holder: Message | None) -> str:
    """Why a ``message_id`` sent again inserted nothing, and the command that frees it for a new message."""
    if holder is None:  # left between the insert and this read: the id is free again
        return f"message_id {message_id!r} was taken by a message that has left since; nothing inserted: send it again"
    said = f"message_id {message_id!r} is held by message {holder.id} ({holder.state.value}"
    if holder.delivery is not None:
        return (
            f"{said}, its delivery record: {holder.delivery.outcome} at {holder.delivery.finished_at.isoformat()}, "
            f"kept for CORRELATION_DELIVERY__RETENTION); nothing inserted. To send it again, free the id with "
            f"`correlation-worker delete --state delivered {holder.id}`"
        )
    return (
        f"{said}); nothing inserted. It is still to be correlated (`correlation-worker requeue {holder.id}` retries "
        f"a dead one); to send it anew, `correlation-worker delete {holder.id}`, then free the id with "
        f"`correlation-worker delete --state delivered {holder.id}`"
    )


def hint_view(store: Store, mode: Mode, hint: str, after: int = 0, limit: int = DEFAULT_LIMIT) -> dict[str, Any]:
    """A hint's messages in id order (a keyset page), the one holding it back marked with why, and each
    message's standing (``note``)."""
    _text(hint, "hint")
    pauses = store.pauses_list()
    infos = pause_infos(pauses)
    names = [pause.target for pause in pauses if pause.scope == "name"]
    holders, now, id_limit = store.hint_holders(hint, names)
    holdback = hint_holdback(hint, [(row.message, row.pause_id) for row in holders], mode, now, infos, id_limit)
    page = store.console_messages(ConsoleFilter(MessageFilter(hint=hint)), after=after, limit=limit, scan=0)
    if not page.rows and after == 0:
        raise NotFound(f"no message with correlation_hint {hint!r}")
    items = []
    for row in page.rows:
        item = listed_as_dict(row)
        item["note"] = message_note(row.message, holdback, now)
        item["blocker"] = holdback is not None and holdback.message_id == row.message.id
        items.append(item)
    return {
        "hint": hint,
        "mode": mode.value,
        "blocker": None if holdback is None else {"id": holdback.message_id, "reason": holdback.reason},
        "items": items,
        "next": page.next,
    }


# -- bulk actions ----------------------------------------------------------------------------------------------------


def bulk(
    store: Store,
    caller: Caller,
    action: str,
    selection: MessageFilter,
    everything: bool,
    *,
    dry_run: bool = False,
    chunk: int = 1000,
    count_limit: int = 10_000,
) -> dict[str, Any]:
    """Requeue, pause, resume or delete every message matching the filter, in chunks of ``chunk`` rows (one
    transaction each); returns ``{"affected": n}`` and writes an audit row. With ``dry_run``, returns how many
    match now (``{"matching": n}``, bounded: e.g. ``"10000+"``) and changes nothing.

    requeue acts on dead messages, pause on ready ones, resume on paused ones, delete on any; a ``state`` in
    the filter narrows it further (a requeue of ``state: ready`` matches nothing).
    """
    if action not in BULK_ACTIONS:
        raise NotFound(f"no bulk action {action!r}; use one of {', '.join(BULK_ACTIONS)}")
    if selection.is_empty() and not everything:
        raise BadRequest('the filter is empty: give ids, name, hint or state, or "all": true for every message')
    acted_on = ACTION_STATE[action]
    if acted_on is not None and selection.state not in (None, acted_on):
        assert selection.state is not None
        raise BadRequest(
            f"{action} acts on {acted_on.value} messages only; a filter of state {selection.state.value!r} would "
            f"match nothing: leave the state out or use {acted_on.value!r}"
        )
    effective: MessageFilter | None = MessageFilter(
        selection.ids, selection.name, selection.hint, acted_on or selection.state
    )
    target = selection_as_dict(selection, everything)
    if dry_run:
        matching = 0 if effective is None else store.console_count(effective, count_limit).shown()
        return {"action": action, "filter": target, "dry_run": True, "matching": matching}
    if not caller.can_write:
        raise Forbidden(f"the token {caller.name!r} may only read; {action} needs CORRELATION_ADMIN__TOKEN")
    affected, after = 0, 0
    try:
        while effective is not None:
            done = store.console_bulk_chunk(action, effective, after=after, chunk=chunk, by=caller.name)
            affected += done.changed
            if done.last_id is None:
                break
            after = done.last_id
    except StoreError as error:
        said = (
            f"{action} stopped after {affected} message(s), changed by the chunks before (each chunk is its own "
            f"transaction: those stay done): {error}; run it again to go on"
        )
        store.audit_add(caller.name, caller.via, f"messages.{action}", target, affected, error=said[:1000])
        raise Interrupted(said) from None
    store.audit_add(caller.name, caller.via, f"messages.{action}", target, affected)
    return {"action": action, "filter": target, "affected": affected}


def duration_text(seconds: float | None) -> str:
    """An age for people: ``45 s``, ``3 min 20 s``, ``2 h 5 min``, ``3 d 4 h``; ``none`` for None."""
    if seconds is None:
        return "none"
    total = round(seconds)
    days, rest = divmod(total, 86_400)
    hours, rest = divmod(rest, 3_600)
    minutes, secs = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "min"), (secs, "s")]
    shown = [f"{value} {unit}" for value, unit in parts if value]
    return " ".join(shown[:2]) or "0 s"
