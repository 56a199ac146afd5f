"""The scheduler: publishes the messages of due schedules, once per fire time, on any number of replicas.

Every replica runs it and none leads. A run reads the switch, every schedule and the database clock in one
transaction (:meth:`~worker.db.schedules.ScheduleStatements.schedules_snapshot`), then for each schedule::

    disabled (or the scheduler off) ──> forget its planned fire time: nothing is caught up when it comes back
    invalid cron or zone ───────────> record why in invalid_reason (logged once), never fire it
    its message refused ────────────> (the database refused a fire's message: too large, a broken constraint)
                                      record why in invalid_reason (logged once); tried again only once the row
                                      is edited (or by a restarted replica), never holding back the others
    not planned, or edited by SQL ──> next_fire_at = the first fire time after now (compare-and-set)
    next_fire_at <= now ────────────> plan the fire (on time, or a misfire: worker.policy.scheduling) and carry it
                                      out in one transaction that claims the due time by compare-and-set; a replica
                                      that loses the claim publishes nothing

and sleeps until the earliest next fire time, or at most ``reload_interval`` (how soon a change made with SQL is
seen). Being due is judged by the database clock only, so replicas with skewed clocks agree; a replica that wakes
early finds nothing due and sleeps again.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from worker.config import SchedulerSettings
from worker.db.errors import MessageRejected, ValueRefused, from_database
from worker.db.schedules import FireOutcome, Schedule
from worker.db.store import DatabaseUnavailable, Store
from worker.policy.cron import CronError, CronExpression, parse_schedulable
from worker.policy.scheduling import DEFAULT_CHUNK_LIMIT, FirePlan, plan_due
from worker.service.metrics import Metrics
from worker.service.tracing import Tracing

logger = logging.getLogger(__name__)

RETRY_DELAY = timedelta(seconds=2)  # after a failed run (the database is unreachable), at most the reload interval
IDLE_FLOOR = timedelta(milliseconds=10)  # the shortest pause after a run that published nothing
MISFIRES_LOGGED = 10  # skipped fire times logged one by one per plan; the rest in one summary line


def load_zone(name: str) -> ZoneInfo:
    """The IANA time zone of that name; ValueError naming it when there is none."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(f"unknown time zone {name!r}; use an IANA name such as 'UTC' or 'Europe/Berlin'") from None


def compile_schedule(cron: str, time_zone: str) -> tuple[CronExpression, ZoneInfo]:
    """The parsed expression and zone of a schedule; ValueError (a :class:`CronError` for the expression) saying
    why it cannot fire."""
    expression = parse_schedulable(cron)
    return expression, load_zone(time_zone)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How the scheduler runs; validated at construction.

    ``reload_interval``: the longest pause between two runs (changes made with SQL are seen within it).
    ``misfire_threshold``: how late a fire time may be and still fire as scheduled. ``fire_all_limit``: the most
    missed times a ``fire_all`` schedule publishes. ``chunk_limit``: the most missed times one run walks through.
    """

    reload_interval: timedelta = timedelta(seconds=10)
    misfire_threshold: timedelta = timedelta(minutes=1)
    fire_all_limit: int = 100
    chunk_limit: int = DEFAULT_CHUNK_LIMIT

    def __post_init__(self) -> None:
        if self.reload_interval <= timedelta(0):
            raise ValueError(f"the scheduler's reload interval must be positive, not {self.reload_interval}")
        if self.misfire_threshold < timedelta(0):
            raise ValueError(f"the misfire threshold must be zero or more, not {self.misfire_threshold}")
        if not 1 <= self.fire_all_limit < self.chunk_limit:
            raise ValueError(
                f"the fire_all limit {self.fire_all_limit} must be at least 1 and below the chunk limit "
                f"{self.chunk_limit}"
            )

    @classmethod
    def from_settings(cls, settings: SchedulerSettings) -> SchedulerConfig:
        """The configuration the settings describe."""
        return cls(settings.reload_interval, settings.misfire_threshold, settings.fire_all_limit)


@dataclass(frozen=True, slots=True)
class SchedulerResult:
    """What one run did. ``next_due`` is the earliest next fire time seen (database clock), ``now`` the clock."""

    enabled: bool
    schedules: int
    published: int
    singleton_skips: int
    misfires: int
    invalid: int
    claims_lost: int
    now: datetime
    next_due: datetime | None


def _content(schedule: Schedule) -> tuple[Any, ...]:
    """What a schedule's messages are made of: when any of it changes, a refused schedule is tried again."""
    return (
        schedule.cron, schedule.time_zone, schedule.message_name, schedule.correlation_hint,
        json.dumps(schedule.payload, sort_keys=True, default=str),
        json.dumps(dict(schedule.headers), sort_keys=True, default=str),
    )


