"""In-flight marks on slot leases: what a replica taking over a dead holder's slot counts and decides.

The dead holder is simulated exactly: its marks are written on its lease row as its committer writes them, and
its term is ended in the database (no waiting for clocks), then another replica takes the slot over.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from sqlalchemy import text

from tests.conftest import stop_at_teardown
from tests.integration.test_slot_leases import leaser
from worker.config import Settings
from worker.correlators import Router
from worker.db.messages import InFlight
from worker.db.store import NewMessage, Store
from worker.engine.committer import MarkTicket
from worker.engine.engine import Engine
from worker.engine.leases import SlotLeaser, slot_lock_name
from worker.message import Message, MessageState
from worker.service.metrics import Metrics


def in_flight_marks(store: Store) -> dict[str, str]:
    with store.engine.connect() as connection:
        rows = connection.execute(text("SELECT name, in_flight FROM correlation_lock WHERE in_flight IS NOT NULL"))
        return {row.name: row.in_flight for row in rows}


def engine_of(store: Store, slots: SlotLeaser, metrics: Metrics, calls: list[int], **policy: object) -> Engine:
    def handler(message: Message) -> None:
        calls.append(message.id)

    settings = Settings(poll={"interval": "PT1S"}, policy=policy, metrics={"enabled": False})
    engine = Engine(store, Router({"*": handler}), settings, slots, metrics, slots.holder)
    stop_at_teardown(lambda: engine.stop(grace=0))
    return engine


def hint_in_slot(store: Store, slot: int, prefix: str) -> str:
    """A hint (starting with ``prefix``) whose messages fall into this slot."""
    with store.engine.connect() as connection:
        return str(connection.execute(text(
            "SELECT h FROM (SELECT :prefix || i AS h FROM generate_series(1, 10000) AS i) AS hints"
            " WHERE ((hashtext(h) % 64) + 64) % 64 = :slot LIMIT 1"
        ), {"prefix": prefix, "slot": slot}).scalar_one())


def send(store: Store, hint: str) -> int:
    row_id = store.messages_insert(NewMessage("n", hint))
    assert row_id is not None
    return row_id


def die_with_marks(store: Store, dead: SlotLeaser, slot: int, marks: InFlight | str) -> None:
    """The holder wrote these marks, then died: its term ends without a release."""
    fence = dead.fence(slot)
    assert fence is not None
    value = marks if isinstance(marks, str) else marks.to_json()
    with store.engine.begin() as connection:
        connection.execute(
            text("UPDATE correlation_lock SET in_flight = :marks, lock_until = now() - interval '1 second' "
                 "WHERE name = :name AND fence = :fence"),
            {"marks": value, "name": fence.name, "fence": fence.fence},
        )


def take_over(store: Store, metrics: Metrics, slot: int, name: str = "heir") -> SlotLeaser:
    heir = leaser(store, name, metrics=metrics)
    heir.run_once()
    assert slot in heir.slots()
    return heir


def test_a_clean_run_leaves_no_in_flight_mark(store: Store) -> None:
    a = leaser(store, "a")
    a.run_once()
    send(store, "order-1")
    calls: list[int] = []
    metrics = Metrics()
    result = engine_of(store, a, metrics, calls).run_once()
    assert result.correlated == 1 and metrics.redeliveries._value.get() == 0
    assert in_flight_marks(store) == {}


def test_calls_in_flight_at_a_holders_death_are_counted_exactly_when_delivered_again(store: Store) -> None:
    dead = leaser(store, "dead")
    dead.run_once()
    alone = send(store, "order-1")  # its call was marked alone: it was running when the holder died
    first, second = send(store, "order-2"), send(store, "order-2")  # a run marked together
    untouched = send(store, "order-3")
    slots = {store.messages_get(i).slot for i in (alone, first, untouched)}  # type: ignore[union-attr]
    for slot in slots:
        marks = InFlight(runs=tuple(
            run for run in ((alone,), (first, second))
            if store.messages_get(run[0]).slot == slot  # type: ignore[union-attr]
        ))
        die_with_marks(store, dead, slot, marks)
    metrics = Metrics()
    heir = take_over(store, metrics, next(iter(slots)))
    calls: list[int] = []
    result = engine_of(store, heir, metrics, calls).run_once()
    assert sorted(calls) == sorted({alone, first, second, untouched})
    assert result.adopted == 3 and metrics.lost_calls._value.get() == 3
    assert metrics.redeliveries._value.get() == 3  # exactly the calls marked in flight, each once
    assert in_flight_marks(store) == {}


def test_a_message_whose_calls_kill_its_replica_is_dead_after_poison_after_crashes(store: Store) -> None:
    poison, neighbour = send(store, "order-1"), send(store, "order-1")
    slot = store.messages_get(poison).slot  # type: ignore[union-attr]
    bystander = send(store, hint_in_slot(store, slot, "other-"))
    holder = leaser(store, "replica-0")
    holder.run_once()
    for crash in (1, 2):  # the call of `poison` was running alone when its replica died
        die_with_marks(store, holder, slot, InFlight(runs=((poison,),), alone=(poison,)))
        holder = take_over(store, Metrics(), slot, f"replica-{crash}")
        adoption = store.slot_adopt_lost_calls(holder.fence(slot), _settle(3))  # type: ignore[arg-type]
        assert adoption.crashed == (poison,) and not adoption.poisoned
    die_with_marks(store, holder, slot, InFlight(runs=((poison,),), alone=(poison,)))
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


def _settle(poison_after: int):  # type: ignore[no-untyped-def]
    from worker.policy.outcomes import settle_lost_call

    return lambda call: settle_lost_call(
        call.lost_calls, call.crashed_calls, call.last_error, crashed=call.crashed, alone=call.alone,
        poison_after=poison_after,
    )


def test_each_runs_first_unrecorded_call_counts_as_a_crash_never_attributed_beside_others(store: Store) -> None:
    """The rest of a run may not have started: lost only. Calls given up at shutdown: lost only. Nothing ran
    alone, so nothing is poison even at poison_after=1."""
    dead = leaser(store, "dead")
    dead.run_once()
    ran, after = send(store, "h-1"), send(store, "h-1")
    slot = store.messages_get(ran).slot  # type: ignore[union-attr]
    single = send(store, hint_in_slot(store, slot, "single-"))  # a run of one, but other lanes were calling
    abandoned = send(store, hint_in_slot(store, slot, "other-"))
    die_with_marks(store, dead, slot, InFlight(runs=((ran, after), (single,)), abandoned=(abandoned,)))
    heir = take_over(store, Metrics(), slot)
    adoption = store.slot_adopt_lost_calls(heir.fence(slot), _settle(1))  # type: ignore[arg-type]
    assert sorted(adoption.lost) == sorted([ran, after, single, abandoned]) and adoption.crashed == ()
    assert adoption.poisoned == (), "poison_after=1, yet nothing ran alone: nobody is blamed"
    for row_id, crashes in ((ran, 1), (after, 0), (single, 1), (abandoned, 0)):
        message = store.messages_get(row_id)
        assert message is not None and (message.lost_calls, message.crashed_calls) == (1, crashes)
        assert message.state is MessageState.READY and message.redelivered


def test_marks_in_the_first_revisions_format_are_read_as_one_run(store: Store) -> None:
    dead = leaser(store, "dead")
    dead.run_once()
    first, second = send(store, "order-1"), send(store, "order-1")
    slot = store.messages_get(first).slot  # type: ignore[union-attr]
    die_with_marks(store, dead, slot, f"[{first}, {second}]")
    heir = take_over(store, Metrics(), slot)
    adoption = store.slot_adopt_lost_calls(heir.fence(slot), _settle(1))  # type: ignore[arg-type]
    assert sorted(adoption.lost) == [first, second] and adoption.crashed == ()


def test_a_message_delivered_again_is_called_with_no_other_call_beside_it_and_marked_so(store: Store) -> None:
    dead = leaser(store, "dead")
    dead.run_once()
    lost = send(store, "lost-1")
    slot = store.messages_get(lost).slot  # type: ignore[union-attr]
    others = [send(store, hint_in_slot(store, slot, f"h{n}-")) for n in range(12)]  # more hints than lanes
    die_with_marks(store, dead, slot, InFlight(runs=((lost,),)))
    heir = take_over(store, Metrics(), slot)
    guard = threading.Lock()
    running: set[int] = set()
    beside: set[int] = set()  # calls that ran while the lost message's call did
    marks_during: list[InFlight] = []

    def handler(message: Message) -> None:
        with guard:
            running.add(message.id)
            if lost in running:
                beside.update(running - {lost})
        if message.id == lost:
            marks_during.append(InFlight.from_json(in_flight_marks(store).get(slot_lock_name(slot))))
        time.sleep(0.05)
        with guard:
            running.discard(message.id)

    settings = Settings(poll={"interval": "PT1S", "concurrency": 8}, metrics={"enabled": False})
    engine = Engine(store, Router({"*": handler}), settings, heir, Metrics(), heir.holder)
    stop_at_teardown(lambda: engine.stop(grace=0))
    result = engine.run_once()
    assert result.correlated == len(others) + 1 and result.adopted == 1
    assert beside == set(), "no other call ran while the message delivered again was being called"
    assert [m.alone for m in marks_during] == [(lost,)], "its mark says it ran alone"


def test_no_call_starts_beside_a_message_delivered_again_until_its_outcome_is_written(store: Store) -> None:
    """Were another call to kill the process while the lone call's outcome still waited to be written, the lone
    call's mark would remain and the crash would be blamed on it: the gate stays shut until the write."""
    dead = leaser(store, "dead")
    dead.run_once()
    lost = send(store, "lost-1")
    slot = store.messages_get(lost).slot  # type: ignore[union-attr]
    others = [send(store, hint_in_slot(store, slot, f"h{n}-")) for n in range(4)]
    die_with_marks(store, dead, slot, InFlight(runs=((lost,),)))
    heir = take_over(store, Metrics(), slot)
    record = store.messages_record

    def slow_record(writes: Any) -> Any:
        time.sleep(0.2)  # the lone call's outcome is written well after its call returned
        return record(writes)

    store.messages_record = slow_record  # type: ignore[method-assign]
    lost_row_at_calls: list[bool] = []
    marks_at_lone_call: list[InFlight] = []

    def handler(message: Message) -> None:
        if message.id == lost:  # nothing else is marked meanwhile, not even ahead
            wait_until(lambda: bool(marked_ids(store) - {lost}), seconds=0.3)
            marks_at_lone_call.extend(InFlight.from_json(marks) for marks in in_flight_marks(store).values())
        else:
            lost_row_at_calls.append(store.messages_get(lost) is not None)

    settings = Settings(poll={"interval": "PT1S", "concurrency": 4}, metrics={"enabled": False})
    engine = Engine(store, Router({"*": handler}), settings, heir, Metrics(), heir.holder)
    stop_at_teardown(lambda: engine.stop(grace=0))
    result = engine.run_once()
    assert result.correlated == len(others) + 1 and result.adopted == 1
    assert lost_row_at_calls == [False] * len(others), "every other call started after the lone outcome was written"
    assert marks_at_lone_call == [InFlight(runs=((lost,),), alone=(lost,))]


