"""Every statement against ``correlation_schedule`` and ``correlation_scheduler``: a part of the store.

:class:`ScheduleStatements` is mixed into :class:`~worker.db.store.Store`, whose plumbing (``_run``, ``_now``, the
translation of driver errors) it uses. Times come from the database clock.

**Exactly once per fire time.** A replica that finds a schedule due publishes in one transaction that first claims
the fire time with a compare-and-set: ``UPDATE … SET next_fire_at = <the next one> WHERE next_fire_at = <the due
one> AND cron = … AND enabled AND <the scheduler is on>``. Concurrent replicas queue on the row lock; the first
commits, the others find ``next_fire_at`` moved and update nothing, so they insert nothing. The message itself is
inserted in the same transaction (a replica killed in between leaves neither), with a ``message_id`` derived from
the schedule and the fire time, so that even a claim replayed by mistake could not publish twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, tzinfo
from typing import Any, TypeVar

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    MetaData,
    SmallInteger,
    Table,
    Text,
    delete,
    exists,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection
from sqlalchemy.exc import OperationalError
from sqlalchemy.sql import ColumnElement

from worker.db.base import StoreBase
from worker.db.errors import MessageRejected
from worker.db.schema import Document, UtcDateTime, message_table
from worker.message import MessageState
from worker.policy.scheduling import (
    FireAction,
    FirePlan,
    MisfirePolicy,
    fire_headers,
    manual_message_id,
    scheduled_message_id,
)

T = TypeVar("T")

# A scheduler statement never waits long behind another session's lock on a schedule row (a replica frozen in the
# middle of a claim): after LOCK_TIMEOUT it gives up (a claim counts as lost to that replica), and a session idle
# in a transaction that long is ended by the server, which frees the row. PostgreSQL only (SQLite has one writer).
LOCK_TIMEOUT = "2s"
IDLE_IN_TRANSACTION_TIMEOUT = "10s"
LOCK_NOT_AVAILABLE = "55P03"  # SQLSTATE of a lock_timeout

# Both settings for the rest of the transaction only (set_config's third argument: is_local).
_BOUND_WAITS = text(
    f"SELECT set_config('lock_timeout', '{LOCK_TIMEOUT}', true),"
    f" set_config('idle_in_transaction_session_timeout', '{IDLE_IN_TRANSACTION_TIMEOUT}', true)"
)


class _ClaimBusy(Exception):
    """Another session holds the schedule's row past the lock timeout."""

metadata = MetaData()

