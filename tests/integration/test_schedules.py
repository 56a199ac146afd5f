"""Schedules against real databases: the table as SQL sees it, every statement, the scheduler's runs, and the
operator actions (PostgreSQL, and SQLite where it runs the same)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from itertools import takewhile
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import text, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DataError, IntegrityError

from worker.admin import schedules as admin
from worker.admin.operations import AdminError
from worker.config import DatabaseSettings
from worker.db.schedules import NewSchedule, Schedule, schedule_table
from worker.db.schema import message_table
from worker.db.store import Store, build_engine
from worker.engine.scheduler import Scheduler, SchedulerConfig
from worker.message import MessageState
from worker.policy.cron import parse
from worker.policy.scheduling import FireAction, MisfirePolicy, plan_due
from worker.service.metrics import Metrics

FAST = SchedulerConfig(reload_interval=timedelta(seconds=1), misfire_threshold=timedelta(seconds=5))


def add(store: Store, name: str = "nightly", cron: str = "0 0 3 * * ?", **values: Any) -> Schedule:
    assert store.schedule_insert(NewSchedule(name=name, cron=cron, message_name=values.pop("message_name", "job"),
                                             **values))
    schedule = store.schedule_get(name)
    assert schedule is not None
    return schedule


def set_row(store: Store, name: str, **values: Any) -> Schedule:
    """Set columns of a schedule as SQL would; ``*_at`` values are seconds relative to the database clock."""
    now = store.now()
    changes = {k: now + timedelta(seconds=v) if k.endswith("_at") and v is not None else v for k, v in values.items()}
    with store.engine.begin() as connection:
        connection.execute(update(schedule_table).where(schedule_table.c.name == name).values(**changes))
    schedule = store.schedule_get(name)
    assert schedule is not None
    return schedule


def make_due(store: Store, name: str, ago: int = 1) -> datetime:
    """Set next_fire_at to the schedule's fire time about ``ago`` seconds before now, as if it had waited for it."""
    schedule = store.schedule_get(name)
    assert schedule is not None
    due = parse(schedule.cron).next_after(store.now() - timedelta(seconds=ago + 1), UTC)
    assert due is not None
    set_row(store, name, next_fire_at=None)
    with store.engine.begin() as connection:
        connection.execute(update(schedule_table).where(schedule_table.c.name == name).values(next_fire_at=due))
    return due


def messages(store: Store) -> list[dict[str, Any]]:
    with store.engine.connect() as connection:
        rows = connection.execute(message_table.select().order_by(message_table.c.id)).mappings().all()
    return [dict(row) for row in rows]


def scheduler(store: Store, config: SchedulerConfig = FAST) -> Scheduler:
    return Scheduler(store, config, Metrics())


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


# -- the table, as SQL sees it --------------------------------------------------------------------------------


@pytest.fixture
def conn(any_store: Store) -> Iterator[Connection]:
    with any_store.engine.connect() as connection:
        yield connection


def sql_insert(conn: Connection, columns: str = "", values: str = "", **params: Any) -> None:
    row = {"name": "nightly", "cron": "0 0 3 * * ?", "message": "job", **params}
    with conn.begin():
        conn.execute(
            text(f"INSERT INTO correlation_schedule (name, cron, message_name{columns}) "
                 f"VALUES (:name, :cron, :message{values})"),
            row,
        )


def test_a_plain_sql_insert_gets_every_other_column_defaulted(conn: Connection, any_store: Store) -> None:
    sql_insert(conn)
    schedule = any_store.schedule_get("nightly")
    assert schedule is not None
    assert (schedule.time_zone, schedule.enabled, schedule.singleton) == ("UTC", True, True)
    assert schedule.misfire is MisfirePolicy.FIRE_ONCE_NOW and schedule.hint == "nightly"
    assert (schedule.payload, dict(schedule.headers)) == ({}, {})
    assert (schedule.fire_count, schedule.skip_count, schedule.misfire_count) == (0, 0, 0)
    assert schedule.next_fire_at is None and schedule.invalid_reason is None and not schedule.planned
    assert any_store.scheduler_is_enabled()


