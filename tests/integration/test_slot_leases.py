"""Slot leases against real PostgreSQL: several SlotLeasers in one process share the 64 slots."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import pytest
from sqlalchemy import text

from tests.conftest import left
from tests.integration.test_locks import wait_past
from worker.db.calls import SlotWrite
from worker.db.store import LeaseLost, NewMessage, Store
from worker.engine.leases import MEMBER_PREFIX, SlotLeaseConfig, SlotLeaser, member_lock_name, slot_lock_name
from worker.policy.outcomes import Disposition, Kind
from worker.service.metrics import Metrics

S = 64
DEADLINE = 15.0  # seconds; only a guard against hanging
# Long terms for tests that drive rounds by hand; nothing expires while they run.
STEADY = SlotLeaseConfig(drain=timedelta(0))
# Short terms for tests that wait for expiry.
SHORT = SlotLeaseConfig(
    lease=timedelta(milliseconds=1200),
    renew_interval=timedelta(milliseconds=300),
    safety_margin=timedelta(milliseconds=300),
    drain=timedelta(0),
)


class FakeClock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def wait_until(condition: Callable[[], bool], what: str, step: float = 0.02) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        time.sleep(step)


def leaser(
    store: Store,
    name: str,
    config: SlotLeaseConfig = STEADY,
    metrics: Metrics | None = None,
    monotonic: Callable[[], float] = time.monotonic,
) -> SlotLeaser:
    return SlotLeaser(store, f"{name}-pod-0a1b2c3d", config, metrics, monotonic)


def counts(leasers: Sequence[SlotLeaser]) -> list[int]:
    return [len(one.slots()) for one in leasers]


def rounds_until(leasers: Sequence[SlotLeaser], done: Callable[[], bool], limit: int = 10) -> int:
    """Run rounds of every leaser in turn until ``done``; returns how many rounds it took."""
    for number in range(1, limit + 1):
        for one in leasers:
            one.run_once()
        if done():
            return number
    pytest.fail(f"not done after {limit} rounds: {counts(leasers)}")


def assert_partition(leasers: Sequence[SlotLeaser]) -> None:
    """Every slot offered by exactly one leaser, and the lock table agrees."""
    offered = [slot for one in leasers for slot in one.slots()]
    assert sorted(offered) == list(range(S))
    held = {row.name: row.locked_by for row in leasers[0].store.locks_list_held()}
    for one in leasers:
        for slot in one.slots():
            assert held[slot_lock_name(slot)] == one.holder


def balanced(leasers: Sequence[SlotLeaser]) -> bool:
    offered = counts(leasers)
    return sum(offered) == S and max(offered) - min(offered) <= 1


def test_a_lone_leaser_takes_every_slot_with_a_first_fence(store: Store) -> None:
    metrics = Metrics()
    alone = leaser(store, "a", metrics=metrics)
    result = alone.run_once()
    assert (result.held, result.target, result.replicas, result.acquired) == (64, 64, 1, 64)
    assert alone.slots() == tuple(range(S))
    assert alone.fences(7)[0].name == "slot:7" and alone.fences(7)[0].fence == 1
    assert metrics.registry.get_sample_value("correlation_slots_held") == 64
    assert metrics.registry.get_sample_value("correlation_lease_acquisitions_total") == 64
    again = alone.run_once()
    assert (again.acquired, again.renewed, again.lost) == (0, 64, 0)


def test_two_leasers_split_the_slots_evenly(store: Store) -> None:
    pair = [leaser(store, "a"), leaser(store, "b")]
    rounds_until(pair, lambda: counts(pair) == [32, 32])
    assert_partition(pair)


def test_two_leasers_starting_together_split_the_slots_evenly(store: Store) -> None:
    a, b = leaser(store, "a"), leaser(store, "b")
    a.run_once()  # a alone takes everything, before b's first round
    b.run_once()
    rounds_until([a, b], lambda: counts([a, b]) == [32, 32])
    assert_partition([a, b])


def test_a_third_leaser_joining_gets_its_share_after_a_few_rounds(store: Store) -> None:
    pair = [leaser(store, "a"), leaser(store, "b")]
    rounds_until(pair, lambda: counts(pair) == [32, 32])
    trio = [*pair, leaser(store, "c")]
    rounds = rounds_until(trio, lambda: balanced(trio))
    assert rounds <= 3
    assert sorted(counts(trio)) == [21, 21, 22]
    assert_partition(trio)
    for one in trio:  # settled: nothing moves any more
        result = one.run_once()
        assert (result.acquired, result.released, result.lost) == (0, 0, 0)


def test_a_leaser_that_releases_all_has_its_slots_taken_over_in_one_round(store: Store) -> None:
    trio = [leaser(store, "a"), leaser(store, "b"), leaser(store, "c")]
    rounds_until(trio, lambda: balanced(trio))
    leaving = trio.pop()
    had = len(leaving.slots())
    assert leaving.release_all() == had
    assert leaving.slots() == ()
    assert member_lock_name(leaving.holder) not in {row.name for row in store.locks_list_held()}
    for one in trio:
        one.run_once()
    assert counts(trio) == [32, 32]
    assert_partition(trio)
    assert leaving.run_once().held == 0  # a stopped leaser takes nothing back


def test_a_frozen_leaser_loses_its_slots_after_the_lease_and_its_commit_is_fenced_off(store: Store) -> None:
    metrics = Metrics()
    live, frozen = leaser(store, "live", SHORT), leaser(store, "frozen", SHORT, metrics=metrics)
    rounds_until([live, frozen], lambda: counts([live, frozen]) == [32, 32])
    message_id, slot = 0, -1
    for n in range(200):
        message_id = store.messages_insert(NewMessage("order.paid", f"order-{n}")) or 0
        message = store.messages_get(message_id)
        assert message is not None
        if message.slot in frozen.slots():
            slot = message.slot
            break
    old_fences = frozen.fences(slot)

    # The frozen replica runs no more rounds; the live one keeps going.
    wait_until(lambda: live.run_once().held == S, "the live leaser takes the frozen one's slots", step=0.1)
    assert frozen.slots() == ()  # its local deadlines passed before its terms ended
    assert live.fences(slot)[0].fence == old_fences[0].fence + 1
    (stale,) = frozen.fences(slot)
    written = store.messages_record([SlotWrite(slot, stale, (Disposition(message_id, Kind.DELETE, 0),))])
    assert written.fenced == {message_id} and not written.written  # no call of it is marked under that term
    assert not left(store, message_id)

    thawed = frozen.run_once()  # waking up, it finds every term lost and joins again with no slot
    assert thawed.lost == 32 and thawed.held == 0
    assert metrics.registry.get_sample_value("correlation_lease_losses_total") == 32
    assert metrics.registry.get_sample_value("correlation_slots_held") == 0
    with pytest.raises(LeaseLost):
        frozen.fences(slot)
    rounds_until([live, frozen], lambda: counts([live, frozen]) == [32, 32])


def test_a_dead_replicas_slots_are_taken_by_a_round_just_after_its_terms_end_even_with_a_new_replica_short(
    store: Store,
) -> None:
    """The survivor's next round is due when the dead replica's terms end (not a renew interval later), and it
    takes every lapsed slot although the replacement, which joined meanwhile, is short of its share."""
    survivor, dead = leaser(store, "survivor", SHORT), leaser(store, "dead", SHORT)
    rounds_until([survivor, dead], lambda: counts([survivor, dead]) == [32, 32])
    dead.run_once()  # its last renewal; then it runs no more rounds
    time.sleep(0.4)
    replacement = leaser(store, "replacement", SHORT)
    replacement.run_once()  # joins (a member with no slot: short of its share), nothing free yet
    survivor.run_once()
    dead_until = max(row.lock_until for row in store.locks_list_held() if row.locked_by == dead.holder)
    due = survivor.next_round_in()
    left_of_term = (dead_until - store.now()).total_seconds()
    assert due is not None and left_of_term - 0.1 <= due <= left_of_term + 0.2, (due, left_of_term)
    time.sleep(due)
    wait_past(store, dead_until)
    taken = survivor.run_once()
    assert taken.acquired == 32  # every lapsed slot, the replacement short of its share or not
    assert dead.holder not in {row.locked_by for row in store.locks_list_held()}
    assert store.locks_count_lapsed("slot:") == 0  # lapsed slots first, before those handed back
    rounds_until([survivor, replacement], lambda: balanced([survivor, replacement]))  # the shares come back


def test_a_round_tells_the_engine_what_it_acquired_and_that_it_renewed_terms(store: Store) -> None:
    """``on_acquired`` after a round that took slots (naming every slot held), ``on_renewed`` after one that
    renewed terms: the engine fetches slots it left until a renewal (a term too short for a call) on it."""
    one = leaser(store, "a")
    acquired: list[tuple[int, ...]] = []
    renewed: list[bool] = []
    one.on_acquired = lambda slots: acquired.append(tuple(slots))
    one.on_renewed = lambda: renewed.append(True)
    one.run_once()
    assert acquired == [tuple(range(S))] and renewed == []
    one.run_once()
    assert len(acquired) == 1 and renewed == [True]


def test_a_surplus_slot_is_handed_back_only_once_the_engine_fetched_it_under_its_term(store: Store) -> None:
    """A slot just taken over (a dead replica's, say) holds work that waited for its lapse: it is handed back to
    balance the cluster only once this replica's engine fetched it, so that work is called here rather than made to
    wait for the hand-back and the next holder's round."""
    a, b = leaser(store, "a"), leaser(store, "b")
    fetched: set[int] = set()
    a.fetched_under = lambda slot, fence: slot in fetched
    a.run_once()  # alone: takes every slot
    b.run_once()  # joins, short of its share
    for _ in range(3):
        a.run_once()
    assert len(a.slots()) == S, "nothing handed back before it was fetched"
    fetched.update(range(0, S, 2))  # half the slots fetched
    rounds_until([a, b], lambda: counts([a, b]) == [32, 32])
    assert set(b.slots()) <= set(range(0, S, 2)), "only fetched slots were handed back"
    assert_partition([a, b])


def test_a_released_slot_has_a_higher_fence_when_acquired_again(store: Store) -> None:
    first = leaser(store, "a")
    first.run_once()
    before = first.fences(5)[0]
    first.release_all()
    second = leaser(store, "b")
    second.run_once()
    after = second.fences(5)[0]
    assert after.holder == second.holder
    assert after.fence == before.fence + 1


def test_slots_stop_being_offered_at_the_local_deadline_until_renewed(store: Store) -> None:
    clock = FakeClock()
    one = leaser(store, "a", monotonic=clock)
    one.run_once()
    safe_for = (STEADY.lease - STEADY.safety_margin).total_seconds()
    clock.advance(safe_for - 0.001)
    assert len(one.slots()) == S
    clock.advance(0.001)
    assert one.slots() == ()
    assert one.fences(3)[0].fence == 1  # the term itself is the database's to judge at commit
    result = one.run_once()  # the database term still runs: renewing brings the slots back
    assert (result.renewed, result.lost) == (S, 0)
    assert len(one.slots()) == S


def test_a_handed_back_slot_is_withheld_from_the_poller_for_the_drain_before_it_is_released(
    store: Store,
) -> None:
    clock = FakeClock()
    config = SlotLeaseConfig(drain=timedelta(seconds=5))
    holder, joiner = leaser(store, "a", config, monotonic=clock), leaser(store, "b", config)
    holder.run_once()
    joiner.run_once()
    result = holder.run_once()
    assert result.released == 0 and result.held == S
    assert len(holder.slots()) == 32  # withheld: the poller stops taking pages of those slots
    slot_rows = [row for row in store.locks_list_held() if row.name.startswith("slot:")]
    assert {row.locked_by for row in slot_rows} == {holder.holder} and len(slot_rows) == S
    assert joiner.run_once().acquired == 0
    clock.advance(5)
    assert holder.run_once().released == 32
    assert joiner.run_once().acquired == 32
    assert_partition([holder, joiner])


def test_a_member_with_no_slots_is_counted_as_live(store: Store) -> None:
    holder, joiner = leaser(store, "a"), leaser(store, "b")
    holder.run_once()
    result = joiner.run_once()
    assert (result.held, result.target, result.replicas) == (0, 32, 2)
    members = [row for row in store.locks_list_held() if row.name.startswith(MEMBER_PREFIX)]
    assert {row.locked_by for row in members} == {holder.holder, joiner.holder}
    assert holder.run_once().released == 32


def test_a_joining_leaser_forgets_the_membership_of_replicas_that_died_long_ago(store: Store) -> None:
    assert store.lock_try_acquire("member:long-gone", "ghost", timedelta(milliseconds=10)) is not None
    assert store.lock_try_acquire("member:just-gone", "ghost-2", SHORT.lease) is not None
    long_gone = next(row for row in store.locks_list() if row.name == "member:long-gone")
    forgotten_after = long_gone.lock_until + SHORT.lease  # the other one ends about a lease later still
    wait_until(lambda: store.now() > forgotten_after, "the first member is a lease past its term")
    leaser(store, "a", SHORT).run_once()
    names = {row.name for row in store.locks_list()}
    assert "member:long-gone" not in names
    assert "member:just-gone" in names


def test_a_term_of_its_own_that_the_leaser_lost_track_of_is_adopted(store: Store) -> None:
    one = leaser(store, "a")
    names = [slot_lock_name(n) for n in (3, 4)]
    taken = store.lock_try_acquire_many(names, one.holder, timedelta(minutes=1), 2)
    result = one.run_once()
    assert result.held == S and result.acquired == S
    assert [one.fences(3)[0], one.fences(4)[0]] == taken


def test_fences_of_a_slot_never_leased_raise_lease_lost(store: Store) -> None:
    with pytest.raises(LeaseLost, match="slot 9"):
        leaser(store, "a").fences(9)


def test_leasers_on_their_own_threads_never_offer_the_same_slot_at_once(store: Store) -> None:
    config = SlotLeaseConfig(
        lease=timedelta(seconds=2),
        renew_interval=timedelta(milliseconds=200),
        safety_margin=timedelta(milliseconds=500),
        drain=timedelta(milliseconds=100),
    )
    trio = [leaser(store, name, config) for name in "abc"]
    stop = {one.holder: threading.Event() for one in trio}
    errors: list[BaseException] = []

    def loop(one: SlotLeaser) -> None:
        while not stop[one.holder].wait(config.renew_interval.total_seconds()):
            try:
                one.run_once()
            except BaseException as error:  # surfaced below
                errors.append(error)

    def offered_once_at_most(leasers: Sequence[SlotLeaser]) -> bool:
        offered = [slot for one in leasers for slot in one.slots()]
        assert len(offered) == len(set(offered)), "a slot offered by two leasers at once"
        return not errors

    threads = [threading.Thread(target=loop, args=(one,), daemon=True) for one in trio]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: offered_once_at_most(trio) and balanced(trio), "three leasers balance", 0.005)
        leaving = trio.pop()
        leaving.release_all()  # while its thread still runs rounds: they must do nothing now
        wait_until(lambda: offered_once_at_most(trio) and counts(trio) == [32, 32], "two take over", 0.005)
        assert leaving.slots() == ()
    finally:
        for event in stop.values():
            event.set()
        for thread in threads:
            thread.join(timeout=DEADLINE)
    assert not errors, errors


