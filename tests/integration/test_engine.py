"""The engine's findings, in-process against real databases: each outcome recorded on its own, no replayed
pages, rows the worker cannot read, commit order, lanes that never wait for one another, expiry judged at the
call, one locked row delaying one hint, bounded threads, the lease checked before each call, wake-ups.

Most tests use ``Engine.run_once`` (one poll, driven to quiescence in the test's thread); those about time
and concurrency run the engine continuously (``Engine.start``) and wait on conditions with a deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from tests.conftest import stop_at_teardown
from worker.config import Settings
from worker.correlators import Router
from worker.db.base import Fence
from worker.db.errors import DatabaseUnavailable
from worker.db.store import MessageFilter, NewMessage, Store
from worker.engine.engine import AllSlots, Engine
from worker.message import Message, MessageState
from worker.policy.outcomes import Reschedule
from worker.service.metrics import Metrics

DEADLINE = 30.0


def wait_until(condition: Callable[[], object], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        time.sleep(0.01)


@dataclass
class Calls:
    """A correlator that records its calls (id, hint, when it started, when it ended) and runs a behaviour."""

    behave: Callable[[Message], object] = lambda message: None
    log: list[tuple[int, str, float, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    running: int = 0
    most: int = 0

    def __call__(self, message: Message) -> object:
        started = time.monotonic()
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            return self.behave(message)
        finally:
            with self.lock:
                self.running -= 1
                self.log.append((message.id, message.hint, started, time.monotonic()))

    def ids(self) -> list[int]:
        with self.lock:
            return [entry[0] for entry in self.log]

    def of(self, hint: str) -> list[int]:
        with self.lock:
            return [entry[0] for entry in self.log if entry[1] == hint]


def settings(**sections: Any) -> Settings:
    poll = {"interval": "PT1S", "initial_delay": "PT0S", **sections.pop("poll", {})}
    policy = {"backoff_unit": "PT60S", **sections.pop("policy", {})}
    return Settings(poll=poll, policy=policy, metrics={"enabled": False}, **sections)


def engine(store: Store, correlator: Callable[[Message], object], s: Settings | None = None,
           metrics: Metrics | None = None) -> Engine:
    made = Engine(store, Router({"*": correlator}), s or settings(), AllSlots(store.slot_count), metrics)
    stop_at_teardown(lambda: made.stop(grace=0))
    return made


def send(store: Store, hint: str, name: str = "order.paid", **payload: Any) -> int:
    row_id = store.messages_insert(NewMessage(name=name, hint=hint, payload=payload))
    assert row_id is not None
    return row_id


def rows(store: Store) -> dict[int, Message]:
    return {m.id: m for m in store.messages_list(MessageFilter(), limit=10_000)}


def sql(store: Store, statement: str, **params: Any) -> list[Any]:
    with store.engine.begin() as connection:
        result = connection.execute(text(statement), params)
        return list(result.all()) if result.returns_rows else []


# -- 1. every outcome is recorded, each on its own -------------------------------------------------------------


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def _bad_outcome(message: Message) -> object:
    kind = message.payload.get("kind")
    if kind == "int_delay":
        raise Reschedule("not yet", 30)  # type: ignore[arg-type]  # an int, as handlers write it
    if kind == "overflowing_delay":
        raise Reschedule("much later", timedelta(days=10**8))
    if kind == "unprintable":
        raise Unprintable()
    if kind == "surrogate":
        raise RuntimeError("bad text \udcff from a decoder")
    if kind == "nul":
        raise RuntimeError("a NUL \x00 inside")
    if kind == "string_delay":
        raise Reschedule("nonsense", "soon")  # type: ignore[arg-type]
    return None


@pytest.mark.parametrize(
    "kind", ["int_delay", "overflowing_delay", "unprintable", "surrogate", "nul", "string_delay"]
)
def test_an_outcome_the_database_could_not_take_is_recorded_for_its_message_alone(
    any_store: Store, kind: str
) -> None:
    calls = Calls(_bad_outcome)
    good = [send(any_store, f"good-{n}") for n in range(5)]
    bad = send(any_store, "bad", kind=kind)
    later = [send(any_store, f"good-{n}") for n in range(5)]
    run = engine(any_store, calls, settings(policy={"time_to_live": None}))
    run.run_once()
    run.run_once()  # nothing is called twice, nothing replayed
    assert sorted(calls.ids()) == sorted([*good, bad, *later])
    left = rows(any_store)
    assert set(left) == {bad}, "every good message is recorded, whatever the bad one's outcome"
    message = left[bad]
    if kind in ("int_delay", "overflowing_delay", "string_delay"):
        assert message.reschedule_count == 1 and message.attempt == 0
        assert message.next_attempt_at is not None and message.next_attempt_at > any_store.now()
    else:
        assert message.attempt == 1 and message.last_error  # a recorded failure with a readable reason
        assert "\x00" not in message.last_error


def test_a_failure_whose_record_the_database_refuses_is_dead_with_both_reasons(store: Store) -> None:
    with store.engine.begin() as connection:  # a rule of the shop's own that refuses this retry's row
        connection.execute(text("ALTER TABLE correlation_message ADD CONSTRAINT shop_rule "
                                "CHECK (state = 'dead' OR last_error IS NULL OR last_error NOT LIKE '%refuse-me%')"))
    calls = Calls(lambda message: (_ for _ in ()).throw(RuntimeError("engine said refuse-me")))
    row_id = send(store, "h")
    run = engine(store, calls, settings(policy={"time_to_live": None}))
    run.run_once()
    message = rows(store)[row_id]
    assert message.state.value == "dead", message
    assert message.last_error is not None
    assert message.last_error.startswith("the worker could not record the outcome of this message: ")
    kept = message.last_error.split("; the outcome was a failure: ", 1)
    assert len(kept) == 2 and "engine said refuse-me" in kept[1], message.last_error


def test_an_int_delay_means_seconds(any_store: Store) -> None:
    send(any_store, "h", kind="int_delay")
    before = any_store.now()
    engine(any_store, Calls(_bad_outcome)).run_once()
    (message,) = rows(any_store).values()
    assert message.next_attempt_at is not None
    assert timedelta(seconds=29) <= message.next_attempt_at - before <= timedelta(seconds=40)


# -- 2. a transient error at the write is retried, not replayed ------------------------------------------------


def test_outcomes_of_rows_another_session_holds_are_written_later_while_the_others_flow(store: Store) -> None:
    """A session holds one hint's row locked (FOR UPDATE): that outcome waits, other hints are recorded."""
    held = send(store, "locked-hint")
    free = [send(store, f"free-{n}") for n in range(10)]
    locker = psycopg.connect(store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False))
    try:
        locker.execute("SELECT 1 FROM correlation_message WHERE id = %s FOR UPDATE", (held,))
        metrics = Metrics()
        calls = Calls()
        run = engine(store, calls, metrics=metrics)
        run.start()
        wait_until(lambda: set(free).isdisjoint(rows(store)), "the free hints' outcomes written")
        assert held in calls.ids() and held in rows(store), "the held row's outcome waits for its lock"
        assert metrics.deferred_outcomes._value.get() >= 1
        locker.rollback()
        wait_until(lambda: held not in rows(store), "the held row's outcome written once the lock went")
        assert sorted(calls.ids()) == sorted([held, *free]), "nothing called twice"
    finally:
        locker.close()