@pytest.mark.parametrize(
    ("constraint", "columns", "values", "params"),
    [
        ("correlation_schedule_name_not_empty", "", "", {"name": ""}),
        ("correlation_schedule_name_length", "", "", {"name": "n" * 256}),
        ("correlation_schedule_cron_not_empty", "", "", {"cron": "  "}),
        ("correlation_schedule_message_name_not_empty", "", "", {"message": ""}),
        ("correlation_schedule_misfire_known", ", misfire", ", 'sometimes'", {}),
        ("correlation_schedule_hint_not_empty", ", correlation_hint", ", ''", {}),
        ("correlation_schedule_hint_length", ", correlation_hint", ", :hint", {"hint": "h" * 256}),
        ("correlation_schedule_headers_object", ", headers", ", '[1, 2]'", {}),
        ("correlation_schedule_time_zone_not_empty", ", time_zone", ", ''", {}),
        ("correlation_schedule_last_fire_kind_known", ", last_fire_kind", ", 'often'", {}),
        ("correlation_schedule_counts_not_negative", ", fire_count", ", -1", {}),
    ],
)
def test_the_schema_refuses_nonsense_with_a_named_constraint(
    conn: Connection, constraint: str, columns: str, values: str, params: dict[str, Any]
) -> None:
    with pytest.raises(IntegrityError) as refused:
        sql_insert(conn, columns, values, **params)
    assert constraint in str(refused.value.orig)


def test_a_payload_that_is_not_json_is_refused(conn: Connection) -> None:
    with pytest.raises((IntegrityError, DataError)) as refused:
        sql_insert(conn, ", payload", ", '{not json'")
    assert "json" in str(refused.value.orig).lower()


def test_the_scheduler_switch_is_one_row(conn: Connection) -> None:
    with pytest.raises(IntegrityError), conn.begin():
        conn.execute(text("INSERT INTO correlation_scheduler (id, enabled) VALUES (2, false)"))
    assert conn.execute(text("SELECT count(*) FROM correlation_scheduler")).scalar() == 1


# -- statements -----------------------------------------------------------------------------------------------


def test_a_name_is_taken_once(any_store: Store) -> None:
    add(any_store)
    assert not any_store.schedule_insert(NewSchedule("nightly", "0 0 4 * * ?", "other"))
    assert [s.name for s in any_store.schedules_list()] == ["nightly"]


def test_planning_is_a_compare_and_set_on_the_row_as_read(any_store: Store) -> None:
    read = add(any_store)
    first = datetime(2030, 1, 1, 3, tzinfo=UTC)
    assert any_store.schedule_plan(read, first)
    assert not any_store.schedule_plan(read, first + timedelta(days=1))  # stale: someone planned it meanwhile
    planned = any_store.schedule_get("nightly")
    assert planned is not None and planned.next_fire_at == first and planned.planned
    set_row(any_store, "nightly", cron="0 0 4 * * ?")
    assert not any_store.schedule_plan(planned, first)  # edited by SQL meanwhile


def test_enabling_or_disabling_forgets_the_plan_only_when_it_changes_something(any_store: Store) -> None:
    schedule = add(any_store)
    assert any_store.schedule_plan(schedule, datetime(2030, 1, 1, tzinfo=UTC))
    assert any_store.schedule_set_enabled("nightly", True) is False
    kept = any_store.schedule_get("nightly")
    assert kept is not None and kept.next_fire_at is not None
    assert any_store.schedule_set_enabled("nightly", False) is True
    off = any_store.schedule_get("nightly")
    assert off is not None and not off.enabled and off.next_fire_at is None and not off.planned
    assert any_store.schedule_set_enabled("missing", True) is None


