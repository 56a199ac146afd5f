"""The delivery record, the deduplication window and the transactional correlator, against real PostgreSQL and
SQLite: what stays of a message that left the table, the two insert forms producers use refused inside the
retention and accepted after it, and a handler's writes committed with its outcome or not at all."""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from tests.conftest import stop_at_teardown
from tests.integration.test_engine import wait_until
from tests.integration.test_slot_leases import leaser
from worker.admin import messages as admin_messages
from worker.admin.auth import Caller
from worker.config import CleanupSettings, Settings
from worker.correlators import Router
from worker.correlators.python import TransactionalCorrelator
from worker.db.base import Fence
from worker.db.errors import StoreError
from worker.db.store import MessageFilter, NewMessage, Store
from worker.engine.cleanup import Cleanup
from worker.engine.engine import AllSlots, Engine
from worker.message import Message, MessageState
from worker.policy.outcomes import Retry

WEEK = timedelta(days=7)


def engine_for(store: Store, handler: Any) -> Engine:
    settings = Settings(poll={"interval": "PT1S"}, metrics={"enabled": False})
    engine = Engine(store, Router({"*": handler}), settings, AllSlots(store.slot_count))
    stop_at_teardown(lambda: engine.stop(grace=0))
    return engine


def send(store: Store, hint: str, message_id: str | None = None, **payload: Any) -> int:
    row_id = store.messages_insert(NewMessage(name="order.paid", hint=hint, payload=payload, message_id=message_id,
                                              headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}))
    assert row_id is not None
    return row_id


def plain_insert(store: Store, message_id: str) -> None:
    with store.engine.begin() as connection:
        connection.execute(
            text("INSERT INTO correlation_message (message_id, message_name, correlation_hint) VALUES (:m, 'x', 'h')"),
            {"m": message_id},
        )


def insert_or_nothing(store: Store, message_id: str) -> int:
    with store.engine.begin() as connection:
        return connection.execute(
            text(
                "INSERT INTO correlation_message (message_id, message_name, correlation_hint) VALUES (:m, 'x', 'h') "
                "ON CONFLICT (message_id) DO NOTHING"
            ),
            {"m": message_id},
        ).rowcount


def age_records(store: Store, by: timedelta) -> None:
    """Move every record's end back in time (as if the retention had passed)."""
    records = store.messages_list(MessageFilter(state=MessageState.DELIVERED), limit=1000)
    with store.engine.begin() as connection:
        for record in records:
            assert record.delivery is not None
            connection.execute(
                text("UPDATE correlation_message SET finished_at = :at WHERE id = :id"),
                {"at": record.delivery.finished_at - by if store.dialect == "postgresql"
                 else (record.delivery.finished_at - by).strftime("%Y-%m-%d %H:%M:%S.%f"), "id": record.id},
            )


def test_any_answer_a_handler_returns_is_recorded_and_the_message_delivered(any_store: Store) -> None:
    """A large answer, NaN, NUL characters, a lone surrogate: each message is delivered with a document its
    database's JSON column takes, never made dead because its answer could not be written."""
    any_store.keep_delivery_records(WEEK, "replica-a")
    answers: dict[str, object] = {
        "large": {"items": [{"sku": n, "name": "widget"} for n in range(1000)]},
        "nan": {"ratio": float("nan")},
        "nul": {"note": "a\x00b"},
        "surrogate": {"note": "\udc80"},
    }
    ids = {hint: send(any_store, hint) for hint in answers}
    assert engine_for(any_store, lambda message: answers[message.hint]).run_once().correlated == len(answers)
    results = {}
    for hint, row_id in ids.items():
        record = any_store.messages_get(row_id)
        assert record is not None and record.state is MessageState.DELIVERED and record.delivery is not None
        results[hint] = record.delivery.result
    assert results["large"]["truncated"] is True and results["large"]["characters"] > 2000
    assert "ValueError" in results["nan"]["unreadable"]
    assert results["nul"] == {"note": "a\ufffdb"} and results["surrogate"] == {"note": "?"}