def test_pauses_the_database_would_not_give_are_a_warning_line_and_the_loop_fetches_once_it_reads_them(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The fetch loop reads the durable pauses before it fetches; when the database cannot answer (its sessions
    terminated, a timeout), that is one warning line counted by kind, not a bug's traceback, and no slot is fetched
    until the pauses are read."""
    read_pauses = store.pauses_list
    failures = [DatabaseUnavailable("database unavailable: terminating connection due to administrator command")] * 2

    def pauses_list() -> list[Any]:
        if failures:
            raise failures.pop()
        return read_pauses()

    monkeypatch.setattr(store, "pauses_list", pauses_list)
    message = send(store, "h")
    calls = Calls()
    metrics = Metrics()
    run = engine(store, calls, settings(), metrics)
    with caplog.at_level(logging.WARNING, logger="worker.engine.engine"):
        run.start()
        wait_until(lambda: message in calls.ids(), "called once the pauses were read")
    assert failures == []
    lines = [r for r in caplog.records if r.name == "worker.engine.engine"]
    assert [r.levelno for r in lines] == [logging.WARNING] * 2 and not any(r.exc_info for r in lines), lines
    assert "reading the pauses failed" in lines[0].getMessage()
    assert metrics.database_errors.labels("unavailable")._value.get() == 2


def test_a_write_that_fails_is_retried_and_no_call_is_made_twice(store: Store) -> None:
    """The worker's connections are terminated over and over while it works: each message is called once."""
    ids = [send(store, f"h-{n % 40}") for n in range(400)]
    calls = Calls(lambda message: time.sleep(0.002))
    metrics = Metrics()
    run = engine(store, calls, settings(poll={"concurrency": 4, "page_size": 20}), metrics)
    run.start()
    database = store.engine.url.database
    url = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    killer = psycopg.connect(url, autocommit=True, application_name="test-killer")

    def left() -> set[int]:
        return {row[0] for row in killer.execute("SELECT id FROM correlation_message WHERE state <> 'delivered'")}

    try:
        disturbed_until = time.monotonic() + 3.0  # terminate the worker's sessions for a while, then let it finish
        while set(ids) & left() and time.monotonic() < disturbed_until:
            killer.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = %s AND application_name = 'correlation-worker' AND pid <> pg_backend_pid()",
                (database,),
            )
            time.sleep(0.05)
        wait_until(lambda: not set(ids) & left(), "every message correlated")
    finally:
        killer.close()
    assert sorted(calls.ids()) == sorted(ids), "every message called exactly once"
    assert metrics.database_errors.labels("unavailable")._value.get() > 0, "the test did disturb the worker"
    assert metrics.redeliveries._value.get() == 0


# -- 3. rows the worker cannot read are dead-lettered with a reason; their slot goes on ---------------------


def test_a_payload_the_worker_cannot_decode_is_dead_with_a_reason_and_its_slot_goes_on(store: Store) -> None:
    deep = "[" * 5000 + "]" * 5000  # valid JSON to the database, deeper than the worker's decoder allows
    sql(store, "INSERT INTO correlation_message (message_name, correlation_hint, payload) "
               "VALUES ('n', 'deep', CAST(:p AS jsonb))", p=deep)
    (unreadable,) = rows(store)
    same_slot = _hint_in_slot(store, rows(store)[unreadable].slot, "neighbour-")
    neighbour = send(store, same_slot)
    metrics = Metrics()
    calls = Calls()
    result = engine(store, calls, metrics=metrics).run_once()
    assert calls.ids() == [neighbour]
    dead = rows(store)[unreadable]
    assert dead.state is MessageState.DEAD and "cannot read this message" in (dead.last_error or "")
    assert result.unreadable == 1 and metrics.unreadable._value.get() == 1


