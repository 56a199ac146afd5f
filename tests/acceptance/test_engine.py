"""The correlation engine end to end: a real worker process, messages inserted with SQL, a recording handler.

Semantics as DESIGN.md §3. Timing checks are one-sided where it matters: a delay is never shorter than the
policy says (checked strictly); how much longer it takes on a busy machine is checked loosely.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from datetime import datetime, timedelta
from itertools import pairwise
from typing import Any

import psycopg
from harness import PROBE, Database, StartWorker, run_cli, wait_until
from recorder import Call

CLOCK_SLACK = 0.05  # seconds: the worker's monotonic clock against the database clock


def seconds(delta: timedelta) -> float:
    return delta.total_seconds()


def real_calls(calls: Sequence[Call]) -> list[Call]:
    """The calls of the test's own messages (not of the probes)."""
    return [call for call in calls if call.message_name != PROBE]


def by_hint(calls: Sequence[Call]) -> dict[str, list[Call]]:
    grouped: dict[str, list[Call]] = {}
    for call in real_calls(calls):
        grouped.setdefault(call.hint, []).append(call)
    return grouped


def ended(call: Call) -> datetime:
    assert call.ended_at is not None, f"call of message {call.message_row_id} never ended"
    return call.ended_at


def first_line(error: str | None) -> str:
    assert error is not None
    return error.splitlines()[0]


# -- order and batches ---------------------------------------------------------------------------------------


def test_messages_of_one_hint_are_correlated_in_id_order(any_db: Database, start_worker: StartWorker) -> None:
    worker = start_worker(any_db, poll__concurrency="4")
    hints = [f"order-{n}" for n in range(5)]
    ids = [any_db.insert("order.step", hint, {"seq": seq}) for seq in range(20) for hint in hints]

    wait_until(lambda: any_db.gone(*ids), what="every message correlated", workers=[worker])

    calls = by_hint(any_db.calls())
    assert sorted(calls) == hints
    for hint, hint_calls in calls.items():
        assert [call.seq for call in hint_calls] == list(range(20)), hint
        assert all(call.outcome == "ok" for call in hint_calls), hint
        for earlier, later in pairwise(hint_calls):
            assert ended(earlier) <= later.started_at, f"{hint}: calls {earlier.seq} and {later.seq} overlap"
    assert any_db.messages() == []


def test_a_failing_message_holds_back_its_group_in_fail_first_mode(
    any_db: Database, start_worker: StartWorker
) -> None:
    a1, a2, a3, a4 = (
        any_db.insert("order.step", "order-a", payload)
        for payload in ({"seq": 1}, {"seq": 2, "fail": True}, {"seq": 3}, {"seq": 4})
    )
    b = [any_db.insert("order.step", "order-b", {"seq": seq}) for seq in range(1, 5)]
    worker = start_worker(any_db)

    def failure_recorded() -> bool:
        row = any_db.message(a2)
        return row is not None and row["attempt"] >= 1 and row["last_error"] is not None

    wait_until(lambda: any_db.gone(a1, *b) and failure_recorded(), what="B done, A stopped", workers=[worker])
    any_db.wait_for_full_polls([worker])

    for untouched in (a3, a4):
        row = any_db.message(untouched)
        assert row is not None and row["state"] == "ready" and row["attempt"] == 0
        assert row["next_attempt_at"] is None and row["last_error"] is None
    assert any_db.calls_of(a3, a4) == []
    failing = any_db.message(a2)
    assert (
        failing is not None
        and first_line(failing["last_error"]) == "RuntimeError: message seq=2 always fails"
    )
    assert [call.seq for call in by_hint(any_db.calls())["order-a"]] == [1, 2]