def test_a_correlated_message_stays_as_its_record_with_the_targets_answer(any_store: Store) -> None:
    any_store.keep_delivery_records(WEEK, "replica-a")
    answered = send(any_store, "order-1", "shop-1-paid", amount=12)
    silent = send(any_store, "order-2")
    waiting = send(any_store, "order-3", fail=True)

    def handler(message: Message) -> object:
        if message.payload.get("fail"):
            raise RuntimeError("not yet")
        return {"processInstanceKey": "2251799813685249"} if message.hint == "order-1" else None

    assert engine_for(any_store, handler).run_once().correlated == 2
    record = any_store.messages_get_by_message_id("shop-1-paid")
    assert record is not None and record.id == answered and record.state is MessageState.DELIVERED
    assert record.delivery is not None and record.delivery.outcome == "correlated"
    assert record.delivery.result == {"processInstanceKey": "2251799813685249"}
    assert record.delivery.finished_by == "replica-a" and record.delivery.finished_at >= record.created_at
    assert (dict(record.payload), dict(record.headers)) == ({}, {})  # the payload is not kept
    other = any_store.messages_get(silent)
    assert other is not None and other.delivery is not None and other.delivery.result is None
    # Records are not messages: lists, the census and the engine see the live ones only.
    assert [m.id for m in any_store.messages_list(MessageFilter())] == [waiting]
    assert [m.id for m in any_store.messages_list(MessageFilter(state=MessageState.DELIVERED))] == [answered, silent]
    counts = any_store.messages_count_by_state()
    assert (counts.ready, counts.waiting, counts.paused, counts.dead) == (0, 1, 0, 0)
    assert ("order.paid", "waiting") in any_store.messages_count_by_name_and_state()
    assert len(any_store.messages_count_by_name_and_state()) == 1


def test_a_delivered_message_id_is_refused_by_both_insert_forms_until_the_retention_ends(any_store: Store) -> None:
    any_store.keep_delivery_records(WEEK, "replica-a")
    calls: list[int] = []
    send(any_store, "order-1", "shop-1-paid")
    engine = engine_for(any_store, lambda message: calls.append(message.id))
    assert engine.run_once().correlated == 1
    with pytest.raises(IntegrityError, match="message_id"):
        plain_insert(any_store, "shop-1-paid")
    assert insert_or_nothing(any_store, "shop-1-paid") == 0
    assert any_store.messages_insert(NewMessage(name="x", hint="h", message_id="shop-1-paid")) is None
    assert engine.run_once().correlated == 0 and len(calls) == 1

    cleanup = Cleanup(any_store, CleanupSettings(), retention=WEEK)
    assert cleanup.run_once().records_removed == 0  # inside the window: kept
    age_records(any_store, WEEK + timedelta(minutes=1))
    result = cleanup.run_once()
    assert result.records_removed == 1 and any_store.messages_get_by_message_id("shop-1-paid") is None
    assert insert_or_nothing(any_store, "shop-1-paid") == 1  # new again
    assert engine.run_once().correlated == 1 and len(calls) == 2


def test_records_past_the_retention_are_removed_in_chunks(any_store: Store) -> None:
    any_store.keep_delivery_records(WEEK, "replica-a")
    for n in range(25):
        send(any_store, f"order-{n}", f"m-{n}")
    assert engine_for(any_store, lambda message: None).run_once().correlated == 25
    age_records(any_store, timedelta(days=8))
    result = Cleanup(any_store, CleanupSettings(chunk_size=10), retention=WEEK).run_once()
    assert (result.records_removed, result.chunks) == (25, 4)  # expired: one empty chunk; records: 10, 10, 5
    assert any_store.messages_list(MessageFilter(state=MessageState.DELIVERED)) == []


def test_with_a_retention_of_zero_a_correlated_message_leaves_nothing(any_store: Store) -> None:
    any_store.keep_delivery_records(timedelta(0), "replica-a")
    row = send(any_store, "order-1", "shop-1-paid")
    assert engine_for(any_store, lambda message: {"answer": 1}).run_once().correlated == 1
    assert any_store.messages_get(row) is None
    assert insert_or_nothing(any_store, "shop-1-paid") == 1