@pytest.mark.parametrize(
    ("column", "value", "constraint"),
    [
        ("next_attempt_at", "'-infinity'", "correlation_message_next_attempt_at_readable"),
        ("next_attempt_at", "'infinity'", "correlation_message_next_attempt_at_readable"),
        ("next_attempt_at", "'0044-03-15 BC'", "correlation_message_next_attempt_at_readable"),
        ("created_at", "'0044-03-15 BC'", "correlation_message_created_at_after_year_1"),
        ("attempt", "2147483647", "correlation_message_attempt_at_most_a_billion"),
        ("reschedule_count", "2147483647", "correlation_message_reschedule_count_at_most_a_billion"),
        ("lost_calls", "2000000000", "correlation_message_lost_calls_in_range"),
        ("payload", "jsonb_build_object('blob', repeat('x', 1100000))", "correlation_message_payload_at_most_1_mib"),
    ],
)
def test_the_schema_refuses_worker_owned_values_the_worker_could_not_read_or_record(
    store: Store, column: str, value: str, constraint: str
) -> None:
    with pytest.raises(IntegrityError, match=constraint):
        sql(store, f"INSERT INTO correlation_message (message_name, correlation_hint, {column}) "
                   f"VALUES ('n', 'h', {value})")


# -- 5. commit order: a message waits while an earlier id of its hint may still commit ---------------------


def test_a_later_message_waits_for_an_earlier_one_whose_transaction_commits_after_it(store: Store) -> None:
    url = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    first = psycopg.connect(url)
    calls = Calls()
    try:
        first_id = first.execute(
            "INSERT INTO correlation_message (message_name, correlation_hint) VALUES ('n', 'h') RETURNING id"
        ).fetchone()[0]  # type: ignore[index]
        second_id = send(store, "h")  # committed first, with the larger id
        run = engine(store, calls, settings(order={"max_wait": "PT60S"}))
        run.run_once()
        assert second_id not in calls.ids(), "held back behind the open transaction"
        first.commit()
        run.run_once()
        assert calls.of("h") == [first_id, second_id]
    finally:
        first.close()


def test_a_producer_transaction_left_open_holds_others_back_for_at_most_the_bound(store: Store) -> None:
    url = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    slow = psycopg.connect(url)
    metrics = Metrics()
    calls = Calls()
    try:
        slow.execute("INSERT INTO correlation_message (message_name, correlation_hint) VALUES ('n', 'slow')")
        waiting = send(store, "unrelated")
        run = engine(store, calls, settings(order={"max_wait": "PT1S"}), metrics)
        started = time.monotonic()
        run.start()
        wait_until(lambda: waiting in calls.ids(), "the message correlated once the bound passed")
        assert time.monotonic() - started >= 0.9, "held back while the producer was open, up to the bound"
        assert metrics.order_wait_timeouts._value.get() == 1
    finally:
        slow.close()


def test_a_slot_held_back_without_progress_is_counted_as_stalled_until_it_moves(store: Store) -> None:
    url = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    producer = psycopg.connect(url)
    metrics = Metrics()
    calls = Calls()

    def sample(name: str) -> float:
        return metrics.registry.get_sample_value(name) or 0.0

    try:
        producer.execute("INSERT INTO correlation_message (message_name, correlation_hint) VALUES ('n', 'open')")
        waiting = send(store, "unrelated")
        run = engine(store, calls, settings(poll={"interval": "PT0.1S"}, order={"max_wait": "PT1M"}), metrics)
        run.stall_after = 0.5  # five polls (a drained slot makes progress at each)
        run.start()
        wait_until(lambda: sample("correlation_stalled_slots") == 1, "the held-back slot counted as stalled")
        assert sample("correlation_slot_progress_age_seconds") > 0.5 and waiting not in calls.ids()
    finally:
        producer.rollback()
        producer.close()
    wait_until(lambda: waiting in calls.ids(), "the message correlated once the producer ended")
    wait_until(lambda: sample("correlation_stalled_slots") == 0, "no slot stalled any more")
    assert sample("correlation_slot_progress_age_seconds") < 0.5


def test_a_transaction_that_inserts_no_message_holds_nothing_back(store: Store) -> None:
    url = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    unrelated = psycopg.connect(url)
    calls = Calls()
    try:
        unrelated.execute("CREATE TEMP TABLE busy (x int)")
        unrelated.execute("INSERT INTO busy VALUES (1)")  # a writing transaction, open, with an xid
        message = send(store, "h")
        engine(store, calls, settings(order={"max_wait": "PT60S"})).run_once()
        assert calls.ids() == [message]
    finally:
        unrelated.close()