def test_switching_the_scheduler_forgets_every_plan(any_store: Store) -> None:
    for name in ("a", "b"):
        assert any_store.schedule_plan(add(any_store, name), datetime(2030, 1, 1, tzinfo=UTC))
    assert any_store.scheduler_set_enabled(False) and not any_store.scheduler_set_enabled(False)
    assert not any_store.scheduler_is_enabled()
    assert all(s.next_fire_at is None for s in any_store.schedules_list())
    assert any_store.scheduler_set_enabled(True) and any_store.scheduler_is_enabled()


def due_plan(store: Store, schedule: Schedule, late: int = 0) -> tuple[Schedule, Any]:
    """Make the schedule due at a fire time of its own (a few seconds ago, plus ``late``; after its last fire or
    skip) and plan that fire with a misfire threshold of 5 s."""
    now = store.now()
    after = max(t for t in (now - timedelta(seconds=5 + late), schedule.last_fire_at, schedule.last_skipped_at) if t)
    due = parse(schedule.cron).next_after(after, UTC)
    assert due is not None and due <= now
    with store.engine.begin() as connection:
        connection.execute(update(schedule_table).where(schedule_table.c.name == schedule.name).values(
            next_fire_at=due, planned_cron=schedule.cron, planned_time_zone=schedule.time_zone))
    fresh = store.schedule_get(schedule.name)
    assert fresh is not None
    return fresh, plan_due(parse(schedule.cron), UTC, due, now, fresh.misfire, threshold=timedelta(seconds=5))


def test_a_fire_publishes_one_message_with_its_headers_and_advances_the_schedule(any_store: Store) -> None:
    schedule = add(any_store, cron="* * * * * ?", payload={"full": True}, headers={"tenant": "acme"},
                   correlation_hint="batch-1", message_name="crawl.start")
    schedule, plan = due_plan(any_store, schedule)
    outcome = any_store.schedule_fire(schedule, plan, ZoneInfo("Europe/Berlin"))
    assert outcome.claimed and len(outcome.published) == 1
    [message] = messages(any_store)
    fire_time = plan.due.astimezone(ZoneInfo("Europe/Berlin"))
    assert message["message_id"] == f"schedule:nightly:{plan.due.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"
    assert (message["message_name"], message["correlation_hint"], message["payload"]) == (
        "crawl.start", "batch-1", {"full": True})
    assert message["headers"] == {"tenant": "acme", "schedule": "nightly", "fire_time": fire_time.isoformat(),
                                  "job_number": 1, "action": "start", "action_type": "scheduled"}
    after = any_store.schedule_get("nightly")
    assert after is not None and after.next_fire_at == plan.next_fire_at
    assert (after.fire_count, after.last_fire_kind, after.last_message_id) == (1, "scheduled", message["message_id"])
    assert after.last_fire_at == plan.due
    assert not any_store.schedule_fire(schedule, plan, UTC).claimed  # the same due time again: nothing
    assert len(messages(any_store)) == 1


