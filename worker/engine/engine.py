"""The engine inside a replica (DESIGN.md §4): each held slot fetched on its own schedule, hint lanes kept busy
across all of them, outcomes written by a committer while the lanes move on.

::

    wake-ups (NOTIFY, a slot taken over, a hint's work done)      poll interval, due times (backstop)
                 │                                                          │
                 ▼                                                          ▼
    fetcher ── for the slot wanted soonest, while the rotation has room:
                 adopt the calls ended terms left in flight (each counted once, whoever adopts again)
                 candidates = hints with fresh or due messages (round robin over hints)
                 batches    = each hint's eligible prefix, up to the commit-order horizon
                 ──► rotation ──► lanes (poll.concurrency calls at once) ──► committer (group commits)
                                                                              │
                 a hint's work is over once its outcomes are written  ◄──────┘
                 (its slot is fetched again at once if it had more)

A hint is *busy* from its fetch until its last outcome is written; busy hints are left out of fetches (the
candidates are read past them), so a message is never handed out twice and a hint never has two calls at once;
when a wake-up says messages arrived in a slot while a hint of it was busy, the slot is fetched again as soon as
that hint's work is over, so a message inserted meanwhile is called right after the one before it, not at the
next poll. A batch also ends before any message with a call in flight (a row in ``correlation_call``: this
replica's, another's, or one of an ended term not adopted yet, its row locked by another session), whatever a
session changed on the row. With ``batch_size`` N a hint that took N messages rests until the next poll
interval (targets that need time between two messages). A durable pause of everything stops fetching; one of a
hint leaves the hint out; one of a message name ends each batch before such a message and pauses it (it then
holds back its hint's later messages, like any paused message) until the pause is lifted. Lanes look at the
same pauses before every call, so fetched work stops too; the pauses are read again at once when a replica is
told they changed, else every second.

:meth:`Engine.run_once` drives the same parts until nothing eligible is left now (for tests and embedding);
:meth:`Engine.start` runs them continuously.
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from worker.config import Settings, format_duration
from worker.correlators import Router
from worker.db.base import Fence
from worker.db.calls import LostCall
from worker.db.errors import LeaseLost, StoreError, from_database
from worker.db.fetch import Candidates, Fetched, FetchMark, HorizonReading, Pause
from worker.db.rows import Unreadable
from worker.db.store import Store
from worker.engine.committer import Committer
from worker.engine.lanes import ROUTES_KEY, DatabaseClock, HintWork, Lanes
from worker.message import Message
from worker.policy.batching import cut_batch, next_cursor
from worker.policy.horizon import Horizon, Pin, PinClock, horizon, overdue
from worker.policy.outcomes import LostCallOutcome, settle_lost_call
from worker.policy.routing import Routing
from worker.service.metrics import Metrics
from worker.service.tracing import Tracing
from worker.supervise import Supervisor

logger = logging.getLogger(__name__)

FETCHERS = 2  # threads fetching slots (one slot by one fetcher at a time): database round trips overlap
MARKERS = 2  # threads writing marks of calls in flight (each a statement of many lanes' runs)
HELD_RETRY = 0.05  # seconds before a slot held back by the horizon is fetched again
ADOPT_RETRY = 0.25  # seconds before a slot with lost calls left unadopted (rows locked elsewhere) is tried again
# Calls of an ended term are adopted when the slot is taken, and looked for again once a poll (at least this
# often): a mark whose statement read the term as running just before it ended, and committed just after the
# next holder's adoption, is found by the next sweep (its call never started: the lane's own deadline passed).
ADOPT_SWEEP = 5.0
PAUSES_REUSE = 1.0  # seconds the list of durable pauses is reused
# Seconds a horizon reading with no producer transaction registered is reused by the replica's other fetches (one
# that a wake-up of its slot came after excepted): reading it reads every lock of the server, too much per fetch.
HORIZON_REUSE = 0.02
STALL_AFTER = 60.0  # seconds without progress after which a held slot counts as stalled (at least 3 polls)
ERROR_FIRST, ERROR_MAX = 0.5, 10.0  # backoff of a slot whose fetch failed
# The cyclic collector's thresholds while an engine runs. Each message makes a few dozen short-lived objects
# (its row, its frozen payload, its disposition), none of them in a cycle. The first threshold counts objects made
# and not yet freed: at Python's default (700) a collection comes every few messages and finds nothing; below what
# the pages of messages waiting for lanes hold, each collection scans (and promotes) them all. At 100 000 one comes
# once the live objects grew that much; cycles are still collected, later (a few MB of them at most).
GC_THRESHOLDS = (100_000, 20, 20)


class SlotSource(Protocol):
    """The slots this replica may work on, and the lease terms that fence their writes."""

    def slots(self) -> Sequence[int]:
        """The slots held now and safe to act on (not being handed back)."""
        ...

    def terms(self) -> dict[int, Fence | None]:
        """The slots held now and safe to act on, with their terms (in one look)."""
        ...

    def fence(self, slot: int) -> Fence | None:
        """The term of a slot's lease (None without leases)."""
        ...

    def safe_for(self, slot: int, fence: Fence | None = None) -> float:
        """Seconds the slot stays safe to act on under this term (0 once it is over)."""
        ...

    def lost(self, slot: int, fence: Fence | None = None) -> None:
        """A write found this term of the slot's lease over (a later term is kept)."""
        ...