def marked_ids(store: Store) -> set[int]:
    return {i for marks in in_flight_marks(store).values() for run in InFlight.from_json(marks).runs for i in run}


def wait_until(condition: Any, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_while_every_lane_calls_the_next_hints_run_is_marked_before_a_lane_is_free(store: Store) -> None:
    """A lane that ends its run finds the next one marked already: it never waits for a mark between runs."""
    holder = leaser(store, "a")
    holder.run_once()
    first = send(store, "order-1")
    second = send(store, hint_in_slot(store, store.messages_get(first).slot, "other-"))  # type: ignore[union-attr]
    calls: list[int] = []
    marked_during_call: list[bool] = []

    def handler(message: Message) -> None:
        if not calls:  # the one lane calls: the other hint's run is marked meanwhile
            other = second if message.id == first else first
            marked_during_call.append(wait_until(lambda: other in marked_ids(store)))
        calls.append(message.id)

    settings = Settings(poll={"interval": "PT1S", "concurrency": 1}, metrics={"enabled": False})
    engine = Engine(store, Router({"*": handler}), settings, holder, Metrics(), holder.holder)
    stop_at_teardown(lambda: engine.stop(grace=0))
    result = engine.run_once()
    assert marked_during_call == [True]
    assert sorted(calls) == [first, second] and result.correlated == 2
    assert in_flight_marks(store) == {}


def test_a_run_marked_ahead_when_its_replica_dies_is_delivered_again_counted_and_not_blamed(store: Store) -> None:
    """A run marked ahead may not have started when the replica died: it is delivered again, counted as lost,
    and it cannot make its message dead, which only a crash during a call made alone can."""
    holder = leaser(store, "dead")
    holder.run_once()
    first = send(store, "order-1")
    slot = store.messages_get(first).slot  # type: ignore[union-attr]
    second = send(store, hint_in_slot(store, slot, "other-"))
    at_death: list[str] = []
    dying, gone = threading.Event(), threading.Event()

    def handler(message: Message) -> None:  # the first call hangs: its replica is as good as dead
        other = second if message.id == first else first
        if wait_until(lambda: other in marked_ids(store)):
            at_death.extend(in_flight_marks(store).values())
        dying.set()
        gone.wait(30)

    settings = Settings(poll={"interval": "PT1S", "concurrency": 1}, metrics={"enabled": False})
    zombie = Engine(store, Router({"*": handler}), settings, holder, Metrics(), holder.holder)
    stop_at_teardown(gone.set)
    stop_at_teardown(lambda: zombie.stop(grace=0))
    zombie.start()
    assert dying.wait(10)
    assert len(at_death) == 1
    marks = InFlight.from_json(at_death[0])
    assert sorted(marks.runs) == sorted(((first,), (second,))) and not marks.alone
    die_with_marks(store, holder, slot, at_death[0])
    metrics = Metrics()
    heir = take_over(store, metrics, slot)
    calls: list[int] = []
    result = engine_of(store, heir, metrics, calls, poison_after=1).run_once()
    assert sorted(calls) == [first, second] and result.correlated == 2 and result.adopted == 2
    assert metrics.redeliveries._value.get() == 2 and metrics.lost_calls._value.get() == 2
    assert in_flight_marks(store) == {}


def test_a_run_marked_as_its_replica_stops_is_unmarked_before_the_last_marks_are_written(store: Store) -> None:
    holder = leaser(store, "a")
    holder.run_once()
    send(store, "order-1")
    calls: list[int] = []
    engine = engine_of(store, holder, Metrics(), calls)
    marked, go = threading.Event(), threading.Event()
    mark_ahead = engine.committer.mark_ahead

    def mark_then_wait(*args: object, **kwargs: object) -> MarkTicket:  # stops between the mark and the call
        ticket = mark_ahead(*args, **kwargs)  # type: ignore[arg-type]
        wait = ticket.wait

        def wait_then_hold() -> float | None:
            remaining = wait()
            marked.set()
            go.wait(10)
            return remaining

        ticket.wait = wait_then_hold  # type: ignore[method-assign]
        return ticket

    engine.committer.mark_ahead = mark_then_wait  # type: ignore[method-assign]
    engine.start()
    assert marked.wait(10)
    assert in_flight_marks(store) != {}
    stopper = threading.Thread(target=engine.stop, kwargs={"grace": 5.0})
    stopper.start()
    deadline = time.monotonic() + 10
    while not engine.lanes._stopping and time.monotonic() < deadline:  # the replica stops taking work
        time.sleep(0.001)
    go.set()
    stopper.join(10)
    assert calls == [], "a replica stopping makes no call it had not started"
    assert in_flight_marks(store) == {}, "the mark of the call not made is gone before the slot is released"


def test_a_replica_whose_every_lane_is_stuck_keeps_no_run_marked_ahead(store: Store) -> None:
    """Its calls will not start before it is restarted: were they left marked, they would count as lost."""
    holder = leaser(store, "a")
    holder.run_once()
    first = send(store, "order-1")
    second = send(store, hint_in_slot(store, store.messages_get(first).slot, "other-"))  # type: ignore[union-attr]
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
    assert wait_until(lambda: in_flight_marks(store) == {}), "the other hint's run is not left marked"
    assert engine.lanes.waiting() == 1
