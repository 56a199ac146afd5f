"""The engine's behaviour under the unusual, with real worker processes against one PostgreSQL.

A correlator that kills its process, a session holding one hint's rows locked for longer than a lease,
replicas killed, frozen and stopped with calls running, wake-ups lost and recovered. Each test checks from
the database (the recorder's journal, the message and lock tables) and the replicas' metrics afterwards.
"""

from __future__ import annotations

import signal
import time
from datetime import timedelta
from typing import Any

import psycopg
from harness import Database, StartReplicas, StartWorker, wait_until
from test_cluster import (
    FAST_LEASES,
    LEASE,
    RENEW,
    TAKEOVER_SLACK,
    by_message,
    database_now,
    held_by_only,
    insert_messages,
    kill,
    remaining,
    slot_holders,
    wait_balanced,
)

LEASE_LOSSES = "correlation_lease_losses_total"
FENCED_COMMITS = "correlation_fenced_commits_total"


def test_a_message_whose_call_kills_the_process_is_dead_after_poison_after_crashes_alone_and_no_other_suffers(
    pg_db: Database, start_worker: StartWorker
) -> None:
    settings = {**FAST_LEASES, "policy__poison_after": "3"}
    poison = pg_db.insert("order.step", "order-poison", {"seq": 0, "exit_process": True})
    behind = pg_db.insert("order.step", "order-poison", {"seq": 1})  # the same hint, after it: untouched
    others = [pg_db.insert("order.step", f"order-{n}", {"seq": 0}) for n in range(20)]
    crashes = 0
    while True:
        worker = start_worker(pg_db, **settings)
        wait_until(
            lambda: not worker.running() or (pg_db.message(poison) or {}).get("state") == "dead",  # noqa: B023
            60, "the worker to crash on the poison message or the message to be dead",
        )
        if worker.running():
            break
        worker.killed = True  # it ended itself: exempt from the clean-exit check
        crashes += 1
        assert crashes <= 4, "still crashing after poison_after crashes of calls made alone"
    row = pg_db.message(poison)
    assert row is not None and row["state"] == "dead" and row["crashed_calls"] == 3
    assert row["lost_calls"] == 4, "the first crash, beside other calls, counted lost only"
    assert "poison" in (row["last_error"] or "")
    calls = by_message(pg_db.calls())
    assert len(calls[poison]) == 4, "called beside others once, then alone until poison_after crashes"
    wait_until(lambda: pg_db.gone(*others), what="the other hints correlated", workers=[worker])
    untouched = pg_db.message(behind)  # it may have shared the poison message's mark: lost, never a crash
    assert untouched is not None and (untouched["attempt"], untouched["crashed_calls"]) == (0, 0)
    assert untouched["state"] == "ready"
    assert behind not in calls, "behind a dead head (fail_first): never called, never blamed"


def test_a_session_holding_one_hints_rows_locked_past_a_lease_delays_that_hint_only(
    pg_db: Database, start_replicas: StartReplicas
) -> None:
    replicas = start_replicas(pg_db, 2, **FAST_LEASES)
    wait_balanced(pg_db, replicas)
    holder = psycopg.connect(pg_db.url.replace("postgresql+psycopg", "postgresql"))
    try:
        held = holder.execute(  # due in a second: locked (below) long before it may be called
            "INSERT INTO correlation_message (message_name, correlation_hint, payload, next_attempt_at) "
            "VALUES ('order.step', 'order-held', '{\"seq\": 0}', now() + interval '1 second') RETURNING id"
        ).fetchone()[0]  # type: ignore[index]
        holder.commit()
        holder.execute("SELECT 1 FROM correlation_message WHERE id = %s FOR UPDATE", (held,))
        held_from = time.monotonic()
        wait_until(lambda: pg_db.calls_of(held), what="the held hint's message called", workers=replicas)
        others = [pg_db.insert("order.step", f"order-{n}", {"seq": 0}) for n in range(200)]
        wait_until(lambda: pg_db.gone(*others), what="every other hint correlated", workers=replicas)
        assert time.monotonic() - held_from < LEASE * 3, "the other hints flowed while the row stayed locked"
        time.sleep(LEASE + RENEW)  # pacing: hold past a whole lease term
        assert pg_db.message(held) is not None, "the held hint's outcome waits for the lock"
        assert held_by_only(pg_db, replicas), "every slot still leased"
        for replica in replicas:
            assert replica.metric(LEASE_LOSSES) == 0 and replica.metric(FENCED_COMMITS) == 0
    finally:
        holder.rollback()
        holder.close()
    wait_until(lambda: pg_db.gone(held), what="the held hint's outcome written", workers=replicas)
    assert len(pg_db.calls_of(held)) == 1, "called once: its outcome was deferred, never replayed"


def test_when_a_replica_is_killed_the_survivors_own_every_slot_within_a_lease_and_a_renewal(
    pg_db: Database, start_replicas: StartReplicas
) -> None:
    replicas = start_replicas(pg_db, 3, **FAST_LEASES)
    wait_balanced(pg_db, replicas)
    victim, *survivors = replicas
    killed_at = time.monotonic()
    kill(pg_db, victim)
    wait_until(lambda: held_by_only(pg_db, survivors), LEASE + RENEW + TAKEOVER_SLACK,
               "the survivors to own every slot", workers=survivors)
    assert time.monotonic() - killed_at <= LEASE + RENEW + TAKEOVER_SLACK