def test_all_mode_attempts_every_message_of_the_batch(pg_db: Database, start_worker: StartWorker) -> None:
    a1, a2, a3, a4 = (
        pg_db.insert("order.step", "order-a", payload)
        for payload in ({"seq": 1}, {"seq": 2, "fail": True}, {"seq": 3}, {"seq": 4})
    )
    b = [pg_db.insert("order.step", "order-b", {"seq": seq}) for seq in range(1, 5)]
    worker = start_worker(pg_db, policy__mode="all")

    def failure_recorded() -> bool:
        row = pg_db.message(a2)
        return row is not None and row["attempt"] >= 1 and row["last_error"] is not None

    wait_until(
        lambda: pg_db.gone(a1, a3, a4, *b) and failure_recorded(), what="all but A2 done", workers=[worker]
    )

    calls = by_hint(pg_db.calls())
    assert [call.seq for call in calls["order-a"]] == [1, 2, 3, 4]
    assert [call.outcome for call in calls["order-a"]] == ["ok", "retry", "ok", "ok"]
    assert [call.seq for call in calls["order-b"]] == [1, 2, 3, 4]
    failing = pg_db.message(a2)
    assert failing is not None and failing["state"] == "ready" and failing["next_attempt_at"] is not None


def test_batch_size_one_takes_only_the_head_of_each_group_per_poll(
    pg_db: Database, start_worker: StartWorker
) -> None:
    interval = 0.5
    hints = ["order-a", "order-b", "order-c"]
    ids = [pg_db.insert("order.step", hint, {"seq": seq}) for seq in range(4) for hint in hints]
    worker = start_worker(pg_db, policy__batch_size="1", poll__interval=f"PT{interval}S")

    wait_until(lambda: pg_db.gone(*ids), what="every message correlated", workers=[worker])

    calls = by_hint(pg_db.calls())
    for hint in hints:
        assert [call.seq for call in calls[hint]] == [0, 1, 2, 3]
        for earlier, later in pairwise(calls[hint]):
            gap = seconds(later.started_at - ended(earlier))
            assert gap >= interval - CLOCK_SLACK, (
                f"{hint}: seq {later.seq} only {gap:.3f}s after {earlier.seq}"
            )


# -- time-to-live, backoff and max retries -------------------------------------------------------------------


