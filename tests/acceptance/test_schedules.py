"""Schedules with real worker processes against PostgreSQL (DESIGN.md §7).

Schedules are inserted with plain SQL (or the CLI) while the replicas run. Most publish messages with payload
``{"permanent": true}``: the recorder makes them dead at once, so that every published message stays in the table
with its headers (schedule, fire_time, job_number, action_type) for the test to read. Waits are on conditions in the
database with deadlines; where time itself must pass (a stopped cluster, a switched-off scheduler), the test waits
for the database clock to reach a point.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from harness import Database, PostgresDatabase, StartReplicas, StartWorker, WorkerProcess, run_cli, wait_until
from schedule_handlers import RELEASE_TABLE_DDL

SETTINGS = {
    "scheduler__reload_interval": "PT0.2S",
    "lease__duration": "PT3S",
    "lease__renew_interval": "PT1S",
    "lease__safety_margin": "PT0.5S",
    "lease__drain": "PT0.5S",
    "policy__handler_timeout": "PT1S",  # a call must fit in the lease minus a renewal and the margin
    "policy__backoff_unit": "PT0.2S",
    "policy__backoff_cap": "PT0.2S",
    "correlators": json.dumps({"held.job": "schedule_handlers:hold_until_released", "*": "recorder:handle"}),
}
KEPT = json.dumps({"permanent": True})  # the recorder makes the message dead at once: its row stays to be read
POLICIES = ("fire_once_now", "do_nothing", "fire_all")
SECOND = timedelta(seconds=1)


@dataclass(frozen=True)
class Published:
    """A message a schedule published, as its row shows it."""

    message_id: str
    fire_time: datetime
    job_number: int
    action: str
    action_type: str


def add_schedule(database: Database, name: str, cron: str, *, message_name: str = "tick", enabled: bool = True,
                 singleton: bool = False, misfire: str = "fire_once_now", payload: str = KEPT) -> None:
    """INSERT a schedule with plain SQL, as an operator would."""
    database.execute(
        "INSERT INTO correlation_schedule (name, cron, message_name, enabled, singleton, misfire, payload)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s::jsonb)",
        (name, cron, message_name, enabled, singleton, misfire, payload),
    )


def schedule_row(database: Database, name: str) -> dict[str, Any]:
    """The schedule's row."""
    [row] = database.execute("SELECT * FROM correlation_schedule WHERE name = %s", (name,))
    return row


def published(database: Database, schedule: str) -> list[Published]:
    """The schedule's messages still in the table, by fire time."""
    rows = database.execute(
        "SELECT message_id, headers FROM correlation_message WHERE headers->>'schedule' = %s", (schedule,)
    )
    messages = [
        Published(
            row["message_id"],
            datetime.fromisoformat(row["headers"]["fire_time"]),
            int(row["headers"]["job_number"]),
            row["headers"]["action"],
            row["headers"]["action_type"],
        )
        for row in rows
    ]
    return sorted(messages, key=lambda message: message.fire_time)


def database_now(database: Database) -> datetime:
    """The database clock, the clock that decides when a schedule is due."""
    now: datetime = database.execute("SELECT clock_timestamp() AS now")[0]["now"]
    return now


def wait_for_clock(database: Database, moment: datetime, workers: list[WorkerProcess] = []) -> None:  # noqa: B006
    """Return once the database clock has passed ``moment``."""
    limit = (moment - database_now(database)).total_seconds() + 30
    wait_until(lambda: database_now(database) >= moment, timeout=limit, what=f"the clock to reach {moment}",
               workers=workers)


def cron_at(times: list[datetime]) -> str:
    """A cron expression firing at these times (UTC, within a few seconds of each other) and otherwise not before
    the next day: their seconds, minutes and hours as lists (other combinations of them are a minute away or in
    the past, never between the times)."""
    def field(values: set[int]) -> str:
        return ",".join(str(value) for value in sorted(values))

    seconds, minutes, hours = ({getattr(t, part) for t in times} for part in ("second", "minute", "hour"))
    return f"{field(seconds)} {field(minutes)} {field(hours)} * * ?"


def metric_sum(replicas: list[WorkerProcess], name: str) -> float:
    """A metric summed over replicas."""
    return sum(replica.metric(name) for replica in replicas)