@pytest.mark.parametrize("records", [True, False])
def test_a_message_being_called_when_it_expires_is_left_to_its_call(any_store: Store, records: bool) -> None:
    """Its call's outcome decides: cleanup passes over a message whose call is marked, and expires it once the
    mark is gone (its call ended without recording it, say)."""
    if records:
        any_store.keep_delivery_records(WEEK, "replica-a")
    now = any_store.now()
    late = any_store.messages_insert(NewMessage(name="x", hint="h1", created_at=now - timedelta(hours=1),
                                                expires_at=now - timedelta(minutes=1)))
    assert late is not None
    with any_store.engine.begin() as connection:
        connection.execute(
            text("INSERT INTO correlation_call (message_id, slot, fence, holder, run_head, state) "
                 "VALUES (:id, 1, 1, 'replica-a', :id, 'called')"), {"id": late},
        )
    cleanup = Cleanup(any_store, CleanupSettings(), retention=WEEK if records else timedelta(0))
    assert cleanup.run_once().expired_removed == 0
    message = any_store.messages_get(late)
    assert message is not None and message.state is not MessageState.DELIVERED
    with any_store.engine.begin() as connection:
        connection.execute(text("DELETE FROM correlation_call WHERE message_id = :id"), {"id": late})
    assert cleanup.run_once().expired_removed == 1


def test_expired_and_deleted_messages_leave_records_saying_how(any_store: Store) -> None:
    any_store.keep_delivery_records(WEEK, "replica-a")
    now = any_store.now()
    expired = any_store.messages_insert(
        NewMessage(name="x", hint="h1", message_id="late", created_at=now - timedelta(hours=1),
                   expires_at=now - timedelta(minutes=1))
    )
    deleted = send(any_store, "h2", "removed")
    kept = send(any_store, "h3", "kept")
    assert expired is not None
    assert Cleanup(any_store, CleanupSettings(), retention=WEEK).run_once().expired_removed == 1
    caller = Caller("cli:ops", "cli", can_write=True)
    assert admin_messages.bulk(any_store, caller, "delete", MessageFilter(ids=(deleted,)), False)["affected"] == 1
    late, gone = any_store.messages_get(expired), any_store.messages_get(deleted)
    assert late is not None and late.delivery is not None and late.state is MessageState.DELIVERED
    assert (late.delivery.outcome, late.delivery.finished_by, late.expires_at) == ("expired", "replica-a", None)
    assert gone is not None and gone.delivery is not None
    assert (gone.delivery.outcome, gone.delivery.finished_by) == ("deleted", "cli:ops")
    # A delete of everything leaves the records alone; one of state delivered removes them.
    assert admin_messages.bulk(any_store, caller, "delete", MessageFilter(), True)["affected"] == 1
    assert [m.id for m in any_store.messages_list(MessageFilter(state=MessageState.DELIVERED))] == [
        expired, deleted, kept
    ]
    selection = MessageFilter(state=MessageState.DELIVERED)
    assert admin_messages.bulk(any_store, caller, "delete", selection, False)["affected"] == 3
    assert insert_or_nothing(any_store, "late") == 1 and insert_or_nothing(any_store, "removed") == 1


def test_producers_racing_a_message_id_while_it_is_delivered_never_get_it_called_twice(store: Store) -> None:
    store.keep_delivery_records(WEEK, "replica-a")
    calling, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def handler(message: Message) -> None:
        calls.append(message.id)
        calling.set()
        release.wait(10)

    send(store, "order-1", "shop-1-paid")
    engine = engine_for(store, handler)
    runner = threading.Thread(target=engine.run_once)
    runner.start()
    assert calling.wait(10)
    inserted = [insert_or_nothing(store, "shop-1-paid") for _ in range(3)]  # during the call
    release.set()
    runner.join(10)
    inserted += [insert_or_nothing(store, "shop-1-paid") for _ in range(3)]  # after it
    with pytest.raises(IntegrityError, match="message_id"):
        plain_insert(store, "shop-1-paid")
    assert inserted == [0] * 6
    assert engine.run_once().correlated == 0 and len(calls) == 1


# -- the transactional correlator -------------------------------------------------------------------------------


def effects_table(store: Store) -> None:
    with store.engine.begin() as connection:
        connection.execute(text("CREATE TABLE shop_effect (message bigint NOT NULL, note text)"))


def effects(store: Store) -> list[tuple[int, str]]:
    with store.engine.begin() as connection:
        rows = connection.execute(text("SELECT message, note FROM shop_effect ORDER BY message")).all()
    return [(int(row[0]), str(row[1])) for row in rows]