def test_the_worked_example_of_ttl_backoff_and_max_retries(
    pg_db: Database, start_worker: StartWorker
) -> None:
    """DESIGN.md §3's table, scaled from minutes to seconds: TTL 1 s, backoff 1 s x 2^(k-1) capped at 10 s."""
    ttl, poll, max_retries = 1.0, 0.6, 5
    backoffs = [1.0, 2.0, 4.0, 8.0]  # after recorded failures 1..4; the 5th is final
    worker = start_worker(
        pg_db,
        poll__interval=f"PT{poll}S",
        policy__time_to_live=f"PT{ttl:.0f}S",
        policy__backoff_unit="PT1S",
        policy__backoff_base="2",
        policy__backoff_cap="PT10S",
        policy__max_retries=str(max_retries),
    )
    row_id = pg_db.insert("order.paid", "order-1", {"seq": 1, "fail": True})

    samples: list[dict[str, Any]] = []

    def sample_until_dead() -> bool:
        rows = pg_db.execute(
            "SELECT clock_timestamp() AS now, created_at, state, attempt, next_attempt_at, last_error"
            " FROM correlation_message WHERE id = %s",
            (row_id,),
        )
        assert rows, "the failing message disappeared"
        samples.append(rows[0])
        return bool(rows[0]["state"] == "dead")

    wait_until(sample_until_dead, timeout=90, what="the message to die", workers=[worker], interval=0.025)
    calls = pg_db.calls_of(row_id)
    created_at = samples[0]["created_at"]
    ttl_end = created_at + timedelta(seconds=ttl)

    # The calls saw attempt 0 while buffered inside the TTL, then 0, 1, 2, 3, 4 as failures were recorded.
    assert all(call.outcome == "retry" for call in calls)
    buffered = len(calls) - max_retries
    assert buffered >= 1, f"no failure inside the TTL: {[c.attempt for c in calls]}"
    assert [call.attempt for call in calls] == [0] * buffered + list(range(max_retries))
    for call in calls[:buffered]:
        assert call.started_at < ttl_end
    for earlier, later in pairwise(calls[: buffered + 1]):
        gap = seconds(later.started_at - ended(earlier))
        assert gap >= poll - CLOCK_SLACK, (
            f"a buffered message was tried again after {gap:.3f}s, not a poll later"
        )

    # While inside the TTL nothing is recorded; a buffered message waits for the next poll with no error.
    for row in samples:
        if row["now"] < ttl_end:
            assert (row["attempt"], row["last_error"]) == (0, None), row
    assert any(
        row["attempt"] == 0 and row["next_attempt_at"] is not None and row["last_error"] is None
        for row in samples
    ), "the buffered state was never seen"

    # Recorded failures: the next attempt is due after the backoff, counted from the failure.
    recorded = calls[buffered:]
    for k, backoff in enumerate(backoffs, start=1):
        waiting = [row for row in samples if row["attempt"] == k]
        assert waiting, f"never saw the row after recorded failure {k}"
        row = waiting[0]
        assert row["state"] == "ready"
        assert first_line(row["last_error"]) == "RuntimeError: message seq=1 always fails"
        due_after = seconds(row["next_attempt_at"] - ended(recorded[k - 1]))
        assert backoff - CLOCK_SLACK <= due_after <= backoff + 1.0, f"failure {k}: due after {due_after:.3f}s"
    for k, backoff in enumerate(backoffs):
        earlier, later = recorded[k], recorded[k + 1]
        gap = seconds(later.started_at - ended(earlier))
        assert gap >= backoff - CLOCK_SLACK, f"attempt {k + 2} came {gap:.3f}s after attempt {k + 1}"
        assert seconds(later.started_at - earlier.started_at) <= backoff + 2 * poll + 1.5

    # Exactly max_retries recorded failures, then dead, with the last error kept and no further call.
    dead = samples[-1]
    assert (dead["state"], dead["attempt"]) == ("dead", max_retries)
    assert first_line(dead["last_error"]) == "RuntimeError: message seq=1 always fails"
    pg_db.wait_for_full_polls([worker])
    pg_db.wait_for_full_polls([worker])
    assert len(pg_db.calls_of(row_id)) == len(calls)
    final = pg_db.message(row_id)
    assert final is not None and (final["state"], final["attempt"]) == ("dead", max_retries)


# -- outcomes ------------------------------------------------------------------------------------------------


def test_a_permanent_error_makes_the_message_dead_at_once(pg_db: Database, start_worker: StartWorker) -> None:
    worker = start_worker(pg_db)
    doomed = pg_db.insert("order.paid", "order-1", {"seq": 1, "permanent": True})
    behind = pg_db.insert("order.paid", "order-1", {"seq": 2})

    def dead() -> bool:
        row = pg_db.message(doomed)
        return row is not None and row["state"] == "dead"

    wait_until(dead, what="the message to die", workers=[worker])
    pg_db.wait_for_full_polls([worker])

    row = pg_db.message(doomed)
    assert row is not None and row["attempt"] == 1
    assert first_line(row["last_error"]) == "PermanentError: message seq=1 can never succeed"
    assert [call.outcome for call in pg_db.calls_of(doomed)] == ["permanent"]
    # In fail_first mode a dead message holds back its hint until an operator acts.
    assert pg_db.calls_of(behind) == []


