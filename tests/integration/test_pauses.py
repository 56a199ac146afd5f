"""Durable pauses (DESIGN.md §3) with the engine in-process: a paused name, hint or everything holds back also
the messages inserted after the pause, keeps its hints' order, and lifting it resumes them in order."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from sqlalchemy import Connection, event, text
from sqlalchemy.engine import make_url

from tests.integration.test_engine_once import Recorder, make_poller, rows, send
from worker.admin import pauses
from worker.admin.auth import Caller
from worker.admin.console import console_database
from worker.admin.errors import Conflict, Forbidden, NotFound
from worker.config import DatabaseSettings, Settings
from worker.db.console import Chunk
from worker.db.store import DatabaseBusy, MessageFilter, Store, build_engine
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


# -- lifting in chunks ------------------------------------------------------------------------------------------


def park_many(store: Store, pause_id: int, name: str, count: int) -> None:
    """``count`` messages of ``name``, one per hint, parked by the pause as the engine parks them."""
    with store.engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO correlation_message (message_name, correlation_hint, state, pause_id) "
                "SELECT :name, 'h-' || n, 'paused', :pause_id FROM generate_series(1, :count) AS n"
            ),
            {"name": name, "pause_id": pause_id, "count": count},
        )


def count_in_state(store: Store, state: str) -> int:
    with store.engine.connect() as connection:
        statement = text("SELECT count(*) FROM correlation_message WHERE state = :state")
        return int(connection.execute(statement, {"state": state}).scalar_one())


def test_a_pause_that_parked_200_000_messages_is_lifted_in_chunks_under_the_consoles_statement_timeout(
    store: Store, pg_url: str
) -> None:
    settings = Settings(database={"url": pg_url}, admin={"statement_timeout": "PT0.5S"}, metrics={"enabled": False})
    console_store = Store.from_settings(console_database(settings))  # the store the API and the pages act on
    try:
        with console_store.engine.connect() as connection:
            assert connection.exec_driver_sql("SHOW statement_timeout").scalar_one() == "500ms"
        pause = pauses.add_pause(console_store, OPERATOR, "name", "order.paid", "engine upgrade")
        park_many(store, pause["id"], "order.paid", 200_000)
        with pytest.raises(DatabaseBusy):  # one statement for them all is cancelled (and rolled back)
            console_store.messages_resume(MessageFilter(name="order.paid", state=MessageState.PAUSED))

        # A tenth of the default timeout (5 s) and a quarter of the default chunk (1 000): a chunk stays well under
        # the timeout on a loaded machine (a chunk of 1 000 took over 0.5 s with four test processes on two cores).
        lifted = pauses.lift_pause(console_store, OPERATOR, pause["id"], chunk=250)

        assert lifted["resumed"] == 200_000
        assert count_in_state(store, "paused") == 0 and count_in_state(store, "ready") == 200_000
        assert console_store.pauses_list() == []
        entry = console_store.audit_page(before=None, limit=1)[0][0]
        assert (entry.action, entry.affected, entry.error) == ("pauses.remove", 200_000, None)
    finally:
        console_store.close()


class CutOff(Store):
    """A store whose connection is lost after ``chunks`` chunks of a lift."""

    def __init__(self, store: Store, chunks: int) -> None:
        super().__init__(store.engine)
        self.chunks = chunks

    def pauses_unpark_chunk(self, pause_id: int, name: str, *, after: int, chunk: int) -> Chunk:
        if self.chunks == 0:
            raise DatabaseBusy("canceling statement due to statement timeout")
        self.chunks -= 1
        return super().pauses_unpark_chunk(pause_id, name, after=after, chunk=chunk)


def parked(store: Store, pause_id: int, count: int, hint_prefix: str = "h") -> list[int]:
    """``count`` messages of order.paid, each heading its hint, parked by the pause with the engine's statement."""
    ids = [send(store, f"{hint_prefix}-{n}", 1) for n in range(count)]
    assert all(store.message_park(row_id, pause_id) for row_id in ids)
    return ids


def test_a_lift_cut_off_half_way_keeps_the_pause_and_running_it_again_finishes_it(any_store: Store) -> None:
    pause = pauses.add_pause(any_store, OPERATOR, "name", "order.paid", "")
    ids = parked(any_store, pause["id"], 5)

    with pytest.raises(DatabaseBusy):
        pauses.lift_pause(CutOff(any_store, chunks=1), OPERATOR, pause["id"], chunk=2)
    assert [p.id for p in any_store.pauses_list()] == [pause["id"]]
    assert states(any_store) == {**dict.fromkeys(ids[:2], "ready"), **dict.fromkeys(ids[2:], "paused")}
    failed = any_store.audit_page(before=None, limit=1)[0][0]
    assert (failed.action, failed.affected) == ("pauses.remove", 2) and "statement timeout" in (failed.error or "")

    again = pauses.lift_pause(any_store, OPERATOR, pause["id"], chunk=2)
    assert again["resumed"] == 3
    assert states(any_store) == dict.fromkeys(ids, "ready") and any_store.pauses_list() == []