def test_a_transactional_handler_commits_its_writes_with_its_outcome_or_not_at_all(any_store: Store) -> None:
    any_store.keep_delivery_records(WEEK, "replica-a")
    effects_table(any_store)

    def on_paid(message: Message, connection: Connection) -> object:
        connection.execute(
            text("INSERT INTO shop_effect (message, note) VALUES (:m, :n)"), {"m": message.id, "n": message.hint}
        )
        if message.payload.get("raise"):
            raise RuntimeError("the projection refused it")
        if message.payload.get("retry"):
            return Retry("not now")
        return {"written": message.hint}

    good = send(any_store, "good")
    raised = send(any_store, "raised", **{"raise": True})
    retried = send(any_store, "retried", retry=True)
    engine = engine_for(any_store, TransactionalCorrelator(on_paid, "shop:on_paid"))
    result = engine.run_once()
    assert result.correlated == 1
    assert effects(any_store) == [(good, "good")]  # the failed calls' writes were rolled back with them
    record = any_store.messages_get(good)
    assert record is not None and record.delivery is not None and record.delivery.result == {"written": "good"}
    for row_id, error in ((raised, "the projection refused it"), (retried, "not now")):
        message = any_store.messages_get(row_id)
        assert message is not None and message.state is MessageState.READY and message.attempt == 1
        assert error in (message.last_error or "")


def test_transactional_calls_under_a_lease_keep_nothing_in_memory_once_settled(store: Store) -> None:
    """Each call marked under a term is the replica's to settle until its outcome is written: one written by the
    call's own transaction (or found gone there) is settled too, not kept for the replica's life."""
    effects_table(store)
    holder = leaser(store, "a")
    holder.run_once()

    def on_paid(message: Message, connection: Connection) -> object:
        connection.execute(text("INSERT INTO shop_effect (message, note) VALUES (:m, 'x')"), {"m": message.id})
        return None

    settings = Settings(poll={"interval": "PT1S"}, metrics={"enabled": False})
    engine = Engine(store, Router({"*": TransactionalCorrelator(on_paid, "shop:on_paid")}), settings, holder,
                    holder=holder.holder)
    stop_at_teardown(lambda: engine.stop(grace=0))
    sent = [send(store, f"order-{n % 7}") for n in range(40)]
    while engine.run_once().correlated:
        pass
    assert [message for message, _ in effects(store)] == sent
    assert not list(engine.committer.in_flight())  # settled, every one


def test_a_transactional_call_whose_term_ended_writes_nothing_and_is_not_called(store: Store) -> None:
    effects_table(store)
    row = send(store, "order-1")
    called: list[int] = []

    def outcome(connection: Connection) -> Any:
        called.append(row)
        return None

    fence = Fence("slot:1", "replica-a", 7)  # no call of the message is marked under this term
    assert store.calls_transact(1, fence, outcome, row) == "fenced"
    assert called == [] and effects(store) == []
    message = store.messages_get(row)
    assert message is not None and message.state is MessageState.READY and message.attempt == 0


def test_ending_a_transactional_call_past_its_timeout_ends_that_transaction_never_a_later_one(store: Store) -> None:
    """The session of a call given up on is ended only while it is in that call's transaction: once the call is
    over its connection goes back to the pool, and ending "its" backend then would end another statement."""
    row = send(store, "order-1")
    sessions: list[Any] = []
    inside, release = threading.Event(), threading.Event()

    def slow(connection: Connection) -> Any:
        inside.set()
        release.wait(10)
        return None

    ended: list[str] = []
    call = threading.Thread(target=lambda: ended.append(
        _status_of(lambda: store.calls_transact(1, None, slow, row, session=sessions.append))
    ))
    call.start()
    assert inside.wait(10)
    assert store.session_end(sessions[0]) is True  # in the call: its transaction is rolled back
    release.set()
    call.join(10)
    assert ended == ["failed"] and sessions[-1] is None

    sessions.clear()
    assert store.calls_transact(1, None, lambda connection: None, row, session=sessions.append) == "failed"
    over = sessions[0]  # the call is over: its connection is back in the pool, in use by whoever takes it next
    with contextlib.ExitStack() as held:
        for _ in range(20):  # take the pool's connections until the call's backend is the one in use
            connection = held.enter_context(store.engine.connect())
            if connection.execute(text("SELECT pg_backend_pid()")).scalar_one() == over.pid:
                break
        else:
            pytest.fail("the call's connection did not come back to the pool")
        assert store.session_end(over) is False
        assert connection.execute(text("SELECT 1")).scalar_one() == 1  # the later transaction is not ended


