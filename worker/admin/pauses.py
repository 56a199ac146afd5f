"""Durable pauses (DESIGN.md §3): a message name, a hint, or everything, held back until an operator lifts it.

A pause is a row of ``correlation_pause``; the engine reads them and holds back also the messages inserted
after the pause. Lifting a pause resumes the messages it paused and wakes the replicas. Creating and lifting
write an audit row. Shared by the CLI, the JSON API and the pages.

**Lifting runs in chunks**, each its own short transaction, so that it fits the console's statement timeout
however many messages the pause parked (the engine parks the messages of a paused *name*, ``state = 'paused'``
with ``pause_id`` set, as it meets them; a pause of a hint or of everything parks none). In this order:

1. the parked messages are resumed in chunks, in id order (the pause row stays, so the engine may park again
   a resumed message meanwhile; no replica is woken yet);
2. the end: chunks of whatever the pause still holds parked (by the engine, behind the chunks), until one
   transaction finds less than a chunk: it deletes the pause, resumes what is left (also what the engine
   parked before the delete committed), and notifies every replica that the pauses changed (each reads them
   again and looks at every slot).

Until that last transaction the pause is there: a lift cut off half-way (a crash, a timeout, a lost
connection) leaves some messages resumed (still held back by the pause, which holds back their hints' later
messages too) and the pause listed, and running it again finishes it. Order within a hint holds at every
step: a message still parked holds back the later ones of its hint. The audit row counts the messages
resumed, also when the lift fails (with the error).

One gap is the engine's: it parks with the pauses it read last, so a park it decided before the lift's last
transaction committed may land after it, leaving that message paused with its pause gone (``resume`` by its
id frees it). Closing it takes a park that holds a lock on its pause row while it writes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from worker.admin.auth import Caller
from worker.admin.errors import BadRequest, Conflict, Forbidden, NotFound
from worker.db.fetch import Pause
from worker.db.store import Store, StoreError
from worker.policy.holdback import PauseInfo
from worker.policy.text import hint_problem, name_problem, shown

TARGET_MAX = 255
REASON_MAX = 1000
DEFAULT_CHUNK = 1000  # messages resumed per transaction of a lift (CORRELATION_ADMIN__CHUNK_SIZE's default)


def pause_as_dict(pause: Pause) -> dict[str, Any]:
    """A durable pause as JSON-ready data."""
    return {
        "id": pause.id,
        "scope": pause.scope,
        "target": pause.target if pause.scope != "all" else None,
        "reason": pause.reason,
        "created_by": pause.created_by,
        "created_at": pause.created_at.isoformat(),
    }


def describe(scope: str, target: str) -> str:
    """What a pause holds, in words: ``name 'order.paid'``, ``hint 'order-42'``, ``every message``."""
    return "every message" if scope == "all" else f"{scope} {target!r}"


def pause_infos(pauses: Iterable[Pause]) -> list[PauseInfo]:
    """The pauses as the hold-back explanations take them."""
    return [PauseInfo(p.id, p.scope, p.target, p.reason, p.created_by) for p in pauses]


def list_pauses(store: Store) -> list[dict[str, Any]]:
    """Every durable pause, oldest first."""
    return [pause_as_dict(pause) for pause in store.pauses_list()]


def parse_pause(data: Mapping[str, Any]) -> tuple[str, str, str]:
    """(scope, target, reason) from ``{"name": N}``, ``{"hint": H}`` or ``{"all": true}`` plus ``"reason"``."""
    unknown = sorted(set(data) - {"name", "hint", "all", "reason"})
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}; a pause takes name, hint or all, and reason")
    chosen = [key for key in ("name", "hint") if data.get(key) is not None]
    everything = data.get("all", False)
    if not isinstance(everything, bool):
        raise BadRequest("'all' must be true or false")
    if len(chosen) + everything != 1:
        raise BadRequest('a pause holds exactly one of: {"name": ...}, {"hint": ...} or {"all": true}')
    reason = data.get("reason") or ""
    if not isinstance(reason, str) or len(reason) > REASON_MAX:
        raise BadRequest(f"'reason' must be a text of at most {REASON_MAX} characters")
    if everything:
        return "all", "", reason
    scope = chosen[0]
    target = data[scope]
    if not isinstance(target, str) or not target or len(target) > TARGET_MAX:
        raise BadRequest(f"{scope!r} must be a non-empty text of at most {TARGET_MAX} characters, "
                         f"not {json.dumps(target, default=str)}")
    return scope, target, reason


def add_pause(store: Store, caller: Caller, scope: str, target: str, reason: str) -> dict[str, Any]:
    """Create a durable pause; :class:`Conflict` when the same one is already there."""
    if not caller.can_write:
        raise Forbidden(f"the token {caller.name!r} may only read; pausing needs CORRELATION_ADMIN__TOKEN")
    if scope != "all" and not target.strip():
        raise BadRequest(f"the {scope} to pause is empty: give the {scope} whose messages are to wait")
    problem = None if scope == "all" else (name_problem if scope == "name" else hint_problem)(target)
    if problem is not None:  # no message can have it (the schema's rule): the pause would hold nothing
        raise BadRequest(f"the {scope} to pause {shown(target)} {problem}")
    pause, created = store.pauses_create(scope, target, reason, caller.name)
    if not created:
        raise Conflict(
            f"{describe(scope, target)} is already paused (pause {pause.id} by {pause.created_by}); "
            "lift that one first to change its reason"
        )
    store.audit_add(caller.name, caller.via, "pauses.add", pause_as_dict(pause), 1)
    return pause_as_dict(pause)


def lift_pause(store: Store, caller: Caller, pause_id: int, *, chunk: int = DEFAULT_CHUNK) -> dict[str, Any]:
    """Lift a durable pause by id, in chunks of ``chunk`` messages (see the module's docstring for the order):
    the messages it paused are resumed, the pause deleted and the replicas woken."""
    if not caller.can_write:
        raise Forbidden(f"the token {caller.name!r} may only read; lifting a pause needs CORRELATION_ADMIN__TOKEN")
    pause = store.pauses_get(pause_id)
    if pause is None:
        raise NotFound(f"no durable pause {pause_id} (see the list of pauses)")
    shown = pause_as_dict(pause)
    resumed = 0
    try:
        if pause.scope == "name":
            after: int | None = 0
            while after is not None:
                done = store.pauses_unpark_chunk(pause.id, pause.target, after=after, chunk=chunk)
                resumed += done.changed
                after = done.last_id
        while True:
            end = store.pauses_lift_rest(pause.id, chunk=chunk)
            resumed += end.resumed
            if end.lifted:
                break
    except StoreError as error:
        store.audit_add(caller.name, caller.via, "pauses.remove", shown, resumed, error=str(error)[:1000])
        raise
    store.audit_add(caller.name, caller.via, "pauses.remove", shown, resumed)
    return {"lifted": shown, "resumed": resumed}


def lift_pause_of(
    store: Store, caller: Caller, scope: str, target: str, *, chunk: int = DEFAULT_CHUNK
) -> dict[str, Any]:
    """Lift the durable pause of a name, a hint, or everything (in chunks, as :func:`lift_pause`)."""
    pause = store.pauses_find(scope, target)
    if pause is None:
        raise NotFound(f"there is no durable pause of {describe(scope, target)} (see `correlation-worker pauses`)")
    return lift_pause(store, caller, pause.id, chunk=chunk)