class ParksBehindTheChunks(Store):
    """A store on which the engine parks one more message, behind the lift's cursor, after its first chunk."""

    def __init__(self, store: Store, message_id: int) -> None:
        super().__init__(store.engine)
        self.message_id: int | None = message_id

    def pauses_unpark_chunk(self, pause_id: int, name: str, *, after: int, chunk: int) -> Chunk:
        done = super().pauses_unpark_chunk(pause_id, name, after=after, chunk=chunk)
        if self.message_id is not None:
            assert self.message_park(self.message_id, pause_id)
            self.message_id = None
        return done


def test_messages_the_engine_parks_while_a_pause_is_lifted_are_resumed_with_the_rest(any_store: Store) -> None:
    pause = pauses.add_pause(any_store, OPERATOR, "name", "order.paid", "")
    early = send(any_store, "early", 1)  # ready, with an id before every parked one
    ids = parked(any_store, pause["id"], 4)

    lifted = pauses.lift_pause(ParksBehindTheChunks(any_store, early), OPERATOR, pause["id"], chunk=2)

    assert lifted["resumed"] == 5
    assert states(any_store) == dict.fromkeys([early, *ids], "ready") and any_store.pauses_list() == []


def test_a_message_parked_while_its_pause_is_lifted_is_not_left_paused_by_a_pause_that_is_gone(
    store: Store, pg_url: str
) -> None:
    """The engine parks a message whose name it last read as paused, while an operator lifts that pause: the park
    runs after the lift's last sweep and before its commit. Read from a snapshot alone, the pause would still be
    there and the message parked by a pause that no longer exists, with nothing left to resume it."""
    pause = pauses.add_pause(store, OPERATOR, "name", "order.paid", "")
    message_id = send(store, "a", 1)
    engine_side = Store(build_engine(DatabaseSettings(url=pg_url)))
    parked_by_engine: list[bool] = []
    park = threading.Thread(target=lambda: parked_by_engine.append(engine_side.message_park(message_id, pause["id"])))

    def before_the_lift_commits(connection: Connection) -> None:
        driver = connection.connection.driver_connection
        assert driver is not None
        if park.ident is not None or driver.execute("SELECT 1 FROM correlation_pause").fetchone():
            return
        park.start()  # the lift has deleted its pause and swept what it parked, and is about to commit
        deadline = time.monotonic() + 10
        while park.is_alive() and not _blocked(pg_url) and time.monotonic() < deadline:
            time.sleep(0.01)

    event.listen(store.engine, "commit", before_the_lift_commits)
    try:
        lifted = pauses.lift_pause(store, OPERATOR, pause["id"])
        park.join(10)
    finally:
        event.remove(store.engine, "commit", before_the_lift_commits)
        engine_side.close()
    assert lifted["resumed"] == 0 and parked_by_engine == [False]
    assert states(store) == {message_id: "ready"}


def _blocked(pg_url: str) -> bool:
    """Whether a session of this database waits for another's lock."""
    with psycopg.connect(make_url(pg_url).set(drivername="postgresql").render_as_string(False)) as connection:
        row = connection.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND cardinality(pg_blocking_pids(pid)) > 0"
        ).fetchone()
    return bool(row and row[0])


def test_lifting_resumes_only_the_messages_its_pause_parked(any_store: Store) -> None:
    pause = pauses.add_pause(any_store, OPERATOR, "name", "order.paid", "")
    ids = parked(any_store, pause["id"], 3)
    by_hand = send(any_store, "other", 1)
    assert any_store.messages_pause(MessageFilter(ids=(by_hand,))) == 1  # an operator's pause of one message

    assert pauses.lift_pause(any_store, OPERATOR, pause["id"], chunk=2)["resumed"] == 3
    assert states(any_store) == {**dict.fromkeys(ids, "ready"), by_hand: "paused"}


class Deadlocked(Store):
    """A store whose bulk action loses a deadlock after ``chunks`` chunks."""

    def __init__(self, store: Store, chunks: int) -> None:
        super().__init__(store.engine)
        self.chunks = chunks

    def console_bulk_chunk(
        self, action: str, selection: MessageFilter, *, after: int, chunk: int, by: str = ""
    ) -> Chunk:
        if self.chunks == 0:
            raise DatabaseBusy("database busy (deadlock): deadlock detected")
        self.chunks -= 1
        return super().console_bulk_chunk(action, selection, after=after, chunk=chunk, by=by)


def test_a_bulk_action_stopped_part_way_says_what_it_did_and_why_it_stopped(any_store: Store) -> None:
    from worker.admin import messages
    from worker.admin.errors import Interrupted

    ids = [send(any_store, f"h-{n}", 1) for n in range(5)]
    with pytest.raises(Interrupted) as info:
        messages.bulk(Deadlocked(any_store, chunks=1), OPERATOR, "delete", MessageFilter(name="order.paid"), False,
                      chunk=2)
    said = str(info.value)
    assert "delete stopped after 2 message(s)" in said and "deadlock detected" in said and "timeout" not in said
    assert len(states(any_store)) == 3 and set(states(any_store)) <= set(ids)
    entry = any_store.audit_page(before=None, limit=1)[0][0]
    assert (entry.action, entry.affected) == ("messages.delete", 2) and "deadlock detected" in (entry.error or "")
