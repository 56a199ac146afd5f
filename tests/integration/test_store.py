"""Every statement of the store against real databases (PostgreSQL, and SQLite where it runs the same)."""

from __future__ import annotations

import json
import random
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from worker.config import Mode
from worker.db.store import MessageFilter, MessageRejected, NewMessage, Store
from worker.message import MessageState
from worker.policy.batching import eligible
from worker.policy.outcomes import Disposition, Kind


def add(store: Store, hint: str = "h", name: str = "order.paid", **columns: Any) -> int:
    row_id = store.messages_insert(NewMessage(name=name, hint=hint, payload=columns.pop("payload", {})))
    assert row_id is not None
    if columns:
        set_columns(store, row_id, **columns)
    return row_id


def set_columns(store: Store, row_id: int, **columns: Any) -> None:
    """Set worker columns directly, with times given as seconds relative to the database clock."""
    now = store.now()
    values = {k: now + timedelta(seconds=v) if k.endswith("_at") else v for k, v in columns.items()}
    if "expires_at" in values:
        values["created_at"] = min(values["expires_at"], now)
    from sqlalchemy import update

    from worker.db.schema import message_table

    with store.engine.begin() as connection:
        connection.execute(update(message_table).where(message_table.c.id == row_id).values(**values))


def fetch(store: Store, mode: Mode = Mode.FAIL_FIRST, after: int = 0, limit: int = 100) -> list[int]:
    now = store.now()
    return [m.id for m in store.messages_fetch_eligible(slot=None, after=after, limit=limit, mode=mode, now=now)]


def test_fresh_messages_are_eligible_in_id_order(any_store: Store) -> None:
    ids = [add(any_store, hint) for hint in ("a", "b", "a", "c")]
    assert fetch(any_store) == ids


def test_keyset_paging_returns_the_next_page_after_a_position(any_store: Store) -> None:
    ids = [add(any_store, f"h{i}") for i in range(7)]
    assert fetch(any_store, limit=3) == ids[:3]
    assert fetch(any_store, after=ids[2], limit=3) == ids[3:6]
    assert fetch(any_store, after=ids[5], limit=3) == ids[6:]


def test_waiting_message_holds_back_its_group(any_store: Store) -> None:
    waiting = add(any_store, "a", attempt=1, next_attempt_at=60)
    add(any_store, "a")
    other = add(any_store, "b")
    assert fetch(any_store) == [other]
    set_columns(any_store, waiting, next_attempt_at=-1)
    assert len(fetch(any_store)) == 3


def test_dead_message_blocks_its_group_only_in_fail_first_mode(any_store: Store) -> None:
    add(any_store, "a", state="dead", attempt=3)
    later = add(any_store, "a")
    assert fetch(any_store, Mode.FAIL_FIRST) == []
    assert fetch(any_store, Mode.ALL) == [later]


def test_expired_messages_are_never_fetched(any_store: Store) -> None:
    add(any_store, "a", expires_at=-5)
    fresh = add(any_store, "a")
    assert fetch(any_store) == [fresh]


def test_slot_filter_returns_only_that_slots_messages(store: Store) -> None:
    ids = [add(store, f"hint-{i}") for i in range(40)]
    by_slot: dict[int, list[int]] = {}
    for row_id in ids:
        message = store.messages_get(row_id)
        assert message is not None
        by_slot.setdefault(message.slot, []).append(row_id)
    now = store.now()
    for slot, expected in by_slot.items():
        got = store.messages_fetch_eligible(slot=slot, after=0, limit=100, mode=Mode.FAIL_FIRST, now=now)
        assert [m.id for m in got] == expected


def test_sql_eligibility_matches_the_pure_rule_on_random_tables(any_store: Store) -> None:
    rng = random.Random(20261121)
    for _ in range(120):
        hint = f"h{rng.randrange(8)}"
        state = rng.choice(["ready"] * 6 + ["paused", "dead"])
        columns: dict[str, Any] = {"state": state}
        if rng.random() < 0.4:
            columns["next_attempt_at"] = rng.choice([-30, 30])
            columns["attempt"] = 1
        if rng.random() < 0.15:
            columns["expires_at"] = rng.choice([-10, 10])
        add(any_store, hint, **columns)
    everything = any_store.messages_list(MessageFilter(), limit=1000)
    now = any_store.now()
    for mode in Mode:
        expected = [m.id for m in eligible(everything, mode, now)]
        assert fetch(any_store, mode, limit=1000) == expected


def test_recording_results_deletes_successes_and_updates_failures(any_store: Store) -> None:
    done, failed, dead = (add(any_store, h) for h in "abc")
    now = any_store.now()
    any_store.messages_record_results(
        [
            Disposition(done, Kind.DELETE, 0),
            Disposition(failed, Kind.RETRY, 1, next_attempt_at=now + timedelta(minutes=1), last_error="boom"),
            Disposition(dead, Kind.DEAD, 5, last_error="gave up"),
        ]
    )
    assert any_store.messages_get(done) is None
    retry = any_store.messages_get(failed)
    assert retry is not None and retry.attempt == 1 and retry.last_error == "boom"
    assert retry.next_attempt_at is not None and abs(retry.next_attempt_at - now - timedelta(minutes=1)) < timedelta(
        seconds=1
    )
    gone = any_store.messages_get(dead)
    assert gone is not None and gone.state is MessageState.DEAD and gone.attempt == 5


def test_a_message_paused_during_its_call_stays_paused(any_store: Store) -> None:
    row_id = add(any_store, "a")
    any_store.messages_pause(MessageFilter(ids=(row_id,)))
    any_store.messages_record_results([Disposition(row_id, Kind.RETRY, 1, last_error="x")])
    message = any_store.messages_get(row_id)
    assert message is not None and message.state is MessageState.PAUSED and message.attempt == 1