def _status_of(call: Any) -> str:
    try:
        return str(call())
    except StoreError:
        return "failed"


def test_a_python_route_can_be_transactional_and_is_checked_at_startup(tmp_path: Any, monkeypatch: Any) -> None:
    from worker.config import ConfigError

    (tmp_path / "shop_handlers.py").write_text(
        "def on_paid(message, connection):\n    return None\n\ndef on_sent(message):\n    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    router = Router.from_settings(
        {"order.paid": {"type": "python", "target": "shop_handlers:on_paid", "transactional": True}}
    )
    assert isinstance(router.route("order.paid"), TransactionalCorrelator)
    with pytest.raises(ConfigError, match="two arguments"):
        Router.from_settings({"a": {"type": "python", "handler": "shop_handlers:on_sent", "transactional": True}})
    with pytest.raises(ConfigError, match="true or false"):
        Router.from_settings({"a": {"type": "python", "handler": "shop_handlers:on_paid", "transactional": "yes"}})


def test_a_transactional_call_past_its_timeout_has_its_session_ended_and_its_writes_rolled_back(store: Store) -> None:
    store.keep_delivery_records(WEEK, "replica-a")
    effects_table(store)
    returned = threading.Event()

    def slow(message: Message, connection: Connection) -> None:
        connection.execute(text("INSERT INTO shop_effect (message, note) VALUES (:m, 'slow')"), {"m": message.id})
        try:
            connection.execute(text("SELECT pg_sleep(5)"))  # ended from outside once past the timeout
        finally:
            returned.set()

    row = send(store, "order-1")
    settings = Settings(poll={"interval": "PT1S"}, policy={"handler_timeout": "PT0.5S", "backoff_unit": "PT1H"},
                        metrics={"enabled": False})
    engine = Engine(store, Router({"*": TransactionalCorrelator(slow, "shop:slow")}), settings,
                    AllSlots(store.slot_count))
    stop_at_teardown(lambda: engine.stop(grace=0))
    engine.start()
    assert returned.wait(4), "the call's statement was not ended: its session still runs"

    def recorded() -> Message | None:
        message = store.messages_get(row)
        return message if message is not None and message.attempt == 1 else None

    wait_until(recorded, "the timeout recorded")
    message = recorded()
    assert message is not None and message.state is MessageState.READY, "the timeout was not recorded"
    assert "did not return within" in (message.last_error or "")
    assert effects(store) == []  # the write of the call given up on never committed


@pytest.mark.parametrize("how", ["commit", "rollback", "close", "driver COMMIT"])
def test_a_transactional_handler_that_ends_the_transaction_is_dead_with_the_reason_and_never_called_again(
    any_store: Store, how: str
) -> None:
    """Its writes may have committed apart from the outcome: calling it again would repeat them. The message is
    dead, saying what the handler did, and its neighbours carry on."""
    effects_table(any_store)
    calls: list[int] = []

    def on_paid(message: Message, connection: Connection) -> object:
        calls.append(message.id)
        connection.execute(text("INSERT INTO shop_effect (message, note) VALUES (:m, 'x')"), {"m": message.id})
        if message.payload.get("misuse"):
            if how == "driver COMMIT":
                connection.exec_driver_sql("COMMIT")
            else:
                getattr(connection, how)()
        return None

    bad = send(any_store, "order-1", misuse=True)
    good = send(any_store, "order-2")
    engine = engine_for(any_store, TransactionalCorrelator(on_paid, "shop:on_paid"))
    for _ in range(3):
        engine.run_once()
    message = any_store.messages_get(bad)
    assert message is not None and message.state is MessageState.DEAD, message
    assert "ended the worker's transaction" in (message.last_error or "")
    assert calls.count(bad) == 1 and calls.count(good) == 1  # never again, and the neighbour delivered
    record = any_store.messages_get(good)
    assert record is not None and record.delivery is not None
    assert [row for row, _ in effects(any_store)].count(good) == 1


