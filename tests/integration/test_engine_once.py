"""The engine in-process against real databases, one poll at a time (``Engine.run_once``): order, modes, batch
size, TTL, timeouts, routes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest

from tests.conftest import left, stop_at_teardown
from worker.config import Settings
from worker.correlators import Router
from worker.db.store import MessageFilter, NewMessage, Store
from worker.engine.engine import AllSlots, Engine
from worker.message import Message, MessageState
from worker.policy.outcomes import PermanentError, Reschedule


@dataclass
class Recorder:
    """A handler that records its calls and fails the messages whose payload says so."""

    calls: list[tuple[str, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    active: dict[str, int] = field(default_factory=dict)
    overlaps: int = 0
    delay: float = 0.0
    hang_over: threading.Event = field(default_factory=threading.Event)

    def __call__(self, message: Message) -> None:
        with self.lock:
            self.calls.append((message.hint, message.payload.get("seq", 0)))
            self.active[message.hint] = self.active.get(message.hint, 0) + 1
            if self.active[message.hint] > 1:
                self.overlaps += 1
        try:
            if self.delay:
                time.sleep(self.delay)
            if message.payload.get("fail"):
                raise RuntimeError(f"refused seq {message.payload.get('seq')}")
            if message.payload.get("permanent"):
                raise PermanentError("never")
            if message.payload.get("reschedule"):
                raise Reschedule(delay=timedelta(minutes=5))
            if message.payload.get("hang"):
                time.sleep(float(message.payload["hang"]))
                self.hang_over.set()
        finally:
            with self.lock:
                self.active[message.hint] -= 1

    def seqs(self, hint: str) -> list[int]:
        return [seq for h, seq in self.calls if h == hint]


def settings(**policy: Any) -> Settings:
    poll = policy.pop("poll", {})
    return Settings(
        poll={"interval": "PT1S", **poll},
        policy={"backoff_unit": "PT60S", **policy},
        metrics={"enabled": False},
    )




def make_poller(store: Store, handler: Callable[[Message], object], s: Settings | None = None,
                routes: dict[str, Callable[[Message], object]] | None = None) -> Engine:
    router = Router(routes if routes is not None else {"*": handler})
    engine = Engine(store, router, s or settings(), AllSlots(store.slot_count))
    stop_at_teardown(lambda: engine.stop(grace=0))
    return engine


def send(store: Store, hint: str, seq: int, name: str = "order.paid", **payload: Any) -> int:
    row_id = store.messages_insert(NewMessage(name=name, hint=hint, payload={"seq": seq, **payload}))
    assert row_id is not None
    return row_id


def set_due_now(store: Store, row_id: int) -> None:
    from sqlalchemy import update

    from worker.db.schema import message_table

    with store.engine.begin() as connection:
        connection.execute(
            update(message_table).where(message_table.c.id == row_id).values(next_attempt_at=store.now())
        )


def rows(store: Store) -> list[Message]:
    return store.messages_list(MessageFilter(), limit=10_000)


def test_each_hint_is_correlated_in_id_order_and_the_table_empties(any_store: Store) -> None:
    recorder = Recorder()
    for seq in range(30):
        for hint in ("a", "b", "c"):
            send(any_store, hint, seq)
    result = make_poller(any_store, recorder, settings(poll={"page_size": 7})).run_once()
    assert result.correlated == 90
    for hint in ("a", "b", "c"):
        assert recorder.seqs(hint) == list(range(30))
    assert rows(any_store) == []


def test_a_failing_message_holds_back_its_group_in_fail_first_mode(any_store: Store) -> None:
    recorder = Recorder()
    send(any_store, "a", 1)
    failing = send(any_store, "a", 2, fail=True)
    send(any_store, "a", 3)
    send(any_store, "b", 1)
    poller = make_poller(any_store, recorder)
    poller.run_once()
    assert recorder.seqs("a") == [1, 2] and recorder.seqs("b") == [1]
    left = {m.id: m for m in rows(any_store)}
    assert list(left) == [failing, failing + 1]
    assert left[failing].attempt == 1 and "refused seq 2" in (left[failing].last_error or "")
    assert left[failing + 1].attempt == 0 and left[failing + 1].last_error is None
    poller.run_once()  # the failed one waits a minute: nothing of hint a is tried again
    assert recorder.seqs("a") == [1, 2]


def test_all_mode_attempts_every_message_and_records_failures_individually(any_store: Store) -> None:
    recorder = Recorder()
    send(any_store, "a", 1)
    failing = send(any_store, "a", 2, fail=True)
    send(any_store, "a", 3)
    make_poller(any_store, recorder, settings(mode="all")).run_once()
    assert recorder.seqs("a") == [1, 2, 3]
    left = rows(any_store)
    assert [m.id for m in left] == [failing] and left[0].attempt == 1


def test_batch_size_one_takes_the_head_of_each_group_per_poll(any_store: Store) -> None:
    recorder = Recorder()
    for seq in range(3):
        send(any_store, "a", seq)
        send(any_store, "b", seq)
    poller = make_poller(any_store, recorder, settings(batch_size=1))
    poller.run_once()
    assert recorder.seqs("a") == [0] and recorder.seqs("b") == [0]
    poller.run_once()
    assert recorder.seqs("a") == [0, 1]


def test_batch_size_n_takes_up_to_n_per_poll(any_store: Store) -> None:
    recorder = Recorder()
    for seq in range(5):
        send(any_store, "a", seq)
    make_poller(any_store, recorder, settings(batch_size=2)).run_once()
    assert recorder.seqs("a") == [0, 1]


def test_more_stuck_messages_than_a_page_do_not_starve_newer_ones(any_store: Store) -> None:
    recorder = Recorder()
    for hint in range(25):
        send(any_store, f"stuck-{hint}", 0, fail=True)
    poller = make_poller(any_store, recorder, settings(poll={"page_size": 10}))
    poller.run_once()
    assert len(recorder.calls) == 25
    for seq in range(5):
        send(any_store, "fresh", seq)
    poller.run_once()
    assert recorder.seqs("fresh") == list(range(5))
    assert {m.hint for m in rows(any_store)} == {f"stuck-{h}" for h in range(25)}


def test_failure_inside_the_time_to_live_is_not_recorded_and_waits_for_the_next_poll(any_store: Store) -> None:
    recorder = Recorder()
    row_id = send(any_store, "a", 1, fail=True)
    poller = make_poller(any_store, recorder, settings(time_to_live="PT1H", poll={"interval": "PT30S"}))
    before = any_store.now()
    poller.run_once()
    poller.run_once()  # woken early: the buffered message is not tried in a tight loop
    assert recorder.seqs("a") == [1]
    message = any_store.messages_get(row_id)
    assert message is not None and message.attempt == 0 and message.last_error is None
    assert message.next_attempt_at is not None
    assert timedelta(seconds=29) <= message.next_attempt_at - before <= timedelta(seconds=40)


def test_permanent_error_is_dead_and_reschedule_counts_no_attempt(any_store: Store) -> None:
    recorder = Recorder()
    dead = send(any_store, "a", 1, permanent=True)
    later = send(any_store, "b", 1, reschedule=True)
    make_poller(any_store, recorder).run_once()
    d, r = any_store.messages_get(dead), any_store.messages_get(later)
    assert d is not None and d.state is MessageState.DEAD and d.attempt == 1 and "never" in (d.last_error or "")
    assert r is not None and r.state is MessageState.READY and r.attempt == 0 and r.reschedule_count == 1


def test_max_retries_reached_is_dead_with_exactly_that_many_attempts(any_store: Store) -> None:
    recorder = Recorder()
    row_id = send(any_store, "a", 1, fail=True)
    poller = make_poller(any_store, recorder, settings(max_retries=3, backoff_unit="PT0S"))
    for _ in range(6):
        poller.run_once()
    message = any_store.messages_get(row_id)
    assert message is not None and message.state is MessageState.DEAD and message.attempt == 3
    assert len(recorder.calls) == 3


def test_per_name_policy_override_applies_only_to_its_name(any_store: Store) -> None:
    recorder = Recorder()
    strict = send(any_store, "a", 1, name="strict", fail=True)
    lenient = send(any_store, "b", 1, name="lenient", fail=True)
    s = Settings(policy={"max_retries": 5}, policies={"strict": {"max_retries": 1}}, metrics={"enabled": False})
    make_poller(any_store, recorder, s).run_once()
    a, b = any_store.messages_get(strict), any_store.messages_get(lenient)
    assert a is not None and a.state is MessageState.DEAD
    assert b is not None and b.state is MessageState.READY and b.attempt == 1


def test_a_message_without_route_is_dead_with_a_reason_naming_it(any_store: Store) -> None:
    recorder = Recorder()
    routed = send(any_store, "a", 1, name="known")
    orphan = send(any_store, "b", 1, name="unknown.name")
    make_poller(any_store, recorder, routes={"known": recorder}).run_once()
    assert left(any_store, routed)
    message = any_store.messages_get(orphan)
    assert message is not None and message.state is MessageState.DEAD
    assert "unknown.name" in (message.last_error or "") and "CORRELATION_CORRELATORS" in (message.last_error or "")


def test_a_handler_exception_never_crashes_the_poll_and_its_error_is_readable(any_store: Store) -> None:
    def broken(message: Message) -> None:
        raise KeyError("amount")

    send(any_store, "a", 1)
    make_poller(any_store, broken).run_once()
    (message,) = rows(any_store)
    assert message.last_error is not None and message.last_error.startswith("KeyError: 'amount'")
    assert len(message.last_error) <= 2000


def test_a_call_over_the_handler_timeout_counts_as_a_retry_and_its_hint_waits(any_store: Store) -> None:
    recorder = Recorder()
    hung = send(any_store, "slow", 1, hang=5)
    send(any_store, "slow", 2)
    send(any_store, "quick", 1)
    poller = make_poller(any_store, recorder, settings(handler_timeout="PT0.3S"))
    poller.run_once()
    assert not recorder.hang_over.is_set()  # the cycle did not wait for the hung call
    message = any_store.messages_get(hung)
    assert message is not None and message.attempt == 1 and "did not return" in (message.last_error or "")
    assert recorder.seqs("quick") == [1] and recorder.seqs("slow") == [1]
    set_due_now(any_store, hung)
    poller.run_once()  # the hung call is still running: its hint is not called a second time
    assert recorder.seqs("slow") == [1]


def test_expired_messages_are_never_correlated(any_store: Store) -> None:
    recorder = Recorder()
    now = any_store.now()
    any_store.messages_insert(
        NewMessage("n", "a", {"seq": 1}, expires_at=now - timedelta(seconds=1), created_at=now - timedelta(hours=1))
    )
    make_poller(any_store, recorder).run_once()
    assert recorder.calls == []


@pytest.mark.parametrize("concurrency", [4])
def test_concurrent_batches_never_run_one_hint_twice_at_once(store: Store, concurrency: int) -> None:
    recorder = Recorder(delay=0.002)
    for seq in range(20):
        for hint in range(12):
            send(store, f"h{hint}", seq)
    s = settings(poll={"concurrency": concurrency, "page_size": 50})
    make_poller(store, recorder, s).run_once()
    assert recorder.overlaps == 0
    for hint in range(12):
        assert recorder.seqs(f"h{hint}") == list(range(20))
    assert rows(store) == []


def test_a_retry_falling_due_while_other_hints_run_is_called_before_the_later_messages_of_its_hint(
    store: Store,
) -> None:
    """Other calls take long enough for an earlier retry to fall due: the hint goes in order once it does."""
    recorder = Recorder(delay=0.3)
    slot = _slot_of(store, ["h"])[0]
    candidates = [f"f{i}" for i in range(2000)]
    same_slot = [h for h, s in zip(candidates, _slot_of(store, candidates), strict=True) if s == slot][:4]
    waiting = send(store, "h", 1)
    for hint in same_slot:  # four calls of 0.3 s each, after which the retry is due
        send(store, hint, 0)
    send(store, "h", 2)
    set_columns_in(store, waiting, attempt=1, due_in=0.6)
    make_poller(store, recorder, settings(poll={"page_size": 4, "concurrency": 1})).run_once()
    assert len([c for c in recorder.calls if c[0] != "h"]) == 4
    assert recorder.seqs("h") in ([], [1, 2])  # never 2 before 1


def _slot_of(store: Store, hints: list[str]) -> list[int]:
    from sqlalchemy import text

    with store.engine.connect() as connection:
        rows = connection.execute(
            text("SELECT ((hashtext(h) % 64) + 64) % 64 FROM unnest(CAST(:hints AS text[])) WITH ORDINALITY AS t(h, n) "
                 "ORDER BY n"),
            {"hints": hints},
        )
        return [int(row[0]) for row in rows]


def set_columns_in(store: Store, row_id: int, attempt: int, due_in: float) -> None:
    from sqlalchemy import update

    from worker.db.schema import message_table

    due = store.now() + timedelta(seconds=due_in)
    with store.engine.begin() as connection:
        connection.execute(
            update(message_table).where(message_table.c.id == row_id).values(attempt=attempt, next_attempt_at=due)
        )


def test_what_a_handler_returns_decides_its_outcome(any_store: Store) -> None:
    answers: dict[str, object] = {"none": None, "true": True, "false": False, "tuple": (False, "not ready")}
    ids = {hint: send(any_store, hint, 1) for hint in answers}
    make_poller(any_store, lambda message: answers[message.hint]).run_once()

    assert left(any_store, ids["none"]) and left(any_store, ids["true"])
    retried = any_store.messages_get(ids["false"])
    assert retried is not None and retried.state is MessageState.READY and retried.attempt == 1
    assert retried.last_error is not None and "returned False" in retried.last_error
    refused = any_store.messages_get(ids["tuple"])  # never taken for a success: the message is kept
    assert refused is not None and refused.state is MessageState.DEAD
    assert refused.last_error is not None and "returned a value of type tuple" in refused.last_error