def test_concurrent_producers_of_one_hint_are_correlated_in_id_order(store: Store) -> None:
    """Four producers insert into the same hints, each keeping its transaction open a random while: whatever
    order they commit in, every hint's messages are called in id order."""
    url = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    calls = Calls()
    run = engine(store, calls, settings(poll={"concurrency": 4}))
    run.start()
    stop = threading.Event()

    def produce(seed: int) -> None:
        import random

        rng = random.Random(seed)
        with psycopg.connect(url) as connection:
            while not stop.is_set():
                for _ in range(rng.randint(1, 3)):
                    connection.execute(
                        "INSERT INTO correlation_message (message_name, correlation_hint) VALUES ('n', %s)",
                        (f"h-{rng.randrange(4)}",),
                    )
                time.sleep(rng.random() * 0.02)
                connection.commit()

    producers = [threading.Thread(target=produce, args=(seed,)) for seed in range(4)]
    for producer in producers:
        producer.start()
    time.sleep(3.0)  # pacing only: the producers run for a while
    stop.set()
    for producer in producers:
        producer.join()
    wait_until(lambda: not rows(store), "everything correlated")
    for hint in (f"h-{n}" for n in range(4)):
        assert calls.of(hint) == sorted(calls.of(hint)), f"{hint} was correlated out of id order"
    assert len(calls.ids()) == len(set(calls.ids()))


# -- 6. lanes: a slow or hot hint never delays another -------------------------------------------------------


def test_a_slow_hint_and_a_hot_hint_never_delay_a_new_message_of_another_hint(store: Store) -> None:
    slow = [send(store, "slow", seconds=0.2) for _ in range(30)]
    slot = rows(store)[slow[0]].slot
    hot_hint = _hint_in_slot(store, slot, "hot-")  # the same slot as the slow hint
    sql(store, "INSERT INTO correlation_message (message_name, correlation_hint) "
               "SELECT 'n', :hint FROM generate_series(1, 20000)", hint=hot_hint)
    calls = Calls(lambda message: time.sleep(float(message.payload.get("seconds", 0))))
    run = engine(store, calls, settings(poll={"concurrency": 2}))
    run.start()
    wait_until(lambda: len(calls.of(hot_hint)) > 100 and calls.of("slow"), "both hints under way")
    newcomer = send(store, _hint_in_slot(store, slot, "new-"))
    wait_until(lambda: newcomer in calls.ids(), "the new message called")
    assert len(calls.of("slow")) < len(slow), "called while the slow hint still had work"
    assert len(calls.of(hot_hint)) < 20000, "called while the hot hint still had work"


def test_a_batch_ending_while_its_slot_is_fetched_has_the_next_batch_fetched_at_once(store: Store) -> None:
    """The fetch that found the hint busy must not postpone its next batch to the next poll."""
    ids = [send(store, "long") for _ in range(30)]
    fetch = store.messages_fetch_slot

    def slow_fetch(*args: Any, **kwargs: Any) -> Any:
        fetched = fetch(*args, **kwargs)
        time.sleep(0.05)  # the busy hint's batch ends meanwhile
        return fetched

    store.messages_fetch_slot = slow_fetch  # type: ignore[method-assign]
    calls = Calls()
    run = engine(store, calls, settings(poll={"interval": "PT30S", "page_size": 7}))
    run.start()
    wait_until(lambda: calls.ids() == ids, "every batch of the hint, long before the next poll", timeout=10)


def test_hints_fetched_while_the_replica_stops_leave_their_slot_free_to_release(store: Store) -> None:
    """A fetch under way when the stop begins hands its hints over after the lanes stopped taking work: they are
    let go at once, so that the slot is not kept (and its lease not held to its term) for calls never made."""
    send(store, "late")
    fetch = store.messages_fetch_slot
    fetched, stopping = threading.Event(), threading.Event()

    def fetch_then_wait(*args: Any, **kwargs: Any) -> Any:
        candidates, batches = fetch(*args, **kwargs)
        if batches.messages and not fetched.is_set():
            fetched.set()
            assert stopping.wait(DEADLINE)  # the lanes take no more work now
        return candidates, batches

    store.messages_fetch_slot = fetch_then_wait  # type: ignore[method-assign]
    calls = Calls()
    run = engine(store, calls)
    stop_taking_work = run.lanes.stop_taking_work

    def stop_taking_work_then_go_on() -> Any:
        dropped = stop_taking_work()
        stopping.set()
        return dropped

    run.lanes.stop_taking_work = stop_taking_work_then_go_on  # type: ignore[method-assign]
    run.start()
    assert fetched.wait(DEADLINE)
    stopper = threading.Thread(target=run.stop, args=(1.0,))
    stopper.start()
    stopper.join(DEADLINE)
    assert not stopper.is_alive()
    assert run.slots_in_use() == set()
    assert calls.ids() == [] and len(rows(store)) == 1


def test_concurrency_counts_calls_in_flight_across_slots(store: Store) -> None:
    for n in range(40):
        send(store, f"hint-{n}")
    calls = Calls(lambda message: time.sleep(0.05))
    run = engine(store, calls, settings(poll={"concurrency": 4}))
    run.start()
    wait_until(lambda: len(calls.ids()) == 40, "every hint called")
    assert calls.most == 4


# -- 7. expiry is judged at the moment of the call --------------------------------------------------------


def test_a_message_that_expires_while_waiting_behind_a_slow_call_of_its_hint_is_never_called(any_store: Store) -> None:
    now = any_store.now()
    slow = send(any_store, "h", seconds=1.0)
    expiring = any_store.messages_insert(
        NewMessage("n", "h", {}, created_at=now - timedelta(seconds=1), expires_at=now + timedelta(seconds=0.5))
    )
    after = send(any_store, "h")
    calls = Calls(lambda message: time.sleep(float(message.payload.get("seconds", 0))))
    engine(any_store, calls).run_once()
    assert calls.ids() == [slow, after]
    assert expiring in rows(any_store), "left for cleanup, never called"


# -- 9. batch size 1 reads what it takes -------------------------------------------------------------------


