"""Durable pauses (DESIGN.md §3) with the engine in-process: a paused name, hint or everything holds back also
the messages inserted after the pause, keeps its hints' order, and lifting it resumes them in order."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy.engine import make_url

from tests.integration.test_engine_once import Recorder, make_poller, rows, send
from worker.admin import pauses
from worker.admin.auth import Caller
from worker.admin.errors import Conflict, Forbidden, NotFound
from worker.db.store import Store
from worker.message import MessageState

OPERATOR = Caller("operator", "api", can_write=True)
READER = Caller("reader", "api", can_write=False)

def states(store: Store) -> dict[int, str]:
    return {message.id: message.state.value for message in rows(store)}


def test_a_paused_name_holds_back_later_messages_and_its_hints_order_until_lifted(any_store: Store) -> None:
    pause = pauses.add_pause(any_store, OPERATOR, "name", "order.cancelled", "target down")
    a1 = send(any_store, "a", 1)
    a2 = send(any_store, "a", 2, name="order.cancelled")
    a3 = send(any_store, "a", 3)
    b1 = send(any_store, "b", 1, name="order.cancelled")
    send(any_store, "c", 1)
    recorder = Recorder()
    make_poller(any_store, recorder).run_once()

    assert recorder.seqs("a") == [1] and recorder.seqs("b") == [] and recorder.seqs("c") == [1]
    assert states(any_store) == {a2: "paused", a3: "ready", b1: "paused"}
    parked = any_store.console_message(a2)
    assert parked is not None and parked.pause_id == pause["id"]
    assert a1 not in states(any_store)

    lifted = pauses.lift_pause(any_store, OPERATOR, pause["id"])
    assert lifted["resumed"] == 2 and any_store.pauses_list() == []
    make_poller(any_store, recorder).run_once()
    assert recorder.seqs("a") == [1, 2, 3] and recorder.seqs("b") == [1]
    assert rows(any_store) == []


def test_a_paused_hint_holds_back_messages_inserted_after_the_pause_until_lifted(any_store: Store) -> None:
    pause = pauses.add_pause(any_store, OPERATOR, "hint", "a", "")
    for seq in (1, 2, 3):
        send(any_store, "a", seq)
    send(any_store, "b", 1)
    recorder = Recorder()
    make_poller(any_store, recorder).run_once()
    assert recorder.seqs("a") == [] and recorder.seqs("b") == [1]
    assert set(states(any_store).values()) == {MessageState.READY.value}  # rows untouched: the hint is left out

    pauses.lift_pause(any_store, OPERATOR, pause["id"])
    make_poller(any_store, recorder).run_once()
    assert recorder.seqs("a") == [1, 2, 3]


def test_a_pause_of_everything_holds_every_hint_until_lifted(any_store: Store) -> None:
    pauses.add_pause(any_store, OPERATOR, "all", "", "maintenance")
    send(any_store, "a", 1)
    send(any_store, "b", 1)
    recorder = Recorder()
    make_poller(any_store, recorder).run_once()
    assert recorder.calls == []

    pauses.lift_pause_of(any_store, OPERATOR, "all", "")
    make_poller(any_store, recorder).run_once()
    assert sorted(recorder.calls) == [("a", 1), ("b", 1)]


def test_a_second_pause_of_the_same_target_is_a_conflict_and_lifting_an_unknown_one_not_found(
    any_store: Store,
) -> None:
    first = pauses.add_pause(any_store, OPERATOR, "hint", "a", "")
    with pytest.raises(Conflict, match=f"pause {first['id']}"):
        pauses.add_pause(any_store, OPERATOR, "hint", "a", "again")
    with pytest.raises(NotFound):
        pauses.lift_pause(any_store, OPERATOR, first["id"] + 100)
    with pytest.raises(NotFound, match="no durable pause of name 'x'"):
        pauses.lift_pause_of(any_store, OPERATOR, "name", "x")
    with pytest.raises(Forbidden):
        pauses.add_pause(any_store, READER, "hint", "b", "")


def test_creating_and_lifting_a_pause_writes_audit_rows_with_the_token_name(any_store: Store) -> None:
    pause = pauses.add_pause(any_store, OPERATOR, "name", "n", "why")
    pauses.lift_pause(any_store, OPERATOR, pause["id"])
    entries, _ = any_store.audit_page(before=None, limit=10)
    assert [(e.action, e.actor, e.via, e.affected) for e in entries] == [
        ("pauses.remove", "operator", "api", 0),
        ("pauses.add", "operator", "api", 1),
    ]
    assert entries[1].target["target"] == "n" and entries[1].target["reason"] == "why"


def _listen(url: str) -> psycopg.Connection[tuple[object, ...]]:
    conninfo = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    connection = psycopg.connect(conninfo, autocommit=True)
    connection.execute("LISTEN correlation_message")
    return connection


def test_lifting_a_pause_wakes_the_replicas_holding_its_slots(store: Store, pg_url: str) -> None:
    send(store, "a", 1)
    hint_pause = pauses.add_pause(store, OPERATOR, "hint", "a", "")
    everything = pauses.add_pause(store, OPERATOR, "all", "", "")
    slot = store.console_message(rows(store)[0].id)
    assert slot is not None
    listener = _listen(pg_url)
    try:
        pauses.lift_pause(store, OPERATOR, hint_pause["id"])
        pauses.lift_pause(store, OPERATOR, everything["id"])
        payloads = [note.payload for note in listener.notifies(timeout=5, stop_after=2)]
    finally:
        listener.close()
    assert payloads == [str(slot.message.slot), "*"]
