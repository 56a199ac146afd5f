"""Hint lanes: the threads that call correlators, a hint at a time, in order, across all of a replica's slots.

Fetched hints wait in one rotation (first in, first out). ``poll.concurrency`` lane threads each take the
hint at the front, make its next *run* of calls, and put it back at the end if it has more: so a hint with a
long backlog or slow calls never keeps a new hint (of any slot) waiting for more than one run. A hint is in
the rotation or with one lane, never two: one hint never has two calls at once.

A run's calls are marked in flight (a row each in ``correlation_call``, through the committer) before the
first starts, so a replica taking the slot over after this one died knows which calls were under way; a lane
makes only the calls that were marked, in order, and stops at the first that was not (in flight elsewhere,
paused or deleted meanwhile). A run is one call for correlators slower than a mark and several for fast ones
(:func:`worker.policy.batching.run_length`). While every lane calls, a lane starting its run has the next run
of the rotation's front *marked ahead* (at most one per lane, never for a message to call alone): the first
lane free takes it and calls at once, so that lanes do not wait for a write between two runs. When every lane
waits for work, the fetch marks the first runs itself, in its own round trip (:meth:`Lanes.reserve`,
:class:`worker.db.fetch.FetchMark`), and they go ahead the same way. A replica dying meanwhile leaves such a run
marked, delivered again by its successor as a run under way would be::

    lane:    ask mark A ── wait ── call A ─────────────── call B ─────────── call C ...
    marker:            write A ┘└ write B (asked ahead) └ write C (asked ahead)

A message already lost once (its replica died during its call) is called *alone*: its lane waits until no
other lane is in a run, other lanes wait until its call is over and its mark says so no more (its outcome
written, or its call marked returned when another session holds its row: that session delays its hint only).
Runs marked ahead are past that gate: a lane waiting at it steps aside to make them when no other lane would.
Should the replica die again during that call, the death is attributable to the message, which is how a
poison message is told from the innocent ones that happened to run beside it
(:func:`worker.policy.outcomes.settle_lost_call`).

Before each call the lane checks that the message has not expired (by the database clock), that no durable
pause holds it back (a pause stops calls within moments, not when fetched work runs out), and that the term the
hint was fetched under still runs and stays safe for longer than the call may take. A watchdog gives up on
calls past their handler timeout: the outcome is recorded as a timeout, the hint stays busy until the call
returns, and a new lane thread replaces the stuck one, up to ``concurrency`` stuck threads; past that the
replica stops taking work and reports itself unhealthy so that its supervisor restarts it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Protocol

from worker.config import Mode, Policy, Settings, format_duration
from worker.correlators import Correlator, Router
from worker.correlators.python import TransactionalCorrelator
from worker.db.base import Fence
from worker.db.errors import StoreError
from worker.engine.committer import Committer, MarkTicket, Outcomes
from worker.message import Message
from worker.policy.batching import MAX_RUN, run_length
from worker.policy.outcomes import (
    AuthProblem,
    Disposition,
    HandlerTimeout,
    Kind,
    PermanentError,
    first_line,
    interpret_return,
    resolve,
    result_of,
    succeeded,
)
from worker.service.logs import log_fields
from worker.service.metrics import Metrics
from worker.service.tracing import Tracing

logger = logging.getLogger(__name__)

WATCH_TICK = 0.05  # seconds between the watchdog's looks at running calls, at least (and while stopping)
WATCH_TICK_MAX = 1.0  # seconds between them at most: a twentieth of the shortest handler timeout in between
MARK_WAIT_LOOK = 0.25  # seconds between a lane's looks at a stop while it waits for marks
# Runs of the rotation marked ahead as a run starts (up to one per lane in all): with one, the runs marked ahead
# stayed as few as when the rotation last ran short, and lanes waited for marks asked a run earlier whenever a mark
# took longer than a run (10 ms calls on a loaded machine: 11-19 % of their time).
AHEAD_PER_RUN = 2
_NO_SPAN = nullcontext()  # reusable: the call's span when tracing is off


class Leases(Protocol):
    """What lanes ask of the slot leases before a call."""

    def safe_for(self, slot: int, fence: Fence | None = None) -> float:
        """Seconds the slot stays safe to act on under this term (0 once it ended; infinite without leases)."""
        ...


class DatabaseClock:
    """The database clock, estimated between readings from the local monotonic clock."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._reading: datetime | None = None
        self._at = 0.0

    def observe(self, now: datetime) -> None:
        """A fresh reading of the database clock."""
        with self._lock:
            self._reading, self._at = now, self._monotonic()

    def now(self) -> datetime:
        """The database time now (the local clock's, in UTC, before the first reading)."""
        with self._lock:
            reading, at = self._reading, self._at
        if reading is None:
            from datetime import UTC

            return datetime.now(UTC)
        return reading + timedelta(seconds=self._monotonic() - at)