def test_insert_with_a_known_message_id_is_a_no_op(any_store: Store) -> None:
    first = any_store.messages_insert(NewMessage("n", "h", {"a": 1}, message_id="m-1"))
    again = any_store.messages_insert(NewMessage("n", "h", {"a": 2}, message_id="m-1"))
    assert first is not None and again is None
    assert len(any_store.messages_list(MessageFilter())) == 1


def test_insert_of_a_bad_row_names_the_broken_rule(any_store: Store) -> None:
    with pytest.raises(MessageRejected) as info:
        any_store.messages_insert(NewMessage("n", ""))
    assert info.value.constraint == "correlation_message_hint_not_empty"


def test_payload_and_headers_round_trip_as_read_only_values(any_store: Store) -> None:
    row_id = any_store.messages_insert(
        NewMessage("n", "h", {"order": {"id": 7, "lines": [1, 2]}}, headers={"tenant": "acme"})
    )
    assert row_id is not None
    message = any_store.messages_get(row_id)
    assert message is not None
    assert message.payload["order"]["id"] == 7 and list(message.payload["order"]["lines"]) == [1, 2]
    assert message.headers["tenant"] == "acme"
    with pytest.raises(TypeError):
        message.payload["order"] = None


def test_pause_resume_requeue_and_delete_by_name_hint_and_id(any_store: Store) -> None:
    a1, a2 = add(any_store, "a", name="x"), add(any_store, "a", name="y")
    b1 = add(any_store, "b", name="x")
    assert any_store.messages_pause(MessageFilter(hint="a")) == 2
    assert fetch(any_store) == [b1]
    assert any_store.messages_resume(MessageFilter(ids=(a2,))) == 1
    assert fetch(any_store) == [b1]  # a1 is still paused and holds back a2
    assert any_store.messages_resume(MessageFilter(name="x")) == 1
    assert fetch(any_store) == [a1, a2, b1]
    set_columns(any_store, b1, state="dead", attempt=100, next_attempt_at=3600)
    assert any_store.messages_requeue(MessageFilter(state=MessageState.DEAD)) == 1
    requeued = any_store.messages_get(b1)
    assert requeued is not None and requeued.state is MessageState.READY and requeued.attempt == 0
    assert requeued.next_attempt_at is not None and requeued.next_attempt_at <= any_store.now()
    assert any_store.messages_delete(MessageFilter(name="x")) == 2
    assert [m.id for m in any_store.messages_list(MessageFilter())] == [a2]


def test_counts_by_state_and_oldest_eligible_age(any_store: Store) -> None:
    add(any_store, "a")
    add(any_store, "b", attempt=1, next_attempt_at=60)
    add(any_store, "c", state="paused")
    add(any_store, "d", state="dead")
    add(any_store, "e", expires_at=-1)
    counts = any_store.messages_count_by_state()
    assert (counts.ready, counts.waiting, counts.paused, counts.dead, counts.expired) == (1, 1, 1, 1, 1)
    assert counts.oldest_eligible_age is not None and counts.oldest_eligible_age >= timedelta(0)


def test_expired_messages_are_deleted_in_bounded_chunks(any_store: Store) -> None:
    for i in range(5):
        add(any_store, f"h{i}", expires_at=-1)
    keep = add(any_store, "keep")
    now = any_store.now()
    assert any_store.messages_delete_expired(now=now, limit=2) == 2
    assert any_store.messages_delete_expired(now=now, limit=2) == 2
    assert any_store.messages_delete_expired(now=now, limit=2) == 1
    assert [m.id for m in any_store.messages_list(MessageFilter())] == [keep]


def _plan(store: Store, mode: Mode, slot: int) -> dict[str, Any]:
    from worker.db.store import _eligible_sql

    sql = _eligible_sql(mode, by_slot=True)
    params = {"after": 0, "limit": 100, "now": store.now(), "slot": slot}
    with store.engine.connect() as connection:
        raw = connection.execute(text("EXPLAIN (ANALYZE, FORMAT JSON) " + sql), params).scalar_one()
    plan = raw if isinstance(raw, list) else json.loads(raw)
    return dict(plan[0]["Plan"])


def _walk(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(child for sub in node.get("Plans", []) for child in _walk(sub))]


@pytest.mark.parametrize("mode", list(Mode))
def test_a_poll_costs_a_page_not_the_table_with_many_dead_paused_and_waiting_rows(store: Store, mode: Mode) -> None:
    with store.engine.begin() as connection:
        for state, delay in (("dead", None), ("paused", None), ("ready", "1 hour")):
            connection.execute(
                text(
                    "INSERT INTO correlation_message (message_name, correlation_hint, state, attempt, "
                    "next_attempt_at) SELECT 'n', 'stuck-' || :state || g, :state, 1, now() + CAST(:delay AS interval)"
                    " FROM generate_series(1, 60000) g"
                ),
                {"state": state, "delay": delay},
            )
        connection.execute(
            text(
                "INSERT INTO correlation_message (message_name, correlation_hint) "
                "SELECT 'n', 'live-' || (g % 50) FROM generate_series(1, 500) g"
            )
        )
        connection.execute(text("ANALYZE correlation_message"))
    for slot in (0, 7, 63):
        plan = _plan(store, mode, slot)
        nodes = _walk(plan)
        assert not any(n["Node Type"] == "Seq Scan" for n in nodes), "the poll must not scan the table"
        touched = sum(n.get("Actual Rows", 0) * n.get("Actual Loops", 1) + n.get("Rows Removed by Filter", 0)
                      for n in nodes)
        assert touched < 5_000, f"a page of 100 touched {touched} rows among 180 000 stuck ones"