schedule_table = Table(
    "correlation_schedule",
    metadata,
    Column("name", Text, primary_key=True),
    Column("cron", Text, nullable=False),
    Column("time_zone", Text, nullable=False),
    Column("enabled", Boolean, nullable=False),
    Column("singleton", Boolean, nullable=False),
    Column("misfire", Text, nullable=False),
    Column("message_name", Text, nullable=False),
    Column("correlation_hint", Text),
    Column("payload", Document, nullable=False),
    Column("headers", Document, nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
    Column("next_fire_at", UtcDateTime),
    Column("planned_cron", Text),
    Column("planned_time_zone", Text),
    Column("last_fire_at", UtcDateTime),
    Column("last_fire_kind", Text),
    Column("last_message_id", Text),
    Column("fire_count", BigInteger, nullable=False),
    Column("skip_count", BigInteger, nullable=False),
    Column("last_skipped_at", UtcDateTime),
    Column("misfire_count", BigInteger, nullable=False),
    Column("invalid_reason", Text),
)

scheduler_table = Table(
    "correlation_scheduler",
    metadata,
    Column("id", SmallInteger, primary_key=True),
    Column("enabled", Boolean, nullable=False),
    Column("changed_at", UtcDateTime, nullable=False),
)

_s = schedule_table.c


class ScheduleRejected(ValueError):
    """The schema refused a schedule; ``constraint`` names the rule it broke."""

    def __init__(self, message: str, constraint: str | None = None) -> None:
        super().__init__(message)
        self.constraint = constraint


@dataclass(frozen=True, slots=True)
class Schedule:
    """One row of ``correlation_schedule``."""

    name: str
    cron: str
    time_zone: str
    enabled: bool
    singleton: bool
    misfire: MisfirePolicy
    message_name: str
    correlation_hint: str | None
    payload: Any
    headers: Mapping[str, Any]
    created_at: datetime
    next_fire_at: datetime | None = None
    planned_cron: str | None = None
    planned_time_zone: str | None = None
    last_fire_at: datetime | None = None
    last_fire_kind: str | None = None
    last_message_id: str | None = None
    fire_count: int = 0
    skip_count: int = 0
    last_skipped_at: datetime | None = None
    misfire_count: int = 0
    invalid_reason: str | None = None

    @property
    def hint(self) -> str:
        """The correlation hint of its messages: its own, or the schedule's name."""
        return self.correlation_hint or self.name

    @property
    def planned(self) -> bool:
        """True when ``next_fire_at`` was computed from the current cron and time zone."""
        return self.planned_cron == self.cron and self.planned_time_zone == self.time_zone


@dataclass(frozen=True, slots=True)
class NewSchedule:
    """What an operator gives to add a schedule; the rest has defaults."""

    name: str
    cron: str
    message_name: str
    time_zone: str = "UTC"
    correlation_hint: str | None = None
    payload: Any = None
    headers: Mapping[str, Any] | None = None
    enabled: bool = True
    singleton: bool = True
    misfire: MisfirePolicy = MisfirePolicy.FIRE_ONCE_NOW


@dataclass(frozen=True, slots=True)
class ScheduleSnapshot:
    """The scheduler's switch and every schedule, read in one transaction with the database clock."""

    now: datetime
    scheduler_enabled: bool
    schedules: tuple[Schedule, ...]


@dataclass(frozen=True, slots=True)
class PublishedMessage:
    """A message a schedule put into ``correlation_message``."""

    id: int
    message_id: str
    fire_time: datetime
    job_number: int


@dataclass(frozen=True, slots=True)
class FireOutcome:
    """What a fire transaction did. ``claimed`` is False when another replica had fired (or the row changed)."""

    claimed: bool
    published: tuple[PublishedMessage, ...] = ()
    singleton_skipped: tuple[datetime, ...] = ()
    duplicates: tuple[datetime, ...] = ()  # fire times whose message_id was in the table already
    misfired: int = 0


@dataclass(frozen=True, slots=True)
class LastMessage:
    """The state of a schedule's last published message, while it is in the table."""

    id: int
    state: MessageState
    attempt: int
    last_error: str | None
    expired: bool

    @property
    def running(self) -> bool:
        """Still to be correlated: neither dead, expired nor delivered (a singleton schedule waits for it)."""
        return self.state not in (MessageState.DEAD, MessageState.DELIVERED) and not self.expired


def _schedule(row: Any) -> Schedule:
    values = dict(row._mapping)
    values["misfire"] = MisfirePolicy(values["misfire"])
    values["enabled"], values["singleton"] = bool(values["enabled"]), bool(values["singleton"])
    values["headers"] = values["headers"] or {}
    return Schedule(**values)


# The claim of a due fire time: advance next_fire_at only if nothing changed since the replica read the row (the
# row lock taken by the UPDATE makes concurrent claimers wait, then find next_fire_at moved).
def _claim(schedule: Schedule, plan: FirePlan) -> Any:
    return (
        update(schedule_table)
        .where(
            _s.name == schedule.name,
            _s.next_fire_at == plan.due,
            _s.cron == schedule.cron,
            _s.time_zone == schedule.time_zone,
            _s.planned_cron == schedule.cron,
            _s.planned_time_zone == schedule.time_zone,
            _s.enabled,
            _s.singleton == schedule.singleton,
            _s.misfire == schedule.misfire.value,
            exists().where(scheduler_table.c.enabled),
        )
        .values(next_fire_at=plan.next_fire_at, misfire_count=_s.misfire_count + len(plan.misfired))
        .returning(_s.fire_count, _s.last_message_id)
    )


class ScheduleStatements(StoreBase):
    """Every statement against ``correlation_schedule`` and ``correlation_scheduler`` (a part of the store)."""

    def _bound_waits(self, connection: Connection) -> None:
        """Bound this transaction's waits for row locks, and its life should its client freeze mid-transaction."""
        if self.dialect == "postgresql":
            connection.execute(_BOUND_WAITS)

    def _run_bounded(self, statement: Any) -> int:
        """Run one scheduler statement with bounded waits; returns its row count."""

        def work(connection: Connection) -> int:
            self._bound_waits(connection)
            return int(connection.execute(statement).rowcount)

        return self._write(work)

    # -- reading ----------------------------------------------------------------------------------------------

    def schedules_snapshot(self) -> ScheduleSnapshot:
        """The database clock, the scheduler's switch and every schedule (by name), in one transaction."""

        def work(connection: Connection) -> ScheduleSnapshot:
            now = self._now(connection)
            enabled = connection.execute(select(scheduler_table.c.enabled)).scalar()
            rows = connection.execute(select(schedule_table).order_by(_s.name))
            return ScheduleSnapshot(now, bool(enabled), tuple(_schedule(row) for row in rows))

        return self._run(work)

    def schedules_list(self) -> list[Schedule]:
        """Every schedule, by name."""
        return list(self.schedules_snapshot().schedules)

    def schedule_get(self, name: str) -> Schedule | None:
        """One schedule by name."""
        row = self._run(lambda c: c.execute(select(schedule_table).where(_s.name == name)).first())
        return None if row is None else _schedule(row)

    def scheduler_is_enabled(self) -> bool:
        """The switch of the whole scheduler."""
        return bool(self._run(lambda c: c.execute(select(scheduler_table.c.enabled)).scalar()))

    def schedule_last_message(self, message_id: str) -> LastMessage | None:
        """The schedule's last published message (by its ``message_id``) while it is in the table (or its
        delivery record)."""
        m = message_table.c
        statement = select(m.id, m.state, m.attempt, m.last_error, m.expires_at).where(m.message_id == message_id)

        def work(connection: Connection) -> LastMessage | None:
            row = connection.execute(statement).first()
            if row is None:
                return None
            expired = row.expires_at is not None and row.expires_at <= self._now(connection)
            return LastMessage(int(row.id), MessageState(row.state), int(row.attempt), row.last_error, expired)

        return self._run(work)

    # -- operators --------------------------------------------------------------------------------------------

    def schedule_insert(self, schedule: NewSchedule) -> bool:
        """Add a schedule; False when one of that name exists. Raises :class:`ScheduleRejected` on a bad value."""
        insert = postgresql_insert if self.dialect == "postgresql" else sqlite_insert
        statement = (
            insert(schedule_table)
            .values(
                name=schedule.name,
                cron=schedule.cron,
                time_zone=schedule.time_zone,
                enabled=schedule.enabled,
                singleton=schedule.singleton,
                misfire=schedule.misfire.value,
                message_name=schedule.message_name,
                correlation_hint=schedule.correlation_hint,
                payload=schedule.payload if schedule.payload is not None else {},
                headers=dict(schedule.headers or {}),
            )
            .on_conflict_do_nothing(index_elements=["name"])
            .returning(_s.name)
        )

        try:
            return self._write(lambda c: c.execute(statement).first()) is not None
        except MessageRejected as error:
            detail = str(error).removeprefix("the database refused the message: ")
            raise ScheduleRejected(f"the database refused the schedule: {detail}", error.constraint) from None

    def schedule_delete(self, name: str) -> bool:
        """Delete a schedule (its published messages stay); False when there was none."""
        return bool(self._write(lambda c: c.execute(delete(schedule_table).where(_s.name == name)).rowcount))

    def schedule_set_enabled(self, name: str, enabled: bool) -> bool | None:
        """Enable or disable a schedule; True if that changed it, False if it already was, None if there is none.

        A change forgets the planned next fire time: an enabled schedule fires from now on, missed times are not
        caught up.
        """
        statement = (
            update(schedule_table)
            .where(_s.name == name, _s.enabled != enabled)
            .values(enabled=enabled, next_fire_at=None, planned_cron=None, planned_time_zone=None)
        )

        def work(connection: Connection) -> bool | None:
            if connection.execute(statement).rowcount:
                return True
            found = connection.execute(select(_s.name).where(_s.name == name)).first()
            return None if found is None else False

        return self._write(work)

    def scheduler_set_enabled(self, enabled: bool) -> bool:
        """Switch the whole scheduler on or off; True if that changed it.

        A change forgets every schedule's planned next fire time: nothing is caught up from while it was off.
        """

        def work(connection: Connection) -> bool:
            changed = connection.execute(
                update(scheduler_table)
                .where(scheduler_table.c.enabled != enabled)
                .values(enabled=enabled, changed_at=self._now(connection))
            ).rowcount
            if changed:
                connection.execute(
                    update(schedule_table).values(next_fire_at=None, planned_cron=None, planned_time_zone=None)
                )
            return bool(changed)

        return self._write(work)

    # -- the scheduler ----------------------------------------------------------------------------------------

    def schedules_unplan(self, names: Sequence[str] = ()) -> int:
        """Forget the planned fire times of these disabled schedules, or (no names) of every schedule while the
        scheduler is off; returns how many rows changed. Schedules enabled again meanwhile are left alone."""
        planned = (_s.next_fire_at.is_not(None)) | (_s.planned_cron.is_not(None))
        condition: ColumnElement[bool] = (
            _s.name.in_(list(names)) & ~_s.enabled if names else ~exists().where(scheduler_table.c.enabled)
        )
        statement = (
            update(schedule_table)
            .where(planned, condition)
            .values(next_fire_at=None, planned_cron=None, planned_time_zone=None)
        )
        return self._run_bounded(statement)

    def schedule_plan(self, schedule: Schedule, next_fire_at: datetime | None) -> bool:
        """Set the next fire time computed from the row as read (None: it has none left); False if the row changed
        meanwhile (another replica planned it, or an operator edited it)."""
        statement = (
            update(schedule_table)
            .where(
                _s.name == schedule.name,
                _s.cron == schedule.cron,
                _s.time_zone == schedule.time_zone,
                _s.enabled,
                _s.next_fire_at.is_not_distinct_from(schedule.next_fire_at),
                _s.planned_cron.is_not_distinct_from(schedule.planned_cron),
                _s.planned_time_zone.is_not_distinct_from(schedule.planned_time_zone),
            )
            .values(
                next_fire_at=next_fire_at,
                planned_cron=schedule.cron,
                planned_time_zone=schedule.time_zone,
                invalid_reason=None,
            )
        )
        return bool(self._run_bounded(statement))

    def schedule_record_invalid(self, schedule: Schedule, reason: str) -> bool:
        """Record why a schedule cannot fire (and that it has no next fire time); True if the row changed, False if
        it said so already or was edited meanwhile."""
        statement = (
            update(schedule_table)
            .where(
                _s.name == schedule.name,
                _s.cron == schedule.cron,
                _s.time_zone == schedule.time_zone,
                _s.invalid_reason.is_distinct_from(reason) | _s.next_fire_at.is_not(None),
            )
            .values(
                invalid_reason=reason,
                next_fire_at=None,
                planned_cron=schedule.cron,
                planned_time_zone=schedule.time_zone,
            )
        )
        return bool(self._run_bounded(statement))

    def schedule_fire(self, schedule: Schedule, plan: FirePlan, zone: tzinfo) -> FireOutcome:
        """Carry out a plan in one transaction: claim the due time (compare-and-set of ``next_fire_at``), count the
        misfires, and publish the planned fire times, unless the schedule is a singleton whose last message is still
        pending (then they are skipped and counted). With a singleton, at most the latest planned time is published.
        """

        def work(connection: Connection) -> FireOutcome:
            self._bound_waits(connection)
            try:
                claimed = connection.execute(_claim(schedule, plan)).first()
            except OperationalError as error:
                if getattr(error.orig, "sqlstate", None) == LOCK_NOT_AVAILABLE:
                    raise _ClaimBusy from None  # another replica is in the middle of firing it (or frozen there)
                raise
            if claimed is None:
                return FireOutcome(claimed=False)
            publish, skipped = list(plan.publish), []
            if publish and schedule.singleton:
                skipped, publish = publish[:-1], publish[-1:]
                if claimed.last_message_id and self._pending(connection, claimed.last_message_id):
                    skipped, publish = skipped + publish, []
            published: list[PublishedMessage] = []
            duplicates: list[datetime] = []
            for fire_time in publish:
                job_number = int(claimed.fire_count) + len(published) + 1
                message_id = scheduled_message_id(schedule.name, fire_time)
                headers = fire_headers(
                    schedule.headers, schedule.name, fire_time.astimezone(zone), job_number, FireAction.START, False
                )
                row_id = self._publish(connection, schedule, message_id, headers)
                if row_id is None:
                    duplicates.append(fire_time)
                else:
                    published.append(PublishedMessage(row_id, message_id, fire_time, job_number))
            changes: dict[str, Any] = {}
            if published:
                changes.update(
                    fire_count=_s.fire_count + len(published),
                    last_fire_at=published[-1].fire_time,
                    last_fire_kind="scheduled",
                    last_message_id=published[-1].message_id,
                )
            if skipped:
                changes.update(skip_count=_s.skip_count + len(skipped), last_skipped_at=skipped[-1])
            if changes:
                connection.execute(update(schedule_table).where(_s.name == schedule.name).values(**changes))
            return FireOutcome(True, tuple(published), tuple(skipped), tuple(duplicates), len(plan.misfired))

        try:
            return self._write(work)
        except _ClaimBusy:
            return FireOutcome(claimed=False)

    def schedule_fire_manual(self, name: str, action: FireAction, zone: tzinfo) -> PublishedMessage | None:
        """Publish a message of the schedule now, by hand (``action_type`` manual, singleton ignored); None if there
        is no such schedule. Its fire time is the database clock's now, shown in ``zone``."""

        def work(connection: Connection) -> PublishedMessage | None:
            now = self._now(connection)
            claimed = connection.execute(
                update(schedule_table)
                .where(_s.name == name)
                .values(fire_count=_s.fire_count + 1, last_fire_at=now, last_fire_kind="manual")
                .returning(*schedule_table.c)
            ).first()
            if claimed is None:
                return None
            schedule = _schedule(claimed)
            # The job number makes it unique: two fires within the clock's resolution (a millisecond on SQLite)
            # are two messages.
            message_id = manual_message_id(name, action, now, schedule.fire_count)
            connection.execute(update(schedule_table).where(_s.name == name).values(last_message_id=message_id))
            headers = fire_headers(
                schedule.headers, name, now.astimezone(zone), schedule.fire_count, action, True
            )
            row_id = self._publish(connection, schedule, message_id, headers)
            assert row_id is not None, "a manual message_id is new by construction"
            return PublishedMessage(row_id, message_id, now, schedule.fire_count)

        return self._write(work)

    def _pending(self, connection: Connection, message_id: str) -> bool:
        """Whether a message is still to be correlated: in the table, not dead, not expired."""
        m = message_table.c
        now = self._now(connection)
        statement = select(m.id).where(
            m.message_id == message_id,
            m.state.not_in([MessageState.DEAD.value, MessageState.DELIVERED.value]),
            m.expires_at.is_(None) | (m.expires_at > now),
        )
        return connection.execute(statement).first() is not None

    def _publish(
        self, connection: Connection, schedule: Schedule, message_id: str, headers: Mapping[str, Any]
    ) -> int | None:
        """Insert a schedule's message; None when its message_id is in the table already."""
        insert = postgresql_insert if self.dialect == "postgresql" else sqlite_insert
        statement = (
            insert(message_table)
            .values(
                message_id=message_id,
                message_name=schedule.message_name,
                correlation_hint=schedule.hint,
                payload=schedule.payload if schedule.payload is not None else {},
                headers=dict(headers),
            )
            .on_conflict_do_nothing(index_elements=["message_id"])
            .returning(message_table.c.id)
        )
        row_id = connection.execute(statement).scalar_one_or_none()
        return None if row_id is None else int(row_id)

