"""Calls in flight (rows of correlation_call): what a replica taking over a dead holder's slot counts and decides.

The dead holder is simulated exactly: its calls are written as its committer writes them, under its term, and
its term is ended in the database (no waiting for clocks), then another replica takes the slot over.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest
from sqlalchemy import event, text
from sqlalchemy.exc import IntegrityError

from tests.conftest import left, stop_at_teardown
from tests.integration.test_engine import watched
from tests.integration.test_slot_leases import leaser
from worker.config import Mode, Settings
from worker.correlators import Router
from worker.db.base import Fence
from worker.db.errors import DatabaseUnavailable
from worker.db.fetch import Fetched, FetchMark
from worker.db.store import MessageFilter, NewMessage, Store
from worker.engine import engine as engine_module
from worker.engine.committer import MarkTicket
from worker.engine.engine import Engine
from worker.engine.lanes import HintWork
from worker.engine.leases import SlotLeaser
from worker.message import Message, MessageState
from worker.service.metrics import Metrics

DEADLINE = 10.0  # seconds; generous, only a guard against hanging


def in_flight(store: Store) -> dict[int, str]:
    """The calls marked in flight: message id → state."""
    return {row["message_id"]: row["state"] for row in store.calls_in_flight()}


def engine_of(
    store: Store, slots: SlotLeaser, metrics: Metrics, calls: list[int], concurrency: int = 8, **policy: object
) -> Engine:
    def handler(message: Message) -> None:
        calls.append(message.id)

    settings = Settings(
        poll={"interval": "PT1S", "concurrency": concurrency}, policy=policy, metrics={"enabled": False}
    )
    engine = Engine(store, Router({"*": handler}), settings, slots, metrics, slots.holder)
    stop_at_teardown(lambda: engine.stop(grace=0))
    return engine


def idle_engine(
    store: Store, monkeypatch: pytest.MonkeyPatch, calls: list[int], metrics: Metrics | None = None
) -> Engine:
    """An engine of one fetcher (one fetch at a time marks: the test's) holding every slot, its lanes idle."""
    monkeypatch.setattr(engine_module, "FETCHERS", 1)
    holder = leaser(store, "a")
    holder.run_once()
    return engine_of(store, holder, metrics or Metrics(), calls)


def hint_in_slot(store: Store, slot: int, prefix: str) -> str:
    """A hint (starting with ``prefix``) whose messages fall into this slot."""
    with store.engine.connect() as connection:
        return str(connection.execute(text(
            "SELECT h FROM (SELECT :prefix || i AS h FROM generate_series(1, 10000) AS i) AS hints"
            " WHERE ((hashtext(h) % 64) + 64) % 64 = :slot LIMIT 1"
        ), {"prefix": prefix, "slot": slot}).scalar_one())


def send(store: Store, hint: str, payload: Any = None) -> int:
    row_id = store.messages_insert(NewMessage("n", hint, payload=payload))
    assert row_id is not None
    return row_id


def fetched_work(store: Store, engine: Engine, slot: int, fence: Fence | None, message_id: int) -> HintWork:
    """A message's hint as a fetch hands it to the lanes (busy in the engine), with the message as its batch."""
    message = store.messages_get(message_id)
    assert message is not None
    work = HintWork(message.hint, slot, fence, deque([message]), cut=False, fetched_at=time.monotonic())
    with engine._cond:
        engine._busy[message.hint] = work
    return work


Call = tuple[int, int, str]  # (message id, the first message of its run, state)


def die_with_calls(store: Store, dead: SlotLeaser, slot: int, calls: Sequence[Call]) -> None:
    """The holder marked these calls, then died: its term ends without a release."""
    fence = dead.fence(slot)
    assert fence is not None
    with store.engine.begin() as connection:
        for message_id, head, state in calls:
            connection.execute(
                text("INSERT INTO correlation_call (message_id, slot, fence, holder, run_head, state) "
                     "VALUES (:id, :slot, :fence, :holder, :head, :state)"),
                {"id": message_id, "slot": slot, "fence": fence.fence, "holder": fence.holder, "head": head,
                 "state": state},
            )
        connection.execute(
            text("UPDATE correlation_lock SET lock_until = now() - interval '1 second' "
                 "WHERE name = :name AND fence = :fence"),
            {"name": fence.name, "fence": fence.fence},
        )


def run_of(*ids: int, state: str = "called") -> list[Call]:
    """Calls marked together: one run, made in this order."""
    return [(message_id, ids[0], state) for message_id in ids]


def take_over(store: Store, metrics: Metrics, slot: int, name: str = "heir") -> SlotLeaser:
    heir = leaser(store, name, metrics=metrics)
    heir.run_once()
    assert slot in heir.slots()
    return heir



def _settle(poison_after: int):  # type: ignore[no-untyped-def]
    from worker.policy.outcomes import settle_lost_call

    return lambda call: settle_lost_call(
        call.lost_calls, call.crashed_calls, call.last_error, crashed=call.crashed, alone=call.alone,
        poison_after=poison_after,
    )


def adopt(store: Store, heir: SlotLeaser, slot: int, poison_after: int = 3) -> Any:
    fence = heir.fence(slot)
    assert fence is not None
    return store.calls_adopt(slot, fence, _settle(poison_after))


def wait_until(condition: Any, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def slot_of(store: Store, message_id: int) -> int:
    message = store.messages_get(message_id)
    assert message is not None
    return message.slot


def test_a_clean_run_leaves_no_call_in_flight(store: Store) -> None:
    a = leaser(store, "a")
    a.run_once()
    send(store, "order-1")
    calls: list[int] = []
    metrics = Metrics()
    result = engine_of(store, a, metrics, calls).run_once()
    assert result.correlated == 1 and metrics.redeliveries._value.get() == 0
    assert in_flight(store) == {}


def test_calls_in_flight_at_a_holders_death_are_counted_exactly_when_delivered_again(store: Store) -> None:
    dead = leaser(store, "dead")
    dead.run_once()
    alone = send(store, "order-1")
    slot = slot_of(store, alone)
    first, second = send(store, hint_in_slot(store, slot, "two-")), 0
    second = send(store, store.messages_get(first).hint)  # type: ignore[union-attr]
    untouched = send(store, hint_in_slot(store, slot, "three-"))
    die_with_calls(store, dead, slot, run_of(alone, state="alone") + run_of(first, second))
    metrics = Metrics()
    heir = take_over(store, metrics, slot)
    calls: list[int] = []
    result = engine_of(store, heir, metrics, calls).run_once()
    assert sorted(calls) == sorted({alone, first, second, untouched})
    assert result.adopted == 3 and metrics.lost_calls._value.get() == 3
    assert metrics.redeliveries._value.get() == 3  # exactly the calls marked in flight, each once
    assert in_flight(store) == {}


def test_a_message_whose_calls_kill_its_replica_is_dead_after_poison_after_crashes(store: Store) -> None:
    poison, neighbour = send(store, "order-1"), send(store, "order-1")
    slot = slot_of(store, poison)
    bystander = send(store, hint_in_slot(store, slot, "other-"))
    holder = leaser(store, "replica-0")
    holder.run_once()
    for crash in (1, 2):  # the call of `poison` was running alone when its replica died
        die_with_calls(store, holder, slot, run_of(poison, state="alone"))
        holder = take_over(store, Metrics(), slot, f"replica-{crash}")
        adoption = adopt(store, holder, slot)
        assert adoption.crashed == (poison,) and not adoption.poisoned
    die_with_calls(store, holder, slot, run_of(poison, state="alone"))
    metrics = Metrics()
    heir = take_over(store, metrics, slot, "heir")
    calls: list[int] = []
    result = engine_of(store, heir, metrics, calls, poison_after=3).run_once()
    message = store.messages_get(poison)
    assert message is not None and message.state is MessageState.DEAD
    assert message.crashed_calls == 3 and "poison" in (message.last_error or "")
    assert metrics.poison_messages.labels("n")._value.get() == 1
    assert poison not in calls and bystander in calls  # never called again; other hints go on
    assert neighbour not in calls  # behind a dead head (fail_first), untouched: no attempt, no penalty
    after = store.messages_get(neighbour)
    assert after is not None and after.attempt == 0 and after.lost_calls == 0 and result.adopted == 1


def test_calls_marked_beside_others_are_lost_never_taken_for_the_one_under_way(store: Store) -> None:
    """Of a run marked beside other calls the marks cannot tell which call had returned with its outcome unwritten
    and which had not started: every one is lost, none counted as a crash (a takeover used to blame a run's first
    unrecorded call, which had often returned or never started). Calls given up at shutdown or returned with their
    outcome unwritten: lost only. Nothing ran alone, so nothing is poison even at poison_after=1."""
    dead = leaser(store, "dead")
    dead.run_once()
    ran, after = send(store, "h-1"), send(store, "h-1")
    slot = slot_of(store, ran)
    single = send(store, hint_in_slot(store, slot, "single-"))  # a run of one, but other lanes were calling
    abandoned = send(store, hint_in_slot(store, slot, "other-"))
    returned, next_one = send(store, hint_in_slot(store, slot, "ret-")), 0
    next_one = send(store, store.messages_get(returned).hint)  # type: ignore[union-attr]
    die_with_calls(store, dead, slot, [
        *run_of(ran, after), *run_of(single), (abandoned, abandoned, "abandoned"),
        (returned, returned, "returned"), (next_one, returned, "called"),
    ])
    heir = take_over(store, Metrics(), slot)
    adoption = adopt(store, heir, slot, poison_after=1)
    assert sorted(adoption.lost) == sorted([ran, after, single, abandoned, returned, next_one])
    assert adoption.crashed == () and adoption.poisoned == (), "poison_after=1, yet nothing ran alone"
    for row_id in (ran, after, single, abandoned, returned, next_one):
        message = store.messages_get(row_id)
        assert message is not None and (message.lost_calls, message.crashed_calls) == (1, 0), row_id
        assert message.state is MessageState.READY and message.redelivered


def test_adopting_again_counts_nothing_twice_and_never_the_holders_own_calls(store: Store) -> None:
    """Adoption takes each lost call's row as it counts it: a second adoption (another fetch, another replica)
    finds nothing of it, and the calls of the term held now are never read."""
    dead = leaser(store, "dead")
    dead.run_once()
    lost = send(store, "order-1")
    slot = slot_of(store, lost)
    own = send(store, hint_in_slot(store, slot, "own-"))
    die_with_calls(store, dead, slot, run_of(lost))
    metrics = Metrics()
    heir = take_over(store, metrics, slot)
    fence = heir.fence(slot)
    assert fence is not None
    from worker.db.calls import MarkRequest
    marked = store.calls_mark([MarkRequest(slot, fence, (own,))])  # the heir's own call runs
    assert marked.marked == {own}
    first, again = adopt(store, heir, slot), adopt(store, heir, slot)
    assert first.lost == (lost,) and again.lost == () and again.kept == 0
    message = store.messages_get(lost)
    assert message is not None and (message.lost_calls, message.crashed_calls) == (1, 0)
    mine = store.messages_get(own)
    assert mine is not None and mine.lost_calls == 0 and in_flight(store) == {own: "called"}


def test_a_call_of_an_ended_term_in_a_quiet_slot_is_adopted_at_the_next_poll(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mark that committed after the slot's next holder adopted it (its term ended meanwhile) leaves a row in
    a slot the holder finds empty: the look at its quiet slots sees the row, and the slot is fetched (adopting the
    call, counted once, and delivering the message again) at the next poll."""
    dead = leaser(store, "dead")
    dead.run_once()
    old_fences = {slot: dead.fence(slot) for slot in dead.slots()}
    with store.engine.begin() as connection:
        connection.execute(text("UPDATE correlation_lock SET lock_until = now() - interval '1 second'"))
    metrics = Metrics()
    heir = leaser(store, "heir", metrics=metrics)
    heir.run_once()
    looks = watched(monkeypatch, store, "messages_look")
    seen: list[tuple[int, bool]] = []

    def handler(message: Message) -> None:
        seen.append((message.id, message.redelivered))

    settings = Settings(poll={"interval": "PT0.5S", "initial_delay": "PT0S"}, metrics={"enabled": False})
    engine = Engine(store, Router({"*": handler}), settings, heir, metrics, heir.holder)
    stop_at_teardown(lambda: engine.stop(grace=0))
    engine.start()
    assert wait_until(lambda: len(looks) >= 2, 10), "the slots went quiet"
    late = send(store, "late-mark")
    slot = slot_of(store, late)
    fence = old_fences[slot]
    assert fence is not None
    with store.engine.begin() as connection:
        connection.execute(
            text("INSERT INTO correlation_call (message_id, slot, fence, holder, run_head, state) "
                 "VALUES (:id, :slot, :fence, 'dead', :id, 'called')"),
            {"id": late, "slot": slot, "fence": fence.fence},
        )
    assert wait_until(lambda: (late, True) in seen, 10), "adopted and delivered again"
    assert metrics.lost_calls._value.get() == 1
    assert wait_until(lambda: in_flight(store) == {}, 10), "its outcome recorded"
    message = store.messages_get(late)
    assert message is not None and message.state is MessageState.DELIVERED


def test_a_lost_call_whose_row_a_session_holds_is_counted_once_after_the_lock_and_delivered_again(
    store: Store, pg_url: str
) -> None:
    dead = leaser(store, "dead")
    dead.run_once()
    locked, free = send(store, "order-1"), 0
    slot = slot_of(store, locked)
    free = send(store, hint_in_slot(store, slot, "free-"))
    die_with_calls(store, dead, slot, run_of(locked) + run_of(free))
    metrics = Metrics()
    heir = take_over(store, metrics, slot)
    seen: list[tuple[int, bool]] = []

    def handler(message: Message) -> None:
        seen.append((message.id, message.redelivered))

    settings = Settings(poll={"interval": "PT1S"}, metrics={"enabled": False})
    engine = Engine(store, Router({"*": handler}), settings, heir, metrics, heir.holder)
    stop_at_teardown(lambda: engine.stop(grace=0))
    with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql")) as session:
        session.execute("SELECT id FROM correlation_message WHERE id = %s FOR UPDATE", (locked,))
        for _ in range(3):  # fetches while the lock is held: the free one goes, the locked one waits uncounted
            engine.run_once(timeout=2)
        assert seen == [(free, True)]
        assert store.messages_get(locked).lost_calls == 0  # type: ignore[union-attr]
        assert in_flight(store) == {locked: "called"}, "never fetched while its lost call is not counted"
        session.rollback()
    engine.run_once()
    assert seen == [(free, True), (locked, True)]
    assert metrics.redeliveries._value.get() == 2 and metrics.lost_calls._value.get() == 2
    assert in_flight(store) == {}


def test_a_message_delivered_again_is_called_with_no_other_call_beside_it_and_marked_so(store: Store) -> None:
    dead = leaser(store, "dead")
    dead.run_once()
    lost = send(store, "lost-1")
    slot = slot_of(store, lost)
    others = [send(store, hint_in_slot(store, slot, f"h{n}-")) for n in range(12)]  # more hints than lanes
    die_with_calls(store, dead, slot, run_of(lost))
    heir = take_over(store, Metrics(), slot)
    guard = threading.Lock()
    running: set[int] = set()
    beside: set[int] = set()  # calls that ran while the lost message's call did
    marks_during: list[dict[int, str]] = []

    def handler(message: Message) -> None:
        with guard:
            running.add(message.id)
            if lost in running:
                beside.update(running - {lost})
        if message.id == lost:
            marks_during.append(in_flight(store))
        time.sleep(0.05)
        with guard:
            running.discard(message.id)

    settings = Settings(poll={"interval": "PT1S", "concurrency": 8}, metrics={"enabled": False})
    engine = Engine(store, Router({"*": handler}), settings, heir, Metrics(), heir.holder)
    stop_at_teardown(lambda: engine.stop(grace=0))
    result = engine.run_once()
    assert result.correlated == len(others) + 1 and result.adopted == 1
    assert beside == set(), "no other call ran while the message delivered again was being called"
    assert marks_during == [{lost: "alone"}], "its mark says it ran alone, and nothing else is marked"


def test_no_call_starts_beside_a_message_delivered_again_until_its_outcome_is_handled(store: Store) -> None:
    """Were another call to kill the process while the lone call's mark still said alone, the crash would be
    blamed on it: the gate stays shut until a flush wrote the outcome (or marked the call returned)."""
    dead = leaser(store, "dead")
    dead.run_once()
    lost = send(store, "lost-1")
    slot = slot_of(store, lost)
    others = [send(store, hint_in_slot(store, slot, f"h{n}-")) for n in range(4)]
    die_with_calls(store, dead, slot, run_of(lost))
    heir = take_over(store, Metrics(), slot)
    record = store.messages_record

    def slow_record(writes: Any) -> Any:
        time.sleep(0.2)  # the lone call's outcome is written well after its call returned
        return record(writes)

    store.messages_record = slow_record  # type: ignore[method-assign]
    lost_row_at_calls: list[bool] = []

    def handler(message: Message) -> None:
        if message.id != lost:
            lost_row_at_calls.append(not left(store, lost))

    settings = Settings(poll={"interval": "PT1S", "concurrency": 4}, metrics={"enabled": False})
    engine = Engine(store, Router({"*": handler}), settings, heir, Metrics(), heir.holder)
    stop_at_teardown(lambda: engine.stop(grace=0))
    result = engine.run_once()
    assert result.correlated == len(others) + 1 and result.adopted == 1
    assert lost_row_at_calls == [False] * len(others), "every other call started after the lone outcome was written"


def test_a_session_holding_the_row_of_a_message_delivered_again_delays_its_hint_only(
    store: Store, pg_url: str
) -> None:
    """The lone call's outcome waits for the lock; its call is marked returned meanwhile, and the other hints'
    calls go on at once instead of waiting for the write (its own hint goes on in order behind it)."""
    dead = leaser(store, "dead")
    dead.run_once()
    lost = send(store, "lost-1")
    slot = slot_of(store, lost)
    behind = send(store, "lost-1")
    others = [send(store, hint_in_slot(store, slot, f"h{n}-")) for n in range(4)]
    die_with_calls(store, dead, slot, run_of(lost))
    heir = take_over(store, Metrics(), slot)
    calls: list[int] = []
    lone_returned = threading.Event()
    session = psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql"))
    stop_at_teardown(session.close)

    def handler(message: Message) -> None:
        if message.id == lost:  # another session takes the row while the lone call runs
            session.execute("SELECT id FROM correlation_message WHERE id = %s FOR UPDATE", (lost,))
            lone_returned.set()
        calls.append(message.id)

    settings = Settings(poll={"interval": "PT1S", "concurrency": 4}, metrics={"enabled": False})
    engine = Engine(store, Router({"*": handler}), settings, heir, Metrics(), heir.holder)
    stop_at_teardown(lambda: engine.stop(grace=0))
    engine.start()
    assert lone_returned.wait(10)
    assert wait_until(lambda: set(others) <= set(calls)), "the other hints were called while the row stayed locked"
    assert wait_until(lambda: behind in calls) and calls.index(lost) < calls.index(behind), "its hint, in order"
    assert wait_until(lambda: in_flight(store) == {lost: "returned"}), "its call is over; its outcome waits"
    assert not left(store, lost)
    session.rollback()
    assert wait_until(lambda: left(store, lost))
    assert calls.count(lost) == 1 and in_flight(store) == {}


def test_while_every_lane_calls_the_next_hints_run_is_marked_before_a_lane_is_free(store: Store) -> None:
    """A lane that ends its run finds the next one marked already: it never waits for a mark between runs."""
    holder = leaser(store, "a")
    holder.run_once()
    first = send(store, "order-1")
    second = send(store, hint_in_slot(store, slot_of(store, first), "other-"))
    calls: list[int] = []
    marked_during_call: list[bool] = []

    def handler(message: Message) -> None:
        if not calls:  # the one lane calls: the other hint's run is marked meanwhile
            other = second if message.id == first else first
            marked_during_call.append(wait_until(lambda: other in in_flight(store)))
        calls.append(message.id)

    settings = Settings(poll={"interval": "PT1S", "concurrency": 1}, metrics={"enabled": False})
    engine = Engine(store, Router({"*": handler}), settings, holder, Metrics(), holder.holder)
    stop_at_teardown(lambda: engine.stop(grace=0))
    result = engine.run_once()
    assert marked_during_call == [True]
    assert sorted(calls) == [first, second] and result.correlated == 2
    assert in_flight(store) == {}


def test_a_run_marked_ahead_when_its_replica_dies_is_delivered_again_counted_and_not_blamed(store: Store) -> None:
    """A run marked ahead may not have started when the replica died: it is delivered again, counted as lost,
    and it cannot make its message dead, which only a crash during a call made alone can."""
    holder = leaser(store, "dead")
    holder.run_once()
    first = send(store, "order-1")
    slot = slot_of(store, first)
    second = send(store, hint_in_slot(store, slot, "other-"))
    at_death: list[dict[int, str]] = []
    dying, gone = threading.Event(), threading.Event()

    def handler(message: Message) -> None:  # the first call hangs: its replica is as good as dead
        other = second if message.id == first else first
        if wait_until(lambda: other in in_flight(store)):
            at_death.append(in_flight(store))
        dying.set()
        gone.wait(30)

    settings = Settings(poll={"interval": "PT1S", "concurrency": 1}, metrics={"enabled": False})
    zombie = Engine(store, Router({"*": handler}), settings, holder, Metrics(), holder.holder)
    stop_at_teardown(gone.set)
    stop_at_teardown(lambda: zombie.stop(grace=0))
    zombie.start()
    assert dying.wait(10)
    assert at_death == [{first: "called", second: "called"}]
    die_with_calls(store, holder, slot, [])
    metrics = Metrics()
    heir = take_over(store, metrics, slot)
    calls: list[int] = []
    result = engine_of(store, heir, metrics, calls, poison_after=1).run_once()
    assert sorted(calls) == [first, second] and result.correlated == 2 and result.adopted == 2
    assert metrics.redeliveries._value.get() == 2 and metrics.lost_calls._value.get() == 2
    assert in_flight(store) == {}


@pytest.mark.parametrize("marker", ["lane", "fetch"])
def test_a_run_marked_as_its_replica_stops_is_unmarked_before_its_slot_is_released(
    store: Store, marker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Marked by its lane (the hint waited in the rotation) or by the fetch itself (a lane waited for work)."""
    calls: list[int] = []
    engine = idle_engine(store, monkeypatch, calls)
    marked, go = threading.Event(), threading.Event()
    if marker == "lane":
        engine.lanes.reserve = lambda: 0  # type: ignore[method-assign]  # as if no lane were free at the fetch
    send(store, "order-1")
    mark_ahead, marked_by_fetch = engine.committer.mark_ahead, engine.committer.marked_by_fetch
    paths: list[str] = []

    def by_fetch(*args: object, **kwargs: object) -> list[MarkTicket]:
        tickets = marked_by_fetch(*args, **kwargs)  # type: ignore[arg-type]
        paths.extend("fetch" for ticket in tickets if ticket.calls)
        return tickets

    def by_lane(*args: object, **kwargs: object) -> MarkTicket:
        paths.append("lane")
        return mark_ahead(*args, **kwargs)  # type: ignore[arg-type]

    marks_written = engine.lanes._marks_written

    async def written_then_hold(ticket: MarkTicket) -> bool:  # stops between the mark and the call
        written = await marks_written(ticket)
        if written:
            marked.set()
            await asyncio.get_running_loop().run_in_executor(None, go.wait, 10)
        return written

    engine.committer.mark_ahead = by_lane  # type: ignore[method-assign]
    engine.committer.marked_by_fetch = by_fetch  # type: ignore[method-assign]
    engine.lanes._marks_written = written_then_hold  # type: ignore[method-assign]
    engine.start()
    assert marked.wait(10)
    assert paths == [marker]
    assert in_flight(store) != {}
    stopper = threading.Thread(target=engine.stop, kwargs={"grace": 5.0})
    stopper.start()
    deadline = time.monotonic() + 10
    while not engine.lanes._stopping and time.monotonic() < deadline:  # the replica stops taking work
        time.sleep(0.001)
    go.set()
    stopper.join(10)
    assert calls == [], "a replica stopping makes no call it had not started"
    assert in_flight(store) == {}, "the mark of the call not made is gone before the slot is released"


def test_a_run_that_starts_while_every_lane_calls_has_the_next_two_runs_marked_ahead(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs marked ahead make up for the ones lanes take, and more, up to one per lane: with one marked per run
    started, as many stayed ahead as when the rotation last ran short, and a lane ending its run waited for a mark
    asked only a run before."""
    monkeypatch.setattr(engine_module, "FETCHERS", 1)
    holder = leaser(store, "a")
    holder.run_once()
    first = send(store, "busy-0")
    slot = slot_of(store, first)
    fence = holder.fence(slot)
    assert fence is not None
    busy = [first, send(store, hint_in_slot(store, slot, "busy-1-"))]
    later = [send(store, hint_in_slot(store, slot, f"later-{n}-")) for n in range(3)]
    calls: list[int] = []
    engine = engine_of(store, holder, Metrics(), calls, 2)
    lanes = engine.lanes
    returns = {message: threading.Event() for message in [*busy, *later]}
    stop_at_teardown(lambda: [done.set() for done in returns.values()])  # before the engine stops

    def handler(message: Message) -> None:
        calls.append(message.id)
        returns[message.id].wait(30)

    lanes.router = Router({"*": handler})
    engine._start_parts()  # the lanes, and no fetch: the test hands the hints over
    lanes.submit([fetched_work(store, engine, slot, fence, message) for message in busy])
    assert wait_until(lambda: sorted(calls) == sorted(busy)), "both lanes call"
    # No lane is free: these wait in the rotation
    lanes.submit([fetched_work(store, engine, slot, fence, message) for message in later])
    assert in_flight(store).keys() == set(busy)
    returns[busy[0]].set()  # a lane ends its run and starts the next hint's...
    assert wait_until(lambda: len(calls) == 3 and calls[2] == later[0])
    # ...and has both hints left marked ahead (one per lane), for the lanes to come
    assert wait_until(lambda: in_flight(store).keys() == {busy[1], *later})
    with lanes._cond:
        assert [ahead.calls[0].id for ahead in lanes._ahead] == later[1:]
    for done in returns.values():
        done.set()
    assert wait_until(lambda: sorted(calls) == sorted([*busy, *later]) and in_flight(store) == {})


def test_a_replica_whose_every_lane_is_stuck_keeps_no_run_marked_ahead(store: Store) -> None:
    """Its calls will not start before it is restarted: were they left marked, they would count as lost."""
    holder = leaser(store, "a")
    holder.run_once()
    first = send(store, "order-1")
    second = send(store, hint_in_slot(store, slot_of(store, first), "other-"))
    release = threading.Event()
    stop_at_teardown(release.set)
    started: list[int] = []

    def handler(message: Message) -> None:
        started.append(message.id)
        release.wait(30)

    settings = Settings(
        poll={"interval": "PT1S", "concurrency": 1}, policy={"handler_timeout": "PT0.3S"}, metrics={"enabled": False},
    )
    engine = Engine(store, Router({"*": handler}), settings, holder, Metrics(), holder.holder)
    stop_at_teardown(lambda: engine.stop(grace=0))
    engine.start()
    assert wait_until(lambda: engine.health() is not None and engine.committer.written == 1)
    assert len(started) == 1 and started[0] in (first, second)
    assert wait_until(lambda: in_flight(store) == {}), "the other hint's run is not left marked"


def test_a_term_taken_again_by_the_same_replica_starts_no_call_of_the_ended_term_and_keeps_the_new_one(
    store: Store,
) -> None:
    """Work fetched under an ended term is not called under the next one; a late write of the ended term never
    drops the term held now; the call that ran records its outcome (nobody took it over) and nothing is lost."""
    holder = leaser(store, "a")
    holder.run_once()
    first, second = send(store, "order-1"), send(store, "order-1")
    slot = slot_of(store, first)
    old = holder.fence(slot)
    assert old is not None
    calls: list[tuple[int, bool]] = []
    in_call, resume = threading.Event(), threading.Event()
    stop_at_teardown(resume.set)

    def handler(message: Message) -> None:
        calls.append((message.id, message.redelivered))
        if message.id == first:
            in_call.set()
            resume.wait(10)

    metrics = Metrics()
    settings = Settings(poll={"interval": "PT1S", "concurrency": 2}, metrics={"enabled": False})
    engine = Engine(store, Router({"*": handler}), settings, holder, metrics, holder.holder)
    stop_at_teardown(lambda: engine.stop(grace=0))
    engine.start()
    assert in_call.wait(10)
    with store.engine.begin() as connection:  # the term ends under the running call...
        connection.execute(text("UPDATE correlation_lock SET lock_until = now() - interval '1 second' "
                                "WHERE name = :name"), {"name": old.name})
    holder.run_once()  # ...and this replica takes the slot again: a new term
    new = holder.fence(slot)
    assert new is not None and new.fence > old.fence
    holder.lost(slot, old)  # a late write of the ended term: the term held now stays
    assert holder.fence(slot) == new
    resume.set()
    assert wait_until(lambda: left(store, second), 10)
    assert [message_id for message_id, _ in calls] == [first, second], "each called once, in order"
    assert left(store, first) and in_flight(store) == {}
    assert metrics.redeliveries._value.get() == 0 and holder.fence(slot) == new


def test_a_message_whose_hint_a_session_changes_while_its_call_runs_is_refused_and_called_once(store: Store) -> None:
    holder = leaser(store, "a")
    holder.run_once()
    moved = send(store, "order-1")
    calls: list[int] = []
    in_call, resume = threading.Event(), threading.Event()
    stop_at_teardown(resume.set)

    def handler(message: Message) -> None:
        calls.append(message.id)
        if len(calls) == 1:
            in_call.set()
            resume.wait(10)

    settings = Settings(poll={"interval": "PT0.2S", "concurrency": 4}, metrics={"enabled": False})
    engine = Engine(store, Router({"*": handler}), settings, holder, Metrics(), holder.holder)
    stop_at_teardown(lambda: engine.stop(grace=0))
    engine.start()
    assert in_call.wait(10)
    with pytest.raises(IntegrityError, match="correlation_message_hint_kept"), store.engine.begin() as connection:
        # a session moving the message to another hint mid-call is refused (schema revision 0015)
        connection.execute(text("UPDATE correlation_message SET correlation_hint = 'elsewhere' WHERE id = :id"),
                           {"id": moved})
    engine.wake()
    time.sleep(1.0)  # several polls and fetches of every slot pass: none may call it again
    assert calls == [moved]
    resume.set()
    assert wait_until(lambda: left(store, moved))
    assert calls == [moved] and in_flight(store) == {}


def test_a_message_moved_to_another_hint_between_its_fetch_and_its_mark_is_not_marked(any_store: Store) -> None:
    """A lane marks a run some time after the fetch read it: a message whose hint a session changed meanwhile
    (no call row yet, so the change was allowed) belongs to its new hint's work now, and is not marked for the
    old one (which would call it beside its new hint's earlier messages, perhaps on another replica)."""
    from worker.db.calls import MarkRequest

    holder = leaser(any_store, "a")
    holder.run_once()
    kept, moved = send(any_store, "order-1"), send(any_store, "order-1")
    slot = slot_of(any_store, kept)
    fence = holder.fence(slot)
    assert fence is not None
    with any_store.engine.begin() as connection:  # after the fetch, before the mark
        connection.execute(text("UPDATE correlation_message SET correlation_hint = 'order-2' WHERE id = :id"),
                           {"id": moved})
    result = any_store.calls_mark([MarkRequest(slot, fence, (kept, moved), hint="order-1")])
    assert result.marked == {kept} and in_flight(any_store) == {kept: "called"}
    assert any_store.calls_mark([MarkRequest(slot, fence, (moved,))]).marked == {moved}, "unchecked without a hint"


# -- calls a fetch marks itself, for lanes waiting for work ----------------------------------------------------


def _fetch_marking(store: Store, slot: int, mark: FetchMark) -> Fetched:
    _, fetched = store.messages_fetch_slot(slot, "", 100, per_hint=100, limit=1000, mode=Mode.FAIL_FIRST, mark=mark)
    return fetched


def _calls(store: Store) -> dict[int, tuple[int, int, str, int]]:
    """The call rows: message id → (slot, fence, holder, run head)."""
    with store.engine.connect() as connection:
        rows = connection.execute(text("SELECT message_id, slot, fence, holder, run_head FROM correlation_call"))
        return {row[0]: (row[1], row[2], row[3], row[4]) for row in rows}


def test_a_fetch_bounded_by_bytes_marks_only_the_calls_it_returns(store: Store) -> None:
    a = leaser(store, "a")
    a.run_once()
    first = send(store, "a-1", payload={"blob": "x" * 100_000})
    slot = slot_of(store, first)
    for prefix in ("b-", "c-", "d-"):
        send(store, hint_in_slot(store, slot, prefix), payload={"blob": "x" * 100_000})
    fence = a.fence(slot)
    assert fence is not None
    _, fetched = store.messages_fetch_slot(slot, "", 100, per_hint=100, limit=1000, mode=Mode.FAIL_FIRST,
                                           mark=FetchMark(fence, 4), page_bytes=150_000)
    returned = {message.id for message in fetched.messages}
    assert len(returned) == 2 and fetched.bytes_full
    assert fetched.marked == returned and set(_calls(store)) == returned


def test_a_fetch_for_idle_lanes_marks_the_first_runs_of_its_first_hints_under_its_term(store: Store) -> None:
    a = leaser(store, "a")
    a.run_once()
    first = send(store, "a-1")
    slot = slot_of(store, first)
    b, c = hint_in_slot(store, slot, "b-"), hint_in_slot(store, slot, "c-")
    rows = {"a": [first], "b": [], "c": []}
    for hint, key in [(b, "b"), ("a-1", "a"), (c, "c"), ("a-1", "a"), (b, "b"), (c, "c")]:
        rows[key].append(send(store, hint))
    fence = a.fence(slot)
    assert fence is not None

    fetched = _fetch_marking(store, slot, FetchMark(fence, 2, runs=(("n", 2),)))

    assert len(fetched.messages) == 7, "the page is the same as without marks"
    assert fetched.marked == {*rows["a"][:2], *rows["b"][:2]}, "the first two hints in the page, two calls each"
    assert fetched.remaining is not None and 0 < fetched.remaining <= 40
    marked = _calls(store)
    assert marked == {i: (slot, fence.fence, fence.holder, rows[k][0]) for k in "ab" for i in rows[k][:2]}

    _, again = store.messages_fetch_slot(slot, "", 100, per_hint=100, limit=1000, mode=Mode.FAIL_FIRST)
    assert again.in_flight >= fetched.marked, "marked calls read as in flight, as a lane's marks do"


def test_a_fetchs_run_ends_before_a_call_in_flight_a_paused_name_and_a_message_delivered_again(store: Store) -> None:
    a = leaser(store, "a")
    a.run_once()
    head = send(store, "a-1")
    slot = slot_of(store, head)
    hints = [hint_in_slot(store, slot, f"{prefix}-") for prefix in "bcde"]
    ids = {hint: [send(store, hint), send(store, hint)] for hint in hints}
    ids["a-1"] = [head, send(store, "a-1")]
    b, c, d, _ = hints
    fence = a.fence(slot)
    assert fence is not None
    with store.engine.begin() as connection:
        connection.execute(text("UPDATE correlation_message SET message_name = 'p' WHERE id = :id"),
                           {"id": ids[b][1]})
        connection.execute(text("UPDATE correlation_message SET lost_calls = 1 WHERE id IN (:c, :d)"),
                           {"c": ids[c][1], "d": ids[d][0]})
    die = [(ids["a-1"][1], ids["a-1"][1], "called")]  # a call of an ended term, not adopted yet
    with store.engine.begin() as connection:
        connection.execute(
            text("INSERT INTO correlation_call (message_id, slot, fence, holder, run_head, state) "
                 "VALUES (:id, :slot, 0, 'gone', :head, :state)"),
            [{"id": i, "slot": slot, "head": h, "state": s} for i, h, s in die],
        )

    fetched = _fetch_marking(store, slot, FetchMark(fence, 10, paused=("p",), runs=(("n", 10),)))

    # a: its second call is in flight; b: its second message's name is paused; c: its second message was delivered
    # again (called alone); d: its first one was, and no hint from there on is marked, e included.
    assert fetched.marked == {ids["a-1"][0], ids[b][0], ids[c][0]}
    assert set(_calls(store)) == fetched.marked | {ids["a-1"][1]}


def test_a_fetch_prepares_its_statements_at_their_first_run_and_the_slots_runs_its_generic_plan(store: Store) -> None:
    """After one fetch, its connection holds both statements prepared (psycopg's own threshold is the fifth run),
    and each has been planned generic, not for its values (a custom plan is made at every run: planning the batches'
    statement at each fetch cost about 1.5 ms of every wake-up). The batches' plan is kept for the table's size
    class (test_a_fetch_keeps_a_plan_of_the_batches_for_each_size_of_the_table)."""
    slot = slot_of(store, send(store, "a-1"))

    def prepared() -> dict[str, tuple[int, int]]:
        store.engine.dispose()  # the fetch's connection is the only one in the pool afterwards
        store.messages_fetch_slot(slot, "", 100, per_hint=100, limit=1000, mode=Mode.FAIL_FIRST)
        with store.engine.connect() as connection:
            rows = connection.execute(text(
                "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
                " WHERE statement LIKE '%correlation_message%' AND from_sql = false"
            )).all()
        return {("slot" if "after_cursor" in sql else "batches" if "AS batch" in sql else sql): (generic, custom)
                for sql, generic, custom in rows}

    assert prepared() == {"slot": (1, 0), "batches": (1, 0)}  # a table of one message


def _rows_through_plan(node: dict[str, Any]) -> float:
    """Every row each node of an EXPLAIN ANALYZE plan produced, over all its loops, summed over the tree."""
    own = float(node.get("Actual Rows", 0)) * float(node.get("Actual Loops", 1))
    return own + sum(_rows_through_plan(child) for child in node.get("Plans", ()))


def test_a_fetch_that_marks_does_work_in_proportion_to_its_page(store: Store) -> None:
    """The statement's plan, from auto_explain, counts the rows its nodes produced: a few dozen per row of the page
    (about 30 here). A run's length joined back to the page's rows was computed again for every row: the page's
    size squared (about 1 200 per row here)."""
    a = leaser(store, "a")
    a.run_once()
    slot = slot_of(store, send(store, "a-1"))
    with store.engine.begin() as connection:
        connection.execute(text(
            "INSERT INTO correlation_message (message_name, correlation_hint)"
            " SELECT 'n', h FROM (SELECT 'h-' || i AS h FROM generate_series(1, 100000) AS i"
            "                      WHERE ((hashtext('h-' || i) % 64) + 64) % 64 = :slot LIMIT 300) AS hints"
            " CROSS JOIN generate_series(1, 2)"
        ), {"slot": slot})
    fence = a.fence(slot)
    assert fence is not None
    plans: list[dict[str, Any]] = []

    def explain(diagnostic: psycopg.errors.Diagnostic) -> None:
        message = diagnostic.message_primary or ""
        if "plan:" in message and "INSERT INTO correlation_call" in message:
            plans.append(json.loads(message.split("plan:", 1)[1])["Plan"])

    def explained(driver: psycopg.Connection[Any], _record: object) -> None:
        try:
            driver.execute("LOAD 'auto_explain'")
        except psycopg.errors.InsufficientPrivilege:
            driver.rollback()
            return
        for setting in ("log_min_duration = 0", "log_analyze = on", "log_format = json", "log_level = notice"):
            driver.execute(f"SET auto_explain.{setting}")
        driver.commit()
        driver.add_notice_handler(explain)

    store.engine.dispose()
    event.listen(store.engine, "connect", explained)
    try:
        _, fetched = store.messages_fetch_slot(
            slot, "", 1000, per_hint=100, limit=1000, mode=Mode.FAIL_FIRST, mark=FetchMark(fence, 8)
        )
    finally:
        event.remove(store.engine, "connect", explained)
        store.engine.dispose()
    if not plans:
        pytest.skip("auto_explain cannot be loaded here (it needs a superuser)")
    page = len(fetched.messages)
    assert page >= 500 and len(fetched.marked) == 8
    assert len(plans) == 1
    assert _rows_through_plan(plans[0]) < 60 * page, plans[0]


def test_a_fetch_whose_term_has_ended_marks_nothing(store: Store) -> None:
    a = leaser(store, "a")
    a.run_once()
    message = send(store, "a-1")
    slot = slot_of(store, message)
    fence = a.fence(slot)
    assert fence is not None
    with store.engine.begin() as connection:
        connection.execute(text("UPDATE correlation_lock SET lock_until = now() - interval '1 second' "
                                "WHERE name = :name"), {"name": fence.name})

    fetched = _fetch_marking(store, slot, FetchMark(fence, 8))

    assert [m.id for m in fetched.messages] == [message]
    assert fetched.marked == frozenset() and fetched.remaining is None and _calls(store) == {}


def test_work_arriving_at_an_idle_replica_is_marked_by_its_fetch_and_called_with_no_mark_of_its_own(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    engine = idle_engine(store, monkeypatch, calls)
    marks: list[object] = []
    calls_mark = store.calls_mark

    def counted(requests: Any) -> Any:
        marks.append(requests)
        return calls_mark(requests)

    store.calls_mark = counted  # type: ignore[method-assign]
    engine.start()
    message = send(store, "order-1")
    engine.wake()
    assert wait_until(lambda: calls == [message] and in_flight(store) == {})
    assert marks == [], "the fetch marked the call: no mark of its own before it"


def called_later_uncounted(
    store: Store, engine: Engine, calls: list[int], metrics: Metrics, failed: list[dict[int, str]]
) -> int:
    """Start the engine, send one message, and check that its marks failed once (written, as ``failed`` saw
    them), were taken back, and that it was called once later, not counted lost; its id."""
    engine.start()
    message = send(store, "order-1")
    engine.wake()
    assert wait_until(lambda: calls == [message] and in_flight(store) == {})
    assert failed == [{message: "called"}], "the failed write had marked the call"
    assert metrics.lost_calls._value.get() == 0 and metrics.redeliveries._value.get() == 0, "its mark was taken back"
    return message


@pytest.mark.parametrize("where", ["after the answer", "before the answer"])
def test_a_fetch_that_fails_after_marking_takes_its_marks_back_and_its_work_is_called_later_uncounted(
    store: Store, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault comes after the fetch's answer (handing the work over), or before it (the statement committed,
    then the connection failed): either way no call stays marked, and the message is called, not counted lost."""
    calls: list[int] = []
    metrics = Metrics()
    engine = idle_engine(store, monkeypatch, calls, metrics)
    took, fetch = engine._took, store.messages_fetch_slot
    failed: list[dict[int, str]] = []

    def fails_once(*args: Any) -> Any:
        if not failed and args[4].marked:  # the batches came back with calls marked, then the fetch fails
            failed.append(in_flight(store))
            raise RuntimeError("a fault after the fetch")
        return took(*args)

    def answer_lost_once(*args: Any, **kwargs: Any) -> Any:
        candidates, fetched = fetch(*args, **kwargs)
        if not failed and fetched.marked:
            failed.append(in_flight(store))
            raise DatabaseUnavailable("the connection was lost after the commit")
        return candidates, fetched

    if where == "after the answer":
        engine._took = fails_once  # type: ignore[method-assign]
    else:
        store.messages_fetch_slot = answer_lost_once  # type: ignore[method-assign]
    called_later_uncounted(store, engine, calls, metrics, failed)


def test_a_lanes_mark_whose_answer_is_lost_is_taken_back_and_its_call_made_later_uncounted(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lane's own mark commits, then the connection fails before its answer: the lane does not call, and takes
    the mark back before its hint is free again; the message is called at a later fetch, not counted lost (a
    call row of the term left behind would hold it back until the term ended, then be counted)."""
    calls: list[int] = []
    metrics = Metrics()
    engine = idle_engine(store, monkeypatch, calls, metrics)
    monkeypatch.setattr(engine.lanes, "reserve", lambda: 0)  # no fetch marks: the lane marks its run itself
    calls_mark = store.calls_mark
    failed: list[dict[int, str]] = []

    def answer_lost_once(requests: Any) -> Any:
        marked = calls_mark(requests)
        if not failed:
            failed.append(in_flight(store))
            raise DatabaseUnavailable("the connection was lost after the commit")
        return marked

    store.calls_mark = answer_lost_once  # type: ignore[method-assign]
    message = called_later_uncounted(store, engine, calls, metrics, failed)
    record = store.messages_get(message)
    assert record is not None and record.lost_calls == 0


def _withdrawals(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[MarkTicket]:
    """The tickets the engine's lanes withdraw, as they withdraw them."""
    withdrawn: list[MarkTicket] = []
    withdraw = engine.committer.withdraw

    def recorded(ticket: MarkTicket) -> None:
        withdrawn.append(ticket)
        withdraw(ticket)

    monkeypatch.setattr(engine.committer, "withdraw", recorded)
    return withdrawn


def _markers_held_up(store: Store, entered: threading.Event) -> threading.Event:
    """Hold up the marks the markers write (not those a lane writes itself) until the event returned is set;
    ``entered`` is set as one is held."""
    held_up = threading.Event()
    calls_mark = store.calls_mark

    def held(requests: Any) -> Any:
        if threading.current_thread().name.startswith("marker-"):
            entered.set()
            held_up.wait(DEADLINE)
        return calls_mark(requests)

    store.calls_mark = held  # type: ignore[method-assign]
    return held_up


def test_a_replica_stopping_while_a_lane_waits_for_held_up_marks_does_not_wait_for_them(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lane looks at the stop while it waits: its ticket is withdrawn at once, where the lane waited for the
    answer and held the stop's wait for runs in flight for as long (its whole grace, were the database slow
    enough). The committer waits for the marks still being written, and takes them back before it stops: a mark
    left in the table would be counted as a lost call by the slot's next holder."""
    calls: list[int] = []
    engine = idle_engine(store, monkeypatch, calls)
    monkeypatch.setattr(engine.lanes, "reserve", lambda: 0)
    monkeypatch.setattr(engine_module, "MARKERS", 1)
    entered = threading.Event()
    held_up = _markers_held_up(store, entered)
    withdrawn = _withdrawals(engine, monkeypatch)
    engine.start()
    message = send(store, "order-1")
    engine.wake()
    assert entered.wait(DEADLINE)
    stopping = threading.Thread(target=lambda: engine.stop(grace=DEADLINE))
    asked = time.monotonic()
    stopping.start()
    try:
        assert wait_until(lambda: withdrawn, 5.0), "the lane waits for its marks through the stop"
        assert time.monotonic() - asked < 5.0 and [*withdrawn[0].calls] == [message]
    finally:
        held_up.set()
        stopping.join(DEADLINE)
    assert calls == [] and not stopping.is_alive()
    assert in_flight(store) == {}


def test_a_fetch_marks_runs_as_long_as_their_first_messages_name_says(store: Store) -> None:
    a = leaser(store, "a")
    a.run_once()
    first = send(store, "a-1")
    slot = slot_of(store, first)
    b = hint_in_slot(store, slot, "b-")
    hint_a = [first, send(store, "a-1"), send(store, "a-1")]
    hint_b = [send(store, b), send(store, b), send(store, b)]
    with store.engine.begin() as connection:  # a-1: n, m, n; b: m, n, n
        connection.execute(text("UPDATE correlation_message SET message_name = 'm' WHERE id IN (:x, :y)"),
                           {"x": hint_a[1], "y": hint_b[0]})
    fence = a.fence(slot)
    assert fence is not None

    fetched = _fetch_marking(store, slot, FetchMark(fence, 8, runs=(("n", 3),)))

    # a-1 starts with an n: three calls, whatever their names; b starts with an m, not timed: one call
    assert fetched.marked == {*hint_a, hint_b[0]}


def test_a_message_delivered_again_waits_at_the_gate_while_a_fetch_may_mark_calls(store: Store) -> None:
    """A fetch marking runs for idle lanes holds the gate: the lone call starts once its runs are ahead (or none)."""
    dead = leaser(store, "dead")
    dead.run_once()
    lost = send(store, "lost-1")
    slot = slot_of(store, lost)
    die_with_calls(store, dead, slot, run_of(lost))
    heir = take_over(store, Metrics(), slot)
    calls: list[int] = []
    engine = engine_of(store, heir, Metrics(), calls)
    engine._start_parts()  # the lanes, idle, and no fetch yet
    assert engine.lanes.reserve() > 0, "a fetch may mark calls for the idle lanes"
    engine.start()
    assert wait_until(lambda: engine.lanes._alone_waiting == 1), "the message delivered again waits at the gate"
    assert calls == []
    engine.lanes.unreserve()  # the fetch handed its work over
    assert wait_until(lambda: calls == [lost])


@pytest.mark.parametrize(("concurrency", "lone"), [(8, 1), (1, 1), (4, 4)])
def test_runs_a_fetch_marked_reach_a_lane_while_the_other_lanes_wait_at_the_gate_behind_a_lone_call(
    store: Store, concurrency: int, lone: int
) -> None:
    """A fetch marking runs for idle lanes hands them over while every lane holds a hint at the gate (``lone`` of
    them to call alone, waiting for runs to end; the others waiting for them): a lane steps aside to make the
    marked runs, or the gate waits for them for ever (a replica taking over slots stalled until they were handed
    back). When every lane holds a message to call alone, one of those lanes steps aside."""
    dead = leaser(store, "dead")
    dead.run_once()
    first = send(store, "a-lost-1")  # the rotation goes by hint: these first
    slot = slot_of(store, first)
    lost = [first, *(send(store, hint_in_slot(store, slot, f"a-lost-{n}-")) for n in range(2, lone + 1))]
    fresh = [send(store, hint_in_slot(store, slot, f"b-fresh-{n}-")) for n in range(30)]
    die_with_calls(store, dead, slot, [call for message in lost for call in run_of(message)])
    heir = take_over(store, Metrics(), slot)
    calls: list[int] = []
    engine = engine_of(store, heir, Metrics(), calls, concurrency)
    lanes = engine.lanes
    beside: dict[int, int] = {}  # message → the most calls seen running beside its own (as it starts, 10 ms on)

    def running_beside() -> int:
        with lanes._cond:
            return lanes._running_calls() - 1

    def handler(message: Message) -> None:
        first = running_beside()
        time.sleep(0.01)
        beside[message.id] = max(first, running_beside())
        calls.append(message.id)

    lanes.router = Router({"*": handler})
    engine._start_parts()  # the lanes, idle, and no fetch yet
    assert lanes.reserve() > 0, "a fetch may mark calls for the idle lanes"
    engine.start()

    def all_at_the_gate() -> bool:
        with lanes._cond:
            return lanes._alone_waiting == min(lone, concurrency) and len(lanes._rotation) > 0 and all(
                lane.work is not None and not lane.admitted for lane in lanes._lanes
            )

    assert wait_until(all_at_the_gate), "the lone calls and a hint per other lane wait at the gate"
    with lanes._cond:  # the marking fetch hands a hint over with its first run marked
        work = lanes._rotation.popleft()
        ticket = engine.committer.mark_ahead(work.slot, work.fence, [work.pending[0].id])
    lanes.submit([work], {work.pending[0].id: ticket})
    lanes.unreserve()
    assert wait_until(lambda: sorted(calls) == sorted([*lost, *fresh]) and in_flight(store) == {}), (
        f"called {len(calls)} of {len(lost) + len(fresh)}"
    )
    assert [beside[message] for message in lost] == [0] * len(lost), "each lost message called alone"


def test_a_run_a_fetch_marked_while_stuck_calls_came_to_hold_every_lane_is_unmarked_and_its_hint_let_go(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetch reserves marking while the lanes are idle; by the time it hands its run over, stuck calls hold every
    lane. No lane would make the run, and its call would stay marked until a stuck call returns or the replica is
    restarted (as health asks), then be counted lost though never made: its mark is taken back and its hint let
    go, to be fetched and called once a lane is free."""
    monkeypatch.setattr(engine_module, "FETCHERS", 1)
    holder = leaser(store, "a")
    holder.run_once()
    first = send(store, "stuck-0")
    slot = slot_of(store, first)
    fence = holder.fence(slot)
    # Two lanes, two stuck calls: the lane replacing the first one given up on finds nothing to take, and no
    # call is given up on after the second (which lets go of any run then ahead)
    stuck = [first, send(store, hint_in_slot(store, slot, "stuck-1-"))]
    release = threading.Event()
    calls: list[int] = []
    engine = engine_of(store, holder, Metrics(), calls, 2, handler_timeout="PT0.3S")
    lanes = engine.lanes

    def handler(message: Message) -> None:
        calls.append(message.id)
        if message.id in stuck:
            release.wait(30)

    lanes.router = Router({"*": handler})
    stop_at_teardown(release.set)  # before the engine stops: finalizers run in reverse order
    engine._start_parts()  # the lanes, idle, and no fetch yet
    assert lanes.reserve() > 0, "a fetch may mark calls for the idle lanes"
    engine.start()  # its own fetch marks nothing while that one may
    assert wait_until(lanes.exhausted), "stuck calls hold both lanes (no fetch runs from now on)"

    # What the marking fetch read meanwhile: a hint of the same slot, its first run marked
    late_hint = hint_in_slot(store, slot, "late-")
    late = send(store, late_hint)
    assert fence is not None
    work = fetched_work(store, engine, slot, fence, late)
    ticket = engine.committer.mark_ahead(slot, fence, [late])
    assert ticket.done.wait(5) and ticket.marked == {late} and late in in_flight(store)
    lanes.submit([work], {late: ticket})
    lanes.unreserve()
    assert wait_until(lambda: late not in in_flight(store)), "the run no lane can make is unmarked"
    assert not lanes._ahead and work.finished, "its hint let go"

    release.set()  # the stuck calls return: a lane is free
    assert wait_until(lambda: late in calls and in_flight(store) == {}), "the late message called once a lane is free"
    assert calls.count(late) == 1
    record = store.messages_get(late)
    assert record is not None and record.lost_calls == 0


def test_a_failure_of_the_lanes_own_before_a_runs_marks_are_answered_takes_them_back_and_charges_nothing(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the lanes after a run's marks were asked for, before their answer was taken: the run's exit
    withdraws them (taken back once written: nothing stays in flight under the live term), nothing is charged,
    and the hint's messages are called, in order, at the next poll."""
    from worker.engine.lanes import Lanes

    real = Lanes._marks_written
    failed: list[int] = []

    async def failing_once(self: Lanes, ticket: Any) -> bool:
        if not failed and not ticket.by_fetch:  # a run marked by a lane (a fetch's marks are the fetch's)
            await real(self, ticket)  # written: only taking the answer fails
            failed.extend(ticket.marked)
            raise KeyError("a bug of the lanes")
        return await real(self, ticket)

    monkeypatch.setattr(Lanes, "_marks_written", failing_once)
    monkeypatch.setattr(engine_module, "FETCHERS", 1)
    # Two hints, one lane: the fetch marks one hint's run (every lane waits), the lane marks the other's ahead.
    hints = {"a": [send(store, "a") for _ in range(2)], "h": [send(store, "h") for _ in range(2)]}
    calls: list[int] = []
    holder = leaser(store, "a")
    holder.run_once()
    engine = engine_of(store, holder, Metrics(), calls, concurrency=1)
    engine.run_once()
    assert failed, "a run marked by the lane failed"
    assert not in_flight(store), "its marks were taken back"
    assert all(message.attempt == 0 for message in store.messages_list(MessageFilter())), "nothing charged"
    engine.run_once()
    assert all([i for i in calls if i in ids] == ids for ids in hints.values()), calls
    assert sorted(calls) == sorted(hints["a"] + hints["h"]), "each called once"