def test_a_transactional_handler_may_use_savepoints(any_store: Store) -> None:
    effects_table(any_store)

    def on_paid(message: Message, connection: Connection) -> object:
        with connection.begin_nested():
            connection.execute(text("INSERT INTO shop_effect (message, note) VALUES (:m, 'x')"), {"m": message.id})
        return None

    row = send(any_store, "order-1")
    assert engine_for(any_store, TransactionalCorrelator(on_paid, "shop:on_paid")).run_once().correlated == 1
    assert effects(any_store) == [(row, "x")]


def test_a_transactional_message_whose_row_another_session_holds_waits_without_spinning(store: Store) -> None:
    """The call finds the row locked (an operator's open transaction, say): the hint rests a second between
    tries instead of being fetched, marked and unmarked again at once, and goes once the row is free."""
    effects_table(store)
    row = send(store, "order-1")
    tries: list[int] = []
    transact = store.calls_transact

    def counted(*args: Any, **kwargs: Any) -> str:
        tries.append(1)
        return transact(*args, **kwargs)

    store.calls_transact = counted  # type: ignore[method-assign]

    def on_paid(message: Message, connection: Connection) -> object:
        connection.execute(text("INSERT INTO shop_effect (message, note) VALUES (:m, 'x')"), {"m": message.id})
        return None

    holder = store.engine.connect()
    holder.execute(text("SELECT 1 FROM correlation_message WHERE id = :id FOR UPDATE"), {"id": row})
    engine = engine_for(store, TransactionalCorrelator(on_paid, "shop:on_paid"))
    engine.start()
    wait_until(lambda: len(tries) >= 1, "the first try")
    time.sleep(2.0)  # the row stays held for two seconds: a try a second at most meanwhile
    assert len(tries) <= 4, f"{len(tries)} tries in 2 s"
    holder.rollback()
    holder.close()
    wait_until(lambda: effects(store) == [(row, "x")], "delivered once the row is free")


def test_a_transactional_delivery_is_stamped_when_it_ended_not_when_its_transaction_began(store: Store) -> None:
    store.keep_delivery_records(WEEK, "replica-a")
    ended: list[Any] = []

    def on_paid(message: Message, connection: Connection) -> object:
        time.sleep(0.5)
        ended.append(connection.execute(text("SELECT clock_timestamp()")).scalar_one())
        return None

    row = send(store, "order-1")
    assert engine_for(store, TransactionalCorrelator(on_paid, "shop:on_paid")).run_once().correlated == 1
    record = store.messages_get(row)
    assert record is not None and record.delivery is not None
    assert record.delivery.finished_at >= ended[0]  # not the transaction's start, half a second before


def test_a_transactional_call_whose_term_ends_during_it_is_taken_back_by_the_same_replica(store: Store) -> None:
    """The term ends while the handler runs (a clock step, an operator ending the lease): nothing commits, and when
    this replica takes the slot again it counts its own call of the ended term and delivers the message."""
    effects_table(store)
    holder = leaser(store, "a")
    holder.run_once()
    row = send(store, "order-1")
    slot = store.messages_get(row).slot  # type: ignore[union-attr]
    ended = []

    def on_paid(message: Message, connection: Connection) -> object:
        connection.execute(text("INSERT INTO shop_effect (message, note) VALUES (:m, 'x')"), {"m": message.id})
        if not ended:  # the first call: its term ends meanwhile (from another session)
            with store.engine.begin() as other:
                other.execute(text("UPDATE correlation_lock SET lock_until = now() - interval '1 second' "
                                   "WHERE name = :name"), {"name": f"slot:{slot}"})
            ended.append(message.id)
        return None

    settings = Settings(poll={"interval": "PT1S"}, metrics={"enabled": False})
    engine = Engine(store, Router({"*": TransactionalCorrelator(on_paid, "shop:on_paid")}), settings, holder,
                    holder=holder.holder)
    stop_at_teardown(lambda: engine.stop(grace=0))
    engine.run_once()
    assert ended == [row] and effects(store) == []  # rolled back
    assert row not in engine.committer.in_flight()  # not kept as its own: the next term counts it
    for _ in range(5):
        holder.run_once()  # the slot again, under a new term
        engine.run_once()
        if effects(store):
            break
    assert effects(store) == [(row, "x")]
    message = store.messages_get(row)
    assert message is not None and message.state is MessageState.DELIVERED