def test_rounds_failing_for_longer_than_a_lease_term_are_reported_as_trouble() -> None:
    from worker.config import DatabaseSettings
    from worker.db.base import build_engine
    from worker.db.store import DatabaseUnavailable

    unreachable = Store(build_engine(DatabaseSettings(url="postgresql+psycopg://postgres@127.0.0.1:1/none")))
    now = [1000.0]
    one = leaser(unreachable, "a", monotonic=lambda: now[0])
    lease = STEADY.lease.total_seconds()
    try:
        for _ in range(2):
            with pytest.raises(DatabaseUnavailable):
                one.run_once()
            assert one.trouble() is None, "a failing round is not yet trouble"
            now[0] += lease / 2
        now[0] += 1
        with pytest.raises(DatabaseUnavailable):
            one.run_once()
        trouble = one.trouble()
        assert trouble is not None and "no slot lease could be taken or renewed" in trouble
        assert "database unavailable" in trouble
    finally:
        unreachable.close()


def test_a_round_that_succeeds_ends_the_trouble(store: Store) -> None:
    now = [1000.0]
    one = leaser(store, "a", monotonic=lambda: now[0])
    one._failing_since, one._failure = 0.0, "an earlier failure"  # rounds failed for a long time
    assert one.trouble() is not None
    one.run_once()
    assert one.trouble() is None


