"""Calls in flight, accounted per message, with real worker processes against one PostgreSQL.

A replica killed mid-call while a session holds one of the rows it was calling; a hint's next message inserted
while its call before runs; a durable pause written while calls of it are fetched and running. Each test checks
from the database (the recorder's journal, the message and call tables) and the replicas' metrics afterwards.
"""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
from harness import Database, StartReplicas, StartWorker, run_cli, wait_until
from test_cluster import FAST_LEASES, assert_every_seq_called_in_order, by_message, insert_messages, kill

REDELIVERIES = "correlation_redeliveries_total"
LOST_CALLS = "correlation_lost_calls_total"
POISON = "correlation_poison_messages_total"


def in_flight(database: Database) -> dict[int, str]:
    rows = database.execute("SELECT message_id, state FROM correlation_call")
    return {row["message_id"]: row["state"] for row in rows}


def test_a_replica_killed_mid_calls_while_a_session_holds_one_row_has_each_lost_call_counted_once(
    pg_db: Database, start_worker: StartWorker
) -> None:
    """The heir counts the free row's lost call once and delivers it again alone, correlates everything else
    while the other row stays locked, and counts that one when the lock ends: nobody dead, nothing twice."""
    settings = {**FAST_LEASES, "policy__poison_after": "2"}  # a call counted as a crash twice would kill it
    first = start_worker(pg_db, replica__name="first", **settings)
    locked_hint, free_hint = pg_db.hint_in_slot(5, "locked-"), pg_db.hint_in_slot(5, "free-")
    locked = pg_db.insert("order.step", locked_hint, {"seq": 0, "sleep_seconds": 0.8})
    free = pg_db.insert("order.step", free_hint, {"seq": 0, "sleep_seconds": 0.8})
    wait_until(lambda: len(pg_db.calls_of(locked, free)) == 2, what="both calls under way", workers=[first])
    assert in_flight(pg_db) == {locked: "called", free: "called"}
    session = psycopg.connect(pg_db.url.replace("postgresql+psycopg", "postgresql"))
    try:
        session.execute("SELECT id FROM correlation_message WHERE id = %s FOR UPDATE", (locked,))
        kill(pg_db, first)
        heir = start_worker(pg_db, replica__name="heir", **settings)
        others = [pg_db.insert("order.step", pg_db.hint_in_slot(5, f"other{n}-"), {"seq": 0}) for n in range(10)]
        wait_until(lambda: pg_db.gone(free, *others), what="the free row and every other hint correlated",
                   workers=[heir])
        for _ in range(3):  # fetches of the slot while the lock holds: the locked row is neither called nor counted
            pg_db.wait_for_full_polls([heir])
        row = pg_db.message(locked)
        assert row is not None and row["lost_calls"] == 0 and row["state"] == "ready"
        assert len(pg_db.calls_of(locked)) == 1 and in_flight(pg_db) == {locked: "called"}
    finally:
        session.rollback()
        session.close()
    wait_until(lambda: pg_db.gone(locked), what="the locked row delivered again once its lock ended", workers=[heir])
    calls = by_message(pg_db.calls())
    for message in (locked, free):
        assert [call.redelivered for call in calls[message]] == [False, True], "delivered again, flagged"
    assert all(len(calls[other]) == 1 for other in others)
    assert heir.metric(REDELIVERIES) == 2 and heir.metric(LOST_CALLS) == 2
    assert heir.metric(POISON) == 0 and len(pg_db.messages()) == 0
    assert in_flight(pg_db) == {}


def test_a_hints_next_message_is_called_as_soon_as_the_call_before_it_ends_not_at_the_poll(
    pg_db: Database, start_worker: StartWorker
) -> None:
    """`created`, then `paid` of the same hint 50 ms later, while `created` is still being called (the
    product's main use), with the default poll interval: `paid` follows at once, never 6 s later."""
    worker = start_worker(pg_db, poll__interval="PT6S")
    gaps = []
    for n in range(3):
        hint = f"order-{n}"
        created = pg_db.insert("order.created", hint, {"seq": 0, "sleep_seconds": 0.2})
        time.sleep(0.05)  # pacing: the second message arrives while the first is being called
        paid = pg_db.insert("order.paid", hint, {"seq": 1})
        wait_until(lambda: pg_db.gone(created, paid), 5, "both correlated", workers=[worker])  # noqa: B023
        first, second = pg_db.calls_of(created)[0], pg_db.calls_of(paid)[0]
        assert first.ended_at is not None
        gaps.append((second.started_at - first.ended_at).total_seconds())
    assert max(gaps) < 1.0, f"the next message waited {max(gaps):.3f}s after the call before it"


