"""Named locks on the database clock: ShedLock's lock-provider behaviour, plus fencing.

Ported from ShedLock's AbstractLockProviderIntegrationTest, AbstractExtensibleLockProviderIntegrationTest and
FuzzTester. Expiry is awaited by polling the database clock with a deadline, with short terms.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import Connection

from tests.conftest import left
from tests.integration.test_pauses import _blocked
from worker.config import Mode
from worker.db.calls import FlushOutcome, LostCall, MarkRequest, SlotWrite
from worker.db.errors import DatabaseUnavailable
from worker.db.store import Fence, InvalidLockName, LockRow, MessageFilter, NewMessage, Store
from worker.policy.outcomes import Disposition, Kind, LostCallOutcome, settle_lost_call

LONG = timedelta(minutes=5)
SHORT = timedelta(milliseconds=200)
DEADLINE = 10.0  # seconds; generous, only a guard against hanging


def wait_until(condition: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        time.sleep(0.02)


def rows_in_use(store: Store) -> list[LockRow]:
    """The lock rows ever taken (the slot rows exist free, never held, from the migration on)."""
    return [lock for lock in store.locks_list() if lock.locked_by or lock.fence]


def row(store: Store, name: str) -> LockRow:
    return next(r for r in store.locks_list() if r.name == name)


def wait_past(store: Store, moment: datetime) -> None:
    """Wait until the database clock has passed a moment."""
    wait_until(lambda: store.now() > moment, f"the database clock passes {moment}")


# -- ShedLock's lock provider ------------------------------------------------------------------------------


def test_a_new_lock_is_created_held_and_release_frees_it(any_store: Store) -> None:
    fence = any_store.lock_try_acquire("job", "a", LONG)
    assert fence == Fence("job", "a", 1)
    assert [r.name for r in any_store.locks_list_held()] == ["job"]
    assert any_store.lock_release(fence)
    assert any_store.locks_list_held() == []


def test_a_held_lock_is_not_acquired_twice(any_store: Store) -> None:
    assert any_store.lock_try_acquire("job", "a", LONG) is not None
    assert any_store.lock_try_acquire("job", "b", LONG) is None
    assert any_store.lock_try_acquire("job", "a", LONG) is None  # not even by its holder
    assert row(any_store, "job").locked_by == "a"


def test_two_names_are_independent(any_store: Store) -> None:
    first = any_store.lock_try_acquire("job", "a", LONG)
    second = any_store.lock_try_acquire("other-job", "b", LONG)
    assert first is not None and second is not None
    assert any_store.lock_release(first)
    assert any_store.lock_try_acquire("other-job", "c", LONG) is None


def test_a_lock_can_be_taken_again_right_after_release(any_store: Store) -> None:
    for _ in range(10):
        fence = any_store.lock_try_acquire("job", "a", LONG)
        assert fence is not None
        assert any_store.lock_try_acquire("job", "b", LONG) is None
        assert any_store.lock_release(fence)


def test_a_lock_expires_after_lock_at_most_for(any_store: Store) -> None:
    first = any_store.lock_try_acquire("job", "a", SHORT)
    assert first is not None
    assert any_store.lock_try_acquire("job", "b", SHORT) is None
    taken: list[Fence] = []

    def taken_by_b() -> bool:
        fence = any_store.lock_try_acquire("job", "b", LONG)
        taken.extend([fence] if fence else [])
        return fence is not None

    wait_until(taken_by_b, "the first term expires")
    assert taken == [Fence("job", "b", 2)]
    assert row(any_store, "job").locked_at >= row(any_store, "job").lock_until - LONG


def test_lock_at_least_for_keeps_a_released_lock_held_until_it_passes(any_store: Store) -> None:
    fence = any_store.lock_try_acquire("job", "a", LONG)
    assert fence is not None
    assert any_store.lock_release(fence, lock_at_least_for=timedelta(milliseconds=300))
    assert any_store.lock_try_acquire("job", "b", LONG) is None, "lock_at_least_for has not passed yet"
    held_until = row(any_store, "job").lock_until
    assert held_until == row(any_store, "job").locked_at + timedelta(milliseconds=300)
    wait_past(any_store, held_until)
    assert any_store.lock_try_acquire("job", "b", LONG) is not None


def test_lock_at_least_for_already_passed_frees_the_lock_at_once(any_store: Store) -> None:
    fence = any_store.lock_try_acquire("job", "a", LONG)
    assert fence is not None
    wait_past(any_store, row(any_store, "job").locked_at + timedelta(milliseconds=50))
    assert any_store.lock_release(fence, lock_at_least_for=timedelta(milliseconds=50))
    assert any_store.lock_try_acquire("job", "b", LONG) is not None


def test_an_extended_lock_outlives_its_first_term(any_store: Store) -> None:
    fence = any_store.lock_try_acquire("job", "a", SHORT)
    assert fence is not None
    first_term_end = row(any_store, "job").lock_until
    for _ in range(3):
        assert any_store.lock_extend(fence, timedelta(seconds=30))
    assert row(any_store, "job").lock_until > first_term_end + timedelta(seconds=20)
    wait_past(any_store, first_term_end)
    assert any_store.lock_try_acquire("job", "b", LONG) is None
    assert row(any_store, "job").fence == 1  # extending is not a new term
    assert any_store.lock_release(fence)
    assert any_store.lock_try_acquire("job", "b", LONG) is not None


def test_a_released_lock_cannot_be_extended(any_store: Store) -> None:
    fence = any_store.lock_try_acquire("job", "a", LONG)
    assert fence is not None
    assert any_store.lock_release(fence)
    assert not any_store.lock_extend(fence, LONG)
    assert not any_store.lock_release(fence)
    assert any_store.locks_list_held() == []


def test_an_expired_lock_cannot_be_extended(any_store: Store) -> None:
    fence = any_store.lock_try_acquire("job", "a", SHORT)
    assert fence is not None
    wait_past(any_store, row(any_store, "job").lock_until)
    assert not any_store.lock_extend(fence, LONG)
    assert any_store.locks_list_held() == []
    assert any_store.lock_try_acquire("job", "b", LONG) is not None


def test_a_too_long_name_is_an_error_and_never_truncated(any_store: Store) -> None:
    with pytest.raises(InvalidLockName, match="at most 64"):
        any_store.lock_try_acquire("x" * 65, "a", LONG)
    with pytest.raises(ValueError, match="at most 64"):
        any_store.lock_try_acquire_many(["slot:1", "y" * 65], "a", LONG, 2)
    assert rows_in_use(any_store) == []
    assert any_store.lock_try_acquire("x" * 64, "a", LONG) is not None
    with pytest.raises(InvalidLockName, match="empty"):
        any_store.lock_try_acquire("", "a", LONG)
    with pytest.raises(InvalidLockName, match="holder"):
        any_store.lock_try_acquire("job", "h" * 256, LONG)


def test_a_lock_duration_must_be_positive(any_store: Store) -> None:
    with pytest.raises(ValueError, match="positive"):
        any_store.lock_try_acquire("job", "a", timedelta(0))


# -- fencing -----------------------------------------------------------------------------------------------


def test_the_fence_increases_on_every_acquisition(any_store: Store) -> None:
    fences = []
    for holder in ["a", "a", "b", "c", "a"]:
        fence = any_store.lock_try_acquire("job", holder, LONG)
        assert fence is not None
        fences.append(fence.fence)
        assert any_store.lock_release(fence)
    assert fences == [1, 2, 3, 4, 5]
    expiring = any_store.lock_try_acquire("job", "a", SHORT)
    assert expiring is not None and expiring.fence == 6
    wait_past(any_store, row(any_store, "job").lock_until)
    taken = any_store.lock_try_acquire("job", "b", LONG)
    assert taken is not None and taken.fence == 7


def test_an_old_term_can_neither_renew_nor_release_the_new_one(any_store: Store) -> None:
    old = any_store.lock_try_acquire("job", "a", SHORT)
    assert old is not None
    wait_past(any_store, row(any_store, "job").lock_until)
    new = any_store.lock_try_acquire("job", "a", LONG)  # the same holder, a new term
    assert new is not None and new.fence == old.fence + 1
    assert not any_store.lock_extend(old, LONG)
    assert not any_store.lock_release(old)
    assert any_store.lock_try_acquire("job", "b", LONG) is None
    assert any_store.lock_extend(new, LONG)


def mark(store: Store, fence: Fence, message_id: int, slot: int = 0) -> None:
    """Mark a call in flight under this term, as a lane has its committer do before the call."""
    assert store.calls_mark([MarkRequest(slot, fence, (message_id,))]).marked == {message_id}


def record(store: Store, fence: Fence, disposition: Disposition, slot: int = 0) -> FlushOutcome:
    """Write one outcome of a call marked under this term (the engine's committer does the same)."""
    return store.messages_record([SlotWrite(slot, fence, (disposition,))])


def _one_message(store: Store) -> int:
    message_id = store.messages_insert(NewMessage("order.paid", "order-1"))
    assert message_id is not None
    return message_id


def _settle(call: LostCall) -> LostCallOutcome:
    return settle_lost_call(call.lost_calls, call.crashed_calls, call.last_error, crashed=call.crashed,
                            alone=call.alone, poison_after=3)


def test_the_outcome_of_a_call_marked_under_the_current_term_is_written(any_store: Store) -> None:
    message_id = _one_message(any_store)
    fence = any_store.lock_try_acquire("slot:0", "a", LONG)
    assert fence is not None
    mark(any_store, fence, message_id)
    outcome = record(any_store, fence, Disposition(message_id, Kind.DELETE, 0))
    assert outcome.fenced == frozenset() and outcome.written == {message_id}
    assert left(any_store, message_id) and any_store.calls_in_flight() == []


def test_a_mark_on_a_connection_that_lost_its_server_fails_alone_and_the_next_mark_gets_a_new_one(
    store: Store, pg_url: str
) -> None:
    first, second = _one_message(store), store.messages_insert(NewMessage("order.paid", "order-2"))
    assert second is not None
    fence = store.lock_try_acquire("slot:0", "a", LONG)
    assert fence is not None
    mark(store, fence, first)
    _end_sessions(pg_url)
    with pytest.raises(DatabaseUnavailable):
        store.calls_mark([MarkRequest(0, fence, (second,))])
    mark(store, fence, second)  # on a new connection: the pool's older ones were let go too
    pooled = store.engine.raw_connection()
    try:
        assert pooled.driver_connection.autocommit is False  # the marks' connections go back as they came
    finally:
        pooled.close()


def test_the_fetchs_statements_on_a_connection_that_lost_its_server_fail_as_unavailable_and_then_work(
    store: Store, pg_url: str
) -> None:
    """The fetch runs its statements through psycopg itself: a lost server must read as SQLAlchemy's would."""
    message_id = _one_message(store)
    slot = next(m.slot for m in store.messages_list(MessageFilter(), limit=10) if m.id == message_id)

    def fetch() -> int:
        _, fetched = store.messages_fetch_slot(
            slot, "", 10, per_hint=10, limit=10, mode=Mode.FAIL_FIRST,
        )
        return len(fetched.messages)

    for read in (lambda: len(store.messages_candidates(slot, "", 10).fresh), fetch):
        assert read() == 1
        _end_sessions(pg_url)
        with pytest.raises(DatabaseUnavailable):
            read()
        assert read() == 1


def _end_sessions(pg_url: str) -> None:
    """End every other session of the database, as a server restart or an administrator would."""
    with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql"), autocommit=True) as admin:
        ended = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
    assert ended is not None and ended[0] >= 1


def test_no_call_is_marked_under_a_term_that_ended(any_store: Store) -> None:
    message_id = _one_message(any_store)
    fence = any_store.lock_try_acquire("slot:0", "a", SHORT)
    assert fence is not None
    wait_past(any_store, row(any_store, "slot:0").lock_until)
    marked = any_store.calls_mark([MarkRequest(0, fence, (message_id,))])
    assert marked.marked == frozenset() and fence not in marked.remaining
    assert any_store.calls_in_flight() == []


def test_the_outcome_of_a_call_taken_over_is_fenced_off_and_writes_nothing(any_store: Store) -> None:
    message_id = _one_message(any_store)
    old = any_store.lock_try_acquire("slot:0", "a", SHORT)
    assert old is not None
    mark(any_store, old, message_id)
    wait_past(any_store, row(any_store, "slot:0").lock_until)
    new = any_store.lock_try_acquire("slot:0", "b", LONG)
    assert new is not None
    assert any_store.calls_adopt(0, new, _settle).lost == (message_id,)
    outcome = record(any_store, old, Disposition(message_id, Kind.DELETE, 0))
    assert outcome.fenced == {message_id} and not outcome.written
    message = any_store.messages_get(message_id)
    assert message is not None and message.lost_calls == 1, "delivered again by the new holder, counted once"


def test_a_flush_writes_the_outcomes_of_calls_still_marked_and_nothing_of_those_taken_over(any_store: Store) -> None:
    kept_id, lost_id = _one_message(any_store), _one_message(any_store)
    kept = any_store.lock_try_acquire("slot:0", "a", LONG)
    old = any_store.lock_try_acquire("slot:1", "a", SHORT)
    assert kept is not None and old is not None
    mark(any_store, kept, kept_id)
    mark(any_store, old, lost_id, slot=1)
    wait_past(any_store, row(any_store, "slot:1").lock_until)
    new = any_store.lock_try_acquire("slot:1", "b", LONG)
    assert new is not None and any_store.calls_adopt(1, new, _settle).lost == (lost_id,)
    outcome = any_store.messages_record([
        SlotWrite(0, kept, (Disposition(kept_id, Kind.DELETE, 0),)),
        SlotWrite(1, old, (Disposition(lost_id, Kind.DELETE, 0),)),
    ])
    assert outcome.fenced == {lost_id} and outcome.written == {kept_id}
    assert left(any_store, kept_id)
    assert not left(any_store, lost_id)


@contextmanager
def flush_waiting_for_call_row(
    store: Store, pg_url: str, held: int, flush: Callable[[], FlushOutcome]
) -> Iterator[tuple[Connection, list[FlushOutcome]]]:
    """A flush on a thread of its own, seen waiting in the database for the call row of message ``held``, which the
    yielded session holds; the session commits as the block ends, and the flush's outcome is then in the list."""
    done: list[FlushOutcome] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(flush())
        except BaseException as error:  # shown by the assertions, not lost with the thread
            failed.append(error)

    thread = threading.Thread(target=run)
    with store.engine.connect() as holder:
        holder.execute(text("SELECT 1 FROM correlation_call WHERE message_id = :id FOR UPDATE"), {"id": held})
        thread.start()
        deadline = time.monotonic() + DEADLINE
        while not _blocked(pg_url) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread.is_alive() and _blocked(pg_url), f"the flush should wait for the call row: {failed}"
        yield holder, done
        holder.commit()
    thread.join(DEADLINE)
    assert done, f"the flush ended without an outcome: {failed}"


@pytest.mark.parametrize("adopted", [False, True], ids=["left-to-the-flush", "adopted-meanwhile"])
def test_a_flush_waits_for_a_call_row_before_it_takes_a_message_row_and_writes_only_calls_still_marked(
    store: Store, pg_url: str, adopted: bool
) -> None:
    """The group commit locks its call rows first, waiting for a session that holds one, and only then its message
    rows, skipping those held elsewhere. An adoption locks a slot's call rows first too, and skips the messages held
    elsewhere, so neither waits for the other in a cycle: while the flush waits, it holds no message row, and the
    session holding the call row may take the message. A message is recorded only if its call is still marked when
    the flush gets the row: a call counted meanwhile is fenced off."""
    message_id = _one_message(store)
    fence = store.lock_try_acquire("slot:0", "a", LONG)
    assert fence is not None
    mark(store, fence, message_id)
    def flush() -> FlushOutcome:
        return record(store, fence, Disposition(message_id, Kind.DELETE, 0))

    with flush_waiting_for_call_row(store, pg_url, message_id, flush) as (adoption, outcome):
        held = adoption.execute(text(
            "SELECT id FROM correlation_message WHERE id = :id FOR UPDATE SKIP LOCKED"), {"id": message_id}).all()
        assert held == [(message_id,)], "the flush holds the message row while it waits for the call row"
        if adopted:  # as if an adoption had counted the call meanwhile: its row gone
            adoption.execute(text("DELETE FROM correlation_call WHERE message_id = :id"), {"id": message_id})
    if adopted:
        assert outcome[0].fenced == {message_id} and not outcome[0].written
        assert not left(store, message_id)
    else:
        assert outcome[0].written == {message_id} and not outcome[0].fenced
        assert left(store, message_id) and store.calls_in_flight() == []


def test_the_outcome_of_a_call_is_written_after_its_term_ended_while_no_one_took_the_call_over(
    any_store: Store,
) -> None:
    """The call was made and nobody delivered it again: recording its outcome is the truth, and it spares a
    redelivery. Once a successor adopts the call instead, the late outcome is fenced off (above)."""
    for end in ("expired", "released"):
        message_id = _one_message(any_store)
        fence = any_store.lock_try_acquire("slot:0", "a", SHORT if end == "expired" else LONG)
        assert fence is not None
        mark(any_store, fence, message_id)
        if end == "expired":
            wait_past(any_store, row(any_store, "slot:0").lock_until)
        else:
            assert any_store.lock_release(fence)
        assert record(any_store, fence, Disposition(message_id, Kind.DELETE, 0)).written == {message_id}
        assert left(any_store, message_id)


def test_an_outcome_of_a_call_never_marked_is_not_written_under_a_term(any_store: Store) -> None:
    message_id = _one_message(any_store)
    fence = any_store.lock_try_acquire("slot:0", "a", LONG)
    assert fence is not None
    assert record(any_store, fence, Disposition(message_id, Kind.DELETE, 0)).fenced == {message_id}
    assert not left(any_store, message_id)


def test_a_fenced_commit_holds_off_a_takeover_until_it_commits(store: Store) -> None:
    """The fence check locks the lease row: a replica taking the slot over waits for the commit."""
    fence = store.lock_try_acquire("slot:0", "a", timedelta(seconds=1))
    assert fence is not None
    with store.engine.begin() as connection:
        store.lock_check_fence(connection, fence)
        wait_past(store, row(store, "slot:0").lock_until)  # the term ends while the transaction runs
        outcome: list[Fence | None] = []
        taker = threading.Thread(target=lambda: outcome.append(store.lock_try_acquire("slot:0", "b", LONG)))
        taker.start()
        taker.join(timeout=0.5)
        assert taker.is_alive(), "the takeover should wait for the fenced transaction"
    taker.join(timeout=DEADLINE)
    assert outcome == [Fence("slot:0", "b", 2)]


# -- many at once (slots) ---------------------------------------------------------------------------------

SLOTS = [f"slot:{n}" for n in range(64)]


def test_acquire_many_creates_the_rows_and_takes_up_to_the_limit(any_store: Store) -> None:
    taken = any_store.lock_try_acquire_many(SLOTS, "a", LONG, 10)
    assert len(taken) == 10
    assert all(f.holder == "a" and f.fence == 1 for f in taken)
    assert len(any_store.locks_list()) == 64
    assert len(any_store.locks_list_held()) == 10
    rest = any_store.lock_try_acquire_many(SLOTS, "b", LONG, 100)
    assert len(rest) == 54
    assert not {f.name for f in taken} & {f.name for f in rest}
    assert any_store.lock_try_acquire_many(SLOTS, "c", LONG, 100) == []


def test_acquire_many_takes_expired_and_released_slots_with_a_new_fence(any_store: Store) -> None:
    expiring = any_store.lock_try_acquire_many(SLOTS[:2], "a", SHORT, 2)
    released = any_store.lock_try_acquire_many(SLOTS[2:4], "a", LONG, 2)
    for fence in released:
        assert any_store.lock_release(fence)
    wait_past(any_store, max(row(any_store, f.name).lock_until for f in expiring))
    again = any_store.lock_try_acquire_many(SLOTS[:4], "b", LONG, 4)
    assert [(f.name, f.fence) for f in again] == [(name, 2) for name in sorted(SLOTS[:4])]


def test_a_term_that_ran_out_unrenewed_counts_as_lapsed_and_a_released_one_does_not(any_store: Store) -> None:
    expiring = any_store.lock_try_acquire_many(SLOTS[:2], "a", SHORT, 2)
    released = any_store.lock_try_acquire_many(SLOTS[2:4], "a", LONG, 2)
    for fence in released:
        assert any_store.lock_release(fence)
    assert {row(any_store, f.name).locked_by for f in released} == {""}  # released: no holder any more
    assert any_store.locks_count_lapsed("slot:") == 0  # the others still run
    wait_past(any_store, max(row(any_store, f.name).lock_until for f in expiring))
    assert any_store.locks_count_lapsed("slot:") == 2 and any_store.locks_count_lapsed("job") == 0
    any_store.lock_try_acquire_many(SLOTS[:2], "b", LONG, 2)
    assert any_store.locks_count_lapsed("slot:") == 0


def test_acquire_many_with_nothing_asked_does_nothing(any_store: Store) -> None:
    assert any_store.lock_try_acquire_many([], "a", LONG, 5) == []
    assert any_store.lock_try_acquire_many(SLOTS, "a", LONG, 0) == []
    assert rows_in_use(any_store) == []


def test_concurrent_acquirers_never_take_the_same_slot(store: Store) -> None:
    holders = [f"replica-{n}" for n in range(6)]
    start = threading.Barrier(len(holders))
    taken: dict[str, list[Fence]] = {}

    def acquire(holder: str) -> None:
        start.wait()
        taken[holder] = store.lock_try_acquire_many(SLOTS, holder, LONG, 20)

    threads = [threading.Thread(target=acquire, args=(holder,)) for holder in holders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=DEADLINE)
    names = [fence.name for fences in taken.values() for fence in fences]
    assert len(taken) == len(holders)
    assert sorted(names) == sorted(SLOTS)  # 6 x 20 asked for 64: every slot once, none twice
    for holder, fences in taken.items():
        assert all(row(store, f.name).locked_by == holder for f in fences)


def test_extend_many_renews_only_the_terms_still_held(any_store: Store) -> None:
    kept = any_store.lock_try_acquire_many(SLOTS[:3], "a", LONG, 3)
    expired = any_store.lock_try_acquire_many(SLOTS[3:5], "a", SHORT, 2)
    wait_past(any_store, max(row(any_store, f.name).lock_until for f in expired))
    taken_over = any_store.lock_try_acquire(SLOTS[3], "b", LONG)
    assert taken_over is not None
    assert set(any_store.lock_extend_many(kept + expired, LONG)) == set(kept)
    assert row(any_store, SLOTS[3]).locked_by == "b"


def test_a_row_another_session_holds_leaves_its_term_busy_and_the_others_renewed_at_once(
    store: Store, pg_url: str
) -> None:
    terms = store.lock_try_acquire_many(SLOTS[:4], "a", LONG, 4)
    ended = store.lock_try_acquire_many(SLOTS[4:5], "a", SHORT, 1)
    wait_past(store, row(store, SLOTS[4]).lock_until)
    before = {f.name: row(store, f.name).lock_until for f in terms}
    held = sorted(terms, key=lambda f: f.name)[1]
    with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql")) as session:
        session.execute("SELECT 1 FROM correlation_lock WHERE name = %s FOR UPDATE", (held.name,))
        started = time.monotonic()
        renewed, busy = store.lock_extend_each(terms + ended, LONG)
        waited = time.monotonic() - started
    assert busy == [held]  # neither renewed nor lost: the next round renews it
    assert sorted(f.name for f in renewed) == sorted(f.name for f in terms if f != held)
    assert waited < 1.0  # the row lock is not waited for (the lock timeout would be seconds)
    assert all(row(store, f.name).lock_until > before[f.name] for f in renewed)
    assert row(store, held.name).lock_until == before[held.name]
    assert store.lock_extend_each([held], LONG) == ([held], [])


def test_held_rows_are_those_whose_term_still_runs(any_store: Store) -> None:
    any_store.lock_try_acquire_many(SLOTS[:4], "a", LONG, 2)
    expiring = any_store.lock_try_acquire("member:x", "x", SHORT)
    assert expiring is not None
    assert len(any_store.locks_list_held()) == 3
    wait_past(any_store, row(any_store, "member:x").lock_until)
    assert {r.locked_by for r in any_store.locks_list_held()} == {"a"}


def test_delete_expired_removes_only_long_expired_rows_of_the_prefix(any_store: Store) -> None:
    assert any_store.lock_try_acquire("member:old", "x", SHORT) is not None
    assert any_store.lock_try_acquire("member:live", "y", LONG) is not None
    assert any_store.lock_try_acquire("cleanup", "z", SHORT) is not None
    assert any_store.locks_delete_expired("member:", timedelta(seconds=60)) == 0
    wait_past(any_store, row(any_store, "member:old").lock_until + timedelta(milliseconds=100))
    assert any_store.locks_delete_expired("member:", timedelta(milliseconds=50)) == 1
    assert [r.name for r in rows_in_use(any_store)] == ["cleanup", "member:live"]
    with pytest.raises(ValueError, match="prefix"):
        any_store.locks_delete_expired("", timedelta(0))  # never every row: slot rows carry fences


# -- ShedLock's fuzz test ---------------------------------------------------------------------------------

THREADS = 8
ITERATIONS = 100
SHORT_ITERATIONS = 10


def test_fuzz_threads_incrementing_counters_under_two_locks_lose_no_update(store: Store) -> None:
    counters = {"lock1": 0, "lock2": 0}
    errors: list[BaseException] = []

    def task(number: int, name: str, iterations: int) -> None:
        holder = f"thread-{number}"
        try:
            done = 0
            while done < iterations:
                fence = store.lock_try_acquire(name, holder, LONG)
                if fence is None:
                    continue
                value = counters[name]  # an unguarded read-modify-write: only the lock protects it
                time.sleep(0.001)
                counters[name] = value + 1
                assert store.lock_release(fence, lock_at_least_for=timedelta(milliseconds=5))
                done += 1
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [
        threading.Thread(
            target=task,
            args=(n, "lock1" if n % 2 == 0 else "lock2", SHORT_ITERATIONS if n == 0 else ITERATIONS),
        )
        for n in range(THREADS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert counters["lock1"] == (THREADS // 2 - 1) * ITERATIONS + SHORT_ITERATIONS == 310
    assert counters["lock2"] == THREADS // 2 * ITERATIONS == 400
    assert row(store, "lock1").fence == 310 and row(store, "lock2").fence == 400
