"""Hint lanes: ``poll.concurrency`` tasks on the call loop that call correlators, a hint at a time, in order, across
all of a replica's slots.

Fetched hints wait in one rotation (first in, first out). Each lane takes the hint at the front, makes its next
*run* of calls, and puts it back at the end if it has more: so a hint with a long backlog or slow calls never
keeps a new hint (of any slot) waiting for more than one run. A hint is in the rotation or with one lane, never
two: one hint never has two calls at once.

The lanes are coroutines on one event loop (:class:`~worker.correlators.network.CallLoop`): they take hints, wait
at the gate, for marks and for room at a target. A run's calls are made, whole, on a thread of their own
(:class:`RunThreads`): a Python handler's, and a network target's (``http``, ``camunda7``, ``camunda8``), whose
requests libcurl makes with the interpreter lock released; a fast handler's calls follow one another with nothing
in between.

A run's calls are marked in flight (a row each in ``correlation_call``, through the committer) before the
first starts, so a replica taking the slot over after this one died knows which calls were under way; a lane
makes only the calls that were marked, in order, and stops at the first that was not (in flight elsewhere,
paused or deleted meanwhile). A run is one call for correlators slower than a mark and several for fast ones
(:func:`worker.policy.batching.run_length`), all to one destination. While every lane calls, a lane starting
its run has the next runs of the rotation's front *marked ahead*: the first lane free takes one and calls at
once. When every lane waits for work, the fetch marks the first runs itself (:meth:`Lanes.reserve`). A replica
dying meanwhile leaves such a run marked, delivered again by its successor as a run under way would be::

    lane:    mark A ── wait ── call A ─────────────── call B ─────────── call C ...
    marker:        write A ┘└ write B (asked ahead) └ write C (asked ahead)

A network target's state (:mod:`worker.policy.targets`) is consulted before a run is marked: a run waits,
parked, while its destination has as many calls in flight as its limit allows; a hint whose destination's
circuit is open is let go to rest (no mark, no call, no attempt) until its next probe or until it closes. An
answer that is the target's (refused, busy) charges no attempt: the hint rests until ``Retry-After``.

A message already lost once (its replica died during its call) is called *alone*: its lane waits until no
other lane is in a run, other lanes wait until its call is over and its mark says so no more. Runs marked ahead
are past that gate: a lane waiting at it steps aside to make them when no other lane would. Should the replica
die again during that call, the death is attributable to the message, which is how a poison message is told
from the innocent ones that happened to run beside it (:func:`worker.policy.outcomes.settle_lost_call`).

Before each call the lane checks that the message has not expired (by the database clock), that no durable
pause holds it back, and that the term the hint was fetched under still runs and stays safe for longer than the
call may take. A network call's requests end at its handler timeout, recorded as a timeout. A Python call past
it (or a network call past it by :data:`NETWORK_GRACE`) is given up on by the watchdog: the outcome is recorded as
a timeout, the hint stays busy until the call returns, and a new lane replaces the stuck one, up to
``concurrency`` stuck calls; past that the replica stops taking work and reports itself unhealthy so that its
supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy.exc import DBAPIError

from worker.config import Mode, Policy, Settings, format_duration
from worker.correlators import Correlator, Router
from worker.correlators.network import (
    CallLoop,
    Destination,
    TargetBusy,
    TargetUnavailable,
    call_deadline,
    shared_loop,
)
from worker.correlators.python import TransactionalCorrelator
from worker.db.base import Fence
from worker.db.calls import CallSession
from worker.db.errors import DatabaseUnavailable, StoreError, connection_lost
from worker.engine.committer import Committer, Latch, MarkTicket, Outcomes
from worker.message import Message
from worker.policy.batching import MAX_RUN, run_length
from worker.policy.outcomes import (
    AuthProblem,
    Disposition,
    HandlerTimeout,
    Kind,
    PermanentError,
    Reschedule,
    Retry,
    first_line,
    interpret_return,
    resolve,
    result_of,
    succeeded,
)
from worker.policy.targets import Answer, Circuit, TargetState, Transition
from worker.service.logs import log_fields
from worker.service.metrics import Metrics
from worker.service.tracing import Tracing

logger = logging.getLogger(__name__)

WATCH_TICK = 0.05  # seconds between the watchdog's looks at running calls, at least (and while stopping)
WATCH_TICK_MAX = 1.0  # seconds between them at most: a twentieth of the shortest handler timeout in between
NAMES_TIMED = 256  # message names whose smoothed call time sizes their runs: the most recently called
NAMES_CACHED = 4096  # message names whose policy, timeout and destination are kept looked up (then looked up anew)
IDLE_MARGIN = 1.0  # seconds past its handler timeout that a transactional call's session may sit idle (frozen)
# Seconds past its handler timeout that the watchdog gives a network call, which ends itself at its timeout.
NETWORK_GRACE = 1.0
ROW_HELD_REST = 1.0  # seconds a hint rests whose message row another session holds (a transactional call)
# A hint whose message name the live replicas route differently rests until they agree (the board then fetches it
# again at once; this bounds the rest should that wake-up be missed).
ROUTES_REST = 30.0
ROUTES_KEY = "\x00routes"  # what such a hint rests for, in the place of a destination's key
WAIT_LOOK = 0.5  # seconds between a waiting lane's looks at a stop (it is woken sooner by what it waits for)
# Runs of the rotation marked ahead as a run starts (up to one per lane in all).
AHEAD_PER_RUN = 2
_NO_SPAN = nullcontext()  # reusable: the call's span when tracing is off

# What a call came to: the error (None for success), the target's answer, and how its transaction ended (a
# transactional call: written, fenced, busy, gone, failed) or ``held`` (the target refused it: not an attempt).
CallResult = tuple[BaseException | None, str | None, str | None]


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


class RunThreads:
    """Daemon threads for the runs of Python correlators: one per run under way (the lanes', and those of calls
    given up on after their timeout, until they return). A thread left idle takes the next run."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._numbers = itertools.count(1)

    def submit(self, job: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``job()`` on a thread; its future."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        self._jobs.put((future, job))
        if spawn:
            threading.Thread(target=self._serve, name=f"lane-{next(self._numbers)}", daemon=True).start()
        return future

    def _serve(self) -> None:
        while True:
            future, job = self._jobs.get()
            try:
                future.set_result(job())
            except BaseException as error:  # the lane awaiting it decides what it means
                future.set_exception(error)
            with self._lock:
                self._idle += 1


@dataclass(eq=False)
class HintWork:
    """One hint's fetched batch while this replica works on it (the hint is *busy* meanwhile)."""

    hint: str
    slot: int
    fence: Fence | None
    pending: deque[Message]
    cut: bool  # the fetch may have left more eligible messages of the hint behind
    running: bool = False  # a lane has it (calling, or parked for its target)
    unrecorded: int = 0  # outcomes handed to the committer, not written yet
    hung: bool = False  # a call given up on (timeout) is still running
    stopped: bool = False  # an outcome ended the batch (it holds the hint back)
    again: bool = False  # fetch its slot again when the work is over (a fetch skipped the hint meanwhile)
    finished: bool = False
    started: float = 0.0  # monotonic time of its first call
    fetched_at: float = 0.0  # monotonic time of its fetch
    called: int = 0
    # Its target refused or is open, or its row is held elsewhere: (the destination or None, seconds to rest)
    rest: tuple[str | None, float] | None = None
    # Given back because its slot's term may end before a call could: fetched again once the term is renewed
    lease_short: bool = False


@dataclass(eq=False)
class _Run:
    """A hint's next calls under one mark, from the moment they are taken off the hint to the run's one exit
    (:meth:`Lanes._close`).

    Once its marks are or may be written (``marked``), each of its calls ends in exactly one of: an outcome handed
    to the committer (or written by the call's own transaction), its mark taken back (never made), or its mark left
    abandoned (given up on at a stop: delivered again, not blamed). ``calls[:decided]`` have theirs; the exit
    decides the rest: a call under way when the run failed is recorded as a failure with the reason, the calls
    after it have their marks taken back.
    """

    work: HintWork
    calls: list[Message]
    ticket: MarkTicket | None = None  # its marks, once asked for (by its lane, ahead by another, or by the fetch)
    marked: bool = False
    room: _Room | None = None  # its call slot at its network target (None: a Python correlator's run)
    key: str | None = None  # its network destination's key (None: a Python correlator's run)
    lone: bool = False  # its call is of a message lost once: it waits at the gate to be called alone
    alone: bool = False  # marked as the only run of the replica (no call given up on still running either)
    index: int = 0  # the position of the call being made
    decided: int = 0
    current: Message | None = None  # the call under way
    deadline: float = float("inf")  # when the watchdog gives up on it (a thread's call)
    session: CallSession | None = None  # the database session of a transactional call in progress (PostgreSQL)
    done: list[tuple[Message, Disposition]] = field(default_factory=list)  # outcomes not handed over yet
    unmark: list[Message] = field(default_factory=list)  # marks to take back (calls that will not be made)
    abandon: list[Message] = field(default_factory=list)  # calls given up on at a stop
    handed: Outcomes | None = None  # the last outcomes handed over (a lone run waits until they are handled)

    def take_back(self, start: int) -> None:
        """Its calls from ``start`` on will not be made: their marks are taken back."""
        self.unmark.extend(self.calls[start:])
        self.decided = len(self.calls)

    def give_up(self) -> None:
        """Its calls after the current one will not be made."""
        self.take_back(self.index + 1)


@dataclass(eq=False)
class _Lane:
    number: int
    task: asyncio.Task[None] | None = None
    work: HintWork | None = None  # the hint it has (calling, or parked for its target)
    run: _Run | None = None  # the run it makes
    abandoned: bool = False  # given up on (timeout or shutdown): it ends when the call returns
    timed_out: bool = False  # given up on by the watchdog: counted among the stuck calls
    admitted: bool = False  # past the gate: its run may be marked and called

    @property
    def current(self) -> Message | None:
        """The call it makes now."""
        return None if self.run is None else self.run.current


def _hints(parked: Iterable[HintWork | asyncio.Future[None]]) -> list[HintWork]:
    """The hints parked for a destination (not the lanes waiting there)."""
    return [item for item in parked if not isinstance(item, asyncio.Future)]


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass(frozen=True, slots=True)
class _Room:
    """A run's room at its network target: the destination's state, its key, and the admission's number."""

    target: TargetState
    key: str
    number: int


class Lanes:
    """The lane tasks and the rotation of hints waiting for them."""

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
        agreed: Callable[[str], bool] = lambda name: True,
        tracing: Tracing | None = None,
        on_target_ready: Callable[[str], None] = lambda key: None,
        call_loop: CallLoop | None = None,
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
        self._on_target_ready = on_target_ready  # a destination's circuit closed: its resting hints may go
        self._held_back = held_back  # a durable pause holds this message back now
        self._agreed = agreed  # every live replica routes this message name as this one does
        self._monotonic = monotonic
        self.call_loop = call_loop or shared_loop()
        self.concurrency = settings.poll.concurrency
        # The lanes' shared state: taken by the loop's tasks, the fetchers, the committer and the run threads, each
        # for moments. Waiters off the loop (a stop) wait on the condition; the lanes on futures of the loop.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._work_waiters: deque[asyncio.Future[None]] = deque()  # lanes waiting for work
        self._gate_waiters: list[asyncio.Future[None]] = []  # lanes waiting at the gate (or for a stop)
        self._rotation: deque[HintWork] = deque()
        # Runs marked before a lane took them (ahead, or by the fetch): lanes take these first.
        self._ahead: deque[_Run] = deque()  # at most one per lane, and the fetch's
        # By destination, in the order they came: hints parked until a call there ends, and lanes holding a run
        # marked ahead that wait for room there (their futures).
        self._parked: dict[str, deque[HintWork | asyncio.Future[None]]] = {}
        self._lanes: list[_Lane] = []
        self._numbers = itertools.count(1)
        self._threads = RunThreads()
        self._hung = 0
        self._stopping = False
        self._started = False
        self._fatal: str | None = None
        self._tally: Counter[str] = Counter()  # outcomes of calls, for Engine.run_once
        self._policies: dict[str, Policy] = {}
        self._timeouts: dict[str, float] = {}  # per message name: its handler timeout in seconds
        self._destinations: dict[str, Destination | None] = {}  # per message name: its route's destination
        self._targets: dict[str, TargetState] = {
            destination.key: destination.bind(self.concurrency) for destination in router.destinations()
        }
        self._shown = {destination.key: destination.shown for destination in router.destinations()}
        self._answer_metrics: dict[tuple[str, Answer], tuple[Any, Any]] = {}
        for key, target in self._targets.items():
            self.metrics.target_open.labels(self._shown[key]).set(0)
            self.metrics.target_limit.labels(self._shown[key]).set(target.allowed())
        self._call_seconds: dict[str, float] = {}  # per message name, smoothed (NAMES_TIMED at most)
        self._mark_seconds = 0.002  # smoothed time a mark takes to be committed
        self._alone_waiting = 0  # lanes waiting to call a message alone (no lane is admitted meanwhile)
        self._alone: _Lane | None = None  # the lane calling a message alone
        self._fetches_marking = 0  # fetches that may mark calls for the lanes waiting (see reserve)
        self._let_go: list[HintWork] = []  # hints given up by the watchdog, their work to report as over
        # The watchdog finds a call past its timeout within a twentieth of the shortest one; stopping wakes it.
        shortest = settings.shortest_handler_timeout().total_seconds()
        self._watch_tick = min(WATCH_TICK_MAX, max(WATCH_TICK, shortest / 20))
        self._watch_wake: asyncio.Event | None = None

    # -- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the lane tasks and the watchdog on the call loop."""
        with self._lock:
            if self._started:
                return
            self._started = True
        self.call_loop.run(self._start_on_loop(), timeout=30)

    async def _start_on_loop(self) -> None:
        self._watch_wake = asyncio.Event()
        with self._lock:
            for _ in range(self.concurrency):
                self._spawn()
        asyncio.get_running_loop().create_task(self._supervised(self._watch, "the watchdog"), name="watchdog")

    def _spawn(self) -> None:
        """Under the lock, on the loop: a new lane."""
        lane = _Lane(next(self._numbers))
        self._lanes.append(lane)
        lane.task = asyncio.get_running_loop().create_task(
            self._supervised(lambda: self._serve_forever(lane), f"lane {lane.number}"), name=f"lane-{lane.number}"
        )

    async def _supervised(self, body: Callable[[], Any], what: str) -> None:
        """Run a long-lived part of the lanes; one that fails makes the replica unhealthy (it is not left to run on
        without it)."""
        try:
            await body()
        except Exception as error:
            self._fatal = f"{what} failed: {type(error).__name__}: {first_line(error)}"
            logger.critical("%s; the replica is unhealthy and must be restarted", self._fatal, exc_info=error)

    def health(self) -> str | None:
        """Why the lanes cannot do their job (None when they can)."""
        return self._fatal or self.call_loop.failure()

    def stop_taking_work(self) -> list[HintWork]:
        """Start no new call; returns the hints still waiting in the rotation (the caller lets them go)."""
        with self._lock:
            self._stopping = True
            dropped = list(self._rotation)
            self._rotation.clear()
            for parked in self._parked.values():
                dropped += _hints(parked)
                self._unpark_lanes(parked)  # they see the stop
            self._parked.clear()
            for work in dropped:
                work.running = False
            dropped += self._let_go_ahead(lambda work: True, withdraw=True)
            self._notify_gate()
            self._notify_work(len(self._lanes))
        self.call_loop.call_soon(self._wake_watchdog)
        return dropped

    def _wake_watchdog(self) -> None:
        if self._watch_wake is not None:
            self._watch_wake.set()

    def _let_go_ahead(self, which: Callable[[HintWork], bool], *, withdraw: bool) -> list[HintWork]:
        """Under the lock: take these hints' runs marked ahead out; returns the hints. ``withdraw``: their marks
        are taken back (the replica stops or the slot is gone)."""
        let_go, kept = [], deque[_Run]()
        for item in self._ahead:
            if not which(item.work):
                kept.append(item)
                continue
            if withdraw and item.ticket is not None:
                self.committer.withdraw(item.ticket)
            item.work.pending.extendleft(reversed(item.calls))
            item.work.running = False
            let_go.append(item.work)
        self._ahead = kept
        if let_go:  # the gate may have waited for these runs
            self._notify_gate()
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
                run = lane.run
                if run is not None and run.current is not None and not lane.abandoned:
                    lane.abandoned = True
                    message = run.current
                    session, run.session = run.session, None
                    if session is not None:  # a transactional call: its transaction holds the call's row, which
                        self._end_transaction(session)  # the abandon mark is written to (its writes roll back)
                    run.abandon.append(message)
                    run.give_up()
                    self._hand_over_locked(lane, run)
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

    # -- waking lanes (the loop's futures) ------------------------------------------------------------------

    def _notify_work(self, count: int) -> None:
        """Wake up to ``count`` lanes waiting for work (from any thread)."""
        if count > 0:
            self._soon(self._wake_work, count)

    def _notify_gate(self) -> None:
        """Under the lock: the gate's state changed (a run began or ended, a lone call's outcome was handled, a
        stop): wake the lanes waiting at it, and any thread waiting for the runs to end."""
        self._cond.notify_all()
        self._soon(self._wake_gate)

    def _soon(self, callback: Callable[..., None], *args: Any) -> None:
        if self.call_loop.in_loop():
            callback(*args)
        else:
            self.call_loop.call_soon(callback, *args)

    def _wake_work(self, count: int) -> None:
        while count and self._work_waiters:
            waiter = self._work_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                count -= 1

    def _wake_gate(self) -> None:
        waiters, self._gate_waiters = self._gate_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _wait(self, waiters: deque[asyncio.Future[None]] | list[asyncio.Future[None]]) -> None:
        """Wait to be woken through ``waiters`` (or WAIT_LOOK seconds)."""
        waiter = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        with suppress(TimeoutError):
            await asyncio.wait_for(waiter, WAIT_LOOK)

    async def _latched(self, latch: Latch, timeout: float | None = None) -> bool:
        """Await a latch set by another thread (for ``timeout`` seconds at most); whether it is set."""
        if latch.is_set():
            return True
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def done() -> None:
            if not waiter.done():
                waiter.set_result(None)

        latch.on_set(lambda: self.call_loop.call_soon(done))
        with suppress(TimeoutError):
            await asyncio.wait_for(waiter, timeout)
        return latch.is_set()

    # -- the rotation ---------------------------------------------------------------------------------------

    def submit(self, works: Sequence[HintWork], marked: Mapping[int, MarkTicket] | None = None) -> None:
        """Put fetched hints at the end of the rotation; a hint whose first run the fetch marked itself (``marked``,
        by its first message's id) goes ahead, that run marked, to the lane waiting for it."""
        if not works:
            return
        let_go: list[HintWork] = []
        with self._lock:
            if not self._stopping:
                for work in works:
                    ticket = marked.get(work.pending[0].id) if marked and work.pending else None
                    if ticket is None:
                        self._rotation.append(work)
                    elif self._hung >= self.concurrency:
                        # Stuck calls came to hold every lane while the fetch marked (it reserved with none stuck):
                        # no lane would make the run. Its marks are taken back and the hint let go.
                        self.committer.withdraw(ticket)
                        work.pending.clear()
                        work.again = True
                        let_go.append(work)
                    else:
                        work.running = True
                        run = [work.pending.popleft() for _ in ticket.calls]
                        destination = self._destination(run[0].name)
                        key = None if destination is None else destination.key
                        self._ahead.append(_Run(work, run, ticket=ticket, key=key))
                self._notify_work(len(works))
                if self._ahead and self._alone_waiting:  # lanes at the gate step aside for them
                    self._notify_gate()
            else:
                for ticket in (marked or {}).values():  # fetched while the replica stops: marks taken back
                    self.committer.withdraw(ticket)
                let_go = list(works)
        for work in let_go:
            self.settle(work)

    def reserve(self) -> int:
        """How many first calls a fetch may mark itself: every lane, when all of them wait for work (work arrives
        at an idle replica, and its first calls then wait for no mark of their own); else none. One fetch at a
        time marks.

        Past zero the gate stays shut to a message to call alone until :meth:`unreserve` (after the fetch's
        :meth:`submit`): a call marked beside it would be counted lost, and its crash not told from its own."""
        with self._lock:
            if (
                self._stopping or self._hung or self._rotation or self._ahead or self._fetches_marking
                or any(self._parked.values()) or not self._lanes
                or any(lane.work is not None for lane in self._lanes)
            ):
                return 0
            self._fetches_marking += 1
            return len(self._lanes)

    def first_runs(self) -> tuple[tuple[str, int], ...]:
        """The calls a run of each message name timed so far would have (one for the others): what a fetch marking
        runs itself marks, as a lane would."""
        with self._lock:
            timed = list(self._call_seconds.items())
        runs = ((name, run_length(seconds, self._mark_seconds, MAX_RUN)) for name, seconds in timed)
        return tuple((name, count) for name, count in runs if count > 1)

    def unreserve(self) -> None:
        """A fetch that was to mark calls (:meth:`reserve`) is over: its marked calls, if any, are ahead."""
        with self._lock:
            self._fetches_marking -= 1
            if self._alone_waiting:
                self._notify_gate()

    def drop_slot(self, slot: int) -> list[HintWork]:
        """Take a slot's hints out of the rotation (its lease is gone); returns them."""
        with self._lock:
            dropped = [work for work in self._rotation if work.slot == slot]
            if dropped:
                self._rotation = deque(work for work in self._rotation if work.slot != slot)
            for key, parked in self._parked.items():
                gone = [work for work in _hints(parked) if work.slot == slot]
                if gone:  # (a lane waiting with a run of the slot finds its lease gone when it gets room)
                    self._parked[key] = deque(item for item in parked if not any(item is work for work in gone))
                    for work in gone:
                        work.running = False
                    dropped += gone
            dropped += self._let_go_ahead(lambda work: work.slot == slot, withdraw=True)
        return dropped

    def waiting(self) -> int:
        """Hints waiting for a lane (in the rotation, their next runs marked ahead, or parked for their target)."""
        with self._lock:
            return len(self._rotation) + len(self._ahead) + sum(len(_hints(parked)) for parked in self._parked.values())

    def busy_lanes(self) -> int:
        """Lanes making a call now (calls given up on not counted)."""
        with self._lock:
            return self._running_calls()

    def hung(self) -> int:
        """Calls given up on after their handler timeout that have not returned yet."""
        with self._lock:
            return self._hung

    def exhausted(self) -> bool:
        """True when stuck calls hold every lane the replica may have: it takes no more work."""
        with self._lock:
            return self._hung >= self.concurrency

    def idle(self) -> bool:
        """No hint waiting and no call running (calls given up on aside)."""
        with self._lock:
            return not self._rotation and not self._ahead and not any(self._parked.values()) and not any(
                lane.work is not None and not lane.abandoned for lane in self._lanes
            )

    def slots_in_use(self) -> set[int]:
        """Slots with a call running (given up on or not): their leases must not be handed to anyone else."""
        with self._lock:
            return {lane.current.slot for lane in self._lanes if lane.current is not None}

    def targets(self) -> list[dict[str, Any]]:
        """The network targets' states now: destination, circuit, concurrency limit, calls in flight, and why
        and until when an open circuit stays open (seconds)."""
        now = self._monotonic()
        with self._lock:
            return [
                {
                    "target": self._shown[key], "circuit": str(target.circuit), "limit": target.allowed(),
                    "in_flight": target.in_flight, "reason": target.reason,
                    "probe_in": round(target.retry_in(now), 3) if target.circuit is not Circuit.CLOSED else None,
                    "parked": len(_hints(self._parked.get(key, ()))),
                }
                for key, target in self._targets.items()
            ]

    # -- a lane -------------------------------------------------------------------------------------------

    async def _take(self, lane: _Lane) -> _Run | HintWork | None:
        """The next work for this lane: a run marked ahead first (unless a message is being called alone), else
        the hint at the front of the rotation; None when the lane is to end."""
        taken: _Run | HintWork
        while True:
            with self._lock:
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
            await self._wait(self._work_waiters)
        self._on_taken()
        return taken

    async def _serve_forever(self, lane: _Lane) -> None:
        while True:
            taken = await self._take(lane)
            if taken is None:
                return
            run: _Run | None
            if isinstance(taken, _Run):
                work, run = taken.work, taken
            else:
                work, run = taken, self._run_of(taken)
            parked = False
            if run is not None:
                parked = await self._serve(lane, run)
            with self._lock:
                lane.work = lane.run = None
                if lane.timed_out:  # the watchdog gave up on this lane's call: it has returned now
                    self._hung -= 1
                    self.metrics.hung_calls.set(self._hung)
                    work.hung = False
                    self._notify_work(len(self._lanes))  # lanes that stopped taking work while all were stuck
                if lane.abandoned:
                    self._lanes.remove(lane)
                if parked:  # with its target's queue: still busy, a lane takes it when a call there ends
                    requeue = False
                else:
                    work.running = False
                    requeue = bool(work.pending) and not work.stopped and not self._stopping
                    if requeue:
                        self._rotation.append(work)
                        self._notify_work(1)
                abandoned = lane.abandoned
            if not requeue and not parked:
                self.settle(work)
            if abandoned:
                return

    async def _serve(self, lane: _Lane, run: _Run) -> bool:
        """Make a run, through to its one exit; True when its hint waits, parked, for a call to its target to end.

        A failure of the lanes' own (a bug) is logged; the exit records the call under way as failed with its
        reason, takes the others' marks back, and the hint is let go: the lane goes on."""
        lane.run = run
        made = parked = False
        failure: Exception | None = None
        try:
            parked = await (self._make_ahead(lane, run) if run.ticket is not None else self._make(lane, run))
            made = True
        except Exception as error:
            failure = error
            logger.exception("lane %s failed while calling hint %r", lane.number, run.work.hint)
        finally:
            self._close(lane, run, failure)
        try:
            if made and run.lone and lane.admitted:
                await self._await_handled(lane, run)
        finally:
            self._leave(lane)
        return parked

    def _close(self, lane: _Lane, run: _Run, failure: Exception | None = None) -> None:
        """The one exit of a run: every call it marked is accounted for (see :class:`_Run`) and handed to the
        committer, and its room at its target is free. A run given up on (a timeout, a stop) was accounted for
        where it was given up on."""
        with self._lock:
            if failure is not None:
                run.work.pending.clear()
                if run.ticket is not None and not run.marked:  # asked for, its answer not taken: taken back
                    self.committer.withdraw(run.ticket)
            if not lane.abandoned:
                message = run.current
                if run.marked and message is not None and failure is not None:  # under way when the lane failed
                    error = RuntimeError(
                        f"the worker failed during the call: {type(failure).__name__}: {first_line(failure)}"
                    )
                    disposition = resolve(
                        message, error, self._policy(message.name), self.clock.now(), self.settings.poll.interval
                    )
                    run.done.append((message, disposition))
                    _log_failure(message, disposition, error)
                    run.give_up()
                elif run.marked:  # the calls not decided were not made (one under way at a cancel: made again)
                    run.take_back(run.decided)
                run.current = None
                self._hand_over_locked(lane, run)
            if run.room is not None:
                room, run.room = run.room, None
                room.target.release()
                self._unpark(room.key, 1)

    def _policy(self, name: str) -> Policy:
        policy = self._policies.get(name)
        if policy is None:
            if len(self._policies) >= NAMES_CACHED:
                self._policies.clear()
            policy = self._policies[name] = self.settings.policy_for(name)
        return policy

    def _timeout(self, name: str) -> float:
        timeout = self._timeouts.get(name)
        if timeout is None:
            if len(self._timeouts) >= NAMES_CACHED:
                self._timeouts.clear()
            timeout = self._timeouts[name] = self._policy(name).handler_timeout.total_seconds()
        return timeout

    def _destination(self, name: str) -> Destination | None:
        """The network destination a message name's route sends to (None: a Python correlator, or no route)."""
        if name in self._destinations:
            return self._destinations[name]
        destination = getattr(self.router.route(name), "destination", None)
        found = destination if isinstance(destination, Destination) else None
        if len(self._destinations) >= NAMES_CACHED:
            self._destinations.clear()
        self._destinations[name] = found
        return found

    def _run_of(self, work: HintWork) -> _Run | None:
        """A hint's next calls under one mark: alone when it was lost before, else by call speed; all to one
        destination. None when it has none (the expired ones are left to cleanup)."""
        now = self.clock.now()
        while work.pending and work.pending[0].is_expired(now):
            work.pending.popleft()
        if not work.pending:
            return None
        head = work.pending[0]
        if head.redelivered:
            count = 1
        else:
            count = run_length(self._call_seconds.get(head.name), self._mark_seconds, len(work.pending))
        destination = self._destination(head.name)
        calls: list[Message] = []
        while work.pending and len(calls) < count and not (calls and work.pending[0].redelivered):
            if calls and self._destination(work.pending[0].name) is not destination:
                break
            calls.append(work.pending.popleft())
        return _Run(work, calls, key=None if destination is None else destination.key, lone=head.redelivered)

    @staticmethod
    def _put_back(run: _Run) -> None:
        """A run not marked goes back to the front of its hint, for a later run."""
        run.work.pending.extendleft(reversed(run.calls))
        run.calls = []

    async def _make(self, lane: _Lane, run: _Run) -> bool:
        """A run from the rotation: through the gate, checked, given room at its target, marked and made; True
        when its target has no room for it now (the hint is parked)."""
        work = run.work
        alone = await self._admit(lane, run.lone)
        if alone is None:  # stopping, or stepping aside for runs marked ahead: the hint goes back to the rotation
            self._put_back(run)
            return False
        run.alone = alone
        head = run.calls[0]
        if not self._lease_lasts(work, head):
            self._give_back_until_renewed(work)
            return False
        if self._held_back(head):
            self._give_back(work, "a durable pause holds it back", again=True)
            return False
        if not self._agreed(head.name):
            self._hold_for_routes(work)
            return False
        destination = self._destination(head.name)
        if destination is not None:
            run.room = self._target_admits(destination, work)
            if run.room is None:
                self._put_back(run)
                if work.rest is None:  # no room: parked, in order, for a call there to end
                    with self._lock:
                        self._parked.setdefault(destination.key, deque()).append(work)
                    return True
                self._give_back(work, "its target's circuit is open")
                return False
        run.ticket = self.committer.mark_ahead(
            work.slot, work.fence, [message.id for message in run.calls], alone, hint=work.hint
        )
        await self._make_marked(lane, run)
        return False

    async def _make_ahead(self, lane: _Lane, run: _Run) -> bool:
        """A run marked ahead: its lane is past the gate already, and asks its target for room now. A target that
        will not take it (its circuit opened) or a stop: its marks are taken back at the exit, and the hint makes
        no more calls now (the rest waits behind the run: it rests, or is fetched again)."""
        destination = self._destination(run.calls[0].name)
        if destination is not None:
            run.room = await self._room_when_free(destination, run.work)
            if run.room is None:
                run.marked = True
                self._give_back(run.work, "its target's circuit is open" if run.work.rest else "the replica stops")
                return False
        await self._make_marked(lane, run)
        return False

    async def _room_when_free(self, destination: Destination, work: HintWork) -> _Room | None:
        """Room at its target for a run marked ahead, waiting while the target is only full (its calls end within
        their timeouts): its marks are written, and the next call there should not wait for a mark. None when the
        circuit is open (``work.rest`` set) or the replica stops."""
        while True:
            room = self._target_admits(destination, work)
            if room is not None or work.rest is not None or self._stopping:
                return room
            waiter = asyncio.get_running_loop().create_future()
            with self._lock:
                waiting = self._parked.setdefault(destination.key, deque())
                waiting.append(waiter)
            with suppress(TimeoutError):
                await asyncio.wait_for(waiter, WAIT_LOOK)
            with self._lock, suppress(ValueError):  # not woken (a look at a stop): out of the queue, asks again
                waiting.remove(waiter)

    async def _await_handled(self, lane: _Lane, run: _Run) -> None:
        """Hold the gate until a lone run's outcomes are handled by a flush (written, or deferred with the call
        marked returned): if a call after it killed the process before then, its mark would still say alone and
        under way, and the crash would be blamed on it. A row lock of another session does not hold the gate."""
        handed = run.handed
        if handed is None:
            return
        while not await self._latched(handed.handled, WAIT_LOOK):
            if lane.abandoned or self._stopping:
                return

    async def _admit(self, lane: _Lane, wants_alone: bool) -> bool | None:
        """Wait at the gate: a lane calling a message alone runs with no other lane admitted.

        Returns whether the run is alone in the replica (a call given up on after its timeout may still be
        running: then nothing is alone), or None when the replica stops meanwhile or the lane steps aside.

        Runs marked ahead are past the gate, and a lone call waits for them to end: a lane waiting here steps
        aside to make them, else the gate could wait for them for ever. A lane waiting for the others steps aside
        at once; one of those waiting to call alone, only when every lane does.
        """
        if wants_alone:
            with self._lock:
                self._alone_waiting += 1
            aside = False
            try:
                while True:
                    with self._lock:
                        if self._stopping or not (self._alone is not None or self._in_runs()):
                            break
                        if self._ahead and self._alone is None and self._alone_waiting >= self._live_lanes():
                            aside = True
                            break
                    await self._wait(self._gate_waiters)
            finally:
                with self._lock:
                    self._alone_waiting -= 1
            with self._lock:
                if self._stopping or aside:  # the lanes it held at the gate go on
                    self._notify_gate()
                    return None
                self._alone = lane
                lane.admitted = True
                return self._hung == 0
        while True:
            with self._lock:
                if self._stopping:
                    return None
                if self._alone is None and not self._alone_waiting:
                    lane.admitted = True
                    return False
                if self._ahead and self._alone is None:
                    return None
            await self._wait(self._gate_waiters)

    def _live_lanes(self) -> int:
        """Under the lock: the lanes that may take work (not given up on)."""
        return sum(1 for lane in self._lanes if not lane.abandoned)

    def _leave(self, lane: _Lane) -> None:
        with self._lock:
            lane.admitted = False
            was_alone = self._alone is lane
            if was_alone:
                self._alone = None
            # Who waits for a lane to leave: the gate (for a lane alone, or for every lane to leave) and a stop.
            if was_alone or self._alone_waiting or self._stopping:
                self._notify_gate()
            if was_alone and self._ahead:  # runs marked ahead wait for the gate to open
                self._notify_work(len(self._ahead))

    async def _marks_written(self, ticket: MarkTicket) -> bool:
        """Wait for a ticket's answer; False (the ticket withdrawn) when the replica stops first."""
        while not await self._latched(ticket.done, WAIT_LOOK):
            if self._stopping:
                self.committer.withdraw(ticket)
                return False
        return True

    def _lease_lasts(self, work: HintWork, message: Message) -> bool:
        """The term the hint was fetched under still runs, long enough for this call."""
        return self.leases.safe_for(work.slot, work.fence) > self._timeout(message.name)

    async def _make_marked(self, lane: _Lane, run: _Run) -> None:
        """Make a run's calls once its marks are written (asked for by this lane, or ahead by another).

        The wait ends with the answer (which the database's timeouts bound), or at once when the replica stops:
        the ticket is then withdrawn (its marks taken back once written, before the committer stops)."""
        work, ticket = run.work, run.ticket
        assert ticket is not None
        if not await self._marks_written(ticket):
            self._give_back(work, "the replica stops while its calls' marks are written")
            return
        if ticket.remaining is None:  # term over, stopping, or the database not writable now
            run.marked = ticket.unsure  # the marks may be written all the same: taken back before the hint is free
            self._give_back(work, "its calls could not be marked" if ticket.unsure else "its slot's lease is gone")
            return
        run.marked = True
        if not ticket.by_fetch:  # a fetch's mark costs its fetch nearly nothing: it says nothing of a mark's time
            self._mark_seconds += 0.2 * (ticket.seconds - self._mark_seconds)
        marked = ticket.marked
        count = next((index for index, message in enumerate(run.calls) if message.id not in marked), len(run.calls))
        if count < len(run.calls):  # in flight elsewhere, paused or deleted since the fetch: the hint waits there
            run.unmark.extend(message for message in run.calls[count:] if message.id in marked)
            run.calls = run.calls[:count]
            self._give_back(work, "a message of it was not marked (in flight elsewhere, paused or deleted)",
                            again=True)
        if not run.calls:
            return
        if not self._lease_lasts(work, run.calls[0]):  # a run marked ahead waited for a lane meanwhile
            self._give_back_until_renewed(work)
            return
        if not work.started:
            work.started = self._monotonic()
        self._mark_next()
        await asyncio.wrap_future(self._threads.submit(lambda: self._calls(lane, run)))

    def _mark_next(self) -> None:
        """While this lane calls, have the next runs of the rotation's front marked (:data:`AHEAD_PER_RUN`, up to
        one per lane in all), for whichever lanes are free first: with every lane calling, no lane then waits for
        a mark between two runs. Runs to a network target are marked ahead a round's worth at most
        (:meth:`_room_ahead`); the lane that makes one waits for room there.

        Not beside a message called alone (the gate is shut, or waits for the marked runs to end), and never
        for a message to be called alone (it waits at the gate).
        """
        with self._lock:
            for _ in range(AHEAD_PER_RUN):
                if (
                    self._stopping or self._alone is not None or self._alone_waiting or not self._rotation
                    or len(self._ahead) >= self.concurrency or self._hung >= self.concurrency
                ):
                    return
                work = self._rotation[0]
                if not work.pending or work.pending[0].redelivered:
                    return
                destination = self._destination(work.pending[0].name)
                if destination is not None and not self._room_ahead(destination.key):
                    return  # the lane that takes the hint asks its target (and parks it, or lets it rest)
                self._rotation.popleft()
                run = self._run_of(work)
                if run is None or run.lone:  # all expired (a lane lets it go), or for the gate after all
                    if run is not None:
                        self._put_back(run)
                    self._rotation.appendleft(work)
                    return
                work.running = True
                run.ticket = self.committer.mark_ahead(
                    work.slot, work.fence, [message.id for message in run.calls], hint=work.hint
                )
                # A network run's room at its target is taken by the lane that makes it (a run waiting for a
                # lane holds none: the calls in flight there are the lanes' own).
                self._ahead.append(run)
                self._notify_work(1)

    def _room_ahead(self, key: str) -> bool:
        """Under the lock: whether a run to a destination may be marked ahead: a round's worth at most (as many as
        its limit lets call at once), so that a call ending there is followed at once by one whose marks are
        written; none while its circuit is not closed."""
        target = self._targets[key]
        if target.circuit is not Circuit.CLOSED:
            return False
        return sum(1 for item in self._ahead if item.key == key) < target.allowed()

    # -- the calls of a run -----------------------------------------------------------------------------------

    def _calls(self, lane: _Lane, run: _Run) -> None:
        """A run's calls in order, on the run's thread: each made and decided (``run.decided``); the outcomes
        collect on the run until its exit, which takes back the marks of the calls a return here leaves
        undecided."""
        work = run.work
        durations: list[float] = []
        try:
            for index, message in enumerate(run.calls):
                run.index = index
                if self._stopping:
                    work.pending.clear()
                    return
                timeout = self._timeout(message.name)
                if message.expires_at is not None and message.is_expired(self.clock.now()):
                    run.unmark.append(message)  # never correlated; cleanup removes it
                    run.decided = index + 1
                    continue
                if self._held_back(message):  # paused since the fetch: it waits, in order, for the lift
                    self._give_back(work, "a durable pause holds it back", again=True)
                    return
                if not self._agreed(message.name):  # a replica routing its name differently joined
                    self._hold_for_routes(work)
                    return
                started = self._monotonic()
                if index and self.leases.safe_for(work.slot, work.fence) <= timeout:
                    self._give_back_until_renewed(work)
                    return
                with self._lock:
                    # A network call ends itself at its timeout (its requests' deadline); the watchdog gives up on
                    # any call past its own.
                    run.deadline = started + timeout + (NETWORK_GRACE if run.room is not None else 0.0)
                    run.current = message
                if message.redelivered:
                    self.metrics.redeliveries.inc()
                    logger.info(
                        "delivering message %s again (%d earlier call(s) not recorded)", message.id,
                        message.lost_calls, extra=_fields(message),
                    )
                with self.tracing.call(message) if self.tracing else _NO_SPAN as span:
                    error, result, status = self._make_call(run, message, self.router.route(message.name))
                    if status in ("fenced", "busy", "gone", "held", "unavailable"):
                        if span is not None:
                            span.outcome("not_called" if status != "held" else "held", error)
                        with self._lock:
                            if lane.abandoned:  # given up on meanwhile: that recorded it
                                return
                            run.current = None
                        if status in ("gone", "fenced"):  # gone: deleted or recorded meanwhile, its mark is out;
                            # fenced: rolled back, its mark left under the ended term (the slot's next holder
                            # counts it, this one too)
                            self.committer.settled(work.fence, [message.id])
                            run.decided = index + 1
                            if status == "gone":
                                continue
                        elif status == "held":  # the target's refusal: no attempt, the hint rests (work.rest)
                            self._give_back(work, "its target refused the call")
                            return
                        else:  # its row held elsewhere, or the database gone mid-call (rolled back, not charged)
                            work.rest = (None, ROW_HELD_REST)
                        self._give_back(work, {"fenced": "its slot's term ended", "busy": "its row is held elsewhere",
                                               "unavailable": "the database was lost during the call"}[status])
                        return
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
                    with self._lock:
                        if lane.abandoned:  # the watchdog recorded a timeout (or shutdown gave up on it) meanwhile
                            return
                        run.current = None
                        run.decided = index + 1
                        if status == "written":  # recorded with the handler's writes, in its transaction
                            self._count(message.name, disposition.outcome)
                            self.committer.settled(work.fence, [message.id])
                        else:
                            run.done.append((message, disposition))
                    work.called += 1
                    durations.append(elapsed)
                    if error is None:
                        _log_success(message, disposition, elapsed)
                    else:
                        if isinstance(error, AuthProblem):
                            self.metrics.target_auth_failures.labels(message.name).inc()
                        elif isinstance(error, HandlerTimeout):
                            self.metrics.handler_timeouts.labels(message.name).inc()
                        _log_failure(message, disposition, error)
                        if self.mode is Mode.FAIL_FIRST:
                            work.pending.clear()
                            work.stopped = True
                            return
        finally:
            if durations:
                self._observe(run.calls[0].name, durations)

    def _make_call(self, run: _Run, message: Message, correlator: Correlator | None) -> CallResult:
        """One call of a run, by its route's kind."""
        if run.room is not None:
            return self._call_network(run, message, correlator, run.room)
        if isinstance(correlator, TransactionalCorrelator):
            return self._call_in_transaction(run, message, correlator)
        error, result = self._call(message, correlator)
        return error, result, None

    def _call_network(self, run: _Run, message: Message, correlator: Correlator | None, room: _Room) -> CallResult:
        """One call to a network target, and what its answer says of the target: a refusal that is the target's
        is ``held`` (the hint rests until its Retry-After, or until the circuit may be tried again). Its requests
        end within the handler timeout."""
        destination = self._destination(message.name)
        call = getattr(correlator, "call", None)
        target = room.target
        if destination is None or call is None:  # its route changed kind meanwhile: called as a plain function
            plain, result = self._call(message, correlator)
            return plain, result, None
        if target.circuit is Circuit.OPEN:  # an earlier call of this run opened it: none goes there now
            run.work.rest = (destination.key, target.retry_in(self._monotonic()))
            self.metrics.target_held.labels(destination.shown, "open").inc()
            return None, None, "held"
        returned = None
        try:
            with call_deadline(self._timeout(message.name)):
                returned = call(message)
        except (Retry, PermanentError, Reschedule) as outcome:  # the target's answer, in words: no frames kept
            error: BaseException | None = outcome.with_traceback(None)
        except BaseException as failure:  # any outcome, never a crash
            error = failure
        else:
            error = interpret_return(returned)
        answer = answer_of(error)
        now = self._monotonic()
        answers, limit = self._target_gauges(destination.shown, answer)
        answers.inc()
        with self._lock:
            transition = target.answered(answer, message.id, now, first_line(error) if error else "", room.number)
            limit.set(target.allowed())
        if transition is not None:
            self._transition(destination, target, transition)
        if answer in (Answer.UNAVAILABLE, Answer.BUSY):
            assert isinstance(error, TargetUnavailable)
            rest = self._rest_for(error, target, message, now)
            run.work.rest = (destination.key, rest)
            self.metrics.target_held.labels(destination.shown, str(answer)).inc()
            logger.debug("message %s held for %.1fs: %s", message.id, rest, first_line(error), extra=_fields(message))
            return error, None, "held"
        return error, (result_of(returned) if error is None else None), None

    def _target_gauges(self, shown: str, answer: Answer) -> tuple[Any, Any]:
        """A destination's answer counter and limit gauge (looked up once: a call is too frequent for labels())."""
        found = self._answer_metrics.get((shown, answer))
        if found is None:
            found = self._answer_metrics[(shown, answer)] = (
                self.metrics.target_answers.labels(shown, str(answer)), self.metrics.target_limit.labels(shown)
            )
        return found

    def _rest_for(self, error: TargetUnavailable, target: TargetState, message: Message, now: float) -> float:
        """How long a hint whose call the target refused rests: its Retry-After (no longer than the backoff's
        cap), else until the circuit may be tried, else the first probe's interval."""
        after = error.after
        if isinstance(after, timedelta):
            after = after.total_seconds()
        if isinstance(after, int | float) and after >= 0:
            return float(min(after, self._policy(message.name).backoff_cap.total_seconds()))
        return max(target.retry_in(now), target.config.probe_first)

    def _target_admits(self, destination: Destination, work: HintWork) -> _Room | None:
        """Ask a destination for room for one run (a call counted in flight) when it has room; else None, with
        ``work.rest`` set when its circuit is open (the hint rests) and unset when it is only full."""
        target = self._targets[destination.key]
        with self._lock:
            verdict = target.admit(self._monotonic())
            if verdict in ("call", "probe"):
                if verdict == "probe":
                    self._transition(destination, target, Transition(Circuit.OPEN, Circuit.HALF_OPEN, target.reason))
                return _Room(target, destination.key, target.admissions)
            if verdict == "open":
                work.rest = (destination.key, target.retry_in(self._monotonic()))
                self.metrics.target_held.labels(destination.shown, "open").inc()
        return None

    def _unpark(self, key: str, count: int) -> None:
        """Under the lock: up to ``count`` of those waiting for room at this destination go, in the order they
        came (a lane that gave up waiting meanwhile is passed over: it asks again)."""
        parked = self._parked.get(key)
        moved = woken = 0
        while parked and moved + woken < count:
            item = parked.popleft()
            if isinstance(item, asyncio.Future):
                if not item.done():
                    self._soon(_wake, item)
                    woken += 1
                continue
            item.running = False
            self._rotation.appendleft(item)
            moved += 1
        if moved:
            self._notify_work(moved)

    def _unpark_lanes(self, parked: deque[HintWork | asyncio.Future[None]]) -> None:
        """Under the lock: wake every lane waiting in ``parked``."""
        for item in parked:
            if isinstance(item, asyncio.Future) and not item.done():
                self._soon(_wake, item)

    def _transition(self, destination: Destination, target: TargetState, transition: Transition) -> None:
        """A circuit changed: its one log line, its metrics; closed, its hints go again."""
        shown = destination.shown
        self.metrics.target_transitions.labels(shown, str(transition.after)).inc()
        self.metrics.target_open.labels(shown).set(0 if transition.after is Circuit.CLOSED else 1)
        if transition.after is Circuit.OPEN and transition.before is Circuit.CLOSED:
            logger.warning(
                "target %s is unavailable (%s): no calls go there, its messages wait without being charged; a probe "
                "in %.1fs", shown, transition.reason, target.retry_in(self._monotonic()),
                extra={"target": shown, "circuit": "open"},
            )
        elif transition.after is Circuit.CLOSED:
            logger.info(
                "target %s answers again: its messages go on", shown, extra={"target": shown, "circuit": "closed"}
            )
            with self._lock:
                self._unpark(destination.key, len(self._parked.get(destination.key, ())))
            self._on_target_ready(destination.key)
        else:
            logger.debug("target %s: %s -> %s (%s)", shown, transition.before, transition.after, transition.reason)

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
        outcome = interpret_return(returned)
        return outcome, (result_of(returned) if outcome is None else None)

    def _call_in_transaction(self, run: _Run, message: Message, correlator: TransactionalCorrelator) -> CallResult:
        """A transactional correlator's call, inside the transaction that records its success (see
        :meth:`~worker.db.calls.CallStatements.calls_transact`): the error (None for success), the target's
        answer, and what became of the transaction."""
        failure: list[BaseException | None] = [None]
        answer: list[str | None] = [None]

        timeout = self._timeout(message.name)

        def disposition(connection: object) -> Disposition | None:
            started = self._monotonic()
            try:
                returned = correlator.function(message, connection)
            except BaseException as error:  # any handler exception is an outcome, never a crash
                failure[0] = error
                return None
            if self._monotonic() - started > timeout:  # past its timeout (a session that could not be ended from
                failure[0] = HandlerTimeout(  # outside: SQLite): rolled back, recorded as the timeout it was
                    f"the correlator did not return within {format_duration(timedelta(seconds=timeout))}"
                )
                return None
            outcome = interpret_return(returned)
            if outcome is not None:
                failure[0] = outcome
                return None
            answer[0] = result_of(returned)
            return Disposition(message.id, Kind.DELETE, message.attempt, result=answer[0])

        def session(call: CallSession | None) -> None:
            with self._lock:
                run.session = call

        try:
            status = self.committer.store.calls_transact(
                run.work.slot, run.work.fence, disposition, message.id, session=session,
                idle_limit=timeout + IDLE_MARGIN,  # past it the watchdog ended it, or the replica froze
            )
        except StoreError as error:  # the transaction did not commit (or cannot be known to): not recorded
            if _database_lost(error):
                return error, None, "unavailable"
            return failure[0] or error, None, "failed"
        if status == "unavailable":  # its session was lost during the call: rolled back, nothing of the message's
            return failure[0], None, status
        if status == "ended":  # its writes may have committed apart from the outcome: never called again
            return PermanentError(
                "the transactional handler ended the worker's transaction (a commit, rollback or close): its writes "
                "may have committed without the outcome, so it is not called again; a transactional handler must "
                "leave the transaction to the worker"
            ), None, "failed"
        return failure[0], answer[0], status

    def _hand_over_locked(self, lane: _Lane, run: _Run) -> None:
        """Under the lock: give the committer the outcomes, unmarks and abandons collected on the run (at its exit,
        and where a call is given up on)."""
        done, run.done = run.done, []
        unmark, run.unmark = run.unmark, []
        abandon, run.abandon = run.abandon, []
        if not (done or unmark or abandon):
            return
        work = run.work
        work.unrecorded += len(done) + len(unmark) + len(abandon)
        counts = Counter((message.name, disposition.outcome) for message, disposition in done)
        for (name, outcome), n in counts.items():
            self._count(name, outcome, n)
        outcomes = Outcomes(
            work.slot, work.fence, done, lambda ended: self._recorded(work, ended), unmark=unmark, abandon=abandon
        )
        run.handed = outcomes
        self.committer.record(outcomes, now=self._alone is lane)  # the gate stays shut until it is written

    def _give_back(self, work: HintWork, why: str, *, again: bool = False) -> None:
        """Make no more calls of this hint now (the messages not called stay as they are, for later);
        ``again``: fetch its slot again once the hint's work is over."""
        logger.debug("hint %r left for later: %s", work.hint, why)
        work.pending.clear()
        work.again = work.again or again

    def _hold_for_routes(self, work: HintWork) -> None:
        """The live replicas route the hint's next message name differently: no call, no attempt; the hint rests
        until they agree."""
        self.metrics.route_holds.inc()
        work.rest = (ROUTES_KEY, ROUTES_REST)
        self._give_back(work, "the live replicas route its message name differently")

    def _give_back_until_renewed(self, work: HintWork) -> None:
        """The slot's term may end before a call could (its renewal is due): the hint's slot is fetched again
        once the term is renewed, not at the next poll."""
        work.lease_short = True
        self._give_back(work, "its slot's lease may end before the call could")

    def _observe(self, name: str, durations: Sequence[float]) -> None:
        """A run's call durations: into the histogram, and into the smoothed time that sizes later runs."""
        self.metrics.call_duration.observe_many(name, durations)
        typical = sum(durations) / len(durations)
        with self._lock:  # the most recently called last; the least recently called goes past NAMES_TIMED
            timed = self._call_seconds
            previous = timed.pop(name, None)
            timed[name] = typical if previous is None else previous + 0.2 * (typical - previous)
            if len(timed) > NAMES_TIMED:
                del timed[next(iter(timed))]

    def _count(self, name: str, outcome: str, n: int = 1) -> None:
        """Under the lock: outcomes of calls, handed over or written by their call's own transaction."""
        self._tally[outcome] += n
        self.metrics.messages.labels(name, outcome).inc(n)

    def tally(self) -> Counter[str]:
        """Outcomes of calls so far, by outcome."""
        with self._lock:
            return Counter(self._tally)

    def _recorded(self, work: HintWork, ended: Sequence[tuple[Message, str]]) -> None:
        with self._lock:
            work.unrecorded -= len(ended)
            if self._alone is not None:  # a lone run may wait for its outcomes before it lets others in
                self._notify_gate()
        self.settle(work)

    def settle(self, work: HintWork) -> None:
        """Report a hint's work as over once nothing of it runs, waits, or waits to be written."""
        with self._lock:
            if work.finished or work.running or work.unrecorded or work.hung:
                return
            if work.pending and not work.stopped and not self._stopping:
                return  # more calls to make: it is in the rotation
            work.finished = True
        self._on_finished(work)

    # -- the watchdog ---------------------------------------------------------------------------------------

    async def _watch(self) -> None:
        assert self._watch_wake is not None
        while True:
            with self._lock:
                if self._stopping and not self._running_calls():
                    return
                now = self._monotonic()
                late = [lane for lane in self._lanes if lane.run is not None and lane.run.current is not None
                        and not lane.abandoned and now >= lane.run.deadline]
                for lane in late:
                    self._give_up(lane)
                let_go, self._let_go = self._let_go, []
            for work in let_go:
                self.settle(work)
            with suppress(TimeoutError):
                await asyncio.wait_for(self._watch_wake.wait(), WATCH_TICK if self._stopping else self._watch_tick)

    def _give_up(self, lane: _Lane) -> None:
        """Under the lock, on the loop: a call past its handler timeout is recorded as one; its lane is let go (it
        ends when its thread's call returns), and a new lane takes its place."""
        run = lane.run
        message = None if run is None else run.current
        if run is None or message is None:
            return
        work = run.work
        lane.abandoned = lane.timed_out = True
        if self._alone is lane:  # the replica goes on without it (nothing is alone while it runs)
            self._alone = None
        self._notify_gate()
        self._notify_work(len(self._lanes))
        self._hung += 1
        work.hung = True
        work.pending.clear()
        work.stopped = True
        policy = self._policy(message.name)
        error = HandlerTimeout(f"the correlator did not return within {format_duration(policy.handler_timeout)}")
        disposition = resolve(message, error, policy, self.clock.now(), self.settings.poll.interval)
        run.done.append((message, disposition))
        self.metrics.handler_timeouts.labels(message.name).inc()
        _log_failure(message, disposition, error)
        run.give_up()
        if run.session is not None:  # a transactional call: its transaction ends first (it holds the call's row)
            session, run.session = run.session, None
            threading.Thread(
                target=self._end_session, args=(lane, run, session), name="end-session", daemon=True
            ).start()
        else:
            self._hand_over_locked(lane, run)
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

    def _end_session(self, lane: _Lane, run: _Run, session: CallSession) -> None:
        """End the database session of a transactional call given up on, then record its timeout (the call's
        row is free once its transaction is rolled back)."""
        self._end_transaction(session)
        with self._lock:
            self._hand_over_locked(lane, run)

    def _end_transaction(self, session: CallSession) -> None:
        """End a transactional call's database session given up on (a timeout, a stop): its transaction rolls
        back and lets go of the call's and the message's rows."""
        try:
            self.committer.store.session_end(session)
        except StoreError as error:  # the session ends with its connection anyway; the outcome waits for it
            logger.warning("could not end the session of a call given up on: %s", error)


def _database_lost(error: BaseException | None) -> bool:
    """The connection of a transactional call was lost (a server restart, a failover, its session ended): its
    transaction is rolled back, or committed with its outcome; it says nothing of the message."""
    if isinstance(error, DatabaseUnavailable):
        return True
    if isinstance(error, StoreError):
        return connection_lost(error)
    return isinstance(error, DBAPIError) and bool(error.connection_invalidated)


def answer_of(error: BaseException | None) -> Answer:
    """What a network call's outcome says of its target (:class:`~worker.policy.targets.Answer`)."""
    if error is None:
        return Answer.SUCCESS
    if isinstance(error, TargetBusy):
        return Answer.BUSY
    if isinstance(error, TargetUnavailable):
        return Answer.UNAVAILABLE
    if isinstance(error, HandlerTimeout) or (isinstance(error, Retry) and not isinstance(error, AuthProblem)):
        return Answer.FAILURE
    if isinstance(error, Reschedule | PermanentError | AuthProblem):
        return Answer.MESSAGE
    return Answer.FAILURE


def _fields(message: Message) -> dict[str, object]:
    """Structured log fields of a message (never its payload)."""
    return log_fields(message)


def _log_success(message: Message, disposition: Disposition, seconds: float) -> None:
    """One line per call that succeeded, at DEBUG (a busy worker correlates thousands a second; the target's
    answer is kept on the delivery record)."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    logger.debug(
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