def test_a_reschedule_is_counted_apart_from_attempts(pg_db: Database, start_worker: StartWorker) -> None:
    delay = 0.5
    worker = start_worker(pg_db)
    row_id = pg_db.insert(
        "order.paid", "order-1", {"seq": 1, "reschedule_seconds": delay, "reschedule_times": 2}
    )

    samples: list[dict[str, Any]] = []

    def sample_until_gone() -> bool:
        row = pg_db.message(row_id)
        if row is not None:
            samples.append(row)
        return row is None

    wait_until(sample_until_gone, what="the message to succeed", workers=[worker], interval=0.025)

    calls = pg_db.calls_of(row_id)
    assert [call.outcome for call in calls] == ["reschedule", "reschedule", "ok"]
    assert [call.attempt for call in calls] == [0, 0, 0]
    assert [call.reschedule_count for call in calls] == [0, 1, 2]
    for count in (1, 2):
        seen = [row for row in samples if row["reschedule_count"] == count]
        assert seen, f"never saw reschedule_count {count}"
        assert (seen[0]["attempt"], seen[0]["last_error"], seen[0]["state"]) == (0, None, "ready")
        due_after = seconds(seen[0]["next_attempt_at"] - ended(calls[count - 1]))
        assert delay - CLOCK_SLACK <= due_after <= delay + 1.0
        gap = seconds(calls[count].started_at - ended(calls[count - 1]))
        assert gap >= delay - CLOCK_SLACK
    assert all(row["attempt"] == 0 for row in samples)


def test_a_message_without_a_route_is_dead_with_a_reason_naming_the_route(
    pg_db: Database, start_worker: StartWorker
) -> None:
    worker = start_worker(pg_db, correlators=json.dumps({"order.paid": "recorder:handle"}))
    unrouted = pg_db.insert("order.shipped", "order-1", {"seq": 1})
    routed = pg_db.insert("order.paid", "order-2", {"seq": 1})

    def dead() -> bool:
        row = pg_db.message(unrouted)
        return row is not None and row["state"] == "dead"

    wait_until(lambda: dead() and pg_db.gone(routed), what="routing decided", workers=[worker])

    row = pg_db.message(unrouted)
    assert row is not None and row["attempt"] == 1
    reason = first_line(row["last_error"])
    assert "no correlator route for message name 'order.shipped'" in reason
    assert "CORRELATION_CORRELATORS" in reason
    assert pg_db.calls_of(unrouted) == []
    assert [call.outcome for call in pg_db.calls_of(routed)] == ["ok"]


def test_a_malformed_row_does_not_stop_the_worker(pg_db: Database, start_worker: StartWorker) -> None:
    worker = start_worker(
        pg_db,
        correlators=json.dumps({"*": "recorder:handle", "order.paid": "recorder:handle_order"}),
        policy__max_retries="2",
        policy__backoff_unit="PT0.2S",
    )
    good = [pg_db.insert("order.step", "order-good", {"seq": 1})]
    # Valid JSON, but not what the handlers expect: not an object, or an object without the key it needs.
    refused = "TypeError: payload must be a JSON object, not "
    malformed = {
        pg_db.insert("order.step", "order-string", "not an object"): refused + "str",
        pg_db.insert("order.step", "order-array", [1, 2]): refused + "tuple",
        pg_db.insert("order.step", "order-null", None): refused + "NoneType",
        pg_db.insert("order.paid", "order-7", {"amount": 3}): "KeyError: 'order_id'",
    }
    good.append(pg_db.insert("order.step", "order-good", {"seq": 2}))

    def all_dead() -> bool:
        rows = [pg_db.message(row_id) for row_id in malformed]
        return all(row is not None and row["state"] == "dead" for row in rows)

    wait_until(
        lambda: all_dead() and pg_db.gone(*good), what="malformed rows dead, good ones done", workers=[worker]
    )
    later = [pg_db.insert("order.step", "order-good", {"seq": seq}) for seq in (3, 4)]
    wait_until(lambda: pg_db.gone(*later), what="later messages correlated", workers=[worker])

    for row_id, error in malformed.items():
        row = pg_db.message(row_id)
        assert row is not None and row["attempt"] == 2
        assert first_line(row["last_error"]) == error
    assert [call.seq for call in by_hint(pg_db.calls())["order-good"]] == [1, 2, 3, 4]
    assert worker.running() and "poll failed" not in worker.log()