def test_three_replicas_publish_each_fire_time_exactly_once_and_a_sigkilled_one_changes_nothing(
    pg_db: Database, start_replicas: StartReplicas
) -> None:
    replicas = start_replicas(pg_db, 3, **SETTINGS)
    add_schedule(pg_db, "tick", "* * * * * ?")  # inserted with SQL while the replicas run: no restart needed
    add_schedule(pg_db, "off", "* * * * * ?", enabled=False)

    def span() -> timedelta:
        times = [message.fire_time for message in published(pg_db, "tick")]
        return times[-1] - times[0] if times else timedelta(0)

    wait_until(lambda: span() >= 10 * SECOND, what="ten seconds of fire times", workers=replicas)
    replicas[0].kill()
    survivors = replicas[1:]
    wait_until(lambda: span() >= 20 * SECOND, what="twenty seconds of fire times", workers=survivors)
    pg_db.execute("UPDATE correlation_schedule SET enabled = false WHERE name = 'tick'")
    # Once a replica has forgotten the plan, every claim that could still publish has committed.
    wait_until(lambda: schedule_row(pg_db, "tick")["next_fire_at"] is None, workers=survivors)

    ticks = published(pg_db, "tick")
    times = [message.fire_time for message in ticks]
    assert len(times) >= 21
    assert times == [times[0] + n * SECOND for n in range(len(times))], "one message per second, none missing"
    assert sorted(message.job_number for message in ticks) == list(range(1, len(ticks) + 1))
    assert [m.message_id for m in ticks] == [f"schedule:tick:{t.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}" for t in times]
    assert {(m.action, m.action_type) for m in ticks} == {("start", "scheduled")}
    row = schedule_row(pg_db, "tick")
    assert (row["fire_count"], row["skip_count"], row["misfire_count"]) == (len(ticks), 0, 0)
    wait_until(lambda: metric_sum(survivors, "correlation_schedule_fires_total") >= 10, workers=survivors)
    assert metric_sum(survivors, "correlation_schedule_fires_total") <= len(ticks)  # they went on alone
    off = schedule_row(pg_db, "off")
    assert published(pg_db, "off") == [] and off["fire_count"] == 0 and off["next_fire_at"] is None


def test_fire_times_missed_while_the_cluster_was_stopped_follow_each_misfire_policy(
    pg_db: Database, start_replicas: StartReplicas
) -> None:
    settings = {**SETTINGS, "scheduler__misfire_threshold": "PT2S"}
    replicas = start_replicas(pg_db, 2, **settings)
    now = database_now(pg_db).astimezone(UTC).replace(microsecond=0)
    missed = [now + n * SECOND for n in (6, 8, 10)]
    for policy in POLICIES:
        add_schedule(pg_db, policy, cron_at(missed), misfire=policy)
    wait_until(lambda: all(schedule_row(pg_db, p)["next_fire_at"] == missed[0] for p in POLICIES),
               what="the schedules planned", workers=replicas)

    for replica in replicas:
        assert replica.stop() == 0
    stopped_at = database_now(pg_db)
    assert stopped_at < missed[0], "the cluster took too long to stop: the first fire time passed while it ran"
    wait_for_clock(pg_db, max(stopped_at + 10 * SECOND, missed[-1] + SECOND))
    assert all(published(pg_db, policy) == [] for policy in POLICIES)

    restarted = start_replicas(pg_db, 2, **settings)
    wait_until(
        lambda: all(schedule_row(pg_db, p)["fire_count"] + schedule_row(pg_db, p)["misfire_count"] == 3
                    for p in POLICIES),
        what="every missed time fired or counted",
        workers=restarted,
    )
    assert [m.fire_time for m in published(pg_db, "fire_once_now")] == missed[-1:]
    assert published(pg_db, "do_nothing") == []
    assert [(m.fire_time, m.job_number) for m in published(pg_db, "fire_all")] == [
        (t, n) for n, t in enumerate(missed, 1)
    ]
    counts = {p: (schedule_row(pg_db, p)["fire_count"], schedule_row(pg_db, p)["misfire_count"]) for p in POLICIES}
    assert counts == {"fire_once_now": (1, 2), "do_nothing": (0, 3), "fire_all": (3, 0)}
    # Counted once the fire transaction has committed, a moment after the rows show it.
    wait_until(lambda: metric_sum(restarted, "correlation_schedule_misfires_total") == 5, workers=restarted)


