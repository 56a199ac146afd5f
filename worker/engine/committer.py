"""The committer: writes the outcomes of correlator calls and the in-flight marks, in group commits.

Lanes hand it two things. *Outcomes* of calls (a disposition per message): the lane moves on at once and the
committer writes them within a few milliseconds, many lanes' together, in one transaction per flush, fenced
by the slots' leases. *Marks*: before a lane calls messages it asks for them to be marked on its slot's lease
row (``in_flight``) and waits until that is committed, so that whoever takes the slot over after this replica
died knows which calls were under way (DESIGN.md §3 "Poison messages", §4 invariant 2). A mark request rides
in the same flush as the outcomes queued before it, so a lane's previous outcome and its next mark are
committed together::

    lane:   call m1 ─ outcome(m1) ┐                  ┌─ call m2 ─ outcome(m2) ┐
                      mark(m2) ───┤  wait            │                         ...
    committer:                    └─ flush: fence, outcome m1, marks {m2} ─ ack ┘

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

from worker.db.base import DatabaseBusy, DatabaseUnavailable, Fence
from worker.db.messages import FlushOutcome, InFlight, SlotWrite
from worker.db.store import Store
from worker.message import Message
from worker.policy.outcomes import Disposition
from worker.service.metrics import Metrics

logger = logging.getLogger(__name__)

GROUP_WINDOW = 0.002  # seconds outcomes may wait for company before they are flushed
MARKS_WINDOW = 0.05  # seconds a withdrawn mark (a call that will not be made) may wait to be written
MAX_GROUP = 5000  # outcomes in one flush
RETRY_FIRST, RETRY_MAX = 0.05, 2.0  # backoff after a failed flush (seconds)
DEFERRED_FIRST, DEFERRED_MAX = 0.1, 5.0  # how soon a deferred outcome (row locked elsewhere) is tried again


@dataclass(eq=False)
class Ticket:
    """A mark request: the lane waits on it; it tells the seconds left of the lease, or None if refused."""

    slot: int
    fence: Fence | None
    ids: tuple[int, ...]
    token: int
    done: threading.Event = field(default_factory=threading.Event)
    remaining: float | None = None

    def wait(self, timeout: float | None = None) -> float | None:
        """Block until the mark is committed (seconds left of the lease) or refused (None)."""
        self.done.wait(timeout)
        return self.remaining if self.done.is_set() else None

    def resolve(self, remaining: float | None) -> None:
        """Answer the lane."""
        self.remaining = remaining
        self.done.set()


@dataclass(eq=False)
class Outcome:
    """A call's disposition waiting to be written; ``on_recorded`` runs once it is (or cannot be)."""

    slot: int
    fence: Fence | None
    message: Message
    disposition: Disposition
    on_recorded: Callable[[Outcome, str], None]  # (outcome, how: written|gone|failed|fenced)
    queued_at: float = 0.0
    retry_at: float = 0.0
    delay: float = DEFERRED_FIRST


