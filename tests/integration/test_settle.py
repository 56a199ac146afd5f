"""Settling outcomes, one way for every path: a group commit of the committer and a transactional call's own
transaction check the call row is still the term's, take the call rows before any message row, and report the
same statuses (against real PostgreSQL, and SQLite where no second session is involved)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Connection

from tests.conftest import left
from tests.integration.test_locks import flush_waiting_for_call_row
from worker.db.calls import MarkRequest, SlotWrite
from worker.db.store import Fence, NewMessage, Store
from worker.policy.outcomes import Disposition, Kind

LONG = timedelta(minutes=5)


def _messages(store: Store, count: int) -> list[int]:
    ids = [store.messages_insert(NewMessage("order.paid", f"order-{n}")) for n in range(count)]
    assert all(i is not None for i in ids)
    return sorted(i for i in ids if i is not None)


def _mark(store: Store, fence: Fence, *ids: int) -> None:
    for message_id in ids:  # one run each (a run is of one hint)
        assert store.calls_mark([MarkRequest(0, fence, (message_id,))]).marked == {message_id}


def _calls(store: Store) -> dict[int, str]:
    return {call["message_id"]: call["state"] for call in store.calls_in_flight()}


def _success(message_id: int) -> Any:
    return lambda connection: Disposition(message_id, Kind.DELETE, 0)


def test_a_transactional_call_reports_what_a_flush_reports(any_store: Store) -> None:
    """written: the outcome and the call row's release commit together; gone: the message left meanwhile, its
    call row leaves and nothing is called; fenced: the call is not marked under this term, nothing changes."""
    fence = any_store.lock_try_acquire("slot:0", "a", LONG)
    assert fence is not None
    written, gone, fenced = _messages(any_store, 3)
    _mark(any_store, fence, written, gone)
    called: list[int] = []

    def handler(message_id: int) -> Any:
        def call(connection: Connection) -> Disposition:
            called.append(message_id)
            return Disposition(message_id, Kind.DELETE, 0)
        return call

    assert any_store.calls_transact(0, fence, handler(written), written) == "written"
    assert left(any_store, written) and written not in _calls(any_store)

    with any_store.engine.begin() as connection:
        connection.execute(text("DELETE FROM correlation_message WHERE id = :id"), {"id": gone})
    assert any_store.calls_transact(0, fence, handler(gone), gone) == "gone"
    assert gone not in _calls(any_store)

    assert any_store.calls_transact(0, Fence("slot:0", "a", fence.fence + 1), handler(fenced), fenced) == "fenced"
    assert not left(any_store, fenced) and called == [written]


def test_a_transactional_call_whose_message_row_is_held_elsewhere_is_busy_and_keeps_its_call(store: Store) -> None:
    """Nothing is called and nothing is written: the call row stays as it was (not returned, for no outcome
    waits), and the call can be made once the row is let go."""
    fence = store.lock_try_acquire("slot:0", "a", LONG)
    assert fence is not None
    [message_id] = _messages(store, 1)
    _mark(store, fence, message_id)
    with store.engine.connect() as other:
        other.execute(text("SELECT 1 FROM correlation_message WHERE id = :id FOR UPDATE"), {"id": message_id})
        assert store.calls_transact(0, fence, _success(message_id), message_id) == "busy"
        assert _calls(store) == {message_id: "called"} and not left(store, message_id)
        other.rollback()
    assert store.calls_transact(0, fence, _success(message_id), message_id) == "written"
    assert left(store, message_id) and _calls(store) == {}


@pytest.mark.parametrize("held", ["outcome", "abandoned"])
def test_a_flush_takes_every_call_row_before_any_message_row(store: Store, pg_url: str, held: str) -> None:
    """While a flush waits for a call row another session holds (the last of its outcomes', or a call it gives up
    on), it holds no message row: the one wait of a settle comes before any message row is taken."""
    fence = store.lock_try_acquire("slot:0", "a", LONG)
    assert fence is not None
    first, second, last = _messages(store, 3)
    _mark(store, fence, first, second, last)
    outcomes = (first, second, last) if held == "outcome" else (first, second)
    write = SlotWrite(0, fence, tuple(Disposition(i, Kind.DELETE, 0) for i in outcomes),
                      abandon=(last,) if held == "abandoned" else ())
    with flush_waiting_for_call_row(store, pg_url, last, lambda: store.messages_record([write])) as (other, done):
        free = other.execute(text(
            "SELECT id FROM correlation_message WHERE id = ANY(:ids) ORDER BY id FOR UPDATE SKIP LOCKED"
        ), {"ids": [first, second, last]}).scalars().all()
        assert free == [first, second, last], "the flush holds a message row while it waits for a call row"
    assert done[0].written == set(outcomes) and not done[0].fenced
    assert all(left(store, i) for i in outcomes)
    assert _calls(store) == ({} if held == "outcome" else {last: "abandoned"})