class AllSlots:
    """Every slot, unfenced: an engine without leases (tests, benchmarks, embedding in another program)."""

    def __init__(self, slot_count: int) -> None:
        self._slots = tuple(range(slot_count))

    def slots(self) -> Sequence[int]:
        """Every slot."""
        return self._slots

    def terms(self) -> dict[int, Fence | None]:
        """Every slot, without a term."""
        return dict.fromkeys(self._slots)

    def fence(self, slot: int) -> Fence | None:
        """No lease, no fence."""
        return None

    def safe_for(self, slot: int, fence: Fence | None = None) -> float:
        """Always safe."""
        return float("inf")

    def lost(self, slot: int, fence: Fence | None = None) -> None:
        """Nothing to lose."""


@dataclass(slots=True)
class PollResult:
    """What :meth:`Engine.run_once` did."""

    fetched: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    adopted: int = 0
    unreadable: int = 0

    @property
    def correlated(self) -> int:
        """Messages whose call ended in success."""
        return self.outcomes.get("success", 0)


@dataclass(slots=True)
class _Slot:
    slot: int
    fence: Fence | None
    adopted: bool
    adopt_again_at: float = 0.0  # monotonic: when to look for calls of ended terms again (a sweep, once a poll)
    wanted_at: float = 0.0  # monotonic: fetch no earlier than this
    cursor: str = ""  # round robin over the slot's hints: the last hint taken
    delay: float = ERROR_FIRST
    last_progress: float = 0.0  # monotonic: last fetch that found the slot drained or took work from it
    fetching: bool = False  # a fetcher is on it
    asked: float = float("inf")  # the soonest fetch asked for while a fetch was under way (it must not be lost)
    notified_at: float = float("-inf")  # monotonic: the last wake-up saying messages arrived in the slot
    # A fetch that may have marked calls failed before handing them over: they are taken back before the next one
    unknown_marks: bool = False
    # Its last fetch found nothing and nothing asked for one since: at its next poll it is looked at together
    # with the other quiet slots (one statement for all of them) and fetched only if that finds work
    quiet: bool = False
    # Its next fetch reads the commit-order horizon itself (it found work a reused reading may not have covered)
    fresh_horizon: bool = False
    # A fetch of it ended under this term: what waited in it when it was taken is in the lanes (or was not there)
    fetched_once: bool = False

    def want(self, at: float) -> None:
        """Fetch no later than ``at`` (a fetch under way keeps this for when it ends)."""
        self.wanted_at = min(self.wanted_at, at)
        self.asked = min(self.asked, at)
        self.quiet = False

    def fetched(self, next_at: float) -> None:
        """A fetch ended: the next one at ``next_at``, or sooner if asked for meanwhile."""
        self.wanted_at = min(next_at, self.asked)
        self.asked = float("inf")