def test_concurrent_fires_of_one_due_time_publish_once(store: Store, pg_url: str) -> None:
    schedule, plan = due_plan(store, add(store, cron="* * * * * ?"))
    stores = [Store(build_engine(DatabaseSettings(url=pg_url))) for _ in range(8)]
    barrier, outcomes = threading.Barrier(len(stores)), []

    def fire(other: Store) -> None:
        barrier.wait()
        outcomes.append(other.schedule_fire(schedule, plan, UTC))

    threads = [threading.Thread(target=fire, args=(other,)) for other in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for other in stores:
        other.close()
    assert sum(outcome.claimed for outcome in outcomes) == 1
    assert len(messages(store)) == 1


def test_a_claim_gives_up_soon_behind_a_session_that_holds_the_row(store: Store) -> None:
    schedule, plan = due_plan(store, add(store, cron="* * * * * ?"))
    with store.engine.connect() as holder:
        holder.execute(text("SELECT * FROM correlation_schedule WHERE name = 'nightly' FOR UPDATE"))
        started = datetime.now(UTC)
        outcome = store.schedule_fire(schedule, plan, UTC)
        waited = datetime.now(UTC) - started
        holder.rollback()
    assert not outcome.claimed and timedelta(seconds=1) < waited < timedelta(seconds=10)
    assert store.schedule_fire(schedule, plan, UTC).published  # the holder is gone: the claim goes through


def test_a_singleton_skips_while_its_last_message_is_pending_and_fires_once_it_is_gone(any_store: Store) -> None:
    schedule, plan = due_plan(any_store, add(any_store, cron="* * * * * ?"))
    assert any_store.schedule_fire(schedule, plan, UTC).published
    schedule, plan = due_plan(any_store, any_store.schedule_get("nightly"))  # type: ignore[arg-type]
    outcome = any_store.schedule_fire(schedule, plan, UTC)
    assert outcome.claimed and not outcome.published and outcome.singleton_skipped == (plan.due,)
    skipped = any_store.schedule_get("nightly")
    assert skipped is not None and skipped.skip_count == 1 and skipped.last_skipped_at == plan.due
    with any_store.engine.begin() as connection:  # correlated: the row is gone
        connection.execute(message_table.delete())
    schedule, plan = due_plan(any_store, skipped)
    assert any_store.schedule_fire(schedule, plan, UTC).published


def test_a_dead_last_message_does_not_hold_a_singleton_back(any_store: Store) -> None:
    schedule, plan = due_plan(any_store, add(any_store, cron="* * * * * ?"))
    assert any_store.schedule_fire(schedule, plan, UTC).published
    with any_store.engine.begin() as connection:
        connection.execute(message_table.update().values(state=MessageState.DEAD.value))
    schedule, plan = due_plan(any_store, any_store.schedule_get("nightly"))  # type: ignore[arg-type]
    assert any_store.schedule_fire(schedule, plan, UTC).published


def test_a_schedule_that_is_not_a_singleton_fires_whatever_is_pending(any_store: Store) -> None:
    schedule, plan = due_plan(any_store, add(any_store, cron="* * * * * ?", singleton=False))
    assert any_store.schedule_fire(schedule, plan, UTC).published
    schedule, plan = due_plan(any_store, any_store.schedule_get("nightly"))  # type: ignore[arg-type]
    assert any_store.schedule_fire(schedule, plan, UTC).published
    assert len(messages(any_store)) == 2


def test_fire_all_publishes_every_missed_time_with_consecutive_job_numbers(any_store: Store) -> None:
    schedule = add(any_store, cron="* * * * * ?", singleton=False, misfire=MisfirePolicy.FIRE_ALL)
    schedule, plan = due_plan(any_store, schedule, late=8)
    outcome = any_store.schedule_fire(schedule, plan, UTC)
    assert len(outcome.published) == len(plan.publish) >= 9
    assert [m["headers"]["job_number"] for m in messages(any_store)] == list(range(1, len(plan.publish) + 1))


def test_fire_all_of_a_singleton_publishes_the_latest_and_counts_the_others_as_skipped(any_store: Store) -> None:
    schedule = add(any_store, cron="* * * * * ?", misfire=MisfirePolicy.FIRE_ALL)
    schedule, plan = due_plan(any_store, schedule, late=8)
    outcome = any_store.schedule_fire(schedule, plan, UTC)
    assert [p.fire_time for p in outcome.published] == [plan.publish[-1]]
    assert outcome.singleton_skipped == plan.publish[:-1]


def test_misfires_are_counted_on_the_row(any_store: Store) -> None:
    schedule = add(any_store, cron="* * * * * ?", misfire=MisfirePolicy.DO_NOTHING)
    schedule, plan = due_plan(any_store, schedule, late=8)
    outcome = any_store.schedule_fire(schedule, plan, UTC)
    assert outcome.claimed and not outcome.published and outcome.misfired == len(plan.misfired) >= 9
    counted = any_store.schedule_get("nightly")
    assert counted is not None and counted.misfire_count == outcome.misfired and counted.fire_count == 0


def test_a_fire_time_whose_message_is_there_already_is_not_published_again(any_store: Store) -> None:
    schedule, plan = due_plan(any_store, add(any_store, cron="* * * * * ?"))
    any_store.schedule_fire(schedule, plan, UTC)
    set_row(any_store, "nightly", next_fire_at=None)
    with any_store.engine.begin() as connection:  # a replayed claim of the same time, by mistake
        connection.execute(update(schedule_table).values(next_fire_at=plan.due, last_message_id=None))
    replay = any_store.schedule_get("nightly")
    assert replay is not None
    outcome = any_store.schedule_fire(replay, plan, UTC)
    assert outcome.claimed and not outcome.published and outcome.duplicates == (plan.due,)
    assert len(messages(any_store)) == 1


def test_a_manual_fire_ignores_the_singleton_rule_and_numbers_its_job(any_store: Store) -> None:
    schedule, plan = due_plan(any_store, add(any_store, cron="* * * * * ?"))
    any_store.schedule_fire(schedule, plan, UTC)
    manual = any_store.schedule_fire_manual("nightly", FireAction.PAUSE, UTC)
    assert manual is not None and manual.job_number == 2
    last = messages(any_store)[-1]
    assert last["headers"]["action"] == "pause" and last["headers"]["action_type"] == "manual"
    assert last["message_id"] == manual.message_id
    fired = any_store.schedule_get("nightly")
    assert fired is not None and fired.last_fire_kind == "manual" and fired.last_message_id == manual.message_id
    assert any_store.schedule_fire_manual("missing", FireAction.START, UTC) is None


def test_no_fire_while_the_scheduler_is_off_or_the_schedule_disabled(any_store: Store) -> None:
    schedule, plan = due_plan(any_store, add(any_store, cron="* * * * * ?"))
    with any_store.engine.begin() as connection:
        connection.execute(text("UPDATE correlation_scheduler SET enabled = false"))
    assert not any_store.schedule_fire(schedule, plan, UTC).claimed
    with any_store.engine.begin() as connection:
        connection.execute(text("UPDATE correlation_scheduler SET enabled = true"))
        connection.execute(text("UPDATE correlation_schedule SET enabled = false"))
    assert not any_store.schedule_fire(schedule, plan, UTC).claimed
    assert messages(any_store) == []


# -- the scheduler's runs -------------------------------------------------------------------------------------


def test_a_schedule_inserted_with_sql_is_planned_from_now_and_fires_when_due(any_store: Store) -> None:
    with any_store.engine.begin() as connection:
        connection.execute(text("INSERT INTO correlation_schedule (name, cron, message_name) "
                                "VALUES ('tick', '* * * * * ?', 'tick')"))
    service = scheduler(any_store)
    first = service.run_once()
    tick = any_store.schedule_get("tick")
    assert tick is not None and tick.next_fire_at is not None and tick.planned
    assert first.now < tick.next_fire_at <= first.now + timedelta(seconds=1)
    assert first.next_due == tick.next_fire_at and timedelta(0) < service.pause_after(first) <= timedelta(seconds=1)
    due = make_due(any_store, "tick")
    fired = service.run_once()
    assert fired.published == 1 and len(messages(any_store)) == 1
    assert sample(service.metrics, "correlation_schedule_fires_total", schedule="tick") == 1
    assert sample(service.metrics, "correlation_scheduler_enabled") == 1
    next_fire = sample(service.metrics, "correlation_schedule_next_fire_timestamp_seconds", schedule="tick")
    assert next_fire == (due + timedelta(seconds=1)).timestamp()


def test_an_invalid_row_is_reported_never_fired_and_does_not_stop_the_others(any_store: Store) -> None:
    with any_store.engine.begin() as connection:
        connection.execute(text("INSERT INTO correlation_schedule (name, cron, message_name, time_zone) VALUES "
                                "('bad-cron', '0 0 12 * * *', 'x', 'UTC'), ('bad-zone', '0 0 12 * * ?', 'x', 'Mars'),"
                                " ('good', '* * * * * ?', 'x', 'UTC')"))
    service = scheduler(any_store)
    result = service.run_once()
    assert result.invalid == 2
    bad_cron, bad_zone = any_store.schedule_get("bad-cron"), any_store.schedule_get("bad-zone")
    assert bad_cron is not None and bad_cron.invalid_reason is not None
    assert bad_cron.invalid_reason.startswith("invalid cron expression: day-of-week: ")
    assert bad_zone is not None and bad_zone.invalid_reason is not None and "Mars" in bad_zone.invalid_reason
    assert sample(service.metrics, "correlation_schedules_invalid") == 2
    make_due(any_store, "good")
    assert service.run_once().published == 1
    assert [m["message_name"] for m in messages(any_store)] == ["x"]
    set_row(any_store, "bad-cron", cron="0 0 12 * * ?")  # fixed with SQL: planned, the reason cleared
    service.run_once()
    fixed = any_store.schedule_get("bad-cron")
    assert fixed is not None and fixed.invalid_reason is None and fixed.next_fire_at is not None


def test_a_row_whose_expression_no_date_matches_is_marked_with_the_reason(any_store: Store) -> None:
    with any_store.engine.begin() as connection:
        connection.execute(text("INSERT INTO correlation_schedule (name, cron, message_name) VALUES "
                                "('feb-31', '0 0 0 31 2 ?', 'x'), ('leap-2100', '0 0 0 29 2 ? 2100', 'x'), "
                                "('leap-day', '0 0 0 29 2 ?', 'x')"))
    service = scheduler(any_store)
    assert service.run_once().invalid == 2
    for name in ("feb-31", "leap-2100"):
        row = any_store.schedule_get(name)
        assert row is not None and row.invalid_reason is not None and "never fire" in row.invalid_reason
    leap_day = any_store.schedule_get("leap-day")
    assert leap_day is not None and leap_day.invalid_reason is None and leap_day.next_fire_at is not None
    assert leap_day.next_fire_at.month == 2 and leap_day.next_fire_at.day == 29


def test_a_cron_changed_with_sql_is_planned_again(any_store: Store) -> None:
    add(any_store, cron="0 0 3 1 1 ? 2099")
    service = scheduler(any_store)
    service.run_once()
    set_row(any_store, "nightly", cron="* * * * * ?")
    result = service.run_once()
    changed = any_store.schedule_get("nightly")
    assert changed is not None and changed.next_fire_at is not None
    assert changed.next_fire_at <= result.now + timedelta(seconds=1)


@pytest.mark.parametrize("policy", list(MisfirePolicy))
def test_a_schedule_late_past_the_threshold_follows_its_misfire_policy(
    any_store: Store, policy: MisfirePolicy
) -> None:
    add(any_store, cron="0/3 * * * * ?", misfire=policy, singleton=False)
    service = scheduler(any_store, SchedulerConfig(reload_interval=timedelta(seconds=1),
                                                   misfire_threshold=timedelta(seconds=2)))
    service.run_once()
    planned = any_store.schedule_get("nightly")
    assert planned is not None and planned.next_fire_at is not None
    due = planned.next_fire_at - timedelta(seconds=33)
    with any_store.engine.begin() as connection:  # as if no replica ran for 33 seconds
        connection.execute(update(schedule_table).values(next_fire_at=due))
    result = service.run_once()
    missed = [due, *takewhile(lambda t: t <= result.now, parse("0/3 * * * * ?").fire_times(due, UTC))]
    assert len(missed) >= 11
    published = {MisfirePolicy.FIRE_ONCE_NOW: missed[-1:], MisfirePolicy.DO_NOTHING: [],
                 MisfirePolicy.FIRE_ALL: missed}[policy]
    assert result.published == len(published) and result.misfires == len(missed) - len(published)
    assert [m["headers"]["fire_time"] for m in messages(any_store)] == [t.isoformat() for t in published]
    after = any_store.schedule_get("nightly")
    assert after is not None and after.next_fire_at is not None and after.next_fire_at > result.now
    assert after.misfire_count == result.misfires
    assert sample(service.metrics, "correlation_schedule_misfires_total", schedule="nightly") == result.misfires


def test_disabled_schedules_and_a_disabled_scheduler_are_unplanned_and_silent(any_store: Store) -> None:
    add(any_store, "on", cron="* * * * * ?")
    add(any_store, "off", cron="* * * * * ?")
    service = scheduler(any_store)
    service.run_once()
    make_due(any_store, "on")
    make_due(any_store, "off")
    set_row(any_store, "off", enabled=False)
    result = service.run_once()
    assert result.published == 1 and [m["headers"]["schedule"] for m in messages(any_store)] == ["on"]
    off = any_store.schedule_get("off")
    assert off is not None and off.next_fire_at is None
    with any_store.engine.begin() as connection:
        connection.execute(text("UPDATE correlation_scheduler SET enabled = false"))
    make_due(any_store, "on", ago=3)
    stopped = service.run_once()
    assert not stopped.enabled and stopped.next_due is None and len(messages(any_store)) == 1
    assert all(s.next_fire_at is None for s in any_store.schedules_list())
    assert sample(service.metrics, "correlation_scheduler_enabled") == 0
    assert service.pause_after(stopped) == FAST.reload_interval


def test_the_loop_survives_an_unreachable_database_and_stops_when_told() -> None:
    store = Store(build_engine(DatabaseSettings(url="postgresql://nobody@127.0.0.1:1/none",
                                                connect_timeout=timedelta(seconds=1))))
    service = scheduler(store)
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,))
    thread.start()
    deadline = datetime.now(UTC) + timedelta(seconds=20)
    errors = "correlation_database_errors_total"
    while sample(service.metrics, errors, kind="unavailable") < 1 and datetime.now(UTC) < deadline:
        stop.wait(0.05)
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive() and sample(service.metrics, errors, kind="unavailable") >= 1


