"""The cluster invariants (DESIGN.md §4) with several real worker processes against one PostgreSQL.

Each test starts real ``correlation-worker run`` processes with short slot leases, disturbs them (SIGKILL,
SIGSTOP, SIGTERM, a database restart) and then checks the invariants from what is in the database: the
recorder's journal (``acceptance_call``: hint, seq, replica, start and end by the database clock), the
message table and the lock table. Messages are inserted with one ``INSERT ... SELECT`` with payload
``{"seq": n}``, seq increasing with id within a hint, so that order is read straight from the journal.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from itertools import pairwise
from typing import Protocol

import pytest
from harness import Database, PostgresDatabase, StartReplicas, WorkerProcess, wait_until
from recorder import Call

LEASE = 3.0  # seconds: the slot lease term
RENEW = 1.0  # seconds between lease rounds
SLOTS = 64
PAGE_SIZE = 100
FAST_LEASES = {
    "lease__duration": f"PT{LEASE:g}S",
    "lease__renew_interval": f"PT{RENEW:g}S",
    "lease__safety_margin": "PT0.5S",
    "lease__drain": "PT0.5S",
    "policy__handler_timeout": "PT1S",  # a call must fit in the lease minus a renewal and the margin
    "poll__interval": "PT0.2S",
    "poll__page_size": str(PAGE_SIZE),
}
DRAIN_DEADLINE = 180.0  # seconds to drain a workload: generous, for a loaded two-core machine
TAKEOVER_SLACK = 3.0  # seconds on top of a lease bound, for processes and the database on a busy machine

REDELIVERIES = "correlation_redeliveries_total"
FENCED_COMMITS = "correlation_fenced_commits_total"


class Server(Protocol):
    """The private PostgreSQL server of a test (tests/conftest.py's ThrowawayServer)."""

    def stop(self, mode: str = "fast") -> None: ...

    def start(self) -> None: ...


# -- workload and journal ------------------------------------------------------------------------------------


def insert_messages(database: Database, hints: int, per_hint: int, **payload: object) -> None:
    """``hints * per_hint`` messages over hints ``order-0`` …, payload {"seq": n, **payload}, seq rising with id."""
    database.execute(
        "INSERT INTO correlation_message (message_name, correlation_hint, payload)"
        " SELECT 'order.step', 'order-' || (n %% %s), jsonb_build_object('seq', n / %s) || %s::jsonb"
        " FROM generate_series(0, %s - 1) AS n ORDER BY n",
        (hints, hints, json.dumps(payload), hints * per_hint),
    )


def remaining(database: Database) -> int:
    """Messages still in the table."""
    return int(database.execute("SELECT count(*) AS n FROM correlation_message WHERE state <> 'delivered'")[0]["n"])


def database_now(database: Database) -> datetime:
    """The database clock, the clock of the journal's start and end times."""
    now: datetime = database.execute("SELECT clock_timestamp() AS now")[0]["now"]
    return now


def kill(database: Database, replica: WorkerProcess) -> datetime:
    """SIGKILL a replica; returns the database clock once no journal entry of its calls can appear any more.

    A statement the replica sent just before it died still runs on the server; the recorder's sessions are
    named after the replica, so their end is awaited before the clock is read.
    """
    replica.kill()

    def sessions_gone() -> bool:
        return not database.execute(
            "SELECT 1 FROM pg_stat_activity WHERE application_name = %s AND datname = current_database()",
            (replica.name,),
        )

    wait_until(sessions_gone, what=f"the database sessions of {replica.name} to end")
    return database_now(database)


def by_hint(calls: Sequence[Call]) -> dict[str, list[Call]]:
    """The calls of each hint, in the order they started (database clock)."""
    grouped: dict[str, list[Call]] = {}
    for call in sorted(calls, key=lambda call: call.started_at):
        grouped.setdefault(call.hint, []).append(call)
    return grouped


def by_message(calls: Sequence[Call]) -> dict[int, list[Call]]:
    """The calls of each message, in the order they started."""
    grouped: dict[int, list[Call]] = {}
    for call in sorted(calls, key=lambda call: call.started_at):
        grouped.setdefault(call.message_row_id, []).append(call)
    return grouped


def repeats(calls: Sequence[Call]) -> list[Call]:
    """The calls that delivered a message again (every call of a message but its first)."""
    return [call for message_calls in by_message(calls).values() for call in message_calls[1:]]


def assert_every_seq_called_in_order(calls: Sequence[Call], hints: int, per_hint: int) -> None:
    """Every message was called, and each hint's calls, repeats collapsed, come in seq order.

    A call may go back only to repeat a seq called before (a redelivery); a new seq is always the next one.
    """
    grouped = by_hint(calls)
    assert sorted(grouped) == sorted(f"order-{n}" for n in range(hints))
    for hint, hint_calls in grouped.items():
        first_calls = list(dict.fromkeys(call.seq for call in hint_calls))
        assert first_calls == list(range(per_hint)), (
            f"{hint}: calls (seq, replica) in this order: {[(c.seq, c.replica) for c in hint_calls]}"
        )


def assert_no_two_calls_of_a_hint_overlap(calls: Sequence[Call], unfinished_allowed: set[str]) -> None:
    """Each call of a hint ended before the next one started (database clock).

    A call that never ended is allowed only of the replicas in ``unfinished_allowed`` (killed mid-call).
    """
    for hint, hint_calls in by_hint(calls).items():
        for earlier, later in pairwise(hint_calls):
            if earlier.ended_at is None:
                assert earlier.replica in unfinished_allowed, (
                    f"{hint}: the call of seq {earlier.seq} by {earlier.replica} never ended"
                )
                continue
            assert earlier.ended_at <= later.started_at, (
                f"{hint}: seq {earlier.seq} by {earlier.replica} ran until {earlier.ended_at:%T.%f}, "
                f"after seq {later.seq} by {later.replica} started at {later.started_at:%T.%f}"
            )


# -- the lock table ------------------------------------------------------------------------------------------


def slot_holders(database: Database) -> dict[int, str]:
    """Every slot whose lease term still runs (by the database clock), with its holder."""
    rows = database.execute(
        "SELECT name, locked_by FROM correlation_lock WHERE name LIKE 'slot:%%' AND lock_until > now()"
    )
    return {int(row["name"].removeprefix("slot:")): row["locked_by"] for row in rows}


def held_by_only(database: Database, replicas: Sequence[WorkerProcess]) -> bool:
    """Every slot is leased, and only by these replicas."""
    holders = slot_holders(database)
    return len(holders) == SLOTS and set(holders.values()) <= {replica.holder() for replica in replicas}


def balanced(database: Database, replicas: Sequence[WorkerProcess]) -> bool:
    """Every slot is leased by these replicas only, each holding at least its fair share rounded down."""
    counts = Counter(slot_holders(database).values())
    share = SLOTS // len(replicas)
    return held_by_only(database, replicas) and all(counts[replica.holder()] >= share for replica in replicas)


def wait_balanced(database: Database, replicas: Sequence[WorkerProcess]) -> None:
    """Wait until the replicas have shared the slots out (see :func:`balanced`)."""
    wait_until(lambda: balanced(database, replicas), what="the slots shared out", workers=replicas)


# -- the tests -----------------------------------------------------------------------------------------------


def test_replicas_drain_many_hints_once_each_in_order_with_no_two_calls_of_a_hint_at_once(
    pg_db: Database, start_replicas: StartReplicas
) -> None:
    hints, per_hint = 200, 25
    replicas = start_replicas(pg_db, 4, poll__concurrency="2", **FAST_LEASES)
    wait_balanced(pg_db, replicas)
    insert_messages(pg_db, hints, per_hint)

    wait_until(lambda: remaining(pg_db) == 0, DRAIN_DEADLINE, "the table drained", workers=replicas, interval=0.5)

    calls = pg_db.calls()
    assert len(calls) == hints * per_hint, f"{len(calls) - len(set(c.message_row_id for c in calls))} repeats"
    assert_every_seq_called_in_order(calls, hints, per_hint)
    assert_no_two_calls_of_a_hint_overlap(calls, unfinished_allowed=set())
    assert {call.replica for call in calls} == {replica.name for replica in replicas}


def test_replicas_killed_mid_drain_lose_nothing_and_only_their_unrecorded_calls_are_delivered_again(
    pg_db: Database, start_replicas: StartReplicas
) -> None:
    hints, per_hint, kills = 300, 30, 4
    settings = {"poll__concurrency": "2", **FAST_LEASES}
    alive = start_replicas(pg_db, 4, **settings)
    wait_balanced(pg_db, alive)
    # A short sleep per call, so that on any machine the drain outlasts the kills (8 threads: 7.5 s at least).
    insert_messages(pg_db, hints, per_hint, sleep_seconds=0.002)

    killed_at: dict[str, datetime] = {}  # replica name -> the database clock just after it died
    for number in range(kills):
        time.sleep(1.0)  # pacing only
        assert remaining(pg_db) > 0, f"the table drained before kill {number + 1}: make the workload bigger"
        # Prefer a replica with calls in flight (rows of correlation_call): that is the case which makes
        # redeliveries.
        busy = {row["holder"] for row in pg_db.execute("SELECT DISTINCT holder FROM correlation_call")}
        victim = next((replica for replica in alive if replica.holder() in busy), alive[number % len(alive)])
        killed_at[victim.name] = kill(pg_db, victim)
        alive.remove(victim)
        alive += start_replicas(pg_db, 1, **settings)

    wait_until(lambda: remaining(pg_db) == 0, DRAIN_DEADLINE, "the table drained", workers=alive, interval=0.5)

    calls = pg_db.calls()
    assert_every_seq_called_in_order(calls, hints, per_hint)
    assert_no_two_calls_of_a_hint_overlap(calls, unfinished_allowed=set(killed_at))
    for message_calls in by_message(calls).values():
        for earlier in message_calls[:-1]:  # delivered again: the earlier call must have died with its replica
            assert earlier.replica in killed_at and earlier.started_at < killed_at[earlier.replica], (
                f"message {earlier.message_row_id} was called again after a call by {earlier.replica}, "
                f"which was not killed after it: {message_calls}"
            )
    again = repeats(calls)
    survivors = {replica.name: replica for replica in alive}
    counted = {name: replica.metric(REDELIVERIES) for name, replica in survivors.items()}
    delivered_again = Counter(call.replica for call in again if call.replica in survivors)
    # A replica counts what it delivers again itself; the counts of the killed ones died with them.
    assert sum(counted.values()) >= sum(delivered_again.values()), (counted, delivered_again)
    for name in survivors:
        assert counted[name] >= delivered_again[name], (name, counted, delivered_again)
    # A killed replica had at most one page in flight (its calls marked), and nothing else is redelivered.
    assert sum(counted.values()) <= kills * PAGE_SIZE
    assert len(again) <= kills * PAGE_SIZE


def test_a_replica_frozen_past_its_lease_writes_nothing_when_it_resumes(
    pg_db: Database, start_replicas: StartReplicas
) -> None:
    frozen, other = start_replicas(
        pg_db,
        2,
        policy__mode="all",
        policy__max_retries="2",
        policy__backoff_unit="PT0.1S",
        **FAST_LEASES,
    )
    wait_balanced(pg_db, [frozen, other])
    slot = min(slot for slot, holder in slot_holders(pg_db).items() if holder == frozen.holder())
    hint = pg_db.hint_in_slot(slot, "slow-")
    # Slow and always failing: after two recorded failures the new owner leaves it dead with attempt 2; a
    # stale write of the frozen replica would bring it back to ready with attempt 1.
    slow = pg_db.insert("order.step", hint, {"seq": 0, "sleep_seconds": 0.8, "fail": True})
    behind = pg_db.insert("order.step", hint, {"seq": 1})

    wait_until(lambda: pg_db.calls_of(slow), what="the slow call started", workers=[frozen], interval=0.01)
    frozen.send(signal.SIGSTOP)
    frozen_at = database_now(pg_db)
    try:
        [mid_call] = pg_db.calls_of(slow)
        assert mid_call.replica == frozen.name and mid_call.ended_at is None, "not frozen in the middle of a call"

        def taken_over_and_settled() -> bool:
            row = pg_db.message(slow)
            return row is not None and row["state"] == "dead" and pg_db.gone(behind)

        wait_until(taken_over_and_settled, what="the other replica to take the hint over", workers=[other])
        settled = pg_db.messages()
    finally:
        frozen.send(signal.SIGCONT)

    wait_until(
        lambda: frozen.metric(FENCED_COMMITS) >= 1, what="the resumed replica's commit fenced off", workers=[frozen]
    )
    wait_until(lambda: "lost the lease of slots" in frozen.log(), what="the lease loss logged", workers=[frozen])
    assert f"slot {slot}: its calls were taken over by its next holder; their outcomes were not written" in frozen.log()

    assert pg_db.messages() == settled  # still the new owner's: nothing resurrected or overwritten
    [row] = settled
    assert (row["id"], row["state"], row["attempt"]) == (slow, "dead", 2)
    calls = pg_db.calls()
    assert [(call.seq, call.replica) for call in by_hint(calls)[hint] if call.replica == other.name] == [
        (0, other.name),
        (1, other.name),
        (0, other.name),
    ]
    late = [call for call in calls if call.replica == frozen.name and call.started_at > frozen_at]
    assert late == [], "the resumed replica started calls on a slot whose lease it had lost"
    assert other.metric(REDELIVERIES) >= 1  # the frozen replica's in-flight call was counted


def test_replicas_reconnect_and_finish_when_postgresql_restarts_mid_drain(
    private_pg: tuple[Server, str], start_replicas: StartReplicas
) -> None:
    server, url = private_pg
    database = PostgresDatabase(url)
    try:
        hints, per_hint = 250, 40
        replicas = start_replicas(
            database, 3, poll__concurrency="2", policy__backoff_unit="PT0.1S", policy__backoff_cap="PT1S", **FAST_LEASES
        )
        wait_balanced(database, replicas)
        insert_messages(database, hints, per_hint)
        wait_until(
            lambda: remaining(database) < hints * per_hint * 3 // 4, what="the drain under way", workers=replicas
        )

        server.stop("fast")
        time.sleep(1.5)  # pacing: the database stays away for a while
        server.start()
        database.close()
        database = PostgresDatabase(url)

        wait_until(
            lambda: remaining(database) == 0, DRAIN_DEADLINE, "the table drained", workers=replicas, interval=0.5
        )
        assert all(replica.running() for replica in replicas)
        assert any("database unavailable" in replica.log() for replica in replicas), "the restart went unnoticed"
        calls = database.calls()
        assert_every_seq_called_in_order(calls, hints, per_hint)
        # A call whose journal entry could not be finished (the database was away) is left open.
        assert_no_two_calls_of_a_hint_overlap(calls, unfinished_allowed={replica.name for replica in replicas})
    finally:
        database.close()


def test_a_replica_restarted_under_the_same_name_has_its_old_slots_recovered_within_a_lease(
    pg_db: Database, start_replicas: StartReplicas
) -> None:
    hints, per_hint = 200, 40
    settings = {"poll__concurrency": "2", **FAST_LEASES}
    first, victim, third = start_replicas(pg_db, 3, **settings)
    wait_balanced(pg_db, [first, victim, third])
    insert_messages(pg_db, hints, per_hint)
    wait_until(
        lambda: remaining(pg_db) < hints * per_hint * 3 // 4, what="the drain under way", workers=[first, victim, third]
    )

    old_holder = victim.holder()
    old_slots = {slot for slot, holder in slot_holders(pg_db).items() if holder == old_holder}
    assert old_slots
    killed = time.monotonic()
    killed_at = kill(pg_db, victim)
    [again] = start_replicas(pg_db, 1, replica__name=victim.name, **settings)
    assert again.holder() != old_holder  # same pod name, new term holder
    live = [first, third, again]

    # Invariant 3: the dead holder's slots are leased again within one lease and one renew interval.
    budget = LEASE + RENEW + TAKEOVER_SLACK - (time.monotonic() - killed)
    wait_until(lambda: held_by_only(pg_db, live), max(budget, 0.1), "every slot leased by a live replica", live)
    holders = slot_holders(pg_db)
    assert {holders[slot] for slot in old_slots} <= {replica.holder() for replica in live}

    wait_until(lambda: remaining(pg_db) == 0, DRAIN_DEADLINE, "the table drained", workers=live, interval=0.5)
    wait_balanced(pg_db, live)  # the restarted replica got its share back
    calls = pg_db.calls()
    assert_every_seq_called_in_order(calls, hints, per_hint)
    assert_no_two_calls_of_a_hint_overlap(calls, unfinished_allowed={victim.name})
    for message_calls in by_message(calls).values():
        for earlier in message_calls[:-1]:
            assert earlier.replica == victim.name and earlier.started_at < killed_at, message_calls


def test_a_replica_stopped_with_sigterm_exits_0_hands_its_slots_back_and_the_others_take_them_at_once(
    pg_db: Database, start_replicas: StartReplicas
) -> None:
    hints, per_hint = 200, 40
    replicas = start_replicas(pg_db, 3, poll__concurrency="2", **FAST_LEASES)
    wait_balanced(pg_db, replicas)
    insert_messages(pg_db, hints, per_hint)
    wait_until(lambda: remaining(pg_db) < hints * per_hint * 3 // 4, what="the drain under way", workers=replicas)

    leaving = replicas[1]
    holder = leaving.holder()
    leaving.send(signal.SIGTERM)
    try:
        code = leaving.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail("the replica did not exit within 10s of SIGTERM")
    assert code == 0
    still_held = pg_db.execute(
        "SELECT name FROM correlation_lock WHERE name LIKE 'slot:%%' AND locked_by = %s AND lock_until > now()",
        (holder,),
    )
    assert still_held == [], "slots not released at exit"

    staying = [replicas[0], replicas[2]]
    wait_until(lambda: held_by_only(pg_db, staying), RENEW + TAKEOVER_SLACK, "the slots taken over", workers=staying)
    wait_until(lambda: remaining(pg_db) == 0, DRAIN_DEADLINE, "the table drained", workers=staying, interval=0.5)
    calls = pg_db.calls()
    assert_every_seq_called_in_order(calls, hints, per_hint)
    assert_no_two_calls_of_a_hint_overlap(calls, unfinished_allowed=set())
    assert repeats(calls) == []  # a clean stop finishes its page and records it: nothing is delivered again
    assert [replica.metric(REDELIVERIES) for replica in staying] == [0, 0]
