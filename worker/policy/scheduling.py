"""What a due schedule publishes: on-time fires and misfires (DESIGN.md §7), pure.

A schedule is due when its ``next_fire_at`` has passed by the database clock. If it is no more than the misfire
threshold late, that one fire time is published and the schedule moves on to the next (a replica that fell a little
behind catches up time by time). If it is later than that (no replica ran: the cluster was down, or the schedule's
scheduler was switched off by a crash), the fire times between ``next_fire_at`` and now were *missed*, and the
schedule's misfire policy, named as Quartz names them, decides:

- ``fire_once_now`` (default): publish the most recent missed time, skip the others;
- ``do_nothing``: skip them all; the schedule fires again at its next time after now;
- ``fire_all``: publish every missed time, but at most ``fire_all_limit`` (the most recent ones); skip the rest.

Every skipped time is a *misfire*: logged and counted. Missed times are walked in chunks of at most
``chunk_limit`` per plan (a week-long outage of an every-second schedule is 600 000 times), each chunk committing
its progress, so one plan's work stays bounded and the count stays exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from enum import StrEnum
from typing import Any

from worker.policy.cron import CronExpression

DEFAULT_MISFIRE_THRESHOLD = timedelta(minutes=1)  # Quartz's default misfireThreshold
DEFAULT_FIRE_ALL_LIMIT = 100
DEFAULT_CHUNK_LIMIT = 10_000


class FireAction(StrEnum):
    """What a published message asks its handler to do (seed 004); scheduled fires always start."""

    START = "start"
    STOP = "stop"
    PAUSE = "pause"
    RESUME = "resume"


class MisfirePolicy(StrEnum):
    """What a schedule does with the fire times it missed."""

    FIRE_ONCE_NOW = "fire_once_now"
    DO_NOTHING = "do_nothing"
    FIRE_ALL = "fire_all"


@dataclass(frozen=True, slots=True)
class FirePlan:
    """What to do with a due schedule: the times to publish and to skip, and the schedule's next fire time.

    ``publish`` and ``misfired`` are fire times, oldest first. ``next_fire_at`` is None when the expression has no
    fire time left. ``late`` is True when the misfire policy decided (the schedule was past the threshold).
    """

    due: datetime
    publish: tuple[datetime, ...]
    misfired: tuple[datetime, ...]
    next_fire_at: datetime | None
    late: bool
    # Wall times the expression allows that the zone skipped on the way (its clocks sprang forward over them).
    nonexistent: tuple[datetime, ...] = ()


def plan_due(
    expression: CronExpression,
    zone: tzinfo,
    due: datetime,
    now: datetime,
    policy: MisfirePolicy,
    *,
    threshold: timedelta = DEFAULT_MISFIRE_THRESHOLD,
    fire_all_limit: int = DEFAULT_FIRE_ALL_LIMIT,
    chunk_limit: int = DEFAULT_CHUNK_LIMIT,
) -> FirePlan:
    """The plan for a schedule whose next fire time ``due`` has passed (``due <= now``, both instants)."""
    if due > now:
        raise ValueError(f"the schedule is not due: its fire time {due.isoformat()} is after {now.isoformat()}")
    if fire_all_limit < 1 or chunk_limit <= fire_all_limit:
        raise ValueError("fire_all_limit must be at least 1 and chunk_limit larger than it")
    gap: list[datetime] = []
    if now - due <= threshold:
        return FirePlan(due, (due,), (), expression.next_after(due, zone, gap), late=False, nonexistent=tuple(gap))

    missed = [due]
    following = expression.next_after(due, zone, gap)
    while following is not None and following <= now and len(missed) < chunk_limit:
        missed.append(following)
        following = expression.next_after(following, zone, gap)
    kept = {MisfirePolicy.FIRE_ONCE_NOW: 1, MisfirePolicy.DO_NOTHING: 0, MisfirePolicy.FIRE_ALL: fire_all_limit}[policy]

    if following is not None and following <= now:
        # A full chunk and more missed times beyond it: skip this chunk's older times and leave the last ``kept``
        # ones due, so that the next plan (a chunk further on) still finds the most recent times to publish.
        skipped = missed[: len(missed) - kept] if kept else missed
        resume = missed[len(skipped)] if kept else following
        return FirePlan(due, (), tuple(skipped), resume, late=True, nonexistent=tuple(gap))

    published = missed[len(missed) - kept :] if kept else []
    return FirePlan(
        due, tuple(published), tuple(missed[: len(missed) - len(published)]), following, late=True,
        nonexistent=tuple(gap),
    )


# -- the published message -----------------------------------------------------------------------------------


def scheduled_message_id(schedule: str, fire_time: datetime) -> str:
    """The ``message_id`` of a scheduled fire: the schedule and the fire time (UTC), the same on every replica."""
    return f"schedule:{schedule}:{fire_time.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"


def manual_message_id(schedule: str, action: FireAction, at: datetime, job_number: int) -> str:
    """The ``message_id`` of a fire by hand: the schedule, the action, the database clock's now and the fire's job
    number (unique per schedule, so two fires within one tick of the clock stay two)."""
    return f"schedule:{schedule}:manual:{action.value}:{at.astimezone(UTC):%Y-%m-%dT%H:%M:%S.%fZ}:{job_number}"


def fire_headers(
    own: Mapping[str, Any],
    schedule: str,
    fire_time: datetime,
    job_number: int,
    action: FireAction,
    manual: bool,
) -> dict[str, Any]:
    """The headers of a published message: the schedule's own, then (winning over them) ``schedule``, ``fire_time``
    (ISO-8601 wall time with offset in the schedule's zone), ``job_number``, ``action`` and ``action_type``."""
    return {
        **own,
        "schedule": schedule,
        "fire_time": fire_time.isoformat(),
        "job_number": job_number,
        "action": action.value,
        "action_type": "manual" if manual else "scheduled",
    }