# -- operator actions -----------------------------------------------------------------------------------------


def test_add_checks_every_value_and_refuses_a_taken_name(any_store: Store) -> None:
    shown = admin.schedule_add(any_store, "nightly", "0 0 3 * * ?", "job", time_zone="Europe/Berlin",
                               headers={"tenant": "acme"}, payload=[1, 2], misfire="do_nothing")
    assert shown["time_zone"] == "Europe/Berlin" and shown["misfire"] == "do_nothing"
    assert len(shown["next_fire_times"]) == 5 and all(t.endswith(("+01:00", "+02:00"))
                                                      for t in shown["next_fire_times"])
    refusals = [
        ({"name": "nightly"}, "exists already"),
        ({"cron": "0 0 3 * * *"}, "invalid cron expression: day-of-week"),
        ({"cron": "0 0 0 31 2 ?"}, "invalid cron expression: day-of-month: no date matches .* never fire"),
        ({"cron": "0 0 0 ? 2 5#5 2021"}, "invalid cron expression: day-of-week: no date matches"),
        ({"time_zone": "Mars/Base"}, "unknown time zone"),
        ({"misfire": "sometimes"}, "unknown misfire policy"),
        ({"headers": [1]}, "must be a JSON object"),
        ({"name": " "}, "must not be empty"),
        ({"hint": "h" * 256}, "at most 255"),
        ({"message_name": ""}, "must not be empty"),
        # The schema's rule for names and hints (worker/policy/text.py), said before the database is asked.
        ({"message_name": "order.paid\u00a0"}, "'order.paid\\\\u00a0' starts or ends with whitespace"),
        ({"name": "nightly\U000e0041"}, "U\\+E0041"),
        ({"hint": "cafe\u0301"}, "is not in Unicode normalisation form NFC"),
    ]
    for change, reason in refusals:
        arguments: dict[str, Any] = {"name": "other", "cron": "0 0 3 * * ?", "message_name": "job", **change}
        with pytest.raises(AdminError, match=reason):
            admin.schedule_add(any_store, arguments.pop("name"), arguments.pop("cron"),
                               arguments.pop("message_name"), **arguments)


