"""Operator actions on schedules (DESIGN.md §7), shared by the CLI and, later, the HTTP API and the pages.

Each action returns plain data ready to print as JSON and raises :class:`~worker.admin.operations.AdminError`
with one clear sentence when the request cannot be carried out as given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime, tzinfo
from itertools import islice
from typing import Any

from worker.admin.errors import AdminError, Conflict, NotFound
from worker.db.schedules import NewSchedule, Schedule, ScheduleRejected
from worker.db.schema import HINT_MAX_LENGTH
from worker.db.store import Store
from worker.engine.scheduler import compile_schedule, load_zone
from worker.message import thaw
from worker.policy.cron import CronError, parse_schedulable
from worker.policy.scheduling import FireAction, MisfirePolicy
from worker.policy.text import hint_problem, name_problem, shown

NAME_MAX_LENGTH = 255
NEXT_FIRE_TIMES = 5
MISFIRE_POLICIES = tuple(policy.value for policy in MisfirePolicy)
ACTIONS = tuple(action.value for action in FireAction)


def _iso(value: datetime | None, zone: tzinfo | None = None) -> str | None:
    if value is None:
        return None
    return (value.astimezone(zone) if zone else value).isoformat()


def _zone_or_utc(schedule: Schedule) -> tzinfo:
    try:
        return load_zone(schedule.time_zone)
    except ValueError:
        return UTC


def schedule_summary(schedule: Schedule) -> dict[str, Any]:
    """A schedule's row as JSON-ready data (times in the schedule's zone)."""
    zone = _zone_or_utc(schedule)
    return {
        "name": schedule.name,
        "enabled": schedule.enabled,
        "cron": schedule.cron,
        "time_zone": schedule.time_zone,
        "singleton": schedule.singleton,
        "misfire": schedule.misfire.value,
        "message_name": schedule.message_name,
        "correlation_hint": schedule.hint,
        "next_fire_at": _iso(schedule.next_fire_at, zone),
        "last_fire_at": _iso(schedule.last_fire_at, zone),
        "last_fire_kind": schedule.last_fire_kind,
        "fire_count": schedule.fire_count,
        "skip_count": schedule.skip_count,
        "misfire_count": schedule.misfire_count,
        "invalid_reason": schedule.invalid_reason,
    }


def schedules_list(store: Store) -> dict[str, Any]:
    """The scheduler's switch and every schedule, by name."""
    snapshot = store.schedules_snapshot()
    return {
        "scheduler_enabled": snapshot.scheduler_enabled,
        "schedules": [schedule_summary(schedule) for schedule in snapshot.schedules],
    }


def _get(store: Store, name: str) -> Schedule:
    schedule = store.schedule_get(name)
    if schedule is None:
        raise NotFound(f"there is no schedule named {name!r} (see `correlation-worker schedules list`)")
    return schedule


def schedule_show(store: Store, name: str, count: int = NEXT_FIRE_TIMES) -> dict[str, Any]:
    """One schedule's status: its row, its next ``count`` fire times after now (database clock), whether its last
    message is still pending ("running") and that message's last error."""
    schedule = _get(store, name)
    snapshot_now = store.now()
    shown = schedule_summary(schedule)
    shown.update(
        scheduler_enabled=store.scheduler_is_enabled(),
        payload=thaw(schedule.payload),
        headers=thaw(schedule.headers),
        created_at=_iso(schedule.created_at),
        last_skipped_at=_iso(schedule.last_skipped_at, _zone_or_utc(schedule)),
        last_message_id=schedule.last_message_id,
    )
    try:
        expression, zone = compile_schedule(schedule.cron, schedule.time_zone)
        upcoming = [fire.isoformat() for fire in islice(expression.fire_times(snapshot_now, zone), count)]
        shown["next_fire_times"] = upcoming
    except CronError as error:
        shown["next_fire_times"], shown["invalid_reason"] = [], f"invalid cron expression: {error}"
    except ValueError as error:
        shown["next_fire_times"], shown["invalid_reason"] = [], str(error)
    last = store.schedule_last_message(schedule.last_message_id) if schedule.last_message_id else None
    shown["running"] = last is not None and last.running
    shown["last_message"] = None if last is None else {
        "id": last.id,
        "state": last.state.value,
        "attempt": last.attempt,
        "expired": last.expired,
        "last_error": last.last_error,
    }
    return shown


def _text(value: str | None, what: str, limit: int) -> None:
    if value is not None and not value.strip():
        raise AdminError(f"the {what} must not be empty")
    rule = hint_problem if what == "correlation hint" else name_problem  # the schema's rule (policy/text.py)
    problem = None if value is None else rule(value)
    if problem is not None:
        raise AdminError(f"the {what} {shown(value or '')} {problem}")
    if value is not None and len(value) > limit:
        raise AdminError(f"the {what} is {len(value)} characters long; at most {limit} are allowed")


