"""The committer: writes the outcomes of correlator calls and the in-flight marks, in group commits.

*Outcomes* of calls (a disposition per message, a run's worth at a time): the lane hands them over and moves
on at once; the committer writes them within a few milliseconds, many lanes' together, in one durable
transaction per flush, fenced by the slots' leases.

*Marks*: before a lane calls messages, they are marked on its slot's lease row (``in_flight``), so that
whoever takes the slot over after this replica died knows which calls were under way (DESIGN.md §3 "Poison
messages", §4 invariant 2). Calls wait for their marks (a lane may ask for its next run's mark ahead, while it
still calls: :meth:`Committer.mark_ahead`); the *marker* writes the marks of many lanes in one
fenced statement committed without waiting for the disk, on a thread and connection of its own, so that no
lane waits behind a durable flush of outcomes. The marks of a slot are kept here, in memory, and every write
of them (the marker's, or the recorder's flush removing the calls whose outcomes it records) carries the
whole current state with a version: the database keeps the newest, so writes racing each other never lose a
mark::

    lane:      mark {m1} ── call m1 ── outcome(m1) ─► mark {m1?, m2} ── call m2 ...
    marker:    write v5 ┘                           write v7 (without m1 if v6 ran first) ┘
    recorder:                          flush v6: fence, outcome m1, marks without m1

Outcomes are written without waiting on rows other sessions hold: such a row's outcome is *deferred* and
written at a later flush, so one locked row delays one hint. A value the database refuses makes that one
message dead with the reason (the store writes the others). A transient error (the database gone, a lock or
statement timeout) is retried with a backoff: nothing is lost, nothing is called twice because of it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from worker.db.base import Fence
from worker.db.errors import StoreError
from worker.db.messages import FlushOutcome, InFlight, SlotWrite
from worker.db.store import Store
from worker.message import Message
from worker.policy.outcomes import Disposition
from worker.service.metrics import Metrics

logger = logging.getLogger(__name__)

GROUP_WINDOW = 0.01  # seconds outcomes may wait for company before they are flushed
MARKS_WINDOW = 0.05  # seconds a withdrawn mark (a call that will not be made) may wait to be written
MAX_GROUP = 5000  # outcomes in one flush
RETRY_FIRST, RETRY_MAX = 0.05, 2.0  # backoff after a failed flush (seconds)
STOP_WRITE_WAIT = 5.0  # seconds a stopping replica keeps trying to write its last outcomes
DEFERRED_FIRST, DEFERRED_MAX = 0.1, 5.0  # how soon a deferred outcome (row locked elsewhere) is tried again

# How an outcome ended: written; gone (its row was deleted meanwhile); failed (the database refused it, the
# message was made dead if it could be); fenced (the slot's lease was lost: the new holder decides).
Recorded = Callable[[Sequence[tuple[Message, str]]], None]


@dataclass(eq=False)
class MarkTicket:
    """Calls waiting for their mark: :meth:`wait` gives the seconds left of the lease once it is written, or
    None when the calls must not start (their marks are withdrawn then)."""

    committer: Committer
    slot: int
    ids: Sequence[int]
    asked: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    remaining: float | None = None
    seconds: float = 0.0  # how long the mark took to be written

    def answer(self, remaining: float | None, now: float) -> None:
        self.remaining = remaining
        self.seconds = max(0.0, now - self.asked)
        self.done.set()

    def wait(self) -> float | None:
        """Block until the mark is written (or refused)."""
        self.done.wait()
        if self.remaining is None:
            self.committer.unmark(self.slot, self.ids)
        return self.remaining


@dataclass(eq=False)
class Outcomes:
    """A run's outcomes waiting to be written; ``on_recorded`` hears how each ended, once."""

    slot: int
    fence: Fence | None
    items: list[tuple[Message, Disposition]]
    on_recorded: Recorded
    queued_at: float = 0.0
    retry_at: float = 0.0
    delay: float = DEFERRED_FIRST