def test_show_tells_whether_the_last_message_runs_and_its_last_error(any_store: Store) -> None:
    admin.schedule_add(any_store, "nightly", "0 0 3 * * ?", "job")
    fired = admin.schedule_fire(any_store, "nightly", "stop")
    assert fired["action"] == "stop" and fired["job_number"] == 1
    with any_store.engine.begin() as connection:
        connection.execute(message_table.update().values(attempt=2, last_error="RuntimeError: engine down"))
    shown = admin.schedule_show(any_store, "nightly")
    assert shown["running"] and shown["last_fire_kind"] == "manual"
    assert shown["last_message"]["last_error"] == "RuntimeError: engine down"
    assert shown["next_fire_times"][0].endswith("T03:00:00+00:00")
    with any_store.engine.begin() as connection:
        connection.execute(message_table.update().values(state="dead"))
    assert not admin.schedule_show(any_store, "nightly")["running"]
    listed = admin.schedules_list(any_store)
    assert listed["scheduler_enabled"] and [s["name"] for s in listed["schedules"]] == ["nightly"]


def test_enable_disable_fire_and_delete_name_what_is_missing(any_store: Store) -> None:
    admin.schedule_add(any_store, "nightly", "0 0 3 * * ?", "job")
    assert admin.schedule_set_enabled(any_store, "nightly", False) == {
        "schedule": "nightly", "enabled": False, "changed": True}
    assert admin.schedule_set_enabled(any_store, None, False) == {"scheduler_enabled": False, "changed": True}
    assert not any_store.scheduler_is_enabled()
    for action in (
        lambda: admin.schedule_set_enabled(any_store, "missing", True),
        lambda: admin.schedule_fire(any_store, "missing"),
        lambda: admin.schedule_show(any_store, "missing"),
        lambda: admin.schedule_delete(any_store, "missing"),
    ):
        with pytest.raises(AdminError, match="no schedule named 'missing'"):
            action()
    with pytest.raises(AdminError, match="unknown action"):
        admin.schedule_fire(any_store, "nightly", "explode")
    assert admin.schedule_fire(any_store, "nightly")["action_type"] == "manual"  # even while disabled
    assert admin.schedule_delete(any_store, "nightly") == {"deleted": "nightly"}
    assert len(messages(any_store)) == 1  # its messages stay