class Engine:
    """Correlates the messages of the slots a :class:`SlotSource` hands it."""

    def __init__(
        self,
        store: Store,
        router: Router,
        settings: Settings,
        slots: SlotSource,
        metrics: Metrics | None = None,
        holder: str = "",
        monotonic: Callable[[], float] = time.monotonic,
        tick: Callable[[], None] = lambda: None,
        tracing: Tracing | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.slot_source = slots
        self.metrics = metrics or Metrics()
        self.holder = holder
        self._monotonic = monotonic
        self._tick = tick  # liveness: the fetch loop calls it at least every second
        self.clock = DatabaseClock(monotonic)
        self.supervisor = Supervisor()  # its threads, and the worker's: one that dies stops the replica
        # Whether the live replicas agree on a message name's route (replaced by the replicas' board at each look;
        # alone, it agrees on every name).
        self.routing = Routing({})
        self.committer = Committer(store, self.metrics, self._lease_lost, monotonic)
        self.lanes = Lanes(
            router, settings, self.committer, slots, self.metrics, self.clock, self._finished,
            on_taken=self._room, monotonic=monotonic, held_back=self.held_back,
            agreed=lambda name: self.routing.agrees(name), tracing=tracing,
            on_target_ready=self._target_ready,
        )
        self._cond = threading.Condition()
        self._slots: dict[int, _Slot] = {}
        self._terms: dict[int, Fence | None] | None = None  # the slot source's terms at the last look
        self._unfollowed = False  # slots were acquired since the fetchers last looked at the leases
        self._busy: dict[str, HintWork] = {}
        # Hints not fetched for a while: hint -> (until, its slot, the destination it waits for or None). After a
        # batch of batch_size, until the next poll; refused by its target, until it may be called again.
        self._resting: dict[str, tuple[float, int, str | None]] = {}
        self._after_renewal: set[int] = set()  # slots to fetch once their terms are renewed
        self._tally: Counter[str] = Counter()
        self._pins = PinClock()
        self._horizon_lock = threading.Lock()  # the pin clock and the last reading, shared by the fetchers
        self._reading_at = float("-inf")  # monotonic: when the fetch that took the last horizon reading started
        self._clean_reading: int | None = None  # its last_id, when no producer transaction was registered
        self._pauses: tuple[float, list[Pause]] | None = None
        self._pauses_delay = ERROR_FIRST  # before the pauses are read again after a failed read
        # What the durable pauses hold back now, read by lanes before every call: (everything, names, hints).
        self._held: tuple[bool, frozenset[str], frozenset[str]] = (False, frozenset(), frozenset())
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        per_hint = settings.policy.batch_size
        self.page_size = settings.poll.page_size
        self.per_hint = self.page_size if per_hint == -1 else min(per_hint, self.page_size)
        # Hints waiting for a lane: fetched up to the high water mark, once fewer than the low one wait, so that a
        # fetch brings several (a fetch per hint a lane takes is most of a replica's CPU with slow targets).
        self.high_water = max(4, 2 * settings.poll.concurrency)
        self.low_water = self.high_water // 2
        self.interval = settings.poll.interval.total_seconds()
        # A fetch marks calls only with its term safe for longer than any call may take.
        self._call_timeout = settings.longest_handler_timeout()[0].total_seconds()
        self.stall_after = max(STALL_AFTER, 3 * self.interval)
        # Read when scraped: what the lanes and slots are doing now.
        self.metrics.busy_lanes.set_function(self.lanes.busy_lanes)
        self.metrics.slot_progress_age.set_function(lambda: max(self.slot_progress_ages().values(), default=0.0))
        self.metrics.stalled_slots.set_function(
            lambda: sum(1 for age in self.slot_progress_ages().values() if age > self.stall_after)
        )

    # -- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Run the committer, the lanes and the fetch loop on threads of their own."""
        if gc.get_threshold()[0] < GC_THRESHOLDS[0]:
            gc.set_threshold(*GC_THRESHOLDS)
        self._start_parts()
        for number in range(FETCHERS):
            fetcher = self.supervisor.thread(self._fetch_forever, f"fetcher-{number + 1}")
            self._threads.append(fetcher)
            fetcher.start()

    def _start_parts(self) -> None:
        if any(thread.name == "committer" for thread in self._threads):
            return
        parts = [("committer", self.committer.run)]
        parts += [(f"marker-{number + 1}", self.committer.run_marks) for number in range(MARKERS)]
        for name, target in parts:
            thread = self.supervisor.thread(target, name)
            self._threads.append(thread)
            thread.start()
        self.lanes.start()

    def stop(self, grace: float) -> None:
        """Stop: fetch nothing more, let running calls finish for ``grace`` seconds (then give up on them),
        write the outcomes, and return."""
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
        for work in self.lanes.stop_taking_work():
            self.lanes.settle(work)
        self.lanes.wait_for_calls(grace)
        for thread in self._threads:  # a fetch under way ends first: marks it takes back reach the committer
            if thread.name.startswith("fetcher-"):
                thread.join(timeout=10)
        self.committer.stop()
        for thread in self._threads:
            thread.join(timeout=10)

    def held_back(self, message: Message) -> bool:
        """True when a durable pause holds this message back (its name, its hint, or everything)."""
        everything, names, hints = self._held
        return everything or message.name in names or message.hint in hints

    def wake(self, slots: Iterable[int] | None = None) -> None:
        """Fetch these slots (None: every slot, and read the durable pauses again) as soon as there is room."""
        if slots is None:
            self._pauses = None
        named = None if slots is None else list(slots)
        now = self._monotonic()
        with self._cond:
            for state in self._slots.values() if named is None else filter(None, map(self._slots.get, named)):
                state.want(now)
                state.notified_at = now  # a busy hint's new message: fetched once that hint's work is over
            # A fetcher for each slot named (the fetchers alone wait here, and one busy now looks at the slots
            # again before it waits): more would only take the interpreter from the one fetching.
            if named is None:
                self._cond.notify_all()
            else:
                self._cond.notify(len(named))

    def renewed(self) -> None:
        """The leases' round renewed the terms: the slots whose hints were given back because their term might end
        before a call could are fetched again now."""
        now = self._monotonic()
        with self._cond:
            waiting, self._after_renewal = self._after_renewal, set()
            for state in filter(None, map(self._slots.get, waiting)):
                state.want(now)
            if waiting:
                self._cond.notify(len(waiting))

    def acquired(self, slots: Sequence[int]) -> None:
        """The leases' round acquired slots (``slots``: every slot held now): fetch them at once. They are not
        followed yet, so a fetcher looks at the leases first, even one about to wait (no fetcher waits its turn
        for them)."""
        with self._cond:
            self._unfollowed = True
        self.wake(slots)

    def slots_in_use(self) -> set[int]:
        """Slots this replica still works on (hints fetched, calls running, outcomes unwritten): not to be
        handed to another replica yet."""
        with self._cond:
            busy = {work.slot for work in self._busy.values()}
        return busy | self.lanes.slots_in_use()

    def fetched_under(self, slot: int, fence: Fence | None) -> bool:
        """Whether a fetch of the slot ended under this term: a slot just taken over is handed back to balance
        the cluster only then, so that the work that waited in it is called by this replica, not made to wait for
        the hand-back and the next holder's round."""
        with self._cond:
            state = self._slots.get(slot)
            return state is not None and state.fence == fence and state.fetched_once

    def health(self) -> str | None:
        """Why the engine cannot do its job (None when it can)."""
        died = self.supervisor.failure()
        if died is not None:
            return died
        if self.lanes.exhausted():
            return (
                f"{self.lanes.hung()} correlator calls are stuck past their handler timeout and hold every lane "
                "(poll.concurrency): restart this replica"
            )
        return self.lanes.health()

    def slot_progress_ages(self) -> dict[int, float]:
        """Seconds since each held slot last drained or gave out work."""
        now = self._monotonic()
        with self._cond:
            return {slot: now - state.last_progress for slot, state in self._slots.items()}

    # -- one pass, for tests and embedding ------------------------------------------------------------------------

    def run_once(self, timeout: float = 60.0) -> PollResult:
        """Correlate everything eligible now (also what becomes eligible meanwhile), then return.

        It is one poll: hints resting after a ``batch_size`` batch may take their next batch, messages due
        later (retries, buffered ones) are left for a later poll, calls stuck past their timeout are not
        waited for.
        """
        self._start_parts()
        before = self._counts()
        with self._cond:
            self._resting.clear()
        self._sync_slots()
        self.wake()
        deadline = self._monotonic() + timeout
        adopted = 0
        while self._monotonic() < deadline:
            self._sync_slots()
            now = self._monotonic()
            with self._cond:
                due = [state for state in self._slots.values() if state.wanted_at <= now]
            for state in sorted(due, key=lambda s: s.wanted_at):
                adopted += self._fetch(state)
            if not due and self.lanes.idle() and self.committer.idle() and self._settled():
                with self._cond:  # a hint finishing just now may have made its slot due again
                    if all(state.wanted_at > self._monotonic() for state in self._slots.values()):
                        break
                continue
            time.sleep(0.001)
        after = self._counts()
        outcomes = {key: after[key] - before[key] for key in after if after[key] != before[key]}
        fetched = outcomes.pop("_fetched", 0)
        unreadable = outcomes.pop("_unreadable", 0)
        return PollResult(fetched, outcomes, adopted, unreadable)

    def _settled(self) -> bool:
        """No hint is busy except with calls given up on (or outcomes deferred behind others' locks)."""
        with self._cond:
            return all(work.hung or work.unrecorded for work in self._busy.values())

    def _counts(self) -> Counter[str]:
        with self._cond:
            counts = Counter(self._tally)
        return counts + self.lanes.tally()

    # -- the fetch loop ---------------------------------------------------------------------------------------------

    def _fetch_forever(self) -> None:
        while not self._stopping.is_set():
            self._tick()
            try:
                if not self._pauses_read(self._monotonic()):
                    continue
                self._sync_slots()
                state = self._next_slot()
                if state is not None:
                    try:
                        if not (state.quiet and self._looked_quiet(state)):
                            self._fetch(state)
                    finally:
                        with self._cond:
                            state.fetching = False
                            # Due again at once: the other fetchers may take it while this one goes round. Else
                            # none is woken (this one comes back to the slots itself); a woken fetcher would
                            # only take the interpreter from the lane about to make the call just fetched.
                            if state.wanted_at <= self._monotonic():
                                self._cond.notify_all()
            except Exception:  # a bug must not stop correlation; the loop goes on
                logger.exception("the fetch loop failed; going on")
                self._stopping.wait(1.0)

    def _pauses_read(self, now: float) -> bool:
        """Read the durable pauses again when told they changed, else every second. False when the database would
        not give them (gone, busy): one line counted by kind, then a backoff, and no slot is fetched meanwhile."""
        try:
            self._pause_list(now)
        except StoreError as error:
            self.metrics.database_error(error)
            delay, self._pauses_delay = self._pauses_delay, min(ERROR_MAX, self._pauses_delay * 2)
            logger.warning("reading the pauses failed, trying again in %.1fs: %s", delay, error)
            self._stopping.wait(delay)
            return False
        return True

    def _next_slot(self) -> _Slot | None:
        """The slot wanted soonest once it is due and the rotation has room (taken by this fetcher: no other
        fetches it meanwhile); None after waiting a while."""
        with self._cond:
            now = self._monotonic()
            if self._unfollowed:  # slots acquired meanwhile: the leases first, then the slots
                self._unfollowed = False
                return None
            if self.lanes.waiting() < self.low_water and not self.lanes.exhausted():
                idle = (state for state in self._slots.values() if not state.fetching)
                due = min(idle, key=lambda s: s.wanted_at, default=None)
                if due is not None and due.wanted_at <= now:
                    due.fetching = True
                    return due
                wait = 1.0 if due is None else min(1.0, due.wanted_at - now)
            else:
                wait = 0.05
            self._cond.wait(max(0.0005, wait))
        return None

    def _looked_quiet(self, first: _Slot) -> bool:
        """A quiet slot's poll (PostgreSQL): it is looked at in one statement together with the
        other quiet slots whose poll comes within half an interval, rather than each fetched on its own (else an
        idle replica holding 64 slots makes dozens of statements a second). A slot found with work (or with a
        call of another term to adopt) is fetched at once; the others are done until their next poll or due
        time. True when ``first`` needs no fetch now."""
        if self.store.dialect != "postgresql":
            return False
        now = self._monotonic()
        soon = now + self.interval / 2
        with self._cond:
            group = [first] + [
                state for state in self._slots.values()
                if state is not first and state.quiet and not state.fetching and state.adopted
                and not state.unknown_marks and state.wanted_at <= soon
            ]
            for state in group:
                state.fetching = True
                state.asked = float("inf")  # what is asked for from now on is kept for after the look
        try:
            looks = self.store.messages_look(
                {state.slot: None if state.fence is None else state.fence.fence for state in group}
            )
        except StoreError:  # the slot is fetched as usual, which reports what the database said
            looks = {}
        try:
            with self._cond:
                for state in group:
                    look = looks.get(state.slot)
                    if look is None or look.work or state.asked != float("inf"):  # asked for during the look too
                        state.want(now)
                        state.adopt_again_at = 0.0  # its fetch sweeps for calls of other terms too
                        state.fresh_horizon = True  # and reads the horizon after the look
                        continue
                    self.clock.observe(look.now)
                    state.fetched(self._next_due(now, look.next_due, look.now))  # still quiet
                    state.last_progress = now
                    state.adopt_again_at = now + max(self.interval, ADOPT_SWEEP)
                return first.quiet
        finally:
            with self._cond:
                for state in group[1:]:
                    state.fetching = False
                self._cond.notify_all()

    def _room(self) -> None:
        if self.lanes.waiting() < self.low_water:  # else the fetchers have nothing to do yet
            with self._cond:
                self._cond.notify_all()

    def _sync_slots(self) -> None:
        """Follow the leases: slots taken are fetched at once (after adopting their in-flight calls), slots
        gone have their waiting hints let go."""
        terms = self.slot_source.terms()
        if terms == self._terms:  # as at the last look (the usual case): nothing to follow
            return
        self._terms = terms
        with self._cond:
            gone = [slot for slot in self._slots if slot not in terms]
            for slot in gone:
                del self._slots[slot]
            taken = 0
            for slot, fence in terms.items():
                state = self._slots.get(slot)
                if state is None or state.fence != fence:  # new, or lost and taken again between two looks
                    self._slots[slot] = _Slot(slot, fence, adopted=fence is None, last_progress=self._monotonic())
                    taken += 1
            if taken > 1:  # due at once: the other fetchers share them (a takeover, a start)
                self._cond.notify_all()
        for slot in gone:
            for work in self.lanes.drop_slot(slot):
                work.pending.clear()
                self.lanes.settle(work)

    def _lease_lost(self, slot: int, fence: Fence) -> None:
        self.slot_source.lost(slot, fence)

    # -- fetching a slot -------------------------------------------------------------------------------------------

    def _fetch(self, state: _Slot) -> int:
        """Fetch one slot's work into the rotation; returns how many lost calls it adopted first."""
        started = self._monotonic()
        adopted = 0
        try:
            if state.unknown_marks:
                self._take_back_unknown_marks(state)
            if not state.adopted or (state.fence is not None and started >= state.adopt_again_at):
                adopted = self._adopt(state)
                state.adopt_again_at = started + max(self.interval, ADOPT_SWEEP)
            self._fetch_work(state)
            state.fetched_once = True
            state.delay = ERROR_FIRST
        except LeaseLost:
            self.slot_source.lost(state.slot, state.fence)
            with self._cond:
                if self._slots.get(state.slot) is state:
                    del self._slots[state.slot]
                    self._terms = None  # the next look follows the leases whatever they say
        except StoreError as error:  # unavailable, busy, read-only, a table gone: one line, counted by kind
            self._failed(state, error)
        except Exception as error:  # one slot's trouble must not hold up the others
            logger.exception("slot %s: fetch failed; trying again in %.1fs", state.slot, state.delay)
            self._failed(state, error)
        self.metrics.fetch_duration.observe(self._monotonic() - started)
        return adopted

    def _failed(self, state: _Slot, error: Exception) -> None:
        self.metrics.fetch_errors.inc()
        if isinstance(error, StoreError):
            self.metrics.database_error(error)
            logger.warning("slot %s: fetch failed, trying again in %.1fs: %s", state.slot, state.delay, error)
        elif from_database(error):  # a database error the store does not know: counted as `other`
            self.metrics.database_error(error)
        with self._cond:
            state.wanted_at = self._monotonic() + state.delay
            state.delay = min(ERROR_MAX, state.delay * 2)

    def _take_back_unknown_marks(self, state: _Slot) -> None:
        """Delete the calls a failed fetch may have marked and never handed over (its statement may have committed
        before the failure reached it): the rows of this term, `called`, of hints this replica is not busy with,
        that the committer does not know. A lane marks only busy hints' calls, and only this thread makes a hint
        of the slot busy, so none of those rows is a call that is made or will be; left, they would keep their
        messages in flight until the term ends, then be counted lost."""
        if state.fence is not None:
            with self._cond:
                busy = [work.hint for work in self._busy.values() if work.slot == state.slot]
            taken_back = self.store.calls_unmark_unknown(
                state.slot, state.fence, self.committer.in_flight_under(state.fence), busy
            )
            if taken_back:
                logger.warning(
                    "slot %s: %d call(s) marked by a fetch that failed were never made; their marks are taken back",
                    state.slot, len(taken_back), extra={"slot": state.slot},
                )
        state.unknown_marks = False

    def _adopt(self, state: _Slot) -> int:
        """Count the calls ended terms of the slot left in flight (this replica's own earlier terms included,
        but for calls it still makes or records); poison messages are made dead. Calls whose rows another session
        holds are adopted at a later fetch."""
        assert state.fence is not None

        def settle(call: LostCall) -> LostCallOutcome:
            poison_after = self.settings.policy_for(call.name).poison_after
            return settle_lost_call(
                call.lost_calls, call.crashed_calls, call.last_error, crashed=call.crashed, alone=call.alone,
                poison_after=poison_after,
            )

        adoption = self.store.calls_adopt(state.slot, state.fence, settle, keep=self.committer.in_flight())
        state.adopted = adoption.kept == 0
        if adoption.lost:
            self.metrics.lost_calls.inc(len(adoption.lost))
            logger.warning(
                "slot %s taken over with %d call(s) of an ended term unrecorded (%d attributed to a crash): "
                "each is delivered again alone, with no other call running beside it", state.slot,
                len(adoption.lost), len(adoption.crashed), extra={"slot": state.slot},
            )
        for message_id, name in adoption.poisoned:
            self.metrics.poison_messages.labels(name).inc()
            logger.error(
                "message %s (%s) is dead: its replica died during %d of its calls (poison_after)", message_id,
                name, self.settings.policy_for(name).poison_after,
                extra={"id": message_id, "message_name": name, "slot": state.slot, "outcome": "poisoned"},
            )
        return len(adoption.lost)

    def _fetch_work(self, state: _Slot) -> None:
        with self._cond:
            state.asked = float("inf")  # what is asked for from now on is kept for after this fetch
        now = self._monotonic()
        pauses = self._pause_list(now)
        if any(pause.scope == "all" for pause in pauses):
            with self._cond:
                state.fetched(now + self.interval)
                state.last_progress = now
            return
        paused_hints = [pause.target for pause in pauses if pause.scope == "hint"]
        paused_names = {pause.target: pause.id for pause in pauses if pause.scope == "name"}
        budget = max(1, self.high_water - self.lanes.waiting())
        with self._cond:
            self._prune_rests(now)
            # Not candidates: hints busy here, resting after a batch of batch_size, or paused.
            skip = [work.hint for work in self._busy.values() if work.slot == state.slot]
            skip += [hint for hint, (_, slot, _) in self._resting.items() if slot == state.slot]
        skip += paused_hints
        skip += self.committer.unrecordable_hints(state.slot)  # called once; the outcome could not be recorded
        with self._horizon_lock:
            passed_over = overdue(self._pins, now, self.settings.order.max_wait.total_seconds())
            reuse = self._clean_reading
            if (passed_over or state.fresh_horizon or now - self._reading_at >= HORIZON_REUSE
                    or self._reading_at < state.notified_at):  # a wake-up after it: what it names may be above it
                reuse = None
        state.fresh_horizon = False
        # Lanes waiting for work: the fetch marks the first calls for them itself (one round trip fewer before
        # each call when work arrives at an idle replica).
        # Only with the term safe for longer than a call may take (as a lane checks before marking).
        free = 0
        if (
            state.fence is not None and self.store.dialect == "postgresql"
            and self.slot_source.safe_for(state.slot, state.fence) > self._call_timeout
        ):
            free = self.lanes.reserve()
        try:
            mark = None
            if free and state.fence is not None:
                mark = FetchMark(state.fence, free, tuple(paused_names), self.lanes.first_runs())
                state.unknown_marks = True  # until the fetch's answer says what it marked
            candidates, batches = self.store.messages_fetch_slot(
                state.slot, state.cursor, budget, per_hint=self.per_hint, limit=self.page_size,
                mode=self.settings.policy.mode, skip=skip,
                passed_over=[(pin.after, pin.holder) for pin in passed_over], mark=mark, reuse_horizon=reuse,
                page_bytes=self.settings.poll.page_bytes,
            )
            state.unknown_marks = False
            if reuse is None:
                self._note_reading(now, candidates.horizon)
            try:
                works = self._took(now, state, budget, candidates, batches, paused_names, reuse is not None)
            except BaseException:
                if batches.marked and state.fence is not None:  # no call of them is made: their marks go
                    runs = [sorted(batches.marked)]
                    for ticket in self.committer.marked_by_fetch(state.slot, state.fence, runs, batches.remaining):
                        self.committer.withdraw(ticket)
                raise
            self._submit(state, works, batches)
        finally:
            if free:
                self.lanes.unreserve()

    def _submit(self, state: _Slot, works: list[HintWork], batches: Fetched) -> None:
        """Hand a fetch's work to the lanes, the runs it marked (if any) ahead; a call it marked that starts no
        hint's work (its row unreadable, say) has its mark taken back."""
        marked, fence = batches.marked, state.fence
        if not marked or fence is None:
            self.lanes.submit(works)
            return
        runs = []
        for work in works:
            run = list(itertools.takewhile(lambda message: message.id in marked, work.pending))
            if run:
                runs.append([message.id for message in run])
            # A call marked past one that was not (its row inserted meanwhile by another session): the hint's work
            # ends before it for now, so that no lane marks it again before its mark is taken back.
            cut = next((index for index, message in enumerate(work.pending) if index >= len(run)
                        and message.id in marked), None)
            if cut is not None:
                while len(work.pending) > cut:
                    work.pending.pop()
                work.again = True
        strays = sorted(marked - {message_id for run in runs for message_id in run})
        tickets = self.committer.marked_by_fetch(state.slot, fence, [*runs, strays], batches.remaining)
        self.committer.withdraw(tickets.pop())
        self.lanes.submit(works, {ticket.calls[0]: ticket for ticket in tickets})

    def _took(
        self,
        now: float,
        state: _Slot,
        budget: int,
        candidates: Candidates,
        batches: Fetched,
        paused_names: dict[str, int],
        reused: bool = False,
    ) -> list[HintWork]:
        """What a slot's fetch took: its hints' works (busy from now on), the slot's cursor and next fetch. A
        fetch that reused a horizon reading and found hints without a batch is followed at once by one reading
        its own (their messages may have been committed after the reading)."""
        chosen = list(dict.fromkeys(candidates.due + candidates.fresh))
        reading = None if reused else self._horizon_now(now, candidates.horizon)
        self.clock.observe(candidates.now)
        if batches.unreadable:
            self._dead_letter(batches.unreadable)
        fetched = len(batches.messages)
        # Hints the page's limit (of rows or of bytes) cut short (not known on SQLite: then any, once it is full).
        full = fetched >= self.page_size or batches.bytes_full
        short = batches.cut if batches.cut is not None else None if full else frozenset()
        works = self._works(now, state, batches.messages, batches.in_flight, paused_names, short)
        got = {work.hint for work in works}
        # Chosen hints the full page had no room for.
        no_room = set(chosen) - {message.hint for message in batches.messages} if full else set()
        left_out = bool(no_room)
        held = reading is not None and reading.held and len(got) < len(chosen)
        with self._cond:
            # Nothing found, nothing asked for meanwhile, no hint resting: its next poll is a look (_looked_quiet)
            rest_ends = min((until for until, slot, _ in self._resting.values() if slot == state.slot), default=None)
            state.quiet = (not fetched and not batches.unreadable and not candidates.due and not candidates.fresh
                           and state.adopted and state.asked == float("inf") and rest_ends is None)
            state.cursor = next_cursor(state.cursor, candidates.fresh, budget, no_room)
            for work in works:
                self._busy[work.hint] = work
            self._tally["_fetched"] += fetched
            more = len(candidates.fresh) >= budget or left_out or any(work.cut for work in works)
            if reused and len(got) < len(chosen):
                state.fresh_horizon = more = True
            if more:
                state.fetched(now)
            elif held:
                state.fetched(now + HELD_RETRY)
                self.metrics.order_waits.inc()
            else:
                state.fetched(self._next_due(now, candidates.next_due, candidates.now))
            if not state.adopted:  # a lost call's row is locked elsewhere: its hint waits until it can be counted
                state.wanted_at = min(state.wanted_at, now + ADOPT_RETRY)
            if rest_ends is not None:  # a hint it skipped as resting (its target refused it) goes when its rest ends
                state.wanted_at = min(state.wanted_at, rest_ends)
            if not held:  # the slot is drained or gave out work (held back by the horizon it is stuck)
                state.last_progress = now
        return works

    def _works(
        self,
        now: float,
        state: _Slot,
        messages: Sequence[Message],
        in_flight: frozenset[int],
        paused_names: dict[str, int],
        short: frozenset[str] | None,
    ) -> list[HintWork]:
        """The fetched messages as one work per hint (in id order), ended before a message with a call in flight
        and before a paused name's message. A hint's work is *cut* when it may have more now: its batch was
        full, or the page's limit cut it short (``short``; None: any hint may have been)."""
        by_hint: dict[str, list[Message]] = {}
        flying: set[str] = set()
        for message in messages:
            if message.hint in flying:
                continue
            if message.id in in_flight:  # in flight, or lost and not adopted yet: the hint waits for it
                flying.add(message.hint)
                continue
            by_hint.setdefault(message.hint, []).append(message)
        works = []
        for hint, batch in by_hint.items():
            taken, held = cut_batch(batch, paused_names)
            if held is not None and self.store.message_park(held.id, paused_names[held.name]):
                logger.info(
                    "message %s paused: its name %r is paused", held.id, held.name,
                    extra={"id": held.id, "message_name": held.name, "hint": held.hint},
                )
            if not taken:
                continue
            cut = held is None and (len(batch) >= self.per_hint or short is None or hint in short)
            works.append(HintWork(hint, state.slot, state.fence, deque(taken), cut, fetched_at=now))
        return works

    def _next_due(self, now: float, next_due: datetime | None, database_now: datetime) -> float:
        """When a drained slot is fetched again: its next due message (``next_due`` on the database's clock,
        read at ``database_now``), or the poll."""
        wanted = now + self.interval
        if next_due is not None:
            wanted = min(wanted, now + max(0.0, (next_due - database_now).total_seconds()))
        return wanted

    def _prune_rests(self, now: float) -> None:
        for hint in [hint for hint, (until, _, _) in self._resting.items() if until <= now]:
            del self._resting[hint]

    def routes_seen(self, routing: Routing, changed: bool) -> None:
        """The replicas' board looked: calls follow ``routing`` from now on; when the live replicas' routes
        changed, the hints held back for a name routed differently are fetched again (those still routed
        differently rest again)."""
        self.routing = routing
        if changed:
            self._target_ready(ROUTES_KEY)

    def _target_ready(self, key: str) -> None:
        """A destination's circuit closed: the hints resting for it are fetched again now."""
        now = self._monotonic()
        with self._cond:
            for hint, (_, slot, waits_for) in list(self._resting.items()):
                if waits_for == key:
                    del self._resting[hint]
                    state = self._slots.get(slot)
                    if state is not None:
                        state.want(now)
            self._cond.notify_all()

    def _note_reading(self, started: float, reading: HorizonReading | None) -> None:
        """Keep the latest horizon reading (by when its fetch started) for other fetches to reuse, if no producer
        transaction was registered when it was taken."""
        if reading is None:
            return
        with self._horizon_lock:
            if started >= self._reading_at:
                self._reading_at = started
                self._clean_reading = None if reading.pins else reading.last_id

    def _horizon_now(self, now: float, reading: HorizonReading | None) -> Horizon | None:
        """The commit-order horizon from the fetch's own reading (the pin clock is shared by the fetchers): the
        statement worked it out itself, leaving out the pins that were overdue; this counts what was passed over
        and notes the pins first seen."""
        if reading is None:
            return None
        pins = [Pin(after, holder) for after, holder in reading.pins]
        with self._horizon_lock:
            result = horizon(reading.last_id, pins, self._pins, now, self.settings.order.max_wait.total_seconds())
        if result.passed_over:
            self.metrics.order_wait_timeouts.inc(result.passed_over)
            logger.warning(
                "%d producer transaction(s) open longer than order.max_wait (%s) no longer hold back later "
                "messages; an earlier message of theirs may be correlated after a later one of its hint",
                result.passed_over, format_duration(self.settings.order.max_wait),
            )
        return result

    def _pause_list(self, now: float) -> list[Pause]:
        cached = self._pauses
        if cached is not None and now - cached[0] < PAUSES_REUSE:
            return cached[1]
        pauses = self.store.pauses_list()
        self._pauses = (now, pauses)
        self._pauses_delay = ERROR_FIRST
        self._held = (
            any(pause.scope == "all" for pause in pauses),
            frozenset(pause.target for pause in pauses if pause.scope == "name"),
            frozenset(pause.target for pause in pauses if pause.scope == "hint"),
        )
        return pauses

    def _dead_letter(self, rows: Sequence[Unreadable]) -> None:
        self.store.messages_dead_letter({row.id: row.reason for row in rows})
        self.metrics.unreadable.inc(len(rows))
        with self._cond:
            self._tally["_unreadable"] += len(rows)
        for row in rows:
            logger.error(
                "message %s is dead: %s", row.id, row.reason,
                extra={"id": row.id, "hint": row.hint, "slot": row.slot, "outcome": "dead"},
            )

    # -- a hint's work is over ---------------------------------------------------------------------------------

    def _finished(self, work: HintWork) -> None:
        now = self._monotonic()
        if work.started:
            self.metrics.batch_duration.observe(now - work.started)
        with self._cond:
            if self._busy.get(work.hint) is work:
                del self._busy[work.hint]
            state = self._slots.get(work.slot)
            resting = not work.stopped and work.cut and self.settings.policy.batch_size != -1
            if state is None:
                pass
            elif work.rest is not None:  # its target refused it, its circuit is open, its row is held: not yet
                key, seconds = work.rest
                self._resting[work.hint] = (now + seconds, work.slot, key)
                state.want(now + seconds)
            elif work.lease_short and self.slot_source.safe_for(work.slot, state.fence) <= self._call_timeout:
                self._after_renewal.add(work.slot)  # fetched again once its term is renewed (renewed())
            elif work.lease_short:  # renewed meanwhile
                state.want(now)
            elif resting:  # N per poll: the hint rests until the next one
                self._resting[work.hint] = (now + self.interval, work.slot, None)
                state.want(now + self.interval)
            elif work.again or (work.cut and not work.stopped) or state.notified_at >= work.fetched_at:
                state.want(now)  # more of it, or messages arrived in its slot while it was busy (and passed over)
            self._cond.notify_all()