def test_a_message_that_never_expires_does_not_stop_other_hints(
    any_db: Database, start_worker: StartWorker
) -> None:
    worker = start_worker(any_db)
    poison_hint = any_db.hint_in_slot(0, "forever-")  # the first slot a poll cycle visits
    try:
        any_db.execute(
            "INSERT INTO correlation_message (message_name, correlation_hint, payload, expires_at)"
            f" VALUES ('order.paid', '{poison_hint}', '{{}}', 'infinity')"
        )
    except (psycopg.IntegrityError, sqlite3.IntegrityError):
        return  # refused at insert time, which is as good: it can never reach a poll
    others = [any_db.insert("order.paid", any_db.hint_in_slot(slot, "order-"), {}) for slot in (0, 1, 31, 63)]

    def others_done() -> bool:
        assert "poll failed" not in worker.log(), "the poll broke on the row"
        return any_db.gone(*others)

    wait_until(others_done, timeout=10, what="the other hints correlated", workers=[worker])


# -- expiry and operators ------------------------------------------------------------------------------------

EXPIRED_INSERT = """
INSERT INTO correlation_message (message_name, correlation_hint, payload, created_at, expires_at)
VALUES (%s, %s, %s::jsonb, now() - interval '10 seconds', now() - interval '5 seconds')
RETURNING id
"""


def test_an_expired_message_is_never_correlated_and_cleanup_removes_it(
    pg_db: Database, start_worker: StartWorker
) -> None:
    expired = [
        pg_db.execute(EXPIRED_INSERT, ("order.paid", hint, json.dumps({"seq": 1})))[0]["id"]
        for hint in ("order-1", "order-2")
    ]
    behind = pg_db.insert("order.paid", "order-1", {"seq": 2})
    not_yet_expired = pg_db.execute(
        "INSERT INTO correlation_message (message_name, correlation_hint, payload, expires_at)"
        " VALUES ('order.paid', 'order-3', '{\"seq\": 1}', now() + interval '1 hour') RETURNING id"
    )[0]["id"]

    first = start_worker(pg_db, cleanup__initial_delay="PT1H")
    wait_until(lambda: pg_db.gone(behind, not_yet_expired), what="live messages correlated", workers=[first])
    pg_db.wait_for_full_polls([first])
    assert all(pg_db.message(row_id) is not None for row_id in expired)
    assert first.stop() == 0

    second = start_worker(pg_db, cleanup__initial_delay="PT0S", cleanup__interval="PT0.2S")
    wait_until(lambda: pg_db.gone(*expired), what="cleanup to remove expired messages", workers=[second])
    assert pg_db.calls_of(*expired) == []
    # The line is written after the delete commits: waited for, not read at once.
    wait_until(lambda: "cleanup removed" in second.log(), what="the cleanup's log line", workers=[second])


def test_a_paused_hint_waits_until_resumed_and_holds_back_later_messages(
    pg_db: Database, start_worker: StartWorker
) -> None:
    paused = [pg_db.insert("order.step", "order-x", {"seq": seq}) for seq in (1, 2)]
    other = pg_db.insert("order.step", "order-y", {"seq": 1})
    assert run_cli(pg_db, "pause", "--hint", "order-x").stdout.startswith("paused hint 'order-x' (pause ")

    worker = start_worker(pg_db)
    later = pg_db.insert("order.step", "order-x", {"seq": 3})
    wait_until(lambda: pg_db.gone(other), what="the other hint correlated", workers=[worker])
    pg_db.wait_for_full_polls([worker])

    # A durable pause leaves the hint's rows alone (ready, no attempt) and holds back the later one too.
    assert [(row or {}).get("state") for row in map(pg_db.message, paused)] == ["ready", "ready"]
    held = pg_db.message(later)
    assert held is not None and (held["state"], held["attempt"]) == ("ready", 0)
    assert pg_db.calls_of(*paused, later) == []

    assert run_cli(pg_db, "resume", "--hint", "order-x").stdout.startswith("lifted pause ")
    wait_until(lambda: pg_db.gone(*paused, later), what="the resumed hint correlated", workers=[worker])
    assert [call.seq for call in pg_db.calls_of(*paused, later)] == [1, 2, 3]
