"""The committer: marks correlator calls in flight, and writes their outcomes, in group commits.

*Marks*: before a lane calls messages, each call is written as a row of ``correlation_call`` under its slot
lease's term (:mod:`worker.db.calls`), so that whoever takes the slot over after this replica died knows which
calls were under way (DESIGN.md §3 "Poison messages", §4 invariant 2). Calls wait for their marks (a lane may ask
for its next run's marks ahead, while it still calls: :meth:`Committer.mark_ahead`); the *markers* write the
marks of many lanes in one statement committed without waiting for the disk, on threads and connections of their
own, so that no lane waits behind a durable flush of outcomes. A mark is written only while its term runs, and
only for a message still ready and not in flight elsewhere: a lane calls the messages marked, in order, and no
other.

*Outcomes* of calls (a disposition per message, a run's worth at a time): the lane hands them over and moves
on at once; the committer writes them within a few milliseconds, many lanes' together, in one durable
transaction per flush. Each outcome is written only if its call is still marked under its term (the row is
the call's identity: a successor that counted the call lost has taken the row, and then nothing is written),
and its mark leaves with it; the store settles a flush as it settles a transactional call's outcome, in one
lock order (:meth:`worker.db.calls.CallStatements._claim`). Calls a lane marked and did not make are unmarked
in the same flush, calls given up on at shutdown are marked abandoned::

    lane:      mark run {m1, m2} ── call m1 ── call m2 ── hand over (m1, m2) ── mark next run ...
    marker:    write rows m1, m2 ┘
    recorder:                                              flush: outcomes of m1, m2, their rows gone

Outcomes are written without waiting on rows other sessions hold: such a row's outcome is *deferred* (its
call marked ``returned``) and written at a later flush, so one locked row delays one hint. A value the
database refuses makes that one message dead with the reason (the store writes the others). A transient error
(the database gone, a lock or statement timeout) is retried with a backoff: nothing is lost, nothing is called
twice because of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field

from worker.db.base import Fence
from worker.db.calls import FlushOutcome, MarkRequest, SlotWrite
from worker.db.errors import StoreError
from worker.db.store import Store
from worker.message import Message
from worker.policy.outcomes import Disposition
from worker.service.metrics import Metrics

logger = logging.getLogger(__name__)

GROUP_WINDOW = 0.01  # seconds outcomes may wait for company before they are flushed
MARKS_WINDOW = 0.05  # seconds a withdrawn mark (a call that will not be made) may wait to be written
MAX_GROUP = 5000  # outcomes in one flush
UNRECORDABLE_KEPT = 10_000  # messages whose outcome could not be recorded at all, kept to hold their hints back
RETRY_FIRST, RETRY_MAX = 0.05, 2.0  # backoff after a failed flush (seconds)
STOP_WRITE_WAIT = 5.0  # seconds a stopping replica keeps trying to write its last outcomes
DEFERRED_FIRST, DEFERRED_MAX = 0.1, 5.0  # how soon a deferred outcome (row locked elsewhere) is tried again

# How an outcome ends: written; gone (its row was deleted meanwhile); failed (the database refused it, the
# message is made dead if it can be); fenced (its call was taken over: the slot's new holder decides); unmarked
# (a call not made, its mark withdrawn); abandoned (given up on at shutdown: delivered again, never blamed).
Recorded = Callable[[Sequence[tuple[Message, str]]], None]


_LATCH_CALLBACKS = threading.Lock()  # a latch's callbacks and its setting, one step to the other


class Latch:
    """A one-shot event, set once by one thread and waited on by any: one lock, held until it is set.

    Each run's mark and outcomes have one: a :class:`threading.Event` would build a Condition (a lock, a waiter
    list) for each and notify through it; this is one lock, released when set.
    """

    __slots__ = ("_callbacks", "_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False
        self._callbacks: list[Callable[[], None]] | None = None

    def set(self) -> None:
        if self._set:
            return
        with _LATCH_CALLBACKS:
            self._set = True
            callbacks, self._callbacks = self._callbacks, None
        self._lock.release()
        for callback in callbacks or ():
            callback()

    def on_set(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once it is set (at once, if it is): how an event loop awaits it without a thread."""
        with _LATCH_CALLBACKS:
            if not self._set:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
                return
        callback()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set (or for ``timeout`` seconds at most); answers whether it is set."""
        if self._set:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._lock.release()  # the next waiter's turn
            return True
        return self._set


@dataclass(eq=False)
class MarkTicket:
    """Calls waiting for their marks: :meth:`wait` gives the seconds left of the lease once they are written,
    or None when no call may start (the term ended, the replica stops, or the database cannot be written);
    :attr:`marked` then says which calls were marked (the others must not be made). A write that failed
    (:attr:`unsure`) may have committed before its answer was lost: its calls are to be unmarked."""

    committer: Committer | None
    slot: int
    fence: Fence | None
    calls: tuple[int, ...]  # the messages, in call order
    alone: bool = False
    asked: float = 0.0
    done: Latch = field(default_factory=Latch)
    remaining: float | None = None
    marked: frozenset[int] = frozenset()
    seconds: float = 0.0  # how long the marks took to be written
    withdrawn: bool = False
    by_fetch: bool = False  # written by the fetch that read the calls (see Committer.marked_by_fetch)
    unsure: bool = False  # the write failed: it may have committed all the same (its answer lost)
    hint: str | None = None  # the hint the calls were fetched under: a message moved to another since is not marked

    def answer(self, remaining: float | None, marked: frozenset[int], now: float) -> None:
        self.remaining = remaining
        self.marked = marked if remaining is not None else frozenset()
        self.seconds = max(0.0, now - self.asked)
        self.done.set()

    def wait(self, timeout: float | None = None) -> float | None:
        """Block until the marks are written (or refused), for ``timeout`` seconds at most: the seconds left of
        the lease, or None (refused; or not answered yet, which :attr:`done` tells)."""
        self.done.wait(timeout)
        return self.remaining

    def ids(self) -> tuple[int, ...]:
        """The messages the calls are for, in call order."""
        return self.calls


@dataclass(eq=False)
class Outcomes:
    """A run's outcomes (and the calls of it not made) waiting to be written; ``on_recorded`` hears how each
    ended, once; ``handled`` is set once a flush wrote or deferred them (their calls are no longer under way)."""

    slot: int
    fence: Fence | None
    items: list[tuple[Message, Disposition]]
    on_recorded: Recorded
    unmark: list[Message] = field(default_factory=list)
    abandon: list[Message] = field(default_factory=list)
    queued_at: float = 0.0
    retry_at: float = 0.0
    delay: float = DEFERRED_FIRST
    handled: Latch = field(default_factory=Latch)


class Committer:
    """Marks and group commits of outcomes for one replica; run :meth:`run` and :meth:`run_marks` on threads of
    their own."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        on_lease_lost: Callable[[int, Fence], None] = lambda slot, fence: None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self._on_lease_lost = on_lease_lost
        self._monotonic = monotonic
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # the recorder's wake-ups (outcomes, withdrawn marks, a stop)
        self._marks_wanted = threading.Condition(lock)  # the markers' (a mark asked for, a stop): one each
        self._queued: list[Outcomes] = []
        self._deferred: list[Outcomes] = []
        self._requests: list[MarkTicket] = []
        self._unmarks: dict[tuple[int, Fence], list[int]] = {}  # withdrawn marks, written at the next flush
        self._unmarks_since = 0.0
        self._in_flight: dict[int, Fence] = {}  # calls marked by this replica and not settled, by message id
        # Messages whose outcome could not be recorded, not even as dead (a trigger refusing the update, say):
        # message id -> (slot, hint, why). Their hints are not fetched again by this replica, which is not ready.
        self._unrecordable: dict[int, tuple[int, str, str]] = {}
        self._marking = 0  # statements of marks being written now (by markers, or by a lane itself)
        self._stopping = False
        self._flushing = False
        self._backoff = RETRY_FIRST
        self._stop_by = float("inf")
        self.flushes = 0
        self.written = 0  # outcomes written (or found gone), for benchmarks and tests waiting on a drain

    # -- what lanes call -----------------------------------------------------------------------------------

    def mark_ahead(
        self, slot: int, fence: Fence | None, ids: Sequence[int], alone: bool = False, hint: str | None = None
    ) -> MarkTicket:
        """Ask for the calls' marks (one run of a hint, in call order) and return at once: the calls start after
        the ticket's :meth:`~MarkTicket.wait` (so that a lane can have its next run marked while it still makes
        the calls of this one).

        ``alone``: no other call runs in this replica while they do (a crash meanwhile is theirs). ``hint``: the
        hint they were fetched under (a message whose hint changed since is not marked).
        """
        return self._ask(MarkTicket(self, slot, fence, tuple(ids), alone, self._monotonic(), hint=hint))

    def _ask(self, ticket: MarkTicket) -> MarkTicket:
        if ticket.fence is None:  # no lease, nothing to tell a successor: the calls may start at once
            ticket.answer(float("inf"), frozenset(ticket.calls), ticket.asked)
            return ticket
        with self._cond:
            if self._stopping:
                ticket.answer(None, frozenset(), ticket.asked)
                return ticket
            self._requests.append(ticket)
            self._marks_wanted.notify()
        return ticket

    def marked_by_fetch(
        self, slot: int, fence: Fence, runs: Sequence[Sequence[int]], remaining: float | None
    ) -> list[MarkTicket]:
        """Runs of calls a slot's fetch marked in flight itself (:class:`~worker.db.fetch.FetchMark`): this
        replica's from now on (an adoption leaves them alone), a ticket each, answered. Called by the fetching
        thread as the fetch returns: the slot's adoptions run on that thread too (unless this replica took the
        slot again meanwhile, under a new term: an adoption then may count them as lost, as a crash would).
        A ticket whose calls are not made after all is withdrawn (:meth:`withdraw`): its marks are taken back."""
        now = self._monotonic()
        tickets = []
        with self._cond:
            for run in runs:
                for message_id in run:
                    self._in_flight[message_id] = fence
                ticket = MarkTicket(self, slot, fence, tuple(run), False, now, by_fetch=True)
                ticket.answer(remaining, frozenset(run), now)
                tickets.append(ticket)
        return tickets

    def withdraw(self, ticket: MarkTicket) -> None:
        """The calls of a ticket will not be made by this term (the replica stops, or the slot is gone): their
        marks are taken back once written, so that a successor does not count them."""
        if ticket.fence is None:
            return
        with self._cond:
            if ticket in self._requests:
                self._requests.remove(ticket)
                ticket.answer(None, frozenset(), self._monotonic())
                return
            ticket.withdrawn = True
            if ticket.done.is_set():
                self._unmark_locked(ticket.slot, ticket.fence, ticket.marked)

    def run_marks(self) -> None:
        """Write the marks lanes wait for, many at once, until stopped (run it on a thread of its own)."""
        while True:
            with self._cond:
                while not self._requests and not self._stopping:
                    self._marks_wanted.wait(1.0)
                requests, self._requests = self._requests, []
                if self._stopping:
                    for request in requests:
                        request.answer(None, frozenset(), self._monotonic())
                    return
                self._taken_for_marking(requests)
            self._write_marks(requests)

    def _taken_for_marking(self, requests: Sequence[MarkTicket]) -> None:
        """Under the lock: these marks are being written (this replica's calls from now on: an adoption leaves
        them alone)."""
        self._marking += 1
        for request in requests:
            for message_id in request.ids():
                if request.fence is not None:
                    self._in_flight[message_id] = request.fence

    def _write_marks(self, requests: Sequence[MarkTicket]) -> None:
        """Write marks taken for marking, and answer their tickets."""
        writes = [MarkRequest(r.slot, r.fence, r.calls, r.alone, r.hint) for r in requests if r.fence is not None]
        try:
            result = self.store.calls_mark(writes)
        except Exception as error:  # the calls are not made: their hints are left for later
            self.metrics.database_error(error if isinstance(error, StoreError) else None)
            logger.warning("marking calls in flight failed; their hints are left for later: %s", error)
            now = self._monotonic()
            with self._cond:
                self._marking -= 1
                if self._stopping:
                    self._cond.notify_all()  # the recorder may wait for this write
                for request in requests:
                    self._forget(request.fence, request.ids())
                    request.unsure = True
                    request.answer(None, frozenset(), now)
            return
        now = self._monotonic()
        lost: set[tuple[int, Fence]] = set()
        with self._cond:
            self._marking -= 1
            if self._stopping:
                self._cond.notify_all()  # the recorder may wait for this write
            for request in requests:
                assert request.fence is not None
                remaining = result.remaining.get(request.fence)
                marked = frozenset(i for i in request.calls if i in result.marked)
                if remaining is None:
                    lost.add((request.slot, request.fence))
                    marked = frozenset()
                self._forget(request.fence, [i for i in request.ids() if i not in marked])
                request.answer(remaining, marked, now)
                if request.withdrawn:
                    self._unmark_locked(request.slot, request.fence, request.marked)
        for slot, fence in sorted(lost, key=lambda term: term[0]):
            self._on_lease_lost(slot, fence)

    def _unmark_locked(self, slot: int, fence: Fence, ids: Sequence[int] | frozenset[int]) -> None:
        if not ids:
            return
        if not self._unmarks:
            self._unmarks_since = self._monotonic()
        self._unmarks.setdefault((slot, fence), []).extend(ids)
        self._cond.notify_all()

    def _forget(self, fence: Fence | None, ids: Sequence[int]) -> None:
        if fence is None:
            return
        for message_id in ids:
            if self._in_flight.get(message_id) == fence:
                del self._in_flight[message_id]

    def unrecordable(self) -> dict[int, tuple[int, str, str]]:
        """Messages whose outcome could not be recorded at all: id -> (slot, hint, why)."""
        with self._cond:
            return dict(self._unrecordable)

    def unrecordable_hints(self, slot: int) -> list[str]:
        """The hints of a slot held back because an outcome of theirs could not be recorded."""
        with self._cond:
            return [hint for kept_slot, hint, _ in self._unrecordable.values() if kept_slot == slot]

    def settled(self, fence: Fence | None, ids: Sequence[int]) -> None:
        """Calls whose outcome (or unmark) their own transaction wrote: no longer this replica's to settle."""
        with self._cond:
            self._forget(fence, ids)

    def in_flight_under(self, fence: Fence) -> list[int]:
        """The calls this replica marked under this term and has not settled."""
        with self._cond:
            return [message_id for message_id, term in self._in_flight.items() if term == fence]

    def in_flight(self) -> Container[int]:
        """Calls this replica marked and has not settled (their marks are its own business, whatever the term): a
        live view, not a copy (an adoption looks up the few calls it finds)."""
        return self._in_flight.keys()

    def record(self, outcomes: Outcomes, *, now: bool = False) -> None:
        """Queue a run's outcomes; they are written within a few milliseconds (``now``: with no group window,
        for a call made alone, which no other call may follow until its outcome is written)."""
        outcomes.queued_at = self._monotonic()
        with self._cond:
            self._queued.append(outcomes)
            # The first queued sets when the recorder flushes (a group window later); with others queued before
            # it, the recorder already waits for the first one's window (or writes, or backs off after a failure).
            if now:
                self._queued[0].queued_at = min(self._queued[0].queued_at, outcomes.queued_at - GROUP_WINDOW)
            if len(self._queued) == 1 or now:
                self._cond.notify_all()

    def idle(self) -> bool:
        """True when nothing waits to be written except deferred outcomes (rows locked elsewhere)."""
        with self._cond:
            return not (self._queued or self._unmarks or self._flushing)

    # -- the loop ---------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Write what is queued, then return from :meth:`run`; later mark requests are refused."""
        with self._cond:
            self._stopping = True
            self._stop_by = self._monotonic() + STOP_WRITE_WAIT
            self._cond.notify_all()
            self._marks_wanted.notify_all()

    def run(self) -> None:
        """Flush until stopped and drained (outcomes still deferred at shutdown are left: their messages are
        delivered again, as are those the database would not take within ``STOP_WRITE_WAIT`` of the stop)."""
        while True:
            with self._cond:
                while not self._due():
                    # Marks still being written are waited for (as long as the last outcomes are): a lane that
                    # gave up waiting for them at the stop withdrew them, to be taken back once written.
                    if self._stopping and not (self._queued or self._unmarks) and (
                        not self._marking or self._monotonic() > self._stop_by
                    ):
                        return
                    self._cond.wait(self._wait_time())
                if self._stopping and self._monotonic() > self._stop_by:
                    unwritten = sum(len(outcomes.items) for outcomes in self._queued)
                    logger.warning(
                        "stopping: %d outcome(s) could not be written; their messages will be delivered again",
                        unwritten,
                    )
                    return
            self.flush_once()

    def _due(self) -> bool:
        now = self._monotonic()
        if self._queued and (self._stopping or now - self._queued[0].queued_at >= GROUP_WINDOW):
            return True
        if self._unmarks and (self._stopping or now - self._unmarks_since >= MARKS_WINDOW):
            return True
        return not self._stopping and any(outcomes.retry_at <= now for outcomes in self._deferred)

    def _wait_time(self) -> float:
        now = self._monotonic()
        times = [1.0]
        if self._queued:
            times.append(self._queued[0].queued_at + GROUP_WINDOW - now)
        if self._unmarks:
            times.append(self._unmarks_since + MARKS_WINDOW - now)
        times += [outcomes.retry_at - now for outcomes in self._deferred]
        return max(0.0005, min(times))

    def flush_once(self) -> FlushOutcome | None:
        """Write everything queued (and deferred outcomes now due), with the marks withdrawn, durably."""
        with self._cond:
            now = self._monotonic()
            taken, self._queued = self._take_queued()
            retry = [o for o in self._deferred if o.retry_at <= now]
            self._deferred = [o for o in self._deferred if o.retry_at > now]
            batches = retry + taken
            unmarks, self._unmarks = self._unmarks, {}
            writes = _writes(batches, unmarks)
            self._flushing = True
        try:
            result = self.store.messages_record(writes)
        except StoreError as error:  # unavailable, busy, access denied...: one line each time
            self._failed(error, batches, unmarks)
            return None
        except Exception:
            logger.exception("recording outcomes failed; trying again")
            self._failed(None, batches, unmarks)
            return None
        finally:
            with self._cond:
                self._flushing = False
        self._backoff = RETRY_FIRST
        self.flushes += 1
        with self._cond:
            for (_, fence), ids in unmarks.items():
                self._forget(fence, ids)
        self._settle(result, batches)
        return result

    def _take_queued(self) -> tuple[list[Outcomes], list[Outcomes]]:
        count, taken = 0, 0
        for outcomes in self._queued:
            if count and count + len(outcomes.items) > MAX_GROUP:
                break
            count += len(outcomes.items)
            taken += 1
        return self._queued[:taken], self._queued[taken:]

    def _failed(
        self, error: Exception | None, batches: list[Outcomes], unmarks: dict[tuple[int, Fence], list[int]]
    ) -> None:
        self.metrics.database_error(error)
        self.metrics.record_failures.inc()
        if error is not None:
            logger.warning("recording outcomes failed, trying again in %.2fs: %s", self._backoff, error)
        with self._cond:
            self._queued = batches + self._queued
            for term, ids in unmarks.items():
                self._unmarks.setdefault(term, []).extend(ids)
            if unmarks and len(self._unmarks) == len(unmarks):
                self._unmarks_since = self._monotonic()
            delay = self._backoff
            self._backoff = min(RETRY_MAX, self._backoff * 2)
            self._cond.wait(delay)

    def _settle(self, result: FlushOutcome, batches: list[Outcomes]) -> None:
        now = self._monotonic()
        deferred: list[Outcomes] = []
        lost: set[tuple[int, Fence]] = set()
        for outcomes in batches:
            ended: list[tuple[Message, str]] = [(message, "unmarked") for message in outcomes.unmark]
            ended += [(message, "abandoned") for message in outcomes.abandon]
            outcomes.unmark, outcomes.abandon = [], []
            waiting: list[tuple[Message, Disposition]] = []
            for message, disposition in outcomes.items:
                if message.id in result.fenced:
                    ended.append((message, "fenced"))
                    if outcomes.fence is not None:
                        lost.add((outcomes.slot, outcomes.fence))
                elif message.id in result.deferred:
                    waiting.append((message, disposition))
                elif message.id in result.failed:
                    self.metrics.unrecordable.inc()
                    why = result.failed[message.id]
                    logger.error(
                        "the outcome of message %s could not be recorded (%s); it was made dead if it could be",
                        message.id, why, extra={"id": message.id, "hint": message.hint},
                    )
                    if message.id in result.stuck:  # not even made dead: its hint is held back here
                        with self._cond:
                            if len(self._unrecordable) < UNRECORDABLE_KEPT:
                                self._unrecordable[message.id] = (outcomes.slot, message.hint, why)
                    ended.append((message, "failed"))
                else:
                    ended.append((message, "gone" if message.id in result.gone else "written"))
            with self._cond:
                self._forget(outcomes.fence, [message.id for message, _ in ended])
            if waiting:
                later = Outcomes(outcomes.slot, outcomes.fence, waiting, outcomes.on_recorded)
                later.retry_at = now + outcomes.delay
                later.delay = min(DEFERRED_MAX, outcomes.delay * 2)
                later.handled.set()
                deferred.append(later)
            outcomes.handled.set()
            if ended:
                self.written += sum(1 for _, how in ended if how in ("written", "gone"))
                outcomes.on_recorded(ended)
        if deferred:
            self.metrics.deferred_outcomes.inc(sum(len(o.items) for o in deferred))
            with self._cond:
                self._deferred += deferred
        for slot, fence in sorted(lost, key=lambda term: term[0]):
            self.metrics.fenced_commits.inc()
            logger.warning(
                "slot %s: its calls were taken over by its next holder; their outcomes were not written", slot,
                extra={"slot": slot},
            )
            self._on_lease_lost(slot, fence)


def _writes(batches: Sequence[Outcomes], unmarks: dict[tuple[int, Fence], list[int]]) -> list[SlotWrite]:
    """What each term gets: its outcomes, the marks of calls not made, the calls given up on."""
    terms: dict[tuple[int, Fence | None], tuple[list[Disposition], list[int], list[int]]] = {}
    for outcomes in batches:
        dispositions, unmark, abandon = terms.setdefault((outcomes.slot, outcomes.fence), ([], [], []))
        dispositions.extend(disposition for _, disposition in outcomes.items)
        unmark.extend(message.id for message in outcomes.unmark)
        abandon.extend(message.id for message in outcomes.abandon)
    for (slot, fence), ids in unmarks.items():
        terms.setdefault((slot, fence), ([], [], []))[1].extend(ids)
    return [
        SlotWrite(slot, fence, tuple(dispositions), tuple(unmark), tuple(abandon))
        for (slot, fence), (dispositions, unmark, abandon) in terms.items()
    ]