@dataclass(slots=True)
class _SlotMarks:
    fence: Fence | None
    runs: dict[int, list[int]] = field(default_factory=dict)  # token → ids not yet recorded, in call order
    token_of: dict[int, int] = field(default_factory=dict)  # message id → its run's token
    abandoned: list[int] = field(default_factory=list)
    leaving: set[int] = field(default_factory=set)  # ids whose outcomes a flush is writing now
    alone: set[int] = field(default_factory=set)  # ids called with no other call running in the replica
    version: int = 0  # of the last state handed out for writing

    def add(self, token: int, ids: Sequence[int], alone: bool) -> None:
        self.runs[token] = list(ids)
        for message_id in ids:
            self.token_of[message_id] = token
        if alone:
            self.alone.update(ids)

    def state(self) -> tuple[str | None, int]:
        """The marks to write (without the calls being recorded) and their new version."""
        gone = self.leaving
        runs = tuple(tuple(i for i in ids if i not in gone) for ids in self.runs.values())
        self.version += 1
        abandoned = tuple(i for i in self.abandoned if i not in gone)
        return InFlight(runs, abandoned, tuple(self.alone - gone)).to_json(), self.version

    def forget(self, message_id: int) -> None:
        self.alone.discard(message_id)
        token = self.token_of.pop(message_id, None)
        if token is not None:
            ids = self.runs[token]
            ids.remove(message_id)
            if not ids:
                del self.runs[token]
        if message_id in self.abandoned:
            self.abandoned.remove(message_id)