@dataclass(eq=False)
class HintWork:
    """One hint's fetched batch while this replica works on it (the hint is *busy* meanwhile)."""

    hint: str
    slot: int
    fence: Fence | None
    pending: deque[Message]
    cut: bool  # the fetch may have left more eligible messages of the hint behind
    running: bool = False  # a lane is calling it
    unrecorded: int = 0  # outcomes handed to the committer, not written yet
    hung: bool = False  # a call given up on (timeout) is still running
    stopped: bool = False  # an outcome ended the batch (it holds the hint back)
    again: bool = False  # fetch its slot again when the work is over (a fetch skipped the hint meanwhile)
    finished: bool = False
    started: float = 0.0  # monotonic time of its first call
    fetched_at: float = 0.0  # monotonic time of its fetch
    called: int = 0


@dataclass(eq=False)
class _Lane:
    number: int
    thread: threading.Thread | None = None
    work: HintWork | None = None
    current: Message | None = None
    deadline: float = float("inf")
    run: list[Message] = field(default_factory=list)  # the run being made
    index: int = 0  # the position in the run of the call being made
    done: list[tuple[Message, Disposition]] = field(default_factory=list)  # outcomes of the run so far
    unmark: list[Message] = field(default_factory=list)  # marked calls of the run that will not be made
    abandon: list[Message] = field(default_factory=list)  # calls given up on at shutdown
    handed: Outcomes | None = None  # the last outcomes handed over (a lone run waits until they are handled)
    abandoned: bool = False  # given up on (timeout or shutdown): its thread ends when the call returns
    timed_out: bool = False  # given up on by the watchdog: counted among the stuck calls
    session: int | None = None  # the database session of a transactional call in progress (PostgreSQL)
    admitted: bool = False  # past the gate: its run may be marked and called

    def unstarted(self) -> list[Message]:
        """The marked calls of the run after the current one."""
        return self.run[self.index + 1 :]


@dataclass(eq=False)
class _Ahead:
    """A hint's next run, marked while the lanes are all calling, for the first lane that is free."""

    work: HintWork
    run: list[Message]
    ticket: MarkTicket


