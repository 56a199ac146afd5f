"""The poll cycle: fetch eligible messages page by page, correlate each hint's batch in order, record results.

One cycle (:meth:`Poller.run_once`) walks every slot this replica holds, round-robin, one page per slot per
round, with keyset paging on ``id`` so that stuck messages never starve newer ones::

    for each round, for each slot with more work:
        now  = database clock
        page = eligible messages of the slot with id > cursor        (SQL decides eligibility)
        batches = group page by hint, honouring batch size and the hints stopped earlier this cycle
        run the batches (up to ``poll.concurrency`` at once; one hint's messages one after another)
        record every outcome in one transaction, fenced by the slot lease
        cursor = last id of the page

Handler calls run on worker threads; the cycle thread watches their deadlines. A call that exceeds its
handler timeout is given up on: its message counts as a timeout, the rest of its batch is left untouched, and
its hint is skipped until the call returns, so that one hint never has two calls at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Protocol

from worker.config import Mode, Policy, PollSettings, Settings, format_duration
from worker.correlators import Router
from worker.db.store import DatabaseUnavailable, Fence, LeaseLost, Store
from worker.message import Message
from worker.policy.batching import Batch, CycleState, plan_batches
from worker.policy.outcomes import Disposition, HandlerTimeout, Kind, PermanentError, interpret_return, resolve
from worker.service.logs import log_fields
from worker.service.metrics import Metrics

logger = logging.getLogger(__name__)

WATCH_TICK = 0.05  # how often the cycle thread checks handler deadlines while batches run


class SlotSource(Protocol):
    """Which slots this replica may poll now, and the lease terms that fence their writes."""

    def slots(self) -> Sequence[int]:
        """The slots held now."""
        ...

    def fences(self, slot: int) -> Sequence[Fence]:
        """The lease terms a commit of this slot's results must still hold (none without leases)."""
        ...

    def redelivered(self, slot: int, message_ids: Sequence[int]) -> int:
        """How many of these messages a previous holder of the slot handed out without recording them."""
        ...


class AllSlots:
    """Every slot, unfenced: a poller without leases (tests, benchmarks, embedding in another program)."""

    def __init__(self, slot_count: int) -> None:
        self._slots = tuple(range(slot_count))

    def slots(self) -> Sequence[int]:
        """Every slot."""
        return self._slots

    def fences(self, slot: int) -> Sequence[Fence]:
        """No lease, no fence."""
        return ()

    def redelivered(self, slot: int, message_ids: Sequence[int]) -> int:
        """A single replica has no previous holder to learn from."""
        return 0


@dataclass(slots=True)
class PollResult:
    """What one cycle did."""

    pages: int = 0
    fetched: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    fenced_off: int = 0
    abandoned: int = 0
    redelivered: int = 0

    @property
    def correlated(self) -> int:
        """Messages whose call ended in success."""
        return self.outcomes.get("success", 0)

    def count(self, outcome: str, n: int = 1) -> None:
        """Add to an outcome."""
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + n


@dataclass(slots=True)
class _Call:
    """One message's correlator call and how it ended (``error`` None: success)."""

    message: Message
    error: BaseException | None
    elapsed: float  # seconds since the page's clock reading, when the call ended


class _BatchRun:
    """A batch executing on a worker thread; the cycle thread reads its progress to enforce timeouts."""

    def __init__(self, batch: Batch, page_started: float) -> None:
        self.batch = batch
        self.page_started = page_started
        self.lock = threading.Lock()
        self.calls: list[_Call] = []
        self.current: Message | None = None
        self.current_deadline = float("inf")
        self.started = 0.0  # seconds since the page's clock reading, when the batch began
        self.abandoned = False
        self.cancelled = threading.Event()