def test_rounds_failing_with_an_error_the_store_does_not_know_are_trouble_too(store: Store) -> None:
    """A round may fail with an error the store does not translate (a trigger of the operator's refusing the lock
    table, here): it is a failed round all the same, and past a lease term the replica says so (not ready)."""
    with store.engine.begin() as connection:
        connection.execute(text(
            "CREATE FUNCTION refuse_locks() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'locks are frozen for maintenance' USING ERRCODE = 'P0001'; END $$"
        ))
        connection.execute(text(
            "CREATE TRIGGER refuse_locks BEFORE INSERT OR UPDATE ON correlation_lock "
            "FOR EACH ROW EXECUTE FUNCTION refuse_locks()"
        ))
    now = [1000.0]
    one = leaser(store, "a", monotonic=lambda: now[0])
    with pytest.raises(Exception, match="locks are frozen"):
        one.run_once()
    assert one.trouble() is None, "a failing round is not yet trouble"
    now[0] += STEADY.lease.total_seconds() + 1
    with pytest.raises(Exception, match="locks are frozen"):
        one.run_once()
    trouble = one.trouble()
    assert trouble is not None and "no slot lease could be taken or renewed" in trouble
    assert "locks are frozen for maintenance" in trouble and len(trouble.splitlines()) == 1, trouble