def test_after_a_pause_returns_no_call_of_it_starts_and_its_fetched_work_waits_in_order_until_the_lift(
    pg_db: Database, start_worker: StartWorker, tmp_path: Path
) -> None:
    worker = start_worker(pg_db, poll__concurrency="4", poll__interval="PT1S")
    # The paused targets' calls wait at a gate the test opens once both pauses have returned: a call of each of
    # their three hints is under way, and the rest of their work waits, while the CLI processes pause them, however
    # slow the machine is at starting a process. The fourth lane is the other hints'.
    gate = tmp_path / "gate"
    held = {"sleep_seconds": 0.1, "wait_for_file": str(gate)}
    paused = [pg_db.insert("order.step", "order-paused", {"seq": n, **held}) for n in range(40)]
    by_name = [pg_db.insert("audit.step", f"audit-{n % 2}", {"seq": n // 2, **held}) for n in range(100)]
    other = [pg_db.insert("order.step", f"order-{n}", {"seq": 0}) for n in range(5)]
    wait_until(lambda: pg_db.calls_of(*paused) and pg_db.calls_of(*by_name), what="calls under way",
               workers=[worker])
    run_cli(pg_db, "pause", "--hint", "order-paused")
    run_cli(pg_db, "pause", "--name", "audit.step")
    returned = pg_db.execute("SELECT now() AS now")[0]["now"]
    gate.touch()
    wait_until(lambda: pg_db.gone(*other), what="the other hints correlated", workers=[worker])
    time.sleep(1.5)  # pacing: past the bound, what starts now would be a call after the pause
    late = [call for call in pg_db.calls_of(*paused, *by_name) if (call.started_at - returned).total_seconds() > 1.0]
    assert late == [], f"{len(late)} call(s) of a paused target started more than 1 s after the pause returned"
    assert len(pg_db.calls_of(*paused)) < len(paused) and len(pg_db.calls_of(*by_name)) < len(by_name)
    run_cli(pg_db, "resume", "--hint", "order-paused")
    run_cli(pg_db, "resume", "--name", "audit.step")
    wait_until(lambda: pg_db.gone(*paused, *by_name), 30, "the paused work correlated after the lift",
               workers=[worker])
    seqs = [call.seq for call in pg_db.calls_of(*paused)]
    assert seqs == list(range(40)), "each called once, in order, across the pause"
    assert in_flight(pg_db) == {}


def test_under_a_storm_of_kills_every_poison_message_ends_dead_and_every_other_message_is_correlated(
    pg_db: Database, start_replicas: StartReplicas
) -> None:
    """Poison messages (their calls end the process) among busy hints, and replicas SIGKILLed and replaced every
    two seconds besides: only the poison messages are dead, each after exactly poison_after crashes."""
    settings = {**FAST_LEASES, "policy__poison_after": "3", "poll__concurrency": "4"}
    poison = [pg_db.insert("order.step", f"poison-{n}", {"seq": 0, "exit_process": True}) for n in range(2)]
    insert_messages(pg_db, 60, 5, sleep_seconds=0.01)
    alive = start_replicas(pg_db, 2, **settings)
    storm_ends = time.monotonic() + 8
    while time.monotonic() < storm_ends or len(alive) < 2:
        for replica in [replica for replica in alive if not replica.running()]:  # a poison message's doing
            replica.killed = True
            alive.remove(replica)
        if time.monotonic() < storm_ends and alive:
            kill(pg_db, alive.pop(0))
        alive += start_replicas(pg_db, 2 - len(alive), **settings)
        time.sleep(2.0)  # pacing of the storm
    dead = {message: pg_db.message(message) for message in poison}

    def settled() -> bool:
        for replica in [replica for replica in alive if not replica.running()]:
            replica.killed = True
            alive.remove(replica)
            alive.extend(start_replicas(pg_db, 1, **settings))
        rows = pg_db.execute("SELECT id, state FROM correlation_message WHERE state <> 'delivered'")
        dead.update({row["id"]: row for row in rows if row["id"] in poison})
        return all(row["state"] == "dead" for row in rows) and len(rows) == len(poison)

    # No replica list to watch: a replica ending on a poison message is expected, settled() replaces it.
    wait_until(settled, 90, "every poison message dead and every other message correlated")
    for message in poison:
        row = pg_db.message(message)
        assert row is not None and row["state"] == "dead" and row["crashed_calls"] == 3, row
        assert "poison" in (row["last_error"] or "")
    calls = pg_db.calls()
    assert_every_seq_called_in_order([call for call in calls if call.message_row_id not in poison], 60, 5)
    assert in_flight(pg_db) == {}
