"""The schedule operations that change something (:mod:`worker.admin.schedules`), checked for the caller's right
to act and written to the audit: add, enable or disable, fire by hand, delete, and the scheduler's switch.

Shared by the JSON API, the pages and the CLI; the body of an API request is parsed here too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.admin import schedules
from worker.admin.auth import Caller
from worker.admin.errors import BadRequest, Forbidden
from worker.db.store import Store

ADD_FIELDS = {
    "name", "cron", "message_name", "correlation_hint", "payload", "headers", "time_zone", "singleton",
    "misfire", "enabled",
}


def _may_act(caller: Caller, what: str) -> None:
    if not caller.can_write:
        raise Forbidden(f"the token {caller.name!r} may only read; {what} needs CORRELATION_ADMIN__TOKEN")


def _audit(store: Store, caller: Caller, action: str, target: Any, affected: int = 1) -> None:
    store.audit_add(caller.name, caller.via, action, target, affected)


def _text(data: Mapping[str, Any], key: str, required: bool = True) -> str | None:
    value = data.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise BadRequest(f"{key!r} must be a text" + (" (it is required)" if required else ""))
    return value


def _flag(data: Mapping[str, Any], key: str, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{key!r} must be true or false")
    return value


def add(store: Store, caller: Caller, data: Mapping[str, Any]) -> dict[str, Any]:
    """Add a schedule from a JSON object (``name``, ``cron``, ``message_name``; optional ``correlation_hint``,
    ``payload``, ``headers``, ``time_zone``, ``singleton``, ``misfire``, ``enabled``)."""
    _may_act(caller, "adding a schedule")
    unknown = sorted(set(data) - ADD_FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}; a schedule takes {', '.join(sorted(ADD_FIELDS))}")
    shown = schedules.schedule_add(
        store,
        _text(data, "name") or "",
        _text(data, "cron") or "",
        _text(data, "message_name") or "",
        hint=_text(data, "correlation_hint", required=False),
        payload=data.get("payload"),
        headers=data.get("headers"),
        time_zone=_text(data, "time_zone", required=False) or "UTC",
        singleton=_flag(data, "singleton", True),
        misfire=_text(data, "misfire", required=False) or "fire_once_now",
        enabled=_flag(data, "enabled", True),
    )
    _audit(store, caller, "schedules.add", {k: data[k] for k in sorted(data) if k not in ("payload", "headers")})
    return shown


def set_enabled(store: Store, caller: Caller, name: str | None, enabled: bool) -> dict[str, Any]:
    """Enable or disable one schedule, or (no name) the whole scheduler."""
    _may_act(caller, "switching schedules")
    result = schedules.schedule_set_enabled(store, name, enabled)
    action = ("scheduler." if name is None else "schedules.") + ("enable" if enabled else "disable")
    _audit(store, caller, action, {} if name is None else {"name": name}, int(bool(result.get("changed"))))
    return result


def patch(store: Store, caller: Caller, name: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """Change a schedule: ``{"enabled": true|false}`` (other fields: delete and add it again)."""
    if set(data) != {"enabled"}:
        raise BadRequest('a schedule is changed with {"enabled": true} or {"enabled": false}; to change anything '
                         "else, delete it and add it again")
    return set_enabled(store, caller, name, _flag(data, "enabled", True))


def fire(store: Store, caller: Caller, name: str, action: str) -> dict[str, Any]:
    """Publish the schedule's message now with an action (start, stop, pause, resume)."""
    _may_act(caller, "firing a schedule")
    result = schedules.schedule_fire(store, name, action)
    _audit(store, caller, "schedules.fire", {"name": name, "action": action, "message_id": result["message_id"]})
    return result


def delete(store: Store, caller: Caller, name: str) -> dict[str, Any]:
    """Delete a schedule (the messages it published stay)."""
    _may_act(caller, "deleting a schedule")
    result = schedules.schedule_delete(store, name)
    _audit(store, caller, "schedules.delete", {"name": name})
    return result