def test_a_frozen_replicas_backlog_is_taken_over_and_worked_on_within_a_lease_and_a_renewal(
    pg_db: Database, start_replicas: StartReplicas
) -> None:
    # A call the freeze catches outlasts its handler timeout when the replica resumes, and is retried: after a
    # short backoff here, so that the drain at the end does not wait the default minute for it.
    frozen, other = start_replicas(pg_db, 2, poll__concurrency="2", policy__backoff_unit="PT0.5S", **FAST_LEASES)
    wait_balanced(pg_db, [frozen, other])
    insert_messages(pg_db, 150, 8, sleep_seconds=0.005)  # a backlog on most slots
    wait_until(lambda: any(c.replica == frozen.name for c in pg_db.calls()), what="the frozen one at work",
               workers=[frozen])
    frozen_slots = {slot for slot, holder in slot_holders(pg_db).items() if holder == frozen.holder()}
    frozen.send(signal.SIGSTOP)
    frozen_at = database_now(pg_db)
    try:
        slot_of_hint = {
            row["correlation_hint"]: row["slot"]
            for row in pg_db.execute("SELECT DISTINCT correlation_hint, slot FROM correlation_message")
        }

        def taken_over() -> bool:
            return any(
                call.replica == other.name and slot_of_hint.get(call.hint) in frozen_slots
                and call.started_at > frozen_at
                for call in pg_db.calls()
            )

        wait_until(taken_over, LEASE + RENEW + TAKEOVER_SLACK, "the other replica calling the frozen slots' hints",
                   workers=[other])
        first = min(
            call.started_at for call in pg_db.calls()
            if call.replica == other.name and slot_of_hint.get(call.hint) in frozen_slots
            and call.started_at > frozen_at
        )
        assert first - frozen_at <= timedelta(seconds=LEASE + RENEW + TAKEOVER_SLACK)
    finally:
        frozen.send(signal.SIGCONT)
    wait_until(lambda: remaining(pg_db) == 0, 180, "the table drained", workers=[frozen, other], interval=0.5)


def test_a_replica_stopped_during_a_long_call_keeps_that_slot_until_its_lease_ends(
    pg_db: Database, start_replicas: StartReplicas
) -> None:
    # A longer term than FAST_LEASES': between the stopping replica handing back its other slots and the end of
    # the running call's term lie seconds, not one, so that a loaded machine cannot make the look come too late.
    leases = {**FAST_LEASES, "lease__duration": "PT6S", "lease__renew_interval": "PT2S", "shutdown__grace": "PT0.5S"}
    first, second = start_replicas(pg_db, 2, **leases)
    wait_balanced(pg_db, [first, second])
    slot = min(slot for slot, holder in slot_holders(pg_db).items() if holder == first.holder())
    hint = pg_db.hint_in_slot(slot, "long-")
    long_call = pg_db.insert("order.step", hint, {"seq": 0, "sleep_seconds": 1.2})
    wait_until(lambda: pg_db.calls_of(long_call), what="the long call to start", workers=[first])
    first.process.send_signal(signal.SIGTERM)

    def kept() -> list[dict[str, Any]]:
        """The slots the stopping replica still holds, with the end of each one's term."""
        return pg_db.execute(
            "SELECT name, lock_until FROM correlation_lock "
            "WHERE name LIKE 'slot:%%' AND locked_by = %s AND lock_until > now()",
            (first.holder(),),
        )

    wait_until(lambda: len(kept()) <= 1, 10, "the stopping replica handing back its other slots", workers=[first])
    held = kept()
    assert [row["name"] for row in held] == [f"slot:{slot}"], "the slot of the running call is not kept"
    term_end = held[0]["lock_until"]
    assert first.process.wait(timeout=20) == 0
    wait_until(lambda: len(pg_db.calls_of(long_call)) == 2, 30, "the message delivered again", workers=[second])
    again = pg_db.calls_of(long_call)[1]
    assert again.replica == second.name
    assert again.started_at >= term_end, "delivered again before the stopped replica's term ended"
    assert second.metric("correlation_redeliveries_total") == 1


def test_wake_ups_reach_the_replica_at_once_and_after_its_listener_was_cut_off(
    pg_db: Database, start_worker: StartWorker
) -> None:
    worker = start_worker(pg_db, poll__interval="PT60S")  # the poll alone would take a minute
    wait_until(lambda: worker.metric("correlation_listener_up") == 1, what="the listener up", workers=[worker])
    message = pg_db.insert("order.step", "order-1", {"seq": 0})
    wait_until(lambda: pg_db.gone(message), 10, "correlated on the producer's notification", workers=[worker])
    pg_db.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE application_name = 'correlation-worker listener' AND datname = current_database()"
    )
    during = pg_db.insert("order.step", "order-2", {"seq": 0})  # perhaps while nobody listens
    wait_until(lambda: pg_db.gone(during), 20, "correlated after the listener came back", workers=[worker])
    assert worker.metric("correlation_listener_reconnects_total") >= 1


def test_without_notify_messages_are_still_correlated_by_the_poll(
    pg_db: Database, start_worker: StartWorker
) -> None:
    worker = start_worker(pg_db, notify__enabled="false", poll__interval="PT0.5S")
    message = pg_db.insert("order.step", "order-1", {"seq": 0})
    wait_until(lambda: pg_db.gone(message), 20, "correlated by the poll", workers=[worker])
    assert worker.metric("correlation_listener_up") == 0