def test_a_transactional_call_whose_database_session_is_lost_is_not_charged_and_goes_again(store: Store) -> None:
    """A server restart, a failover or an operator ending sessions in the middle of the call: its transaction is
    rolled back, which says nothing of the message; it is called again, no attempt charged."""
    effects_table(store)
    lost: list[int] = []

    def on_paid(message: Message, connection: Connection) -> object:
        connection.execute(text("INSERT INTO shop_effect (message, note) VALUES (:m, 'x')"), {"m": message.id})
        if not lost:
            lost.append(message.id)
            connection.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))  # its session ends
        return None

    row = send(store, "order-1")
    engine = engine_for(store, TransactionalCorrelator(on_paid, "shop:on_paid"))
    engine.run_once()
    message = store.messages_get(row)
    assert lost == [row] and message is not None and message.attempt == 0 and message.last_error is None
    wait_until(lambda: engine.run_once().correlated == 1 or effects(store) == [(row, "x")], "called again")
    assert effects(store) == [(row, "x")]
    message = store.messages_get(row)
    assert message is not None and message.state is MessageState.DELIVERED


def test_a_transactional_handler_that_returns_past_its_timeout_is_rolled_back_as_a_timeout(any_store: Store) -> None:
    """On SQLite nothing can end the call's session from outside: a handler that returns after its timeout must
    not commit a delivery the watchdog has given up on; it is a timeout, its writes rolled back."""
    effects_table(any_store)

    def on_paid(message: Message, connection: Connection) -> object:
        connection.execute(text("INSERT INTO shop_effect (message, note) VALUES (:m, 'x')"), {"m": message.id})
        time.sleep(1.3)
        return None

    row = send(any_store, "order-1")
    settings = Settings(poll={"interval": "PT1S"}, policy={"handler_timeout": "PT1S"}, metrics={"enabled": False})
    engine = Engine(any_store, Router({"*": TransactionalCorrelator(on_paid, "shop:on_paid")}), settings,
                    AllSlots(any_store.slot_count))
    stop_at_teardown(lambda: engine.stop(grace=0))
    engine.run_once()

    def charged() -> bool:  # (on PostgreSQL the watchdog ends the session and records it, on a thread of its own)
        message = any_store.messages_get(row)
        return message is not None and message.attempt == 1

    wait_until(charged, "the timeout recorded")
    message = any_store.messages_get(row)
    assert message is not None and message.state is MessageState.READY, message
    assert "did not return within" in (message.last_error or "")
    assert effects(any_store) == []


def test_a_message_hint_cannot_change_while_it_is_being_called(any_store: Store) -> None:
    """The hint decides the slot and the replica: moved during its call, the message would be called by one
    replica while another calls the new hint's messages. Refused while its call is marked; free after."""
    row = send(any_store, "order-1")
    with any_store.engine.begin() as connection:
        connection.execute(
            text("INSERT INTO correlation_call (message_id, slot, fence, holder, run_head, state) "
                 "VALUES (:id, 1, 1, 'replica-a', :id, 'called')"), {"id": row},
        )
    with pytest.raises(Exception, match="correlation_message_hint_kept"), any_store.engine.begin() as connection:
        connection.execute(text("UPDATE correlation_message SET correlation_hint = 'order-2' WHERE id = :id"),
                           {"id": row})
    with any_store.engine.begin() as connection:  # other columns may change; the hint set to itself too
        connection.execute(text("UPDATE correlation_message SET correlation_hint = 'order-1', payload = '{}' "
                                "WHERE id = :id"), {"id": row})
        connection.execute(text("DELETE FROM correlation_call WHERE message_id = :id"), {"id": row})
    with any_store.engine.begin() as connection:
        connection.execute(text("UPDATE correlation_message SET correlation_hint = 'order-2' WHERE id = :id"),
                           {"id": row})
    message = any_store.messages_get(row)
    assert message is not None and message.hint == "order-2"
