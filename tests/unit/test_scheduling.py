"""Firing policy of schedules: on-time fires, misfire policies, the published message's id and headers; the
scheduler's settings and the `schedules next` command."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from click.testing import CliRunner

from worker.cli import main
from worker.config import ConfigError, load_settings
from worker.engine.scheduler import SchedulerConfig, compile_schedule, load_zone
from worker.policy.cron import CronError, parse
from worker.policy.scheduling import (
    FireAction,
    MisfirePolicy,
    fire_headers,
    manual_message_id,
    plan_due,
    scheduled_message_id,
)

EVERY_SECOND = parse("* * * * * ?")
T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)


def seconds(*offsets: int) -> tuple[datetime, ...]:
    return tuple(T0 + timedelta(seconds=offset) for offset in offsets)


def test_a_fire_time_within_the_threshold_is_published_and_the_next_one_planned() -> None:
    plan = plan_due(EVERY_SECOND, UTC, T0, T0 + timedelta(seconds=5), MisfirePolicy.DO_NOTHING,
                    threshold=timedelta(seconds=10))
    assert plan.publish == (T0,) and plan.misfired == () and not plan.late
    assert plan.next_fire_at == T0 + timedelta(seconds=1)


def test_fire_once_now_publishes_the_latest_missed_time_and_skips_the_others() -> None:
    plan = plan_due(EVERY_SECOND, UTC, T0, T0 + timedelta(seconds=10), MisfirePolicy.FIRE_ONCE_NOW,
                    threshold=timedelta(seconds=2))
    assert plan.late
    assert plan.publish == seconds(10)
    assert plan.misfired == seconds(*range(10))
    assert plan.next_fire_at == T0 + timedelta(seconds=11)


def test_do_nothing_skips_every_missed_time() -> None:
    plan = plan_due(EVERY_SECOND, UTC, T0, T0 + timedelta(seconds=10, milliseconds=500), MisfirePolicy.DO_NOTHING,
                    threshold=timedelta(seconds=2))
    assert plan.publish == ()
    assert plan.misfired == seconds(*range(11))
    assert plan.next_fire_at == T0 + timedelta(seconds=11)


def test_fire_all_publishes_every_missed_time_up_to_the_limit_the_most_recent_ones() -> None:
    plan = plan_due(EVERY_SECOND, UTC, T0, T0 + timedelta(seconds=9), MisfirePolicy.FIRE_ALL,
                    threshold=timedelta(seconds=2), fire_all_limit=4)
    assert plan.publish == seconds(6, 7, 8, 9)
    assert plan.misfired == seconds(0, 1, 2, 3, 4, 5)
    everything = plan_due(EVERY_SECOND, UTC, T0, T0 + timedelta(seconds=9), MisfirePolicy.FIRE_ALL,
                          threshold=timedelta(seconds=2), fire_all_limit=100)
    assert everything.publish == seconds(*range(10)) and everything.misfired == ()


@pytest.mark.parametrize(
    ("policy", "published"),
    [(MisfirePolicy.FIRE_ONCE_NOW, 1), (MisfirePolicy.DO_NOTHING, 0), (MisfirePolicy.FIRE_ALL, 3)],
)
def test_long_outages_are_walked_in_bounded_chunks_and_every_missed_time_is_counted_once(
    policy: MisfirePolicy, published: int
) -> None:
    now = T0 + timedelta(seconds=95)
    due, publish, misfired, plans = T0, [], [], 0
    while due is not None and due <= now:
        plan = plan_due(EVERY_SECOND, UTC, due, now, policy, threshold=timedelta(seconds=2),
                        fire_all_limit=3, chunk_limit=10)
        assert len(plan.publish) + len(plan.misfired) <= 10
        publish += plan.publish
        misfired += plan.misfired
        due, plans = plan.next_fire_at, plans + 1
    assert plans > 9
    assert len(publish) == published and publish == list(seconds(*range(96 - published, 96)))
    assert sorted(publish + misfired) == list(seconds(*range(96)))
    assert due == T0 + timedelta(seconds=96)


def test_a_schedule_without_fire_times_left_has_no_next_one() -> None:
    last = datetime(2005, 1, 1, tzinfo=UTC)
    plan = plan_due(parse("0 0 0 1 1 ? 2005"), UTC, last, last, MisfirePolicy.FIRE_ONCE_NOW)
    assert plan.publish == (last,) and plan.next_fire_at is None


def test_a_schedule_that_is_not_due_cannot_be_planned() -> None:
    with pytest.raises(ValueError, match="not due"):
        plan_due(EVERY_SECOND, UTC, T0, T0 - timedelta(seconds=1), MisfirePolicy.FIRE_ONCE_NOW)


def test_misfires_are_judged_in_the_schedule_zone_across_a_skipped_wall_time() -> None:
    berlin = ZoneInfo("Europe/Berlin")
    due = datetime(2024, 3, 30, 1, 30, tzinfo=UTC)  # 02:30 CET on Saturday
    now = datetime(2024, 4, 1, 6, 0, tzinfo=UTC)
    plan = plan_due(parse("0 30 2 * * ?"), berlin, due, now, MisfirePolicy.DO_NOTHING)
    assert [t.isoformat() for t in plan.misfired] == ["2024-03-30T01:30:00+00:00", "2024-04-01T02:30:00+02:00"]


def test_message_ids_derive_from_the_schedule_and_the_fire_time() -> None:
    fire = datetime(2005, 6, 2, 12, 15, tzinfo=ZoneInfo("Europe/Berlin"))
    assert scheduled_message_id("nightly", fire) == "schedule:nightly:2005-06-02T10:15:00Z"
    assert scheduled_message_id("nightly", fire.astimezone(UTC)) == scheduled_message_id("nightly", fire)
    at = datetime(2005, 6, 2, 10, 15, 1, 250, tzinfo=UTC)
    manual = manual_message_id("nightly", FireAction.STOP, at, 7)
    assert manual == "schedule:nightly:manual:stop:2005-06-02T10:15:01.000250Z:7"


def test_headers_carry_the_schedule_fire_time_job_number_and_action_over_the_schedule_own() -> None:
    fire = datetime(2005, 6, 2, 10, 15, tzinfo=UTC)
    headers = fire_headers({"tenant": "acme", "action": "mine"}, "nightly", fire, 7, FireAction.START, False)
    assert headers == {
        "tenant": "acme",
        "schedule": "nightly",
        "fire_time": "2005-06-02T10:15:00+00:00",
        "job_number": 7,
        "action": "start",
        "action_type": "scheduled",
    }
    assert fire_headers({}, "n", fire, 1, FireAction.PAUSE, True)["action_type"] == "manual"


def test_scheduler_config_is_validated_at_construction() -> None:
    with pytest.raises(ValueError, match="reload interval"):
        SchedulerConfig(reload_interval=timedelta(0))
    with pytest.raises(ValueError, match="misfire threshold"):
        SchedulerConfig(misfire_threshold=timedelta(seconds=-1))
    with pytest.raises(ValueError, match="fire_all limit"):
        SchedulerConfig(fire_all_limit=0)


def test_a_schedule_compiles_or_says_why_not() -> None:
    expression, zone = compile_schedule("0 0 12 * * ?", "Europe/Berlin")
    assert zone.key == "Europe/Berlin" and expression.hours == (12,)
    with pytest.raises(CronError):
        compile_schedule("0 0 12 * * *", "UTC")
    for bad in ("Mars/Base", "", "../etc/passwd", "Europe/"):
        with pytest.raises(ValueError, match="unknown time zone"):
            load_zone(bad)


# -- settings -------------------------------------------------------------------------------------------------


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("CORRELATION_"):
            monkeypatch.delenv(name)


@pytest.mark.usefixtures("clean_environment")
def test_scheduler_settings_have_defaults_and_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = load_settings().scheduler
    assert defaults.enabled and defaults.reload_interval == timedelta(seconds=10)
    assert defaults.misfire_threshold == timedelta(minutes=1) and defaults.fire_all_limit == 100
    monkeypatch.setenv("CORRELATION_SCHEDULER__RELOAD_INTERVAL", "PT0.5S")
    monkeypatch.setenv("CORRELATION_SCHEDULER__MISFIRE_THRESHOLD", "PT2S")
    monkeypatch.setenv("CORRELATION_SCHEDULER__ENABLED", "false")
    settings = load_settings().scheduler
    assert settings.reload_interval == timedelta(milliseconds=500) and not settings.enabled
    assert SchedulerConfig.from_settings(settings).misfire_threshold == timedelta(seconds=2)


@pytest.mark.usefixtures("clean_environment")
@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("CORRELATION_SCHEDULER__RELOAD_INTERVAL", "PT0S"),
        ("CORRELATION_SCHEDULER__RELOAD_INTERVAL", "P1M"),
        ("CORRELATION_SCHEDULER__FIRE_ALL_LIMIT", "0"),
        ("CORRELATION_SCHEDULER__MISFIRE_TRESHOLD", "PT1S"),
    ],
)
def test_a_bad_scheduler_setting_stops_startup_with_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as refused:
        load_settings()
    assert variable in str(refused.value) and "\n" not in str(refused.value)


# -- `correlation-worker schedules next` ----------------------------------------------------------------------


def run_next(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["schedules", "next", *args])
    return result.exit_code, result.output


def test_next_prints_fire_times_as_local_iso_times_with_offset_one_per_line() -> None:
    code, output = run_next("0 15 10 * * ? 2005", "--after", "2005-06-01T10:15:00", "--count", "2")
    assert code == 0
    assert output == "2005-06-02T10:15:00+00:00\n2005-06-03T10:15:00+00:00\n"


def test_next_reads_after_as_a_wall_time_of_the_zone() -> None:
    code, output = run_next("0 30 2 * * ?", "--after", "2024-03-09T03:00:00", "--zone", "America/New_York",
                            "--count", "2")
    assert code == 0 and output.split() == ["2024-03-11T02:30:00-04:00", "2024-03-12T02:30:00-04:00"]


def test_next_prints_five_by_default_and_nothing_when_there_is_none() -> None:
    code, output = run_next("0 0 12 * * ?", "--after", "2005-06-01T00:00:00")
    assert code == 0 and len(output.splitlines()) == 5
    assert run_next("0 0 0 1 1 ? 2005", "--after", "2005-01-01T00:00:00") == (0, "")


def test_next_refuses_an_invalid_expression_with_one_line_and_exit_code_2() -> None:
    code, output = run_next("0 10 20 * * 1")
    assert code == 2
    assert output.startswith("invalid cron expression: day-of-week: ") and output.count("\n") == 1


def test_next_defaults_to_now() -> None:
    code, output = run_next("* * * * * ?", "--count", "1")
    fire = datetime.fromisoformat(output.strip())
    assert code == 0 and timedelta(0) < fire - datetime.now(UTC) <= timedelta(seconds=2)


def test_a_plan_names_the_fire_times_the_zone_skipped_on_the_way_to_the_next() -> None:
    from zoneinfo import ZoneInfo

    from worker.policy.cron import parse
    from worker.policy.scheduling import MisfirePolicy, plan_due

    berlin = ZoneInfo("Europe/Berlin")
    due = datetime(2030, 3, 30, 2, 30, tzinfo=berlin)  # the night before Berlin springs forward (31 March 2030)
    plan = plan_due(parse("0 30 2 * * ?"), berlin, due, due + timedelta(seconds=1), MisfirePolicy.FIRE_ONCE_NOW)
    assert plan.next_fire_at == datetime(2030, 4, 1, 2, 30, tzinfo=berlin)
    assert plan.nonexistent == (datetime(2030, 3, 31, 2, 30),)