class Lanes:
    """The lane threads and the rotation of hints waiting for them."""

    def __init__(
        self,
        router: Router,
        settings: Settings,
        committer: Committer,
        leases: Leases,
        metrics: Metrics,
        clock: DatabaseClock,
        on_finished: Callable[[HintWork], None],
        on_taken: Callable[[], None] = lambda: None,
        monotonic: Callable[[], float] = time.monotonic,
        held_back: Callable[[Message], bool] = lambda message: False,
        tracing: Tracing | None = None,
    ) -> None:
        self.router = router
        self.tracing = tracing  # None: no spans, nothing of OpenTelemetry imported
        self.settings = settings
        self.mode: Mode = settings.policy.mode
        self.committer = committer
        self.leases = leases
        self.metrics = metrics
        self.clock = clock
        # A hint's work is over: no call running or to make, every outcome written.
        self._on_finished = on_finished
        self._on_taken = on_taken  # a lane took a hint: there is room in the rotation
        self._held_back = held_back  # a durable pause holds this message back now
        self._monotonic = monotonic
        self.concurrency = settings.poll.concurrency
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        # Idle lanes wait on this one (same lock): new work wakes as many of them as it has hints, where a
        # notify_all of _cond woke every idle lane and every waiter at the gate for each page of work.
        self._work_ready = threading.Condition(lock)
        self._rotation: deque[HintWork] = deque()
        # The front of the rotation, its runs marked ahead while every lane was calling: lanes take these first.
        self._ahead: deque[_Ahead] = deque()  # at most one per lane
        self._lanes: list[_Lane] = []
        self._numbers = itertools.count(1)
        self._hung = 0
        self._stopping = False
        self._started = False
        self._tally: Counter[str] = Counter()  # outcomes of calls, for Engine.run_once
        self._policies: dict[str, Policy] = {}
        self._timeouts: dict[str, float] = {}  # per message name: its handler timeout in seconds
        self._call_seconds: dict[str, float] = {}  # per message name, smoothed
        self._mark_seconds = 0.002  # smoothed time a mark takes to be committed
        self._watchdog: threading.Thread | None = None
        self._alone_waiting = 0  # lanes waiting to call a message alone (no lane is admitted meanwhile)
        self._alone: _Lane | None = None  # the lane calling a message alone
        self._fetches_marking = 0  # fetches that may mark calls for the lanes waiting (see reserve)
        self._let_go: list[HintWork] = []  # hints given up by the watchdog, their work to report as over
        # The watchdog finds a call past its timeout within a twentieth of the shortest one (20 looks a second
        # at the default 30 s were most of an idle replica's wake-ups); stopping wakes it.
        shortest = settings.shortest_handler_timeout().total_seconds()
        self._watch_tick = min(WATCH_TICK_MAX, max(WATCH_TICK, shortest / 20))
        self._watch_wake = threading.Event()

    # -- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the lane threads and the watchdog."""
        with self._cond:
            if self._started:
                return
            self._started = True
            for _ in range(self.concurrency):
                self._spawn()
        self._watchdog = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._watchdog.start()

    def _spawn(self) -> None:
        lane = _Lane(next(self._numbers))
        lane.thread = threading.Thread(target=self._serve_forever, args=(lane,), name=f"lane-{lane.number}",
                                       daemon=True)
        self._lanes.append(lane)
        lane.thread.start()

    def stop_taking_work(self) -> list[HintWork]:
        """Start no new call; returns the hints still waiting in the rotation (the caller lets them go)."""
        with self._cond:
            self._stopping = True
            self._watch_wake.set()
            dropped = list(self._rotation)
            self._rotation.clear()
            dropped += self._let_go_ahead(lambda work: True, withdraw=True)
            self._cond.notify_all()
            self._work_ready.notify_all()
        return dropped

    def _let_go_ahead(self, which: Callable[[HintWork], bool], *, withdraw: bool) -> list[HintWork]:
        """Under the lock: take these hints' runs marked ahead out; returns the hints. ``withdraw``: their marks
        are taken back (the replica stops or the slot is gone), else kept for when a lane calls them (marking
        them again under the same term changes nothing)."""
        let_go, kept = [], deque[_Ahead]()
        for item in self._ahead:
            if not which(item.work):
                kept.append(item)
                continue
            if withdraw:
                self.committer.withdraw(item.ticket)
            item.work.pending.extendleft(reversed(item.run))
            item.work.running = False
            let_go.append(item.work)
        self._ahead = kept
        if let_go:  # the gate may have waited for these runs
            self._cond.notify_all()
        return let_go

    def wait_for_calls(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for running calls to end; give up on those still running then.

        Calls given up at shutdown are left in flight marked as abandoned: the next holder of the slot
        delivers them again without counting them as crashes.
        """
        deadline = self._monotonic() + grace
        with self._cond:
            # Runs, not only calls: a lane between its mark and its call (or its outcomes' hand-over) must
            # finish what it does with the marks while the committer still writes them.
            while self._in_runs() and self._monotonic() < deadline:
                self._cond.wait(min(0.05, max(0.0, deadline - self._monotonic())))
            for lane in self._lanes:
                if lane.current is not None and not lane.abandoned:
                    lane.abandoned = True
                    message = lane.current
                    lane.abandon.append(message)
                    lane.unmark.extend(lane.unstarted())
                    if lane.work is not None:
                        self._hand_over_locked(lane, lane.work)
                    self.metrics.messages.labels(message.name, "abandoned").inc()
                    logger.warning(
                        "shutdown: gave up on the call of message %s (%s), still running; it will be delivered "
                        "again", message.id, message.name, extra=_fields(message),
                    )
            # The lanes left are not in a correlator (between a mark and a call, or handing outcomes over): they
            # are done in moments, and their marks must reach the committer before it stops.
            settle_by = self._monotonic() + 1.0
            while self._in_runs() and self._monotonic() < settle_by:
                self._cond.wait(0.01)

    def _in_runs(self) -> bool:
        """Runs marked and not over (or marked ahead, not begun)."""
        return bool(self._ahead or self._fetches_marking) or any(
            lane.admitted and not lane.abandoned for lane in self._lanes
        )

    def _running_calls(self) -> int:
        return sum(1 for lane in self._lanes if lane.current is not None and not lane.abandoned)

    # -- the rotation ---------------------------------------------------------------------------------------

    def submit(self, works: Sequence[HintWork], marked: Mapping[int, MarkTicket] | None = None) -> None:
        """Put fetched hints at the end of the rotation; a hint whose first run the fetch marked itself (``marked``,
        by its first message's id) goes ahead, that run marked, to the lane waiting for it."""
        if not works:
            return
        let_go: list[HintWork] = []
        with self._cond:
            if not self._stopping:
                for work in works:
                    ticket = marked.get(work.pending[0].id) if marked and work.pending else None
                    if ticket is None:
                        self._rotation.append(work)
                    elif self._hung >= self.concurrency:
                        # Stuck calls came to hold every lane while the fetch marked (it reserved with none stuck):
                        # no lane would make the run, and its calls would stay marked, to be counted lost at the
                        # restart health asks for. Its marks are taken back and the hint let go, as when the last
                        # lane got stuck with runs ahead (_give_up).
                        self.committer.withdraw(ticket)
                        work.pending.clear()
                        work.again = True
                        let_go.append(work)
                    else:
                        work.running = True
                        run = [work.pending.popleft() for _ in ticket.calls]
                        self._ahead.append(_Ahead(work, run, ticket))
                self._work_ready.notify(len(works))
                if self._ahead and self._alone_waiting:  # lanes at the gate step aside for them
                    self._cond.notify_all()
            else:
                for ticket in (marked or {}).values():  # fetched while the replica stops: marks taken back
                    self.committer.withdraw(ticket)
                let_go = list(works)
        for work in let_go:  # outside the lock: a hint's work ending reaches the engine
            self.settle(work)

    def reserve(self) -> int:
        """How many first calls a fetch may mark itself: every lane, when all of them wait for work (work arrives
        at an idle replica, and its first calls then wait for no mark of their own); else none. A busy replica
        marks runs as its lanes take them, or ahead of them, as long as its calls make them. One fetch at a time
        marks (the lanes' runs marked ahead stay at about one per lane).

        Past zero the gate stays shut to a message to call alone until :meth:`unreserve` (after the fetch's
        :meth:`submit`): a call marked beside it would be counted lost, and its crash not told from its own."""
        with self._cond:
            if (
                self._stopping or self._hung or self._rotation or self._ahead or self._fetches_marking
                or not self._lanes or any(lane.work is not None for lane in self._lanes)
            ):
                return 0
            self._fetches_marking += 1
            return len(self._lanes)

    def first_runs(self) -> tuple[tuple[str, int], ...]:
        """The calls a run of each message name timed so far would have (one for the others): what a fetch marking
        runs itself marks, as a lane would."""
        timed = list(self._call_seconds.items())  # one step: lanes add names as they time their first calls
        return tuple((name, run_length(seconds, self._mark_seconds, MAX_RUN)) for name, seconds in timed)

    def unreserve(self) -> None:
        """A fetch that was to mark calls (:meth:`reserve`) is over: its marked calls, if any, are ahead."""
        with self._cond:
            self._fetches_marking -= 1
            if self._alone_waiting:
                self._cond.notify_all()

    def drop_slot(self, slot: int) -> list[HintWork]:
        """Take a slot's hints out of the rotation (its lease is gone); returns them."""
        with self._cond:
            dropped = [work for work in self._rotation if work.slot == slot]
            if dropped:
                self._rotation = deque(work for work in self._rotation if work.slot != slot)
            dropped += self._let_go_ahead(lambda work: work.slot == slot, withdraw=True)
        return dropped

    def waiting(self) -> int:
        """Hints waiting in the rotation for a lane (their next runs marked ahead or not)."""
        with self._cond:
            return len(self._rotation) + len(self._ahead)

    def busy_lanes(self) -> int:
        """Lanes making a call now (calls given up on not counted)."""
        with self._cond:
            return self._running_calls()

    def hung(self) -> int:
        """Calls given up on after their handler timeout that have not returned yet."""
        with self._cond:
            return self._hung

    def exhausted(self) -> bool:
        """True when stuck calls hold every lane the replica may have: it takes no more work."""
        with self._cond:
            return self._hung >= self.concurrency

    def idle(self) -> bool:
        """No hint waiting and no call running (calls given up on aside)."""
        with self._cond:
            return not self._rotation and not self._ahead and not any(
                lane.work is not None and not lane.abandoned for lane in self._lanes
            )

    def slots_in_use(self) -> set[int]:
        """Slots with a call running (given up on or not): their leases must not be handed to anyone else."""
        with self._cond:
            return {lane.current.slot for lane in self._lanes if lane.current is not None}

    # -- a lane -------------------------------------------------------------------------------------------

    def _take(self, lane: _Lane) -> HintWork | _Ahead | None:
        """The next hint for this lane: a run marked ahead first (unless a message is being called alone),
        else the front of the rotation; None when the lane is to end."""
        taken: HintWork | _Ahead
        with self._cond:
            while True:
                if self._stopping or lane.abandoned:
                    return None
                # Stuck calls hold every lane the replica may have: take no more work (health says so).
                if self._hung < self.concurrency:
                    if self._ahead and self._alone is None:
                        taken = self._ahead.popleft()
                        lane.admitted = True  # its run is marked: it is past the gate
                        lane.work = taken.work
                        break
                    if self._rotation:
                        taken = lane.work = self._rotation.popleft()
                        taken.running = True
                        break
                self._work_ready.wait(0.5)
        self._on_taken()
        return taken

    def _serve_forever(self, lane: _Lane) -> None:
        while True:
            taken = self._take(lane)
            if taken is None:
                return
            work = taken.work if isinstance(taken, _Ahead) else taken
            try:
                if isinstance(taken, _Ahead):
                    self._serve_ahead(lane, taken)
                else:
                    self._serve(lane, work)
            except Exception:  # a bug here must not take a lane away; the hint is let go
                logger.exception("lane %s failed while calling hint %r", lane.number, work.hint)
                work.pending.clear()
            with self._cond:
                work.running = False
                lane.work = None
                lane.run = []
                if lane.timed_out:  # the watchdog gave up on this thread's call: it has returned now
                    self._hung -= 1
                    self.metrics.hung_calls.set(self._hung)
                    work.hung = False
                    self._work_ready.notify_all()  # lanes that stopped taking work while every lane was stuck
                if lane.abandoned:
                    self._lanes.remove(lane)
                requeue = bool(work.pending) and not work.stopped and not self._stopping
                if requeue:
                    self._rotation.append(work)
                    self._work_ready.notify()
                abandoned = lane.abandoned
            if not requeue:
                self.settle(work)
            if abandoned:
                return

    def _policy(self, name: str) -> Policy:
        policy = self._policies.get(name)
        if policy is None:
            policy = self._policies[name] = self.settings.policy_for(name)
        return policy

    def _timeout(self, name: str) -> float:
        timeout = self._timeouts.get(name)
        if timeout is None:
            timeout = self._timeouts[name] = self._policy(name).handler_timeout.total_seconds()
        return timeout

    def _run_of(self, work: HintWork) -> list[Message]:
        """The next calls of a hint under one mark: alone when it was lost before, else by call speed."""
        now = self.clock.now()
        while work.pending and work.pending[0].is_expired(now):  # expired: never correlated, left to cleanup
            work.pending.popleft()
        if not work.pending:
            return []
        head = work.pending[0]
        if head.redelivered:
            count = 1
        else:
            count = run_length(self._call_seconds.get(head.name), self._mark_seconds, len(work.pending))
        run: list[Message] = []
        while work.pending and len(run) < count and not (run and work.pending[0].redelivered):
            run.append(work.pending.popleft())
        return run

    def _serve(self, lane: _Lane, work: HintWork) -> None:
        run = self._run_of(work)
        if not run:
            return
        wants_alone = run[0].redelivered
        alone = self._admit(lane, wants_alone)
        if alone is None:  # stopping, or stepping aside for runs marked ahead: the hint goes back to the rotation
            work.pending.extendleft(reversed(run))
            return
        lane.handed = None
        try:
            self._serve_run(lane, work, run, alone)
            if wants_alone:
                self._await_handled(lane)
        finally:
            self._leave(lane)

    def _serve_ahead(self, lane: _Lane, ahead: _Ahead) -> None:
        """A run marked ahead: its lane is past the gate already."""
        try:
            self._run_marked(lane, ahead.work, ahead.run, ahead.ticket)
        finally:
            self._leave(lane)

    def _await_handled(self, lane: _Lane) -> None:
        """Hold the gate until a lone run's outcomes are handled by a flush (written, or deferred with the call
        marked returned): if a call after it killed the process before then, its mark would still say alone and
        under way, and the crash would be blamed on it. A row lock of another session does not hold the gate."""
        handed = lane.handed
        if handed is None:
            return
        while not handed.handled.wait(0.05):
            if lane.abandoned or self._stopping:
                return

    def _admit(self, lane: _Lane, wants_alone: bool) -> bool | None:
        """Wait at the gate: a lane calling a message alone runs with no other lane admitted.

        Returns whether the run is alone in the replica (a call given up on after its timeout may still be
        running: then nothing is alone), or None when the replica stops meanwhile or the lane steps aside.

        Runs marked ahead (a fetch's, handed over while lanes waited here) are past the gate, and a lone call
        waits for them to end: a lane waiting here steps aside to make them, else the gate could wait for them for
        ever. A lane waiting for the others steps aside at once; one of those waiting to call alone, only when
        every lane does (one is enough, and the others keep their turn).
        """
        with self._cond:
            if wants_alone:
                self._alone_waiting += 1
                aside = False
                try:
                    while not self._stopping and (self._alone is not None or self._in_runs()):
                        if self._ahead and self._alone is None and self._alone_waiting >= self._live_lanes():
                            aside = True
                            break
                        self._cond.wait(0.5)
                finally:
                    self._alone_waiting -= 1
                if self._stopping or aside:  # the lanes it held at the gate go on
                    self._cond.notify_all()
                    return None
                self._alone = lane
            else:
                while not self._stopping and (self._alone is not None or self._alone_waiting):
                    if self._ahead and self._alone is None:
                        return None
                    self._cond.wait(0.5)
                if self._stopping:
                    return None
            lane.admitted = True
            return wants_alone and self._hung == 0

    def _live_lanes(self) -> int:
        """Under the lock: the lanes that may take work (not given up on)."""
        return sum(1 for lane in self._lanes if not lane.abandoned)

    def _leave(self, lane: _Lane) -> None:
        with self._cond:
            lane.admitted = False
            was_alone = self._alone is lane
            if was_alone:
                self._alone = None
            # Who waits for a lane to leave: the gate (for a lane alone, or for every lane to leave) and a stop.
            # Every run ends here: waking all the lanes each time cost more than the calls of a fast correlator.
            if was_alone or self._alone_waiting or self._stopping:
                self._cond.notify_all()
            if was_alone and self._ahead:  # runs marked ahead wait for the gate to open
                self._work_ready.notify(len(self._ahead))

    def _serve_run(self, lane: _Lane, work: HintWork, run: list[Message], alone: bool) -> None:
        if not self._lease_lasts(work, run[0]):
            self._give_back(work, "its slot's lease may end before the call could")
            return
        if self._held_back(run[0]):
            self._give_back(work, "a durable pause holds it back", again=True)
            return
        self._run_marked(lane, work, run, self.committer.mark_now(work.slot, work.fence, [m.id for m in run], alone))

    def _marks_written(self, ticket: MarkTicket) -> bool:
        """Wait for a ticket's answer unless the replica stops (looked at every MARK_WAIT_LOOK seconds); whether
        it came."""
        while True:
            ticket.wait(MARK_WAIT_LOOK)
            if ticket.done.is_set():
                return True
            if self._stopping:
                return False

    def _lease_lasts(self, work: HintWork, message: Message) -> bool:
        """The term the hint was fetched under still runs, long enough for this call."""
        return self.leases.safe_for(work.slot, work.fence) > self._timeout(message.name)

    def _run_marked(self, lane: _Lane, work: HintWork, run: list[Message], ticket: MarkTicket) -> None:
        """Make a run's calls once its marks are written (asked for by this lane, or ahead by another).

        The wait ends with the answer (which the database's timeouts bound), or at once when the replica stops:
        the ticket is then withdrawn (its marks taken back once written, before the committer stops), so marks
        held up in the database do not hold the stop's wait for runs in flight for its whole grace. (Not at the
        end of the term's safe time: the hint would be free again while its late marks were still to be taken
        back, and a fetch under the same term renewed could mark its calls again, only for the late take-back
        to remove those marks.)"""
        if not self._marks_written(ticket):
            self.committer.withdraw(ticket)
            self._give_back(work, "the replica stops while its calls' marks are written")
            return
        if ticket.remaining is None:  # term over, stopping, or the database not writable now
            if ticket.unsure:  # the marks may be written all the same: taken back before the hint is free
                lane.unmark.extend(run)  # (a call row of this term no one makes would be counted lost later)
                self._hand_over(lane, work)
            self._give_back(work, "its calls could not be marked" if ticket.unsure else "its slot's lease is gone")
            return
        if not ticket.by_fetch:  # a fetch's mark costs its fetch nearly nothing: it says nothing of a mark's time
            self._mark_seconds += 0.2 * (ticket.seconds - self._mark_seconds)
        marked = ticket.marked
        count = next((index for index, message in enumerate(run) if message.id not in marked), len(run))
        if count < len(run):  # in flight elsewhere, paused or deleted since the fetch: the hint waits there
            lane.unmark.extend(message for message in run[count:] if message.id in marked)
            run = run[:count]
            self._give_back(work, "a message of it was not marked (in flight elsewhere, paused or deleted)",
                            again=True)
        try:
            if not run:
                return
            if not self._lease_lasts(work, run[0]):  # a run marked ahead waited for a lane meanwhile
                lane.unmark.extend(run)
                self._give_back(work, "its slot's lease may end before the call could")
                return
            if not work.started:
                work.started = self._monotonic()
            self._mark_next()
            self._calls(lane, work, run)
        finally:
            self._hand_over(lane, work)

    def _mark_next(self) -> None:
        """While this lane calls, have the next runs of the rotation's front marked (:data:`AHEAD_PER_RUN`, up to
        one per lane in all), for whichever lanes are free first: with every lane calling, no lane then waits for
        a mark between two runs.

        Not beside a message called alone (the gate is shut, or waits for the marked runs to end), and never
        for a message to be called alone (it waits at the gate).
        """
        with self._cond:
            for _ in range(AHEAD_PER_RUN):
                if (
                    self._stopping or self._alone is not None or self._alone_waiting or not self._rotation
                    or len(self._ahead) >= self.concurrency or self._hung >= self.concurrency
                ):
                    return
                work = self._rotation[0]
                if not work.pending or work.pending[0].redelivered:
                    return
                self._rotation.popleft()
                run = self._run_of(work)
                if not run or run[0].redelivered:  # all expired (a lane lets it go), or for the gate after all
                    work.pending.extendleft(reversed(run))
                    self._rotation.appendleft(work)
                    return
                work.running = True
                ticket = self.committer.mark_ahead(work.slot, work.fence, [message.id for message in run])
                self._ahead.append(_Ahead(work, run, ticket))
                self._work_ready.notify()

    def _calls(self, lane: _Lane, work: HintWork, run: list[Message]) -> None:
        """Make a run's calls in order; their outcomes collect on the lane until the run ends."""
        lane.run = run
        durations: list[float] = []
        try:
            for index, message in enumerate(run):
                lane.index = index
                if self._stopping:
                    lane.unmark.extend(run[index:])
                    work.pending.clear()
                    return
                timeout = self._timeout(message.name)
                if message.expires_at is not None and message.is_expired(self.clock.now()):
                    lane.unmark.append(message)  # never correlated; cleanup removes it
                    continue
                if self._held_back(message):  # paused since the fetch: it waits, in order, for the lift
                    lane.unmark.extend(run[index:])
                    self._give_back(work, "a durable pause holds it back", again=True)
                    return
                started = self._monotonic()
                if index and self.leases.safe_for(work.slot, work.fence) <= timeout:
                    lane.unmark.extend(run[index:])
                    self._give_back(work, "its slot's lease may end before the call could")
                    return
                lane.deadline = started + timeout  # before current: the watchdog reads current first
                lane.current = message
                if message.redelivered:
                    self.metrics.redeliveries.inc()
                    logger.info(
                        "delivering message %s again (%d earlier call(s) not recorded)", message.id,
                        message.lost_calls, extra=_fields(message),
                    )
                with self.tracing.call(message) if self.tracing else _NO_SPAN as span:
                    correlator = self.router.route(message.name)
                    status = None
                    if isinstance(correlator, TransactionalCorrelator):
                        error, result, status = self._call_in_transaction(lane, work, message, correlator)
                        if status in ("fenced", "busy", "gone"):
                            if span is not None:
                                span.outcome("not_called", None)
                            with self._cond:
                                lane.current = None
                            if status == "gone":  # deleted or recorded meanwhile: its mark is out, go on
                                continue
                            lane.unmark.extend(run[index + 1 :] if status == "fenced" else run[index:])
                            self._give_back(
                                work, "its slot's term ended" if status == "fenced" else "its row is held elsewhere",
                                again=status == "busy",
                            )
                            return
                    else:
                        error, result = self._call(message, correlator)
                    elapsed = self._monotonic() - started
                    disposition = (
                        succeeded(message.id, message.attempt, result)
                        if error is None
                        else resolve(
                            message, error, self._policy(message.name), self.clock.now(), self.settings.poll.interval
                        )
                    )
                    if span is not None:
                        timed_out = lane.abandoned
                        span.outcome(
                            "timeout" if timed_out else disposition.outcome,
                            HandlerTimeout("the call outlasted its handler timeout") if timed_out else error,
                        )
                    # The outcome's log line is written inside the span: it carries the span's ids.
                    with self._cond:
                        if lane.abandoned:  # the watchdog recorded a timeout (or shutdown gave up on it) meanwhile
                            return
                        lane.current = None
                        if status == "written":  # recorded with the handler's writes, in its transaction
                            self._count_recorded(message, disposition)
                        else:
                            lane.done.append((message, disposition))
                    work.called += 1
                    durations.append(elapsed)
                    if error is None:
                        _log_success(message, disposition, elapsed)
                    else:
                        if isinstance(error, AuthProblem):
                            self.metrics.target_auth_failures.labels(message.name).inc()
                        _log_failure(message, disposition, error)
                        if self.mode is Mode.FAIL_FIRST:
                            lane.unmark.extend(run[index + 1 :])
                            work.pending.clear()
                            work.stopped = True
                            return
        finally:
            if durations:
                self._observe(run[0].name, durations)

    def _hand_over(self, lane: _Lane, work: HintWork) -> None:
        """Give the committer the outcomes collected on the lane (once per run)."""
        with self._cond:
            self._hand_over_locked(lane, work)

    def _hand_over_locked(self, lane: _Lane, work: HintWork) -> None:
        done, lane.done = lane.done, []
        unmark, lane.unmark = lane.unmark, []
        abandon, lane.abandon = lane.abandon, []
        if not (done or unmark or abandon):
            return
        work.unrecorded += len(done) + len(unmark) + len(abandon)
        counts = Counter((message.name, disposition.outcome) for message, disposition in done)
        for (name, outcome), n in counts.items():
            self._tally[outcome] += n
            self.metrics.messages.labels(name, outcome).inc(n)
        outcomes = Outcomes(
            work.slot, work.fence, done, lambda ended: self._recorded(work, ended), unmark=unmark, abandon=abandon
        )
        lane.handed = outcomes
        self.committer.record(outcomes, now=self._alone is lane)  # the gate stays shut until it is written

    def _give_back(self, work: HintWork, why: str, *, again: bool = False) -> None:
        """Make no more calls of this hint now (the messages not called stay as they are, for later);
        ``again``: fetch its slot again once the hint's work is over."""
        logger.debug("hint %r left for later: %s", work.hint, why)
        work.pending.clear()
        work.again = work.again or again

    def _observe(self, name: str, durations: Sequence[float]) -> None:
        """A run's call durations: into the histogram, and into the smoothed time that sizes later runs."""
        self.metrics.call_duration.observe_many(name, durations)
        typical = sum(durations) / len(durations)
        previous = self._call_seconds.get(name)
        self._call_seconds[name] = typical if previous is None else previous + 0.2 * (typical - previous)

    def _call(self, message: Message, correlator: Correlator | None) -> tuple[BaseException | None, str | None]:
        """One correlator call (``correlator``: its route): its outcome (None for success) and, on success, the
        target's answer."""
        if correlator is None:
            return PermanentError(
                f"no correlator route for message name {message.name!r}: add it to CORRELATION_CORRELATORS "
                'or configure a "*" fallback'
            ), None
        try:
            returned = correlator(message)
        except BaseException as error:  # any handler exception (even SystemExit) is an outcome, never a crash
            return error, None
        # What a returned value means (an outcome, False, an answer, or a value that is refused):
        # worker.policy.outcomes.
        outcome = interpret_return(returned)
        return outcome, (result_of(returned) if outcome is None else None)

    def _call_in_transaction(
        self, lane: _Lane, work: HintWork, message: Message, correlator: TransactionalCorrelator
    ) -> tuple[BaseException | None, str | None, str]:
        """A transactional correlator's call, inside the transaction that records its success (see
        :meth:`~worker.db.calls.CallStatements.calls_transact`): the error (None for success), the target's
        answer, and what became of the transaction."""
        failure: list[BaseException | None] = [None]
        answer: list[str | None] = [None]

        def disposition(connection: object) -> Disposition | None:
            try:
                returned = correlator.function(message, connection)
            except BaseException as error:  # any handler exception is an outcome, never a crash
                failure[0] = error
                return None
            outcome = interpret_return(returned)
            if outcome is not None:
                failure[0] = outcome
                return None
            answer[0] = result_of(returned)
            return Disposition(message.id, Kind.DELETE, message.attempt, result=answer[0])

        def session(pid: int | None) -> None:
            with self._cond:
                lane.session = pid

        try:
            status = self.committer.store.calls_transact(
                work.slot, work.fence, disposition, message.id, session=session
            )
        except StoreError as error:  # the transaction did not commit (or cannot be known to): not recorded
            return failure[0] or error, None, "failed"
        return failure[0], answer[0], status

    def _count_recorded(self, message: Message, disposition: Disposition) -> None:
        """Under the lock: an outcome written by its call's own transaction, counted as handed-over ones are."""
        self._tally[disposition.outcome] += 1
        self.metrics.messages.labels(message.name, disposition.outcome).inc()

    def tally(self) -> Counter[str]:
        """Outcomes of calls so far, by outcome."""
        with self._cond:
            return Counter(self._tally)

    def _recorded(self, work: HintWork, ended: Sequence[tuple[Message, str]]) -> None:
        with self._cond:
            work.unrecorded -= len(ended)
            if self._alone is not None:  # a lone run may wait for its outcomes before it lets others in
                self._cond.notify_all()
        self.settle(work)

    def settle(self, work: HintWork) -> None:
        """Report a hint's work as over once nothing of it runs, waits, or waits to be written."""
        with self._cond:
            if work.finished or work.running or work.unrecorded or work.hung:
                return
            if work.pending and not work.stopped and not self._stopping:
                return  # more calls to make: it is in the rotation
            work.finished = True
        self._on_finished(work)

    # -- the watchdog ---------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while True:
            with self._cond:
                if self._stopping and not self._running_calls():
                    return
                now = self._monotonic()
                late = [lane for lane in self._lanes if lane.current is not None and not lane.abandoned
                        and now >= lane.deadline]
                for lane in late:
                    self._give_up(lane)
                let_go, self._let_go = self._let_go, []
            for work in let_go:  # outside the lock: a hint's work ending reaches the engine
                self.settle(work)
            if self._stopping:
                time.sleep(WATCH_TICK)
            else:
                self._watch_wake.wait(self._watch_tick)

    def _give_up(self, lane: _Lane) -> None:
        """Under the lock: a call past its handler timeout is recorded as one; its thread is let go."""
        message, work = lane.current, lane.work
        assert message is not None and work is not None
        lane.abandoned = lane.timed_out = True
        if self._alone is lane:  # the replica goes on without it (nothing is alone while it runs)
            self._alone = None
        self._cond.notify_all()
        self._work_ready.notify_all()
        self._hung += 1
        work.hung = True
        work.pending.clear()
        work.stopped = True
        policy = self._policy(message.name)
        error = HandlerTimeout(f"the correlator did not return within {format_duration(policy.handler_timeout)}")
        disposition = resolve(message, error, policy, self.clock.now(), self.settings.poll.interval)
        lane.done.append((message, disposition))
        _log_failure(message, disposition, error)
        lane.unmark.extend(lane.unstarted())
        if lane.session is not None:  # a transactional call: its transaction ends first (it holds the call's row)
            session, lane.session = lane.session, None
            threading.Thread(
                target=self._end_session, args=(lane, work, session), name="end-session", daemon=True
            ).start()
        else:
            self._hand_over_locked(lane, work)
        self.metrics.hung_calls.set(self._hung)
        if self._hung < self.concurrency and not self._stopping:
            self._spawn()
            logger.warning(
                "message %s: the correlator did not return within %s; its hint waits for the call, a new lane "
                "replaces this one (%d call(s) stuck)", message.id, format_duration(policy.handler_timeout), self._hung,
                extra=_fields(message),
            )
        else:  # runs marked ahead would stay marked for nothing (counted lost at a restart): let go, unmarked
            for dropped in self._let_go_ahead(lambda work: True, withdraw=True):
                dropped.pending.clear()
                dropped.again = True
                self._let_go.append(dropped)
            logger.error(
                "%d correlator calls are stuck past their timeout: this replica takes no more work; restart it",
                self._hung,
            )

    def _end_session(self, lane: _Lane, work: HintWork, session: int) -> None:
        """End the database session of a transactional call given up on, then record its timeout (the call's
        row is free once its transaction is rolled back)."""
        try:
            self.committer.store.session_end(session)
        except StoreError as error:  # the session ends with its connection anyway; the outcome waits for it
            logger.warning("could not end the session of a call past its timeout: %s", error)
        with self._cond:
            self._hand_over_locked(lane, work)


def _fields(message: Message) -> dict[str, object]:
    """Structured log fields of a message (never its payload)."""
    return log_fields(message)


def _log_success(message: Message, disposition: Disposition, seconds: float) -> None:
    """One line per call that succeeded: at INFO with the target's answer when it gave one (a process instance
    key, a response body), else at DEBUG (a busy worker correlates thousands a second)."""
    level = logging.INFO if disposition.result is not None else logging.DEBUG
    if not logger.isEnabledFor(level):
        return
    logger.log(
        level,
        "%s id=%s hint=%s: correlated in %.1f ms%s",
        message.name, message.id, message.hint, seconds * 1000,
        "" if disposition.result is None else f": result {disposition.result}",
        extra=log_fields(message, outcome=disposition.outcome, result=disposition.result),
    )


def _log_failure(message: Message, disposition: Disposition, error: BaseException | None) -> None:
    """One line per call that did not succeed: what it was, what happens next, and the error's first line.
    A target refusing the worker's credentials is an error: an operator must fix them."""
    reason = f"{type(error).__name__}: {first_line(error)}" if error is not None else ""
    due = disposition.next_attempt_at.isoformat() if disposition.next_attempt_at else "never"
    level = logging.WARNING if disposition.kind in (Kind.RETRY, Kind.DEAD) else logging.INFO
    if isinstance(error, AuthProblem):
        level = logging.ERROR
    logger.log(
        level,
        "%s id=%s hint=%s: %s (attempt %d, next %s): %s",
        message.name, message.id, message.hint, disposition.outcome, disposition.attempt, due, reason,
        extra=log_fields(
            message, attempt=disposition.attempt, outcome=disposition.outcome,
            next_attempt_at=disposition.next_attempt_at, error=error,
        ),
    )