def schedule_add(
    store: Store,
    name: str,
    cron: str,
    message_name: str,
    *,
    hint: str | None = None,
    payload: Any = None,
    headers: Mapping[str, Any] | None = None,
    time_zone: str = "UTC",
    singleton: bool = True,
    misfire: str = MisfirePolicy.FIRE_ONCE_NOW.value,
    enabled: bool = True,
) -> dict[str, Any]:
    """Add a schedule after checking every value; returns it as :func:`schedule_show` does."""
    _text(name, "schedule name", NAME_MAX_LENGTH)
    _text(message_name, "message name", NAME_MAX_LENGTH)
    _text(hint, "correlation hint", HINT_MAX_LENGTH)
    try:
        parse_schedulable(cron)
    except CronError as error:
        raise AdminError(f"invalid cron expression: {error}") from None
    try:
        load_zone(time_zone)
    except ValueError as error:
        raise AdminError(str(error)) from None
    if misfire not in MISFIRE_POLICIES:
        raise AdminError(f"unknown misfire policy {misfire!r}; use one of {', '.join(MISFIRE_POLICIES)}")
    if headers is not None and not isinstance(headers, Mapping):
        raise AdminError("the headers must be a JSON object")
    try:
        json.dumps(payload)
        json.dumps(dict(headers or {}))
    except (TypeError, ValueError) as error:
        raise AdminError(f"the payload and headers must be JSON: {error}") from None
    schedule = NewSchedule(
        name=name,
        cron=cron.strip(),
        message_name=message_name,
        time_zone=time_zone,
        correlation_hint=hint,
        payload=payload,
        headers=headers,
        enabled=enabled,
        singleton=singleton,
        misfire=MisfirePolicy(misfire),
    )
    try:
        added = store.schedule_insert(schedule)
    except ScheduleRejected as error:
        raise AdminError(str(error)) from None
    if not added:
        raise Conflict(f"a schedule named {name!r} exists already: delete it first, or choose another name")
    return schedule_show(store, name)


def schedule_set_enabled(store: Store, name: str | None, enabled: bool) -> dict[str, Any]:
    """Enable or disable one schedule, or (no name) the whole scheduler."""
    if name is None:
        changed = store.scheduler_set_enabled(enabled)
        return {"scheduler_enabled": enabled, "changed": changed}
    result = store.schedule_set_enabled(name, enabled)
    if result is None:
        raise NotFound(f"there is no schedule named {name!r} (see `correlation-worker schedules list`)")
    return {"schedule": name, "enabled": enabled, "changed": result}


def schedule_fire(store: Store, name: str, action: str = FireAction.START.value) -> dict[str, Any]:
    """Publish the schedule's message now, by hand: ``action_type`` manual, the singleton rule ignored, whether
    the schedule or the scheduler is enabled or not."""
    if action not in ACTIONS:
        raise AdminError(f"unknown action {action!r}; use one of {', '.join(ACTIONS)}")
    zone = _zone_or_utc(_get(store, name))
    published = store.schedule_fire_manual(name, FireAction(action), zone)
    if published is None:
        raise NotFound(f"there is no schedule named {name!r} (it was deleted meanwhile)")
    return {
        "schedule": name,
        "id": published.id,
        "message_id": published.message_id,
        "job_number": published.job_number,
        "fire_time": published.fire_time.astimezone(zone).isoformat(),
        "action": action,
        "action_type": "manual",
    }


def schedule_delete(store: Store, name: str) -> dict[str, Any]:
    """Delete a schedule; the messages it published stay."""
    if not store.schedule_delete(name):
        raise NotFound(f"there is no schedule named {name!r} (see `correlation-worker schedules list`)")
    return {"deleted": name}


def next_fire_times(expression: str, after: str | None, time_zone: str, count: int, now: datetime) -> list[str]:
    """The next ``count`` fire times of an expression after ``after`` (an ISO-8601 wall time in the zone, or a time
    with an offset; None: ``now``), as ISO-8601 wall times with offset.

    Raises :class:`~worker.policy.cron.CronError` for the expression and ValueError for the zone or the time.
    """
    parsed = parse_schedulable(expression)
    zone = load_zone(time_zone)
    if after is None:
        start = now
    else:
        try:
            given = datetime.fromisoformat(after)
        except ValueError:
            raise ValueError(f"{after!r} is not an ISO-8601 time such as 2005-06-01T10:15:00") from None
        start = given.replace(tzinfo=zone) if given.tzinfo is None else given
    return [fire.isoformat() for fire in islice(parsed.fire_times(start, zone), count)]