def test_manual_fires_back_to_back_within_one_tick_of_the_clock_each_publish_their_message(any_store: Store) -> None:
    """SQLite's clock ticks in milliseconds: fires within one tick are still fires of their own."""
    add(any_store, cron="0 0 0 1 1 ? 2199")
    published = [any_store.schedule_fire_manual("nightly", FireAction.START, UTC) for _ in range(300)]
    assert all(fire is not None for fire in published)
    ids = [fire.message_id for fire in published if fire is not None]
    assert len(set(ids)) == 300 and [fire.job_number for fire in published if fire] == list(range(1, 301))
    assert len(messages(any_store)) == 300


def test_a_fire_time_the_zone_skips_is_skipped_as_quartz_does_and_said(
    any_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    from zoneinfo import ZoneInfo

    year = 2101
    spring = max(day for day in range(25, 32) if datetime(year, 3, day).weekday() == 6)  # Berlin springs forward
    assert datetime(year, 3, spring, 2, 30, tzinfo=ZoneInfo("Europe/Berlin")).astimezone(UTC).astimezone(
        ZoneInfo("Europe/Berlin")).hour == 3, "02:30 does not exist that night"
    add(any_store, name="nightly", cron=f"0 30 2 {spring} 3 ? {year},{year + 1}", time_zone="Europe/Berlin")
    service = scheduler(any_store)
    with caplog.at_level("WARNING"):
        service.run_once()
    planned = any_store.schedule_get("nightly")
    assert planned is not None and planned.next_fire_at is not None and planned.next_fire_at.year == year + 1
    assert sample(service.metrics, "correlation_schedule_nonexistent_times_total", schedule="nightly") == 1
    assert any(
        "nightly" in r.getMessage() and f"{year}-03-{spring} 02:30:00" in r.getMessage() for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