def test_a_singleton_skips_while_its_message_is_held_and_a_switched_off_scheduler_publishes_nothing(
    pg_db: Database, start_replicas: StartReplicas
) -> None:
    pg_db.execute(RELEASE_TABLE_DDL)
    replicas = start_replicas(pg_db, 1, **SETTINGS)
    run_cli(pg_db, "schedules", "add", "held", "--cron", "* * * * * ?", "--message-name", "held.job")

    wait_until(lambda: schedule_row(pg_db, "held")["skip_count"] >= 2, what="fire times skipped", workers=replicas)
    assert [m.job_number for m in published(pg_db, "held")] == [1]
    shown = json.loads(run_cli(pg_db, "schedules", "show", "held").stdout)
    assert shown["running"] and shown["singleton"] and shown["skip_count"] >= 2
    assert "job 1 of schedule held is held by the test" in shown["last_message"]["last_error"]
    wait_until(lambda: replicas[0].metric("correlation_schedule_singleton_skips_total") >= 2, workers=replicas)

    pg_db.execute("INSERT INTO acceptance_release VALUES ('held')")  # the handler succeeds from now on
    wait_until(lambda: schedule_row(pg_db, "held")["fire_count"] >= 2, what="firing resumed", workers=replicas)
    assert all(m.job_number > 1 for m in published(pg_db, "held"))  # job 1 was correlated (its row is gone)

    run_cli(pg_db, "schedules", "disable")  # the whole scheduler
    wait_until(lambda: schedule_row(pg_db, "held")["next_fire_at"] is None
               and replicas[0].metric("correlation_scheduler_enabled") == 0, workers=replicas)
    before = schedule_row(pg_db, "held")
    wait_for_clock(pg_db, database_now(pg_db) + 2 * SECOND, replicas)
    after = schedule_row(pg_db, "held")
    assert (after["fire_count"], after["skip_count"]) == (before["fire_count"], before["skip_count"])

    pg_db.execute("UPDATE correlation_scheduler SET enabled = true")  # as SQL may do it, too
    wait_until(lambda: schedule_row(pg_db, "held")["fire_count"] > before["fire_count"], what="firing again",
               workers=replicas)


def test_a_schedule_whose_message_the_database_refuses_is_marked_with_why_and_the_others_keep_firing(
    any_db: Database, start_worker: StartWorker
) -> None:
    worker = start_worker(any_db, **SETTINGS)
    mark = "%s" if isinstance(any_db, PostgresDatabase) else "?"
    too_large = json.dumps({"blob": "x" * (1024 * 1024 + 1)})  # over the message table's 1 MiB payload limit
    # Inserted with SQL (the schedule table has no payload limit); named to come first in every run.
    any_db.execute(
        f"INSERT INTO correlation_schedule (name, cron, message_name, payload, singleton)"
        f" VALUES ({mark}, {mark}, {mark}, {mark}, false)",
        ("aaa-too-large", "* * * * * ?", "tick", too_large),
    )
    any_db.execute(
        f"INSERT INTO correlation_schedule (name, cron, message_name, payload, singleton)"
        f" VALUES ({mark}, {mark}, {mark}, {mark}, false)",
        ("tick", "* * * * * ?", "tick", KEPT),
    )

    def reason() -> str | None:
        rows = any_db.execute(
            f"SELECT invalid_reason FROM correlation_schedule WHERE name = {mark}", ("aaa-too-large",)
        )
        return rows[0]["invalid_reason"] if rows else None

    wait_until(lambda: reason() is not None, what="the refused schedule marked", workers=[worker])
    assert "correlation_message_payload_at_most_1_mib" in (reason() or "")

    def tick_times() -> list[str]:
        rows = any_db.execute(
            f"SELECT message_id FROM correlation_message WHERE message_id LIKE {mark} ORDER BY message_id",
            ("schedule:tick:%",),
        )
        return [row["message_id"] for row in rows]

    wait_until(lambda: len(tick_times()) >= 5, what="five fires of the other schedule", workers=[worker])
    times = [datetime.strptime(m.removeprefix("schedule:tick:"), "%Y-%m-%dT%H:%M:%SZ") for m in tick_times()]
    assert times == [times[0] + n * SECOND for n in range(len(times))], "one message per second, none missing"
    assert any_db.execute(f"SELECT misfire_count FROM correlation_schedule WHERE name = {mark}", ("tick",)) == [
        {"misfire_count": 0}
    ]
    assert any_db.execute(f"SELECT count(*) AS n FROM correlation_message WHERE message_id LIKE {mark}",
                          ("schedule:aaa-too-large:%",)) == [{"n": 0}]
    log = worker.log()
    assert "Traceback" not in log
    assert log.count("schedule aaa-too-large cannot fire") == 1, log[-3000:]

    # Once the row is edited, it is tried again: with a payload that fits, it fires.
    any_db.execute(f"UPDATE correlation_schedule SET payload = {mark} WHERE name = {mark}", (KEPT, "aaa-too-large"))
    wait_until(lambda: any_db.execute(f"SELECT count(*) AS n FROM correlation_message WHERE message_id LIKE {mark}",
                                      ("schedule:aaa-too-large:%",))[0]["n"] > 0,
               what="the edited schedule firing", workers=[worker])
    assert reason() is None