class Scheduler:
    """Publishes due schedules' messages: :meth:`run_once` once, :meth:`run` until told to stop."""

    def __init__(
        self, store: Store, config: SchedulerConfig, metrics: Metrics | None = None, tracing: Tracing | None = None
    ) -> None:
        self.tracing = tracing  # a publish span per fire, its context in the published messages' headers
        self.store = store
        self.config = config
        self.metrics = metrics or Metrics()
        self._compiled: dict[tuple[str, str], tuple[CronExpression, ZoneInfo] | str] = {}
        self._gauged: set[str] = set()
        # Schedules whose message the database refused, by name: the row's content as it was then, and why.
        self._refused: dict[str, tuple[tuple[Any, ...], str]] = {}

    # -- one run ----------------------------------------------------------------------------------------------

    def run_once(self) -> SchedulerResult:
        """Plan, fire and report every schedule once; returns the counts and when the next one is due."""
        snapshot = self.store.schedules_snapshot()
        now, schedules = snapshot.now, snapshot.schedules
        self.metrics.scheduler_enabled.set(1 if snapshot.scheduler_enabled else 0)
        self._compiled = {key: self._compiled[key] for key in self._current_keys(schedules) if key in self._compiled}
        if not snapshot.scheduler_enabled:
            if any(s.next_fire_at is not None or s.planned_cron is not None for s in schedules):
                self.store.schedules_unplan()
            self._set_next_fire_gauges({})
            self.metrics.schedules_invalid.set(0)
            return SchedulerResult(False, len(schedules), 0, 0, 0, 0, 0, now, None)

        self._refused = {name: seen for name, seen in self._refused.items() if name in {s.name for s in schedules}}
        stale = [s.name for s in schedules if not s.enabled and (s.next_fire_at or s.planned_cron)]
        if stale:
            self.store.schedules_unplan(stale)
        published = skips = misfires = invalid = lost = 0
        next_fire: dict[str, datetime] = {}
        for schedule in schedules:
            compiled = self._compile(schedule)
            if isinstance(compiled, str):
                invalid += 1
                self._report_invalid(schedule, compiled)
                continue
            if not schedule.enabled:
                continue
            refused = self._refused.get(schedule.name)
            if refused is not None and refused[0] == _content(schedule):
                invalid += 1
                self._report_invalid(schedule, refused[1])
                continue
            self._refused.pop(schedule.name, None)
            expression, zone = compiled
            if not schedule.planned or schedule.invalid_reason is not None:
                planned = self._plan(schedule, expression, zone, now)
                if planned is None:
                    continue  # changed meanwhile (another replica planned it): seen again at the next run
                schedule = planned
            due = schedule.next_fire_at
            if due is not None and due <= now:
                plan = plan_due(
                    expression,
                    zone,
                    due,
                    now,
                    schedule.misfire,
                    threshold=self.config.misfire_threshold,
                    fire_all_limit=self.config.fire_all_limit,
                    chunk_limit=self.config.chunk_limit,
                )
                try:
                    outcome = self._fire(schedule, plan, zone)
                except (MessageRejected, ValueRefused) as error:
                    # Nothing was written; the schedule waits for an edit instead of failing every run.
                    reason = f"its message cannot be published: {error}"
                    self._refused[schedule.name] = (_content(schedule), reason)
                    invalid += 1
                    self._report_invalid(schedule, reason)
                    continue
                if outcome.claimed:
                    self._report_fire(schedule, zone, outcome, plan.misfired)
                    self._report_nonexistent(schedule, plan.nonexistent)
                    published += len(outcome.published)
                    skips += len(outcome.singleton_skipped)
                    misfires += outcome.misfired
                else:
                    lost += 1  # another replica fired it first; its next time is most likely the planned one
                due = plan.next_fire_at
            if due is not None:
                next_fire[schedule.name] = due.astimezone(UTC)
        self._set_next_fire_gauges(next_fire)
        self.metrics.schedules_invalid.set(invalid)
        next_due = min(next_fire.values(), default=None)
        return SchedulerResult(True, len(schedules), published, skips, misfires, invalid, lost, now, next_due)

    def _fire(self, schedule: Schedule, plan: FirePlan, zone: ZoneInfo) -> FireOutcome:
        if self.tracing is None:
            return self.store.schedule_fire(schedule, plan, zone)
        with self.tracing.publish(schedule.message_name, schedule.name) as context:
            return self.store.schedule_fire(replace(schedule, headers={**schedule.headers, **context}), plan, zone)

    def pause_after(self, result: SchedulerResult) -> timedelta:
        """How long to wait before the next run: until the next fire time, at most the reload interval."""
        if result.next_due is None:
            return self.config.reload_interval
        floor = timedelta(0) if result.published or result.claims_lost else IDLE_FLOOR
        return min(max(result.next_due - result.now, floor), self.config.reload_interval)

    # -- the loop ---------------------------------------------------------------------------------------------

    def run(self, stop: threading.Event, alive: Callable[[], None] = lambda: None) -> None:
        """Run until ``stop`` is set; a failed run is logged (and counted when the database is away), never fatal."""
        while not stop.is_set():
            alive()
            try:
                pause = self.pause_after(self.run_once())
            except DatabaseUnavailable as error:
                self.metrics.database_error(error)
                logger.warning("scheduler: %s", error)
                pause = min(RETRY_DELAY, self.config.reload_interval)
            except Exception as error:  # a bug must not end the scheduler; logged, and tried again after the interval
                logger.exception("scheduler run failed")
                if from_database(error):  # a database error the store does not know: counted as `other`
                    self.metrics.database_error(error)
                pause = self.config.reload_interval
            stop.wait(pause.total_seconds())

    # -- parts ------------------------------------------------------------------------------------------------

    @staticmethod
    def _current_keys(schedules: tuple[Schedule, ...]) -> set[tuple[str, str]]:
        return {(s.cron, s.time_zone) for s in schedules}

    def _compile(self, schedule: Schedule) -> tuple[CronExpression, ZoneInfo] | str:
        """The schedule's expression and zone (cached by their text), or why it cannot fire."""
        key = (schedule.cron, schedule.time_zone)
        if key not in self._compiled:
            try:
                self._compiled[key] = compile_schedule(*key)
            except CronError as error:
                self._compiled[key] = f"invalid cron expression: {error}"
            except ValueError as error:
                self._compiled[key] = str(error)
        return self._compiled[key]

    def _report_nonexistent(self, schedule: Schedule, walls: Sequence[datetime]) -> None:
        """Say which fire times the zone's spring-forward skipped (Quartz skips them too; silently, it would not
        be seen that a daily job did not run that night)."""
        if not walls:
            return
        self.metrics.schedule_nonexistent_times.labels(schedule.name).inc(len(walls))
        shown = ", ".join(wall.isoformat(sep=" ") for wall in walls[:3]) + (" …" if len(walls) > 3 else "")
        logger.warning(
            "schedule %s (%s): %d fire time(s) do not exist in %s, whose clocks spring forward over them; skipped as "
            "Quartz does: %s", schedule.name, schedule.cron, len(walls), schedule.time_zone, shown,
            extra={"schedule": schedule.name},
        )

    def _report_invalid(self, schedule: Schedule, reason: str) -> None:
        if schedule.invalid_reason == reason and schedule.next_fire_at is None:
            return
        if self.store.schedule_record_invalid(schedule, reason):  # one replica records (and logs) each change
            logger.warning("schedule %s cannot fire: %s", schedule.name, reason)

    def _plan(self, schedule: Schedule, expression: CronExpression, zone: ZoneInfo, now: datetime) -> Schedule | None:
        """Compute and store the first fire time after now; the schedule as planned, or None if it changed."""
        skipped: list[datetime] = []
        upcoming = expression.next_after(now, zone, skipped)
        next_fire_at = None if upcoming is None else upcoming.astimezone(UTC)
        if not self.store.schedule_plan(schedule, next_fire_at):
            return None
        self._report_nonexistent(schedule, skipped)
        if upcoming is None:
            logger.info("schedule %s (%s) has no fire time after %s", schedule.name, schedule.cron, now.isoformat())
        else:
            logger.info("schedule %s (%s, %s) fires next at %s", schedule.name, schedule.cron, schedule.time_zone,
                        upcoming.isoformat())
        return replace(
            schedule,
            next_fire_at=next_fire_at,
            planned_cron=schedule.cron,
            planned_time_zone=schedule.time_zone,
            invalid_reason=None,
        )

    def _report_fire(
        self, schedule: Schedule, zone: ZoneInfo, outcome: FireOutcome, misfired: tuple[datetime, ...]
    ) -> None:
        name = schedule.name
        for message in outcome.published:
            self.metrics.schedule_fires.labels(name).inc()
            logger.info(
                "schedule %s published job %d for %s (message_id %s)",
                name, message.job_number, message.fire_time.astimezone(zone).isoformat(), message.message_id,
            )
        for fire_time in outcome.singleton_skipped:
            self.metrics.schedule_singleton_skips.labels(name).inc()
            logger.info(
                "schedule %s skipped %s: its last message %s is still pending (singleton)",
                name, fire_time.astimezone(zone).isoformat(), schedule.last_message_id,
            )
        for fire_time in outcome.duplicates:
            logger.warning(
                "schedule %s: the message of %s is in the table already; not published again",
                name, fire_time.astimezone(zone).isoformat(),
            )
        if misfired:
            self.metrics.schedule_misfires.labels(name).inc(len(misfired))
            for fire_time in misfired[:MISFIRES_LOGGED]:
                logger.warning(
                    "schedule %s missed %s (misfire policy %s)",
                    name, fire_time.astimezone(zone).isoformat(), schedule.misfire.value,
                )
            if len(misfired) > MISFIRES_LOGGED:
                logger.warning(
                    "schedule %s missed %d more fire times, up to %s (misfire policy %s)",
                    name, len(misfired) - MISFIRES_LOGGED, misfired[-1].astimezone(zone).isoformat(),
                    schedule.misfire.value,
                )

    def _set_next_fire_gauges(self, next_fire: dict[str, datetime]) -> None:
        for name in self._gauged - set(next_fire):
            self.metrics.schedule_next_fire.remove(name)
        for name, when in next_fire.items():
            self.metrics.schedule_next_fire.labels(name).set(when.timestamp())
        self._gauged = set(next_fire)