@dataclass(slots=True)
class _SlotMarks:
    fence: Fence | None
    runs: dict[int, list[int]] = field(default_factory=dict)  # token → ids not yet recorded, in call order
    abandoned: list[int] = field(default_factory=list)

    def in_flight(self) -> InFlight:
        return InFlight(tuple(tuple(ids) for ids in self.runs.values() if ids), tuple(self.abandoned))

    def forget(self, message_id: int) -> None:
        for token, ids in list(self.runs.items()):
            if message_id in ids:
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
        holder: str,
        metrics: Metrics,
        on_lease_lost: Callable[[int], None] = lambda slot: None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.holder = holder
        self.metrics = metrics
        self._on_lease_lost = on_lease_lost
        self._monotonic = monotonic
        self._cond = threading.Condition()
        self._outcomes: list[Outcome] = []
        self._deferred: list[Outcome] = []
        self._tickets: list[Ticket] = []
        self._marks: dict[int, _SlotMarks] = {}
        self._dirty: set[int] = set()  # slots whose marks changed since the last flush
        self._dirty_since = 0.0
        self._tokens = itertools.count(1)
        self._stopping = False
        self._flushing = False
        self._backoff = RETRY_FIRST
        self.flushes = 0

    # -- what lanes call -----------------------------------------------------------------------------------

    def mark(self, slot: int, fence: Fence | None, ids: Sequence[int]) -> Ticket:
        """Ask for these calls to be marked in flight before they start; wait on the ticket."""
        ticket = Ticket(slot, fence, tuple(ids), next(self._tokens))
        if fence is None:  # no lease, nothing to tell a successor: the calls may start at once
            ticket.resolve(float("inf"))
            return ticket
        with self._cond:
            if self._stopping:
                ticket.resolve(None)
                return ticket
            marks = self._slot(slot, fence)
            marks.runs[ticket.token] = list(ids)
            self._dirty.add(slot)
            self._tickets.append(ticket)
            self._cond.notify_all()
        return ticket

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

    def record(self, outcome: Outcome) -> None:
        """Queue a call's outcome; it is written within a few milliseconds."""
        outcome.queued_at = self._monotonic()
        with self._cond:
            self._outcomes.append(outcome)
            self._cond.notify_all()

    def forget_slot(self, slot: int) -> None:
        """The slot is no longer held: drop its marks (its outcomes are fenced off when flushed)."""
        with self._cond:
            self._marks.pop(slot, None)
            self._dirty.discard(slot)

    def pending(self) -> int:
        """Outcomes and marks not written yet (deferred ones included)."""
        with self._cond:
            return len(self._outcomes) + len(self._deferred) + len(self._tickets) + len(self._dirty)

    def idle(self) -> bool:
        """True when nothing waits to be written except deferred outcomes (rows locked elsewhere)."""
        with self._cond:
            return not (self._outcomes or self._tickets or self._dirty or self._flushing)

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
            self._cond.notify_all()

    def run(self) -> None:
        """Flush until stopped and drained (outcomes still deferred at shutdown are left: their rows' holders
        keep them, and the messages are delivered again)."""
        while True:
            with self._cond:
                while not self._due():
                    if self._stopping and not (self._outcomes or self._tickets or self._dirty):
                        return
                    self._cond.wait(self._wait_time())
            self.flush_once()

    def _due(self) -> bool:
        if self._tickets:
            return True
        now = self._monotonic()
        if self._outcomes and (self._stopping or len(self._outcomes) >= MAX_GROUP):
            return True
        if self._outcomes and now - self._outcomes[0].queued_at >= GROUP_WINDOW:
            return True
        if self._dirty and (self._stopping or now - self._dirty_since >= MARKS_WINDOW):
            return True
        return any(outcome.retry_at <= now for outcome in self._deferred)

    def _wait_time(self) -> float:
        now = self._monotonic()
        times = [1.0]
        if self._outcomes:
            times.append(self._outcomes[0].queued_at + GROUP_WINDOW - now)
        if self._dirty:
            times.append(self._dirty_since + MARKS_WINDOW - now)
        times += [outcome.retry_at - now for outcome in self._deferred]
        return max(0.0005, min(times))

    def flush_once(self) -> FlushOutcome | None:
        """Write everything queued now (and deferred outcomes that are due) in one transaction."""
        with self._cond:
            now = self._monotonic()
            outcomes = self._outcomes[:MAX_GROUP]
            self._outcomes = self._outcomes[MAX_GROUP:]
            retry = [outcome for outcome in self._deferred if outcome.retry_at <= now]
            self._deferred = [outcome for outcome in self._deferred if outcome.retry_at > now]
            outcomes = retry + outcomes
            tickets, self._tickets = self._tickets, []
            dirty, self._dirty = self._dirty, set()
            # Outcomes of an earlier term of their slot (lost, then taken again) are fenced off.
            stale = [o for o in outcomes if o.slot in self._marks and self._marks[o.slot].fence != o.fence]
            outcomes = [o for o in outcomes if o not in stale]
            writes = self._writes(outcomes, tickets, dirty)
            self._flushing = True
        for outcome in stale:
            outcome.on_recorded(outcome, "fenced")
        try:
            result = self.store.messages_record(writes)
        except (DatabaseUnavailable, DatabaseBusy) as error:
            self._failed(error, outcomes, tickets, dirty)
            return None
        except Exception:
            logger.exception("recording outcomes failed; trying again")
            self._failed(None, outcomes, tickets, dirty)
            return None
        finally:
            with self._cond:
                self._flushing = False
        self._backoff = RETRY_FIRST
        self.flushes += 1
        self._settle(result, outcomes, tickets)
        return result

    def _writes(self, outcomes: list[Outcome], tickets: list[Ticket], dirty: set[int]) -> list[SlotWrite]:
        """What each touched slot gets: its outcomes, and its marks as they are once those are written."""
        recorded = {(o.slot, o.message.id) for o in outcomes}
        writes = []
        for slot in sorted({o.slot for o in outcomes} | {t.slot for t in tickets} | dirty):
            marks = self._marks.get(slot)
            if marks is None:
                fence = _fence_of(slot, outcomes, tickets)
                in_flight = InFlight()
            else:
                fence = marks.fence
                current = marks.in_flight()
                in_flight = InFlight(
                    tuple(tuple(i for i in run if (slot, i) not in recorded) for run in current.runs),
                    tuple(i for i in current.abandoned if (slot, i) not in recorded),
                )
            dispositions = tuple(o.disposition for o in outcomes if o.slot == slot)
            writes.append(SlotWrite(slot, fence, dispositions, in_flight.to_json()))
        return writes

    def _failed(
        self, error: Exception | None, outcomes: list[Outcome], tickets: list[Ticket], dirty: set[int]
    ) -> None:
        self.metrics.database_errors.inc()
        self.metrics.record_failures.inc()
        if error is not None:
            logger.warning("recording outcomes failed, trying again in %.2fs: %s", self._backoff, error)
        with self._cond:
            self._outcomes = outcomes + self._outcomes
            self._tickets = tickets + self._tickets
            self._dirty |= dirty
            delay = self._backoff
            self._backoff = min(RETRY_MAX, self._backoff * 2)
            self._cond.wait(delay)

    def _settle(self, result: FlushOutcome, outcomes: list[Outcome], tickets: list[Ticket]) -> None:
        now = self._monotonic()
        with self._cond:
            for outcome in outcomes:
                if outcome.slot in result.lost:
                    continue
                marks = self._marks.get(outcome.slot)
                if outcome.message.id in result.deferred:
                    self._touch(outcome.slot)  # its mark was written as gone: put it back at the next flush
                    continue
                if marks is not None:
                    marks.forget(outcome.message.id)
            for slot in result.lost:
                self._marks.pop(slot, None)
                self._dirty.discard(slot)
        for slot in sorted(result.lost):
            self.metrics.fenced_commits.inc()
            logger.warning("slot %s: lease lost; its outcomes were not written (its new holder decides)", slot)
            self._on_lease_lost(slot)
        deferred: list[Outcome] = []
        for outcome in outcomes:
            message_id = outcome.message.id
            if outcome.slot in result.lost:
                outcome.on_recorded(outcome, "fenced")
            elif message_id in result.deferred:
                outcome.retry_at = now + outcome.delay
                outcome.delay = min(DEFERRED_MAX, outcome.delay * 2)
                deferred.append(outcome)
            elif message_id in result.failed:
                self.metrics.unrecordable.inc()
                logger.error(
                    "the outcome of message %s could not be recorded (%s); it was made dead if possible",
                    message_id, result.failed[message_id],
                )
                outcome.on_recorded(outcome, "failed")
            elif message_id in result.gone:
                outcome.on_recorded(outcome, "gone")
            else:
                outcome.on_recorded(outcome, "written")
        if deferred:
            self.metrics.deferred_outcomes.inc(len(deferred))
            with self._cond:
                self._deferred += deferred
        for ticket in tickets:
            if ticket.slot in result.lost:
                ticket.resolve(None)
            else:
                ticket.resolve(result.remaining.get(ticket.slot, float("inf")))


def _fence_of(slot: int, outcomes: Sequence[Outcome], tickets: Sequence[Ticket]) -> Fence | None:
    for ticket in tickets:
        if ticket.slot == slot:
            return ticket.fence
    for outcome in outcomes:
        if outcome.slot == slot:
            return outcome.fence
    return None