def test_batch_size_one_on_a_long_hint_reads_one_message_per_fetch(store: Store) -> None:
    from worker.config import Mode
    from worker.db.fetch import _batches_statement

    sql(store, "INSERT INTO correlation_message (message_name, correlation_hint) "
               "SELECT 'n', 'long' FROM generate_series(1, 50000)")
    sql(store, "ANALYZE correlation_message")
    statement = _batches_statement("postgresql", Mode.FAIL_FIRST).text
    with store.engine.connect() as connection:
        plan = connection.execute(
            text("EXPLAIN (ANALYZE, FORMAT JSON) " + statement),
            {"hints": ["long"], "horizon": 2**62, "per_hint": 1, "limit": 1, "page_bytes": 2**62},
        ).scalar_one()

    def walk(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield node
        for child in node.get("Plans", []):
            yield from walk(child)

    touched = sum(n.get("Actual Rows", 0) * n.get("Actual Loops", 1) + n.get("Rows Removed by Filter", 0)
                  for n in walk(plan[0]["Plan"]))
    assert touched < 20, f"one message of a 50 000-message hint touched {touched} rows"


# -- 14. threads stay bounded when calls hang --------------------------------------------------------------


def test_hung_calls_keep_the_threads_bounded_and_make_the_engine_unhealthy_when_they_hold_every_lane(
    store: Store,
) -> None:
    release = threading.Event()
    hung = [send(store, f"hung-{n}") for n in range(8)]
    started: list[int] = []
    calls = Calls(lambda message: (started.append(message.id), release.wait(30)))
    metrics = Metrics()
    run = engine(store, calls, settings(poll={"concurrency": 2}, policy={"handler_timeout": "PT0.3S"}), metrics)
    before = threading.active_count()
    try:
        run.start()
        wait_until(lambda: run.health() is not None, "every lane held by a stuck call")
        assert "stuck" in (run.health() or "")
        wait_until(lambda: len([m for m in rows(store).values() if m.attempt == 1]) == len(started),
                   "every stuck call recorded as a timeout")
        count = len(started)
        assert 2 <= count <= 2 * 2, "at most one replacement lane per lane"
        time.sleep(0.5)  # an absence: no call starts while every lane is stuck
        assert len(started) == count and run.lanes.waiting() > 0
        # engine threads: committer, marker, two fetchers, the watchdog, two lanes and two replacements at most
        assert threading.active_count() - before <= 7 + 2, "no thread per timed-out call"
        stuck = [m for m in rows(store).values() if m.attempt == 1]
        assert all("did not return" in (m.last_error or "") for m in stuck)
        timeouts = metrics.registry.get_sample_value(
            "correlation_handler_timeouts_total", {"message_name": "order.paid"}
        )
        assert timeouts == len(stuck), "each timeout counted once, under its message name"
    finally:
        release.set()
    wait_until(lambda: run.health() is None, "healthy again once the calls returned")
    assert set(started) <= set(hung)


def test_the_watchdog_looks_as_often_as_the_shortest_handler_timeout_needs_and_a_short_one_still_holds(
    store: Store,
) -> None:
    """A twentieth of the shortest handler timeout between two looks at running calls, from 50 ms to a second: at
    the default 30 s an idle replica's watchdog wakes once a second, not twenty times; a name whose timeout is
    shorter than the default's is still given up on at its own."""
    assert engine(store, Calls()).lanes._watch_tick == 1.0
    assert engine(store, Calls(), settings(policy={"handler_timeout": "PT0.3S"})).lanes._watch_tick == 0.05
    release = threading.Event()
    calls = Calls(lambda message: release.wait(30) if message.name == "slow" else None)
    run = engine(store, calls, settings(policies={"slow": {"handler_timeout": "PT1S"}}))
    assert run.lanes._watch_tick == 0.05
    slow = send(store, "slow-1", name="slow")
    try:
        run.start()
        wait_until(lambda: (rows(store)[slow].attempt == 1), "the slow call given up at its own timeout",
                   timeout=10)
        assert "did not return within PT1S" in (rows(store)[slow].last_error or "")
    finally:
        release.set()


# -- 15. a call starts only if the lease outlasts it --------------------------------------------------------


class ShortLeases(AllSlots):
    """Every slot, but one whose lease ends sooner than any call may take."""

    def __init__(self, slot_count: int, short: int) -> None:
        super().__init__(slot_count)
        self.short = short

    def safe_for(self, slot: int, fence: Fence | None = None) -> float:
        return 0.1 if slot == self.short else float("inf")


def test_no_call_starts_on_a_slot_whose_lease_could_end_before_the_call(store: Store) -> None:
    endangered = send(store, "a")
    slot = rows(store)[endangered].slot
    safe = send(store, _hint_in_slot(store, (slot + 1) % 64, "b-"))
    calls = Calls()
    run = Engine(store, Router({"*": calls}), settings(), ShortLeases(64, slot))
    stop_at_teardown(lambda: run.stop(grace=0))
    run.run_once()
    assert calls.ids() == [safe]
    assert rows(store)[endangered].attempt == 0, "left untouched for a replica whose lease lasts"


class RenewableLeases(AllSlots):
    """Every slot; the lease of ``short`` ends sooner than a call may take until ``renew`` is called, as a
    renewal a few milliseconds late leaves it just under the handler timeout."""

    def __init__(self, slot_count: int, short: int) -> None:
        super().__init__(slot_count)
        self.short: int | None = short

    def renew(self) -> None:
        self.short = None

    def safe_for(self, slot: int, fence: Fence | None = None) -> float:
        return 0.1 if slot == self.short else float("inf")


def test_a_hint_given_back_for_a_short_lease_is_fetched_again_on_the_renewal_not_at_the_next_poll(
    store: Store,
) -> None:
    """A lane refuses to start a call whose slot's term may end before the call could. The hint is given back;
    the leases' round that renews the term (``Engine.renewed``) must fetch it again, or its message waits for the
    next poll (a minute here) although nothing holds it back any more."""
    message = send(store, "h")
    slot = rows(store)[message].slot
    source = RenewableLeases(store.slot_count, slot)
    calls = Calls()
    run = Engine(store, Router({"*": calls}), settings(poll={"interval": "PT60S"}), source)
    stop_at_teardown(lambda: run.stop(grace=0))
    run.start()
    wait_until(lambda: slot in run._after_renewal, "the hint given back until its term is renewed")
    assert calls.ids() == [] and rows(store)[message].attempt == 0, "untouched while the term is short"
    source.renew()
    renewed = time.monotonic()
    run.renewed()  # as the leases' round calls it after renewing terms
    wait_until(lambda: message in calls.ids(), "called once the term was renewed")
    assert time.monotonic() - renewed < 2, "the message waited for the poll"
    assert rows(store)[message].attempt == 0


def test_a_slot_counts_as_fetched_under_its_term_once_a_fetch_of_it_ended(store: Store) -> None:
    message = send(store, "h")
    slot = rows(store)[message].slot
    source = AllSlots(store.slot_count)
    run = Engine(store, Router({"*": Calls()}), settings(), source)
    stop_at_teardown(lambda: run.stop(grace=0))
    fence = source.terms()[slot]  # None: an engine without leases
    assert not run.fetched_under(slot, fence), "not followed yet"
    run.run_once()
    assert run.fetched_under(slot, fence)
    assert not run.fetched_under(slot, Fence("slot:x", "other", 99)), "another term"


# -- wake-ups -------------------------------------------------------------------------------------------------


class LateSlots(AllSlots):
    """No slot until granted, as a replica's first lease round finds them. A look at the terms can be held
    (``hold``): it reads them, says so (``looked``), and returns what it read once ``proceed`` is set."""

    def __init__(self, slot_count: int) -> None:
        super().__init__(slot_count)
        self.granted: tuple[int, ...] = ()
        self.hold = threading.Event()
        self.looked = threading.Event()
        self.proceed = threading.Event()

    def slots(self) -> tuple[int, ...]:
        return self.granted

    def terms(self) -> dict[int, Fence | None]:
        read: dict[int, Fence | None] = dict.fromkeys(self.granted)
        if self.hold.is_set():
            self.hold.clear()
            self.looked.set()
            self.proceed.wait(10)
        return read


def test_slots_a_replica_acquires_while_its_fetcher_is_busy_are_fetched_at_once(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leases' round that acquired slots calls ``Engine.acquired`` naming them. The fetcher may be busy then
    (here: following the leases, which it read before the grant), so no wake-up reaches it; it must look at the
    leases again before it waits, not wait its turn a second later with the slots unknown. One fetcher, so that
    no other one takes them."""
    import worker.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "FETCHERS", 1)
    message = send(store, "h")
    slot = rows(store)[message].slot
    source = LateSlots(store.slot_count)
    calls = Calls()
    run = Engine(store, Router({"*": calls}), settings(poll={"interval": "PT60S"}), source)
    stop_at_teardown(lambda: run.stop(grace=0))
    source.hold.set()
    run.start()
    wait_until(source.looked.is_set, "the fetcher's look at the leases")  # no slot in what it read
    source.granted = (slot,)
    granted = time.monotonic()
    run.acquired(source.slots())  # as the leases' round calls it, while the fetcher is not waiting
    source.proceed.set()
    wait_until(lambda: message in calls.ids(), "called")
    assert time.monotonic() - granted < 0.5, "the slots waited for the fetcher's own turn"


def test_a_message_is_called_at_once_on_its_producers_notify_long_before_the_poll(store: Store) -> None:
    from worker.db.listener import Listener

    settings_ = settings(poll={"interval": "PT60S"})
    calls = Calls()
    run = engine(store, calls, settings_)
    listener = Listener(settings_.database.model_copy(update={"url": str(store.engine.url.render_as_string(
        hide_password=False))}), settings_.notify, run.wake, run.metrics)
    thread = threading.Thread(target=listener.run, daemon=True)
    thread.start()
    try:
        run.start()
        wait_until(lambda: run.metrics.listener_up._value.get() == 1, "the listener connected")
        time.sleep(0.2)  # pacing: the first fetches of every slot are over
        message = send(store, "h")
        wait_until(lambda: message in calls.ids(), "called on the notification", timeout=10)
        # After the listener's connection is terminated, it reconnects and looks at every slot again.
        sql(store, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                   "WHERE application_name = 'correlation-worker listener' AND datname = current_database()")
        wait_until(lambda: run.metrics.listener_reconnects._value.get() >= 1, "the listener reconnected")
        again = send(store, "h2")
        wait_until(lambda: again in calls.ids(), "called after the reconnection", timeout=10)
    finally:
        listener.stop()
        thread.join(timeout=5)


@dataclass(frozen=True)
class StoreCall:
    """One call of a store method a test watches: when, and with what."""

    at: float
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def watched(monkeypatch: pytest.MonkeyPatch, store: Store, method: str) -> list[StoreCall]:
    """The calls of the store's ``method`` from now on."""
    calls: list[StoreCall] = []
    original = getattr(store, method)

    def watching(*args: Any, **kwargs: Any) -> Any:
        calls.append(StoreCall(time.monotonic(), args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(store, method, watching)
    return calls


def test_an_idle_engine_looks_at_its_quiet_slots_in_one_statement_a_poll_and_fetches_only_those_with_work(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No wake-ups (no listener): only the poll finds work. After the first fetch of each slot, a poll of the
    slots found empty is one look at all of them; a slot is fetched again only once a look finds work in it."""
    fetches, looks = watched(monkeypatch, store, "messages_fetch_slot"), watched(monkeypatch, store, "messages_look")
    calls = Calls()
    run = engine(store, calls, settings(poll={"interval": "PT0.3S"}))
    run.start()
    wait_until(lambda: len(looks) >= 4, "four polls of quiet slots")
    before = len(fetches)
    assert before >= store.slot_count, "each slot fetched once first"
    wait_until(lambda: len(looks) >= 8, "four more polls")
    assert len(fetches) == before, "no quiet slot fetched on its own while nothing arrived"
    message = send(store, "arrives-unannounced")
    wait_until(lambda: message in calls.ids(), "called after a look found it", timeout=10)
    assert len(fetches) - before <= 3, "only its slot fetched (once to take it, at most twice more)"


def test_a_drains_fetches_share_horizon_readings_and_keep_each_hints_order(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading the commit-order horizon reads every lock of the server: a fetch moments after another reuses its
    reading when no producer transaction was registered then. The drain is whole and in order all the same."""
    sql(store, "INSERT INTO correlation_message (message_name, correlation_hint, payload) "
               "SELECT 'n', 'h-' || (i % 200), '{}' FROM generate_series(0, 3999) AS i")
    fetches = watched(monkeypatch, store, "messages_fetch_slot")
    calls = Calls()
    run = engine(store, calls, settings(poll={"interval": "PT30S", "page_size": 50}))
    run.start()
    wait_until(lambda: len(calls.ids()) == 4000, "the drain")
    reused = [fetch for fetch in fetches if fetch.kwargs.get("reuse_horizon") is not None]
    assert reused, f"none of {len(fetches)} fetches reused a reading"
    for hint in {f"h-{i}" for i in range(200)}:
        assert calls.of(hint) == sorted(calls.of(hint)), f"{hint} called out of order"


def test_a_fetch_after_its_slots_wake_up_reads_the_horizon_itself(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message announced by its notification may have been committed after the last reading: the fetch its
    wake-up brings reads the horizon itself, so the message is in it."""
    calls = Calls()
    run = engine(store, calls, settings(poll={"interval": "PT30S"}))
    fetches = watched(monkeypatch, store, "messages_fetch_slot")
    run.start()
    wait_until(lambda: len(fetches) >= store.slot_count, "the first fetch of every slot")
    for n in range(5):
        first = send(store, _hint_in_slot(store, n, f"woken-{n}-"))
        at = time.monotonic()
        run.wake([n])
        wait_until(lambda first=first: first in calls.ids(), "called on its wake-up", timeout=10)
        woken = [fetch for fetch in fetches if fetch.args[0] == n and fetch.at >= at]
        assert woken and woken[0].kwargs.get("reuse_horizon") is None, "the woken slot's fetch read the horizon itself"


def test_a_delayed_message_in_a_quiet_slot_is_called_when_due_not_at_the_next_poll(store: Store) -> None:
    due_in = 1.5
    later = send(store, "due-later")
    sql(store, "UPDATE correlation_message SET next_attempt_at = now() + make_interval(secs => :s) WHERE id = :id",
        s=due_in, id=later)
    calls = Calls()
    run = engine(store, calls, settings(poll={"interval": "PT60S"}))
    started = time.monotonic()
    run.start()
    wait_until(lambda: later in calls.ids(), "called at its due time", timeout=15)
    assert time.monotonic() - started >= due_in - 0.2, "not before it was due"


def test_a_hint_the_full_page_left_no_room_for_is_fetched_at_once_not_at_the_next_poll(store: Store) -> None:
    """Two hints fill the page with whole batches: the third, chosen too, got none of its messages."""
    first = send(store, "a-first")
    slot = rows(store)[first].slot
    second = send(store, _hint_in_slot(store, slot, "b-"))
    third = send(store, _hint_in_slot(store, slot, "c-"))
    calls = Calls()
    run = engine(store, calls, settings(poll={"interval": "PT30S", "page_size": 2}))
    run.start()
    wait_until(lambda: sorted(calls.ids()) == [first, second, third], "the third hint, long before the next poll",
               timeout=10)


def test_hints_a_page_bound_by_bytes_left_out_are_fetched_at_once_not_at_the_next_poll(store: Store) -> None:
    """Payloads of 100 kB and a page of 150 000 bytes: each fetch takes two hints' messages whole, and the engine
    fetches again at once for the hints left out."""
    first = send(store, "a-first", blob="x" * 100_000)
    slot = rows(store)[first].slot
    hints = ["a-first", *(_hint_in_slot(store, slot, prefix) for prefix in ("b-", "c-", "d-", "e-"))]
    sent = [first, *(send(store, hint, blob="x" * 100_000) for hint in hints[1:])]
    calls = Calls()
    run = engine(store, calls, settings(poll={"interval": "PT30S", "page_bytes": 150_000}))
    run.start()
    wait_until(lambda: sorted(calls.ids()) == sorted(sent), "every message, long before the next poll", timeout=10)


def test_hints_a_full_page_had_no_room_for_come_first_in_the_next_fetch(store: Store) -> None:
    """More candidate hints than the page holds: the next fetch goes on after the last hint taken, not after the
    last candidate, so the round robin calls the hints in its own order and skips none until it comes round."""
    first = send(store, "a-first")
    slot = rows(store)[first].slot
    hints = [str(row[0]) for row in sql(
        store, "SELECT h FROM (SELECT 'k-' || lpad(i::text, 5, '0') AS h FROM generate_series(1, 100000) AS i) AS x "
               "WHERE ((hashtext(h) % 64) + 64) % 64 = :slot ORDER BY h LIMIT 12", slot=slot)]
    sent = {send(store, hint): hint for hint in hints}
    calls = Calls()
    # One lane: a budget of three or four candidate hints a fetch, a page of two messages.
    run = engine(store, calls, settings(poll={"interval": "PT30S", "page_size": 2, "concurrency": 1}))
    run.start()
    wait_until(lambda: len(calls.ids()) == len(sent) + 1, "every message")
    assert [sent[i] for i in calls.ids() if i in sent] == hints


# -- helpers ------------------------------------------------------------------------------------------------


def _hint_in_slot(store: Store, slot: int, prefix: str) -> str:
    found = sql(store, "SELECT h FROM (SELECT :prefix || i AS h FROM generate_series(1, 10000) AS i) AS hints "
                       "WHERE ((hashtext(h) % 64) + 64) % 64 = :slot LIMIT 1", prefix=prefix, slot=slot)
    return str(found[0][0])



def test_an_exception_whose_str_raises_is_logged_in_one_line_and_the_rest_of_its_run_goes_on(
    store: Store, capfd: pytest.CaptureFixture[str]
) -> None:
    from worker.service.logs import configure_logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    configure_logging(settings().log, "test")  # the worker's own formatter, as a replica logs
    bad = send(store, "h", bad=True)
    after = [send(store, "h") for _ in range(3)]

    def behave(message: Message) -> None:
        if message.payload.get("bad"):
            raise Unprintable()

    calls = Calls(behave)
    run = engine(store, calls, settings(policy={"mode": "all"}))
    try:
        result = run.run_once()
    finally:
        root.handlers[:], root.level = handlers, level
    assert calls.ids() == [bad, *after], "the rest of the run was called"
    assert result.outcomes == {"retry": 1, "success": 3}
    logged = capfd.readouterr().err
    assert "Traceback" not in logged and "failed while calling" not in logged, logged
    assert f"id={bad} hint=h: retry" in logged and "Unprintable" in logged
    row = rows(store)[bad]
    assert row.attempt == 1 and "Unprintable" in (row.last_error or "")


def test_a_failure_of_the_lanes_own_during_a_call_records_that_call_alone_and_leaves_no_call_marked(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the lanes while a run is under way: the run's one exit records the call under way as a failed
    attempt with the reason, takes back the marks of the run's calls not made (they wait, ready, behind it), and
    the lane goes on with the other hints; nothing stays marked in flight."""
    import worker.engine.lanes as lanes_module

    real = lanes_module.succeeded
    bad = send(store, "h", bad=True)
    after = [send(store, "h") for _ in range(3)]
    others = [send(store, f"o{n}") for n in range(4)]

    def failing(message_id: int, attempt: int, result: str | None) -> Any:
        if message_id == bad:
            raise KeyError("a bug of the lanes")
        return real(message_id, attempt, result)

    monkeypatch.setattr(lanes_module, "succeeded", failing)
    calls = Calls()
    run = engine(store, calls, settings(poll={"concurrency": 1}))
    run.lanes._observe("order.paid", [0.00001])  # fast calls: a hint's messages go in runs of several
    run.run_once()
    left = rows(store)
    assert calls.of("h") == [bad], "the run's later calls were not made"
    assert not set(others) & set(left), "the other hints were called and recorded"
    message = left[bad]
    assert message.attempt == 1 and message.state is MessageState.READY
    assert "the worker failed during the call: KeyError" in (message.last_error or "")
    assert all(left[n].attempt == 0 and left[n].state is MessageState.READY for n in after)
    assert sql(store, "SELECT count(*) FROM correlation_call")[0][0] == 0, "no call left marked"
    assert run.health() is None


def test_what_a_replica_keeps_per_message_name_is_bounded(store: Store) -> None:
    """Names come and go (one per tenant, per customer): the call times that size runs are kept for the most
    recently called names only, and a fetch is sent those whose runs are longer than one call."""
    from worker.engine.lanes import NAMES_TIMED

    calls: list[int] = []
    run = engine(store, lambda message: calls.append(message.id))
    names = NAMES_TIMED + 150
    with store.engine.begin() as connection:
        connection.execute(
            text("INSERT INTO correlation_message (message_name, correlation_hint, payload) "
                 "SELECT 'name-' || i, 'hint-' || i, '{}' FROM generate_series(1, :n) AS i"), {"n": names},
        )
    while run.run_once().correlated:
        pass
    assert len(calls) == names
    assert len(run.lanes.first_runs()) <= NAMES_TIMED
    assert len(run.lanes._call_seconds) == NAMES_TIMED