class Poller:
    """Correlates the eligible messages of the slots a :class:`SlotSource` hands it."""

    def __init__(
        self,
        store: Store,
        router: Router,
        settings: Settings,
        slots: SlotSource,
        metrics: Metrics | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        tick: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.router = router
        self.settings = settings
        self.poll: PollSettings = settings.poll
        self.mode: Mode = settings.policy.mode
        self.slot_source = slots
        self.metrics = metrics or Metrics()
        self._monotonic = monotonic
        self._tick = tick  # liveness: called at every page and while batches run
        self._executor = self._new_executor()
        self._busy_hints: dict[str, int] = {}  # hint → slot of a call given up on but still running
        self._page_slot: int | None = None  # the slot whose page is being correlated
        self._busy_lock = threading.Lock()
        self._stopping = threading.Event()
        self._running: list[_BatchRun] = []
        self._policies: dict[str, Policy] = {}  # effective policy by message name (the settings are frozen)

    # -- lifecycle ----------------------------------------------------------------------------------------

    def _new_executor(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self.poll.concurrency, thread_name_prefix="correlate")

    def request_stop(self) -> None:
        """Start no new message; batches stop after their current call."""
        self._stopping.set()
        for run in list(self._running):
            run.cancelled.set()

    def close(self) -> None:
        """Let go of the worker threads (calls still running are abandoned)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- the cycle ------------------------------------------------------------------------------------------

    def run_once(self) -> PollResult:
        """One poll cycle over every slot held; returns what it did."""
        result = PollResult()
        started = time.perf_counter()
        cycle = CycleState()
        cursors = {slot: 0 for slot in self.slot_source.slots()}
        # Eligibility is judged at one instant for the whole cycle: a retry falling due mid-cycle must not
        # unblock later messages of its hint on a later page while it is itself behind the cursor.
        cycle_now = self.store.now() if cursors else None
        while cursors and not self._stopping.is_set():
            for slot in list(cursors):
                if self._stopping.is_set():
                    break
                if slot not in self.slot_source.slots():  # lease lost or handed back mid-cycle
                    del cursors[slot]
                    continue
                try:
                    assert cycle_now is not None
                    fetched, last_id = self._run_page(slot, cursors[slot], cycle, cycle_now, result)
                except DatabaseUnavailable:
                    raise
                except Exception:  # one slot's trouble must not hold up the others: retried next cycle
                    logger.exception("slot %s skipped until the next poll", slot)
                    del cursors[slot]
                    continue
                if fetched < self.poll.page_size:
                    del cursors[slot]
                else:
                    cursors[slot] = last_id
        self.metrics.poll_duration.observe(time.perf_counter() - started)
        return result

    def slots_in_use(self) -> set[int]:
        """Slots that must not change hands yet: the page being correlated, and calls given up but running."""
        with self._busy_lock:
            in_use = set(self._busy_hints.values())
        page_slot = self._page_slot
        if page_slot is not None:
            in_use.add(page_slot)
        return in_use

    def _run_page(
        self, slot: int, after: int, cycle: CycleState, cycle_now: datetime, result: PollResult
    ) -> tuple[int, int]:
        self._page_slot = slot
        try:
            return self._correlate_page(slot, after, cycle, cycle_now, result)
        finally:
            self._page_slot = None

    def _correlate_page(
        self, slot: int, after: int, cycle: CycleState, cycle_now: datetime, result: PollResult
    ) -> tuple[int, int]:
        self._tick()
        try:
            fences = self.slot_source.fences(slot)  # the term this page is read, called and written under
        except LeaseLost:
            return 0, after
        now = self.store.now()
        page_started = self._monotonic()
        page = self.store.messages_fetch_eligible(
            slot=slot, after=after, limit=self.poll.page_size, mode=self.mode, now=cycle_now
        )
        if not page:
            return 0, after
        result.pages += 1
        result.fetched += len(page)
        with self._busy_lock:
            busy = set(self._busy_hints)
        batches = plan_batches(page, self.settings.policy.batch_size, cycle, busy)
        handed_out = [message.id for batch in batches for message in batch.messages]
        for fence in fences:
            if handed_out and not self.store.lock_mark_in_flight(fence, handed_out):
                logger.warning("slot %s: lease ended before its page was correlated; page left alone", slot)
                return 0, after
        redelivered = self.slot_source.redelivered(slot, handed_out)
        if redelivered:
            result.redelivered += redelivered
            self.metrics.redeliveries.inc(redelivered)
        calls, given_up = self._execute(batches, page_started, result)
        dispositions = [self._resolve(call, now) for call in calls]
        for disposition, call in zip(dispositions, calls, strict=True):
            if disposition.kind is not Kind.DELETE:
                cycle.stop(call.message.hint)
        called = {call.message.id for call in calls}
        for batch in batches:
            if batch.messages[-1].id not in called:  # cut short (lease ending): later pages must not overtake it
                cycle.stop(batch.hint)
        try:
            self.store.messages_record_results(dispositions, fences, still_in_flight=given_up)
        except LeaseLost as lost:
            logger.warning("results of slot %s not written: %s", slot, lost)
            self.metrics.fenced_commits.inc()
            result.fenced_off += len(dispositions)
            return 0, after  # the slot is done for this cycle: its new owner decides what comes next
        # Counted once per message name and outcome, not once per message: labels() costs more than inc().
        pairs = zip(dispositions, calls, strict=True)
        tally = Counter((call.message.name, disposition.outcome) for disposition, call in pairs)
        for (name, outcome), n in tally.items():
            result.count(outcome, n)
            self.metrics.messages.labels(name, outcome).inc(n)
        for disposition, call in zip(dispositions, calls, strict=True):
            if disposition.kind is not Kind.DELETE:
                _log_failure(call, disposition)
        return len(page), page[-1].id

    def _policy(self, message_name: str) -> Policy:
        """The effective policy of a message name, merged once (a merge copies the policy model)."""
        policy = self._policies.get(message_name)
        if policy is None:
            policy = self._policies[message_name] = self.settings.policy_for(message_name)
        return policy

    def _resolve(self, call: _Call, page_now: datetime) -> Disposition:
        policy = self._policy(call.message.name)
        now = page_now + timedelta(seconds=call.elapsed)
        return resolve(call.message, call.error, policy, now, self.poll.interval)

    # -- running batches ------------------------------------------------------------------------------------

    def _execute(
        self, batches: list[Batch], page_started: float, result: PollResult
    ) -> tuple[list[_Call], list[int]]:
        """Run the batches (at most ``concurrency`` at once).

        Returns the calls that ended, in id order, and the ids of the messages whose call was given up at
        shutdown (left as they were, to be delivered again).
        """
        runs = [_BatchRun(batch, page_started) for batch in batches]
        given_up: list[int] = []
        if self._stopping.is_set():
            return [], given_up
        self._running = runs
        futures: dict[Future[None], _BatchRun] = {
            self._executor.submit(self._run_batch, run): run for run in runs
        }
        pending = set(futures)
        grace_deadline: float | None = None
        while pending:
            _, pending = wait(pending, timeout=WATCH_TICK, return_when=FIRST_COMPLETED)
            self._tick()
            now = self._monotonic()
            if self._stopping.is_set() and grace_deadline is None:
                grace_deadline = now + self.settings.shutdown.grace.total_seconds()
                for run in runs:
                    run.cancelled.set()
            for future in list(pending):
                if future not in pending:  # cancelled and resubmitted after an earlier abandonment
                    continue
                run = futures[future]
                with run.lock:
                    timed_out = run.current is not None and now >= run.current_deadline
                    out_of_grace = grace_deadline is not None and now >= grace_deadline
                    if not (timed_out or out_of_grace) or run.current is None:
                        continue
                    run.abandoned = True
                    with self._busy_lock:  # under run.lock: the call may return at any moment and unmark it
                        self._busy_hints[run.batch.hint] = run.batch.messages[0].slot
                    message = run.current
                    if timed_out and not out_of_grace:
                        timeout = self._policy(message.name).handler_timeout
                        error = HandlerTimeout(f"the correlator did not return within {format_duration(timeout)}")
                        run.calls.append(_Call(message, error, now - page_started))
                    else:  # shutting down: leave the message as it was, to be delivered again
                        given_up.append(message.id)
                        result.abandoned += 1
                        self.metrics.messages.labels(message.name, "abandoned").inc()
                pending.discard(future)
                # The stuck thread is lost to the pool: give the batches not started yet, and the next pages,
                # a fresh set of threads.
                stuck_pool, self._executor = self._executor, self._new_executor()
                for queued in [f for f in pending if f.cancel()]:
                    pending.discard(queued)
                    resubmitted = self._executor.submit(self._run_batch, futures[queued])
                    futures[resubmitted] = futures.pop(queued)
                    pending.add(resubmitted)
                stuck_pool.shutdown(wait=False)
        self._running = []
        calls = [call for run in runs for call in run.calls]
        calls.sort(key=lambda call: call.message.id)
        for run in runs:
            if run.calls:
                self.metrics.batch_duration.observe(run.calls[-1].elapsed - run.started)
        return calls, given_up

    def _run_batch(self, run: _BatchRun) -> None:
        """On a worker thread: call the correlator for each message of one hint, in order."""
        run.started = self._monotonic() - run.page_started
        try:
            for message in run.batch.messages:
                # No call starts once the slot's lease is near its end or handed back: the next holder does it.
                if run.cancelled.is_set() or message.slot not in self.slot_source.slots():
                    return
                timeout = self._policy(message.name).handler_timeout.total_seconds()
                with run.lock:
                    if run.abandoned:
                        return
                    run.current = message
                    run.current_deadline = self._monotonic() + timeout
                error = self._call(message)
                with run.lock:
                    if run.abandoned:
                        return
                    run.current = None
                    run.calls.append(_Call(message, error, self._monotonic() - run.page_started))
                if error is not None and self.mode is Mode.FAIL_FIRST:
                    return
        finally:
            with run.lock:
                abandoned = run.abandoned
            if abandoned:
                with self._busy_lock:
                    self._busy_hints.pop(run.batch.hint, None)

    def _call(self, message: Message) -> BaseException | None:
        correlator = self.router.route(message.name)
        if correlator is None:
            return PermanentError(
                f"no correlator route for message name {message.name!r}: add it to CORRELATION_CORRELATORS "
                'or configure a "*" fallback'
            )
        started = time.perf_counter()
        try:
            returned = correlator(message)
        except BaseException as error:  # any handler exception (even SystemExit) is an outcome, never a crash
            return error
        finally:
            self.metrics.observe_call(message.name, time.perf_counter() - started)
        # What a returned value means (an outcome, False, or a value that is refused): worker.policy.outcomes.
        return interpret_return(returned)


def _log_failure(call: _Call, disposition: Disposition) -> None:
    """One line per call that did not succeed: what it was, what happens next, and the error's first line."""
    message = call.message
    reason = str(call.error).splitlines()[0] if call.error is not None and str(call.error) else ""
    error = f"{type(call.error).__name__}: {reason}" if call.error is not None else ""
    due = disposition.next_attempt_at.isoformat() if disposition.next_attempt_at else "never"
    level = logging.WARNING if disposition.kind in (Kind.RETRY, Kind.DEAD) else logging.INFO
    logger.log(
        level,
        "%s id=%s hint=%s: %s (attempt %d, next %s): %s",
        message.name, message.id, message.hint, disposition.outcome, disposition.attempt, due, error,
        extra=log_fields(
            message, attempt=disposition.attempt, outcome=disposition.outcome,
            next_attempt_at=disposition.next_attempt_at, error=error,
        ),
    )
