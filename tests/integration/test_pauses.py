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


def test_adding_and_lifting_a_pause_notifies_every_replica(store: Store, pg_url: str) -> None:
    send(store, "a", 1)
    listener = _listen(pg_url)
    try:
        hint_pause = pauses.add_pause(store, OPERATOR, "hint", "a", "")
        pauses.lift_pause(store, OPERATOR, hint_pause["id"])
        payloads = [note.payload for note in listener.notifies(timeout=5, stop_after=2)]
    finally:
        listener.close()
    assert payloads == ["pauses", "pauses"]


def test_a_lifted_pause_frees_its_hint_at_once_on_a_replica_that_just_read_the_pauses(store: Store) -> None:
    """Long before the poll, and though the engine read the pauses (with the pause) a moment before."""
    import threading
    import time

    from tests.integration.test_engine import Calls, engine, settings, wait_until
    from worker.db.listener import Listener

    held = send(store, "a", 1)
    pause = pauses.add_pause(store, OPERATOR, "hint", "a", "")
    settings_ = settings(poll={"interval": "PT60S"})
    calls = Calls()
    run = engine(store, calls, settings_)
    url = store.engine.url.render_as_string(hide_password=False)
    listener = Listener(settings_.database.model_copy(update={"url": url}), settings_.notify, run.wake, run.metrics)
    thread = threading.Thread(target=listener.run, daemon=True)
    thread.start()
    try:
        run.start()
        wait_until(lambda: run.metrics.listener_up._value.get() == 1, "the listener connected")
        other = send(store, "b", 1)  # a fetch of its slot reads the pauses: they are fresh in the engine's cache
        wait_until(lambda: other in calls.ids(), "another hint called")
        time.sleep(0.2)  # an absence: the paused hint is not called
        assert held not in calls.ids()
        pauses.lift_pause(store, OPERATOR, pause["id"])
        wait_until(lambda: held in calls.ids(), "the paused hint called once its pause was lifted", timeout=5)
    finally:
        listener.stop()
        thread.join(timeout=5)