class Committer:
    """Group commits of outcomes and marks for one replica; run :meth:`run` on a thread of its own."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        on_lease_lost: Callable[[int], None] = lambda slot: None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self._on_lease_lost = on_lease_lost
        self._monotonic = monotonic
        self._cond = threading.Condition()
        self._queued: list[Outcomes] = []
        self._deferred: list[Outcomes] = []
        self._requests: list[MarkTicket] = []
        self._marks: dict[int, _SlotMarks] = {}
        self._dirty: set[int] = set()  # slots whose marks changed since the last flush
        self._dirty_since = 0.0
        self._tokens = itertools.count(1)
        self._stopping = False
        self._flushing = False
        self._backoff = RETRY_FIRST
        self._stop_by = float("inf")
        self.flushes = 0
        self.written = 0  # outcomes written (or found gone), for benchmarks and tests waiting on a drain

    # -- what lanes call -----------------------------------------------------------------------------------

    def mark(self, slot: int, fence: Fence | None, ids: Sequence[int], alone: bool = False) -> float | None:
        """Mark these calls in flight on the slot's lease row before they start; blocks until written.

        ``alone``: no other call runs in this replica while they do (a crash meanwhile is theirs).

        Returns the seconds left of the lease, or None when the calls must not start: the lease is gone, the
        replica stops, or the database cannot be written now (the hint is left for later).
        """
        return self.mark_ahead(slot, fence, ids, alone).wait()

    def mark_ahead(self, slot: int, fence: Fence | None, ids: Sequence[int], alone: bool = False) -> MarkTicket:
        """Ask for the calls' mark and return at once: the calls start after the ticket's :meth:`~MarkTicket.wait`
        (so that a lane can have its next run marked while it still makes the calls of this one)."""
        ticket = MarkTicket(self, slot, ids, self._monotonic())
        if fence is None:  # no lease, nothing to tell a successor: the calls may start at once
            ticket.answer(float("inf"), ticket.asked)
            return ticket
        with self._cond:
            if self._stopping:
                ticket.answer(None, ticket.asked)
                return ticket
            self._slot(slot, fence).add(next(self._tokens), ids, alone)
            self._requests.append(ticket)
            self._cond.notify_all()
        return ticket

    def run_marks(self) -> None:
        """Write the marks lanes wait for, many at once, until stopped (run it on a thread of its own).

        A write is one fenced statement committed without waiting for the disk, on a connection of its own,
        so that lanes never wait behind a durable flush of outcomes.
        """
        while True:
            with self._cond:
                while not self._requests and not self._stopping:
                    self._cond.wait(1.0)
                requests, self._requests = self._requests, []
                if self._stopping:
                    for request in requests:
                        request.answer(None, self._monotonic())
                    return
                writes = []
                for slot in sorted({request.slot for request in requests}):
                    marks = self._marks.get(slot)
                    if marks is not None:
                        text, version = marks.state()
                        writes.append(SlotWrite(slot, marks.fence, (), text, version))
            try:
                result = self.store.leases_mark(writes)
            except Exception as error:  # the calls are not made: their hints are left for later
                self.metrics.database_error(error)
                logger.warning("marking calls in flight failed; their hints are left for later: %s", error)
                now = self._monotonic()
                for request in requests:
                    request.answer(None, now)
                continue
            for slot in sorted(result.lost):
                self._lease_lost(slot)
            now = self._monotonic()
            for request in requests:
                request.answer(None if request.slot in result.lost else result.remaining.get(request.slot), now)

    def unmark(self, slot: int, ids: Sequence[int]) -> None:
        """These marked calls will not be made after all (the batch stopped early)."""
        if not ids:
            return
        with self._cond:
            marks = self._marks.get(slot)
            if marks is None:
                return
            for message_id in ids:
                marks.forget(message_id)
            self._touch(slot)
            self._cond.notify_all()

    def abandon(self, slot: int, message_id: int) -> None:
        """A call given up at shutdown: its successor delivers the message again without blaming it."""
        with self._cond:
            marks = self._marks.get(slot)
            if marks is None:
                return
            marks.forget(message_id)
            marks.abandoned.append(message_id)
            self._touch(slot)
            self._cond.notify_all()

    def record(self, outcomes: Outcomes) -> None:
        """Queue a run's outcomes; they are written within a few milliseconds."""
        outcomes.queued_at = self._monotonic()
        with self._cond:
            self._queued.append(outcomes)
            self._cond.notify_all()

    def forget_slot(self, slot: int) -> None:
        """The slot is no longer held: drop its marks (its outcomes are fenced off when flushed)."""
        with self._cond:
            self._marks.pop(slot, None)
            self._dirty.discard(slot)

    def idle(self) -> bool:
        """True when nothing waits to be written except deferred outcomes (rows locked elsewhere)."""
        with self._cond:
            return not (self._queued or self._dirty or self._flushing)

    def _touch(self, slot: int) -> None:
        if not self._dirty:
            self._dirty_since = self._monotonic()
        self._dirty.add(slot)

    def _slot(self, slot: int, fence: Fence | None) -> _SlotMarks:
        marks = self._marks.get(slot)
        if marks is None or marks.fence != fence:
            marks = self._marks[slot] = _SlotMarks(fence)
        return marks

    # -- the loop ---------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Write what is queued, then return from :meth:`run`; later mark requests are refused."""
        with self._cond:
            self._stopping = True
            self._stop_by = self._monotonic() + STOP_WRITE_WAIT
            self._cond.notify_all()

    def run(self) -> None:
        """Flush until stopped and drained (outcomes still deferred at shutdown are left: their messages are
        delivered again, as are those the database would not take within ``STOP_WRITE_WAIT`` of the stop)."""
        while True:
            with self._cond:
                while not self._due():
                    if self._stopping and not (self._queued or self._dirty):
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
        if self._dirty and (self._stopping or now - self._dirty_since >= MARKS_WINDOW):
            return True
        return not self._stopping and any(outcomes.retry_at <= now for outcomes in self._deferred)

    def _wait_time(self) -> float:
        now = self._monotonic()
        times = [1.0]
        if self._queued:
            times.append(self._queued[0].queued_at + GROUP_WINDOW - now)
        if self._dirty:
            times.append(self._dirty_since + MARKS_WINDOW - now)
        times += [outcomes.retry_at - now for outcomes in self._deferred]
        return max(0.0005, min(times))

    def flush_once(self) -> FlushOutcome | None:
        """Write everything queued (and deferred outcomes now due), with the marks it changes, durably."""
        with self._cond:
            now = self._monotonic()
            taken, self._queued = self._take_queued()
            retry = [o for o in self._deferred if o.retry_at <= now]
            self._deferred = [o for o in self._deferred if o.retry_at > now]
            batches = retry + taken
            dirty, self._dirty = self._dirty, set()
            # Outcomes of an earlier term of their slot (lost, then taken again) are fenced off.
            stale = [o for o in batches if o.slot in self._marks and self._marks[o.slot].fence != o.fence]
            batches = [o for o in batches if o not in stale]
            writes = self._writes(batches, dirty)
            self._flushing = True
        for outcomes in stale:
            outcomes.on_recorded([(message, "fenced") for message, _ in outcomes.items])
        try:
            result = self.store.messages_record(writes)
        except StoreError as error:  # unavailable, busy, access denied...: one line each time
            self._failed(error, batches, dirty)
            return None
        except Exception:
            logger.exception("recording outcomes failed; trying again")
            self._failed(None, batches, dirty)
            return None
        finally:
            with self._cond:
                self._flushing = False
        self._backoff = RETRY_FIRST
        self.flushes += 1
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

    def _writes(self, batches: list[Outcomes], dirty: set[int]) -> list[SlotWrite]:
        """Under the lock: what each touched slot gets, its outcomes and its marks without the calls they
        record (those are *leaving* until the flush ends, so that lanes' marks meanwhile leave them out too)."""
        by_slot: dict[int, list[Disposition]] = {}
        leaving: dict[int, set[int]] = {}
        fences: dict[int, Fence | None] = {}
        for outcomes in batches:
            by_slot.setdefault(outcomes.slot, []).extend(disposition for _, disposition in outcomes.items)
            leaving.setdefault(outcomes.slot, set()).update(message.id for message, _ in outcomes.items)
            fences.setdefault(outcomes.slot, outcomes.fence)
        writes = []
        for slot in sorted(set(by_slot) | dirty):
            marks = self._marks.get(slot)
            if marks is None:
                writes.append(SlotWrite(slot, fences.get(slot), tuple(by_slot.get(slot, ()))))
                continue
            marks.leaving |= leaving.get(slot, set())
            text, version = marks.state()
            writes.append(SlotWrite(slot, marks.fence, tuple(by_slot.get(slot, ())), text, version))
        return writes

    def _failed(self, error: Exception | None, batches: list[Outcomes], dirty: set[int]) -> None:
        self.metrics.database_error(error)
        self.metrics.record_failures.inc()
        if error is not None:
            logger.warning("recording outcomes failed, trying again in %.2fs: %s", self._backoff, error)
        with self._cond:
            self._queued = batches + self._queued
            for outcomes in batches:  # not recorded after all: back in the marks a lane writes next
                marks = self._marks.get(outcomes.slot)
                if marks is not None:
                    marks.leaving.difference_update(message.id for message, _ in outcomes.items)
                self._touch(outcomes.slot)
            self._dirty |= dirty
            delay = self._backoff
            self._backoff = min(RETRY_MAX, self._backoff * 2)
            self._cond.wait(delay)

    def _settle(self, result: FlushOutcome, batches: list[Outcomes]) -> None:
        now = self._monotonic()
        with self._cond:
            for slot in result.lost:
                self._marks.pop(slot, None)
                self._dirty.discard(slot)
            for outcomes in batches:
                marks = self._marks.get(outcomes.slot)
                if outcomes.slot in result.lost or marks is None:
                    continue
                for message, _ in outcomes.items:
                    marks.leaving.discard(message.id)
                    if message.id in result.deferred:
                        self._touch(outcomes.slot)  # written as gone from the marks: put it back next flush
                    else:
                        marks.forget(message.id)
        for slot in sorted(result.lost):
            self.metrics.fenced_commits.inc()
            logger.warning(
                "slot %s: lease lost; its outcomes were not written (its new holder decides)", slot,
                extra={"slot": slot},
            )
            self._on_lease_lost(slot)
        self._settle_outcomes(result, batches, now)

    def _lease_lost(self, slot: int) -> None:
        with self._cond:
            self._marks.pop(slot, None)
            self._dirty.discard(slot)
        self._on_lease_lost(slot)

    def _settle_outcomes(self, result: FlushOutcome, batches: list[Outcomes], now: float) -> None:
        deferred: list[Outcomes] = []
        for outcomes in batches:
            ended: list[tuple[Message, str]] = []
            waiting: list[tuple[Message, Disposition]] = []
            for message, disposition in outcomes.items:
                if outcomes.slot in result.lost:
                    ended.append((message, "fenced"))
                elif message.id in result.deferred:
                    waiting.append((message, disposition))
                elif message.id in result.failed:
                    self.metrics.unrecordable.inc()
                    logger.error(
                        "the outcome of message %s could not be recorded (%s); it was made dead if it could be",
                        message.id, result.failed[message.id], extra={"id": message.id, "hint": message.hint},
                    )
                    ended.append((message, "failed"))
                else:
                    ended.append((message, "gone" if message.id in result.gone else "written"))
            if waiting:
                later = Outcomes(outcomes.slot, outcomes.fence, waiting, outcomes.on_recorded)
                later.retry_at = now + outcomes.delay
                later.delay = min(DEFERRED_MAX, outcomes.delay * 2)
                deferred.append(later)
            if ended:
                self.written += sum(1 for _, how in ended if how in ("written", "gone"))
                outcomes.on_recorded(ended)
        if deferred:
            self.metrics.deferred_outcomes.inc(sum(len(o.items) for o in deferred))
            with self._cond:
                self._deferred += deferred
