"""Slot leases: which replica polls which slot, and how a replica that lost one is kept from writing.

Every message has a slot, ``hash(correlation_hint) mod S``. A replica polls only the slots it leases, so a
hint belongs to exactly one replica at a time. A slot is leased through the row ``slot:<n>`` of
``correlation_lock``; its term is ``(locked_by, fence)`` and it ends at ``lock_until``, a time of the
database clock (every statement reads ``now()`` itself, so replicas with skewed clocks still agree)::

               acquire: fence n, lock_until = now() + lease
    +------+  ---------------------------------------------->  +--------------------+ --+ renew: lock_until
    | free |                                                   | held by R, fence n |   | = now() + lease,
    +------+  <----------------------------------------------  +--------------------+ <-+ before it passes
                release: surplus handed back, or SIGTERM           |            ^
                (only by R, with fence n)                          |            |
                                                                   |            | acquired by any
                       lock_until passes without renewal           |            | replica R': held by
                       (R frozen, crashed or cut off)              v            | R', fence n + 1
                                                              +---------+       |
                                                              | expired | ------+
                                                              +---------+

Every acquisition increments the fence, so a term is never confused with an earlier or later one, even by
the same replica. Renewal and release happen only ``WHERE locked_by = me AND fence = my fence``.

**Why a commit is fenced.** A replica can stop between reading a page and writing its results (a long
garbage collection, a frozen VM, a lost network). Meanwhile its lease expires, another replica takes the
slot with fence n + 1 and correlates the same messages. When the first one wakes up it must not write its
stale results over the new owner's. So a call is marked in flight (``correlation_call``) only while its term
still runs, and its outcome is written only while that mark is still there under that term
(:mod:`worker.db.calls`): the new holder adopts the marks of ended terms as it takes the slot, and a late
outcome then finds no mark of its term and writes nothing.

**Stop acting before lock_until.** Fencing protects the table, not the correlation target: a call already
made cannot be taken back. So a replica stops *starting* work on a slot a safety margin before its term can
end: each lease keeps a local monotonic deadline, ``time the renewal was sent + lease - safety margin``
(the database granted the term after the request was sent, so this is never later than ``lock_until``), and
:meth:`SlotLeaser.slots` leaves out a slot past it. Renewals come at most every third of the lease, so two
can fail before a term ends.

**Balance.** Each replica aims for its fair share of S among the live replicas (those holding a slot or a
``member:`` row, which every replica renews with its slots so that one with no slot yet is counted):
``floor(S / n)``, plus one for the ``S mod n`` replicas that hold the most. A short replica takes free or
expired slots; a replica above its share hands back its surplus only while another one is short, never
going below its share (:func:`balance`, pure). A handed-back slot is first withheld from the poller for a
short drain period, so that a page in flight can still commit, and released after it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from worker.config import format_duration
from worker.db.store import Fence, LeaseLost, LockRow, Store, StoreError
from worker.policy.balance import balance
from worker.service.metrics import Metrics

logger = logging.getLogger(__name__)

SLOT_PREFIX = "slot:"
MEMBER_PREFIX = "member:"

DEFAULT_LEASE = timedelta(seconds=40)
DEFAULT_RENEW_INTERVAL = timedelta(seconds=5)  # at most a third of the lease
DEFAULT_SAFETY_MARGIN = timedelta(seconds=5)  # stop offering a slot this long before its term can end
DEFAULT_DRAIN = timedelta(seconds=5)  # a handed-back slot is withheld from the poller this long first
LAPSE_LOOK_AFTER = 0.05  # seconds after another replica's term would end that a round looks whether it lapsed


def slot_lock_name(slot: int) -> str:
    """The lock row of a slot: ``slot:<n>``."""
    return f"{SLOT_PREFIX}{slot}"


def slot_of(lock_name: str) -> int | None:
    """The slot a lock row leases, or None for any other row."""
    if not lock_name.startswith(SLOT_PREFIX):
        return None
    number = lock_name.removeprefix(SLOT_PREFIX)
    return int(number) if number.isdigit() else None


def member_lock_name(holder: str) -> str:
    """A replica's membership row; a digest of the holder, since holders may be longer than a lock name."""
    return MEMBER_PREFIX + hashlib.blake2b(holder.encode(), digest_size=12).hexdigest()


def _seconds(duration: timedelta) -> str:
    return format_duration(duration)  # the settings' own format: PT5S


@dataclass(frozen=True, slots=True)
class SlotLeaseConfig:
    """How long a slot lease lasts and how it is kept; validated at construction.

    ``lease``: the term granted by each acquisition or renewal. ``renew_interval``: how often
    :meth:`SlotLeaser.run_once` should run (at most a third of the lease). ``safety_margin``: how long before
    a term can end the slot stops being offered to the poller. ``drain``: how long a handed-back slot is
    withheld from the poller before it is released.
    """

    lease: timedelta = DEFAULT_LEASE
    renew_interval: timedelta = DEFAULT_RENEW_INTERVAL
    safety_margin: timedelta = DEFAULT_SAFETY_MARGIN
    drain: timedelta = DEFAULT_DRAIN

    def __post_init__(self) -> None:
        if self.lease <= timedelta(0):
            raise ValueError(f"the slot lease must be positive, not {_seconds(self.lease)}")
        if self.renew_interval <= timedelta(0) or self.renew_interval * 3 > self.lease:
            raise ValueError(
                f"the lease renew interval {_seconds(self.renew_interval)} must be positive and at most a "
                f"third of the lease {_seconds(self.lease)}, so that two renewals can fail before a term ends"
            )
        if self.safety_margin < timedelta(0) or self.safety_margin >= self.lease - self.renew_interval:
            raise ValueError(
                f"the lease safety margin {_seconds(self.safety_margin)} must be zero or more and less than "
                f"the lease minus the renew interval ({_seconds(self.lease - self.renew_interval)}), or "
                "slots would stop being offered between two renewals"
            )
        if self.drain < timedelta(0) or self.drain >= self.lease:
            raise ValueError(
                f"the lease drain {_seconds(self.drain)} must be zero or more and shorter than the lease "
                f"{_seconds(self.lease)}"
            )


# -- the service ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LeaseRound:
    """What one round did, and where it left this replica."""

    held: int  # slots leased after the round (including ones being handed back)
    target: int  # this replica's fair share
    replicas: int  # live replicas seen, this one included
    acquired: int = 0  # new terms (fences) taken this round
    renewed: int = 0
    lost: int = 0  # terms found expired or taken over when renewing
    released: int = 0  # handed back to the table


@dataclass(slots=True)
class _Lease:
    slot: int
    fence: Fence
    safe_until: float  # monotonic seconds: stop offering the slot after this
    draining_since: float | None = None  # monotonic seconds: withheld from the poller, to be released
    acquired_at: float = 0.0  # monotonic seconds: when this term was taken


class SlotLeaser:
    """Leases this replica's share of the slots and keeps it; the poller's :class:`SlotSource`.

    Call :meth:`run_once` every ``config.renew_interval`` from one thread (a round acquires, renews, hands
    back); the poller calls :meth:`slots` and :meth:`fences` from another. On shutdown, stop polling, then
    call :meth:`release_all` so that the other replicas take the slots over at their next round.
    """

    def __init__(
        self,
        store: Store,
        holder: str,
        config: SlotLeaseConfig | None = None,
        metrics: Metrics | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.holder = holder
        self.config = config or SlotLeaseConfig()
        self.metrics = metrics or Metrics()
        self.slot_count = store.slot_count
        self._monotonic = monotonic
        self._lease_s = self.config.lease.total_seconds()
        self._safe_for = (self.config.lease - self.config.safety_margin).total_seconds()
        self._leases: dict[int, _Lease] = {}
        self._state = threading.Lock()  # guards _leases: the poller reads while a round writes
        self._round = threading.Lock()  # one round (or release_all) at a time
        self._member: Fence | None = None
        self._member_term = min(self.config.lease, 2 * self.config.renew_interval + timedelta(seconds=1))
        self._stopped = False
        # Slots the engine still works on (hints fetched, calls running, outcomes unwritten): a handed-back
        # slot is released only once it is out of use, so that its next owner never calls a hint this one is
        # calling; at shutdown such slots are not released but left to expire.
        self.in_use: Callable[[], Collection[int]] = frozenset
        # Called after a round that acquired slots (the engine fetches them at once).
        self.on_acquired: Callable[[Sequence[int]], None] = lambda slots: None
        # Whether the engine fetched a slot under a term (a slot is handed back only once it did).
        self.fetched_under: Callable[[int, Fence], bool] = lambda slot, fence: True
        # Called after a round that renewed terms (the engine fetches the slots it left for a renewal).
        self.on_renewed: Callable[[], None] = lambda: None
        self._failing_since: float | None = None  # monotonic: the first of the rounds failing since
        self._failure = ""
        # Monotonic time at which the earliest term another replica holds ends unless renewed: a round then
        # takes the slot at once if it lapsed (its holder died), instead of at the next regular round.
        self._next_lapse: float | None = None

    # -- the engine's view (SlotSource) ---------------------------------------------------------------------

    def slots(self) -> Sequence[int]:
        """The slots held and still safe to act on (before the local deadline, not being handed back)."""
        now = self._monotonic()
        with self._state:
            return tuple(
                sorted(
                    lease.slot
                    for lease in self._leases.values()
                    if lease.draining_since is None and now < lease.safe_until
                )
            )

    def terms(self) -> dict[int, Fence | None]:
        """The slots held and still safe to act on, with their terms."""
        now = self._monotonic()
        with self._state:
            return {
                lease.slot: lease.fence
                for lease in self._leases.values()
                if lease.draining_since is None and now < lease.safe_until
            }

    def fence(self, slot: int) -> Fence | None:
        """The term of a slot's lease: a commit of its outcomes must still hold it (None: not leased)."""
        with self._state:
            lease = self._leases.get(slot)
        return None if lease is None else lease.fence

    def fences(self, slot: int) -> Sequence[Fence]:
        """The term a commit of this slot's results must still hold; LeaseLost if the slot is not leased.

        A slot past its local deadline or being handed back still has its term: the database decides at
        commit whether it still runs.
        """
        fence = self.fence(slot)
        if fence is None:
            raise LeaseLost(f"slot {slot} is not leased by {self.holder}")
        return (fence,)

    def safe_for(self, slot: int, fence: Fence | None = None) -> float:
        """Seconds until the slot stops being safe to act on (0 when it is not held or being handed back, or when
        ``fence`` is given and the term held now is another one: work fetched under an ended term never runs
        under the next, even this replica's own)."""
        with self._state:
            lease = self._leases.get(slot)
        if lease is None or lease.draining_since is not None:
            return 0.0
        if fence is not None and lease.fence is not fence and lease.fence != fence:  # the same term: the same object
            return 0.0
        return max(0.0, lease.safe_until - self._monotonic())

    def lost(self, slot: int, fence: Fence | None = None) -> None:
        """A write found the slot's term over: forget the lease (its new holder has it). With ``fence``, only if
        that is the term held now: a late write of an ended term never drops the term that followed it."""
        with self._state:
            lease = self._leases.get(slot)
            if lease is not None and fence is not None and lease.fence != fence:
                lease = None
            if lease is not None:
                del self._leases[slot]
            held = len(self._leases)
        if lease is not None:
            self.metrics.lease_losses.inc()
            self.metrics.slots_held.set(held)
            logger.warning("lost the lease of slot %s (found at a write)", slot, extra={"slot": slot})

    # -- rounds -------------------------------------------------------------------------------------------

    def trouble(self) -> str | None:
        """Why this replica may not be doing its share: every round failed for longer than a lease term."""
        with self._state:
            since, failure = self._failing_since, self._failure
        if since is None or self._monotonic() - since <= self._lease_s:
            return None
        return f"no slot lease could be taken or renewed for {self._monotonic() - since:.0f}s: {failure}"

    def run_once(self) -> LeaseRound:
        """One round: renew the held slots, keep membership, take the fair share, hand back surplus.

        Raises a :class:`~worker.db.store.StoreError` when the database cannot be reached or refuses the
        round (leases not renewed meanwhile stop being offered at their local deadline); :meth:`trouble`
        reports rounds failing for longer than a lease term, whatever they failed with.
        """
        try:
            result = self._run_once()
        except Exception as error:  # a store error, or one the store does not know (still a round that failed)
            with self._state:
                if self._failing_since is None:
                    self._failing_since = self._monotonic()
                self._failure = str(error) if isinstance(error, StoreError) else _first_line(error)
            raise
        with self._state:
            self._failing_since = None
        return result

    def _run_once(self) -> LeaseRound:
        with self._round:
            if self._stopped:
                return LeaseRound(held=0, target=0, replicas=0)
            renewed, lost = self._renew()
            self._keep_membership()
            released = self._release_drained()
            rows, database_now = self.store.locks_view()
            sent = self._monotonic()
            others, untracked = self._view(rows)
            self._next_lapse = self._earliest_end(rows, database_now, sent)
            acquired = self._adopt(untracked)
            lapsed = self.store.locks_count_lapsed(SLOT_PREFIX)
            plan = balance(self.slot_count, self.holder, self._kept_slots(), others, lapsed)
            acquired += self._acquire(plan.acquire)
            self._start_draining(self._fetched(plan.hand_back))
            released += self._release_drained()
            with self._state:
                held = len(self._leases)
            self.metrics.slots_held.set(held)
            result = LeaseRound(held, plan.target, len(others) + 1, acquired, renewed, lost, released)
        if renewed:
            self.on_renewed()
        if acquired:
            self.on_acquired(self.slots())
        if acquired or lost or released:
            logger.info(
                "slot leases: %d held (share %d of %d, %d replicas), %d acquired, %d lost, %d handed back",
                result.held, result.target, self.slot_count, result.replicas, acquired, lost, released,
            )
        return result

    def next_round_in(self) -> float | None:
        """Seconds until a round should look again because another replica's term may lapse by then (just
        after it ends, by the database clock); None when no other replica holds a slot."""
        if self._next_lapse is None:
            return None
        return max(0.0, self._next_lapse - self._monotonic()) + LAPSE_LOOK_AFTER

    def _earliest_end(self, rows: Sequence[LockRow], database_now: datetime, now: float) -> float | None:
        ends = [
            row.lock_until for row in rows
            if slot_of(row.name) is not None and row.locked_by and row.locked_by != self.holder
        ]
        if not ends:
            return None
        return now + max(0.0, (min(ends) - database_now).total_seconds())

    def release_all(self) -> int:
        """Give the slots (and the membership) back at once, for shutdown; returns how many slots.

        A slot with a call still running (given up at the end of the shutdown grace) is not released: its
        term expires on its own, so no other replica calls that hint while the call may still be alive.
        Later rounds do nothing. Database errors are logged, not raised: unreleased terms simply expire.
        """
        with self._round:
            self._stopped = True
            busy = set(self.in_use())
            with self._state:
                leases = sorted(
                    (lease for lease in self._leases.values() if lease.slot not in busy), key=lambda lease: lease.slot
                )
                self._leases.clear()
            self.metrics.slots_held.set(0)
            if busy:
                logger.warning(
                    "slots %s keep their leases until they expire: a call of theirs is still running",
                    sorted(busy),
                )
            member, self._member = self._member, None
            released = 0
            try:
                for lease in leases:
                    released += self.store.lock_release(lease.fence)
                if member is not None:
                    self.store.lock_release(member)
            except StoreError as error:
                logger.warning("slot leases not released, they expire on their own: %s", error)
            return released

    # -- the steps of a round -------------------------------------------------------------------------------

    def _kept_slots(self) -> list[int]:
        """The slots kept (not being handed back), those the engine has not fetched under their terms first, then
        newest terms first: a hand-back takes the last ones, fetched and held longest, and leaves a slot just taken
        over (its waiting work not fetched yet) where it is."""
        with self._state:
            kept = [(lease.slot, lease.fence, lease.acquired_at) for lease in self._leases.values()
                    if lease.draining_since is None]
        # The engine is asked outside the leases' lock (it asks the leases under its own).
        order = {slot: (self.fetched_under(slot, fence), -acquired_at, slot) for slot, fence, acquired_at in kept}
        return sorted(order, key=order.__getitem__)

    def _renew(self) -> tuple[int, int]:
        with self._state:
            fences = [lease.fence for lease in self._leases.values()]
        if not fences:
            return 0, 0
        sent = self._monotonic()
        # A row someone holds delays its own renewal only (skipped, or renewed in a transaction of its own).
        renewed, busy = self.store.lock_extend_each(fences, self.config.lease)
        kept, waiting = set(renewed), set(busy)
        lost: list[int] = []
        with self._state:
            for lease in list(self._leases.values()):
                if lease.fence in kept:
                    lease.safe_until = sent + self._safe_for
                elif lease.fence not in waiting:  # busy ones are tried again next round
                    lost.append(lease.slot)
                    del self._leases[lease.slot]
        if lost:
            self.metrics.lease_losses.inc(len(lost))
            logger.warning("lost the lease of slots %s (expired or taken over)", sorted(lost))
        return len(kept), len(lost)

    def _keep_membership(self) -> None:
        # A short term (two renewals): a replica that died stops counting as live before its slots expire,
        # so that the survivors take every slot once they do.
        if self._member is not None and self.store.lock_extend(self._member, self._member_term):
            return
        name = member_lock_name(self.holder)
        self._member = self.store.lock_try_acquire(name, self.holder, self._member_term)
        if self._member is not None:
            # (Re)joining: forget replicas that died long ago, so that their rows do not pile up.
            self.store.locks_delete_expired(MEMBER_PREFIX, self.config.lease)

    def _view(self, rows: Sequence[LockRow]) -> tuple[dict[str, int], list[LockRow]]:
        """The other live replicas with their slot counts, and slot rows of mine this leaser lost track of."""
        others: dict[str, int] = {}
        untracked: list[LockRow] = []
        with self._state:
            tracked = set(self._leases)
        for row in rows:
            if not row.locked_by:
                continue
            slot = slot_of(row.name)
            if slot is not None and slot < self.slot_count:
                if row.locked_by == self.holder:
                    if slot not in tracked:
                        untracked.append(row)
                else:
                    others[row.locked_by] = others.get(row.locked_by, 0) + 1
            elif row.name.startswith(MEMBER_PREFIX) and row.locked_by != self.holder:
                others.setdefault(row.locked_by, 0)
        return others, untracked

    def _adopt(self, rows: Sequence[LockRow]) -> int:
        """Take back terms this replica holds but does not know of (a commit whose reply was lost)."""
        if not rows:
            return 0
        sent = self._monotonic()
        fences = [Fence(row.name, self.holder, row.fence) for row in rows]
        adopted = self.store.lock_extend_many(fences, self.config.lease)
        self._track(adopted, sent)
        return len(adopted)

    def _acquire(self, wanted: int) -> int:
        if wanted <= 0:
            return 0
        with self._state:  # slots being handed back are the cheapest to take: they are still held
            for lease in self._leases.values():
                if wanted and lease.draining_since is not None:
                    lease.draining_since = None
                    wanted -= 1
            held = set(self._leases)
        if not wanted:
            return 0
        names = [slot_lock_name(slot) for slot in range(self.slot_count) if slot not in held]
        sent = self._monotonic()
        fences = self.store.lock_try_acquire_many(names, self.holder, self.config.lease, wanted)
        self._track(fences, sent)
        return len(fences)

    def _track(self, fences: Sequence[Fence], sent: float) -> None:
        with self._state:
            for fence in fences:
                slot = slot_of(fence.name)
                assert slot is not None
                self._leases[slot] = _Lease(slot, fence, sent + self._safe_for, acquired_at=sent)
        self.metrics.lease_acquisitions.inc(len(fences))

    def _fetched(self, slots: Sequence[int]) -> list[int]:
        """The slots the engine has fetched under their terms: a surplus slot not fetched yet (just taken over,
        its waiting work not called) goes back at a later round."""
        with self._state:
            terms = [(slot, self._leases[slot].fence) for slot in slots if slot in self._leases]
        return [slot for slot, fence in terms if self.fetched_under(slot, fence)]

    def _start_draining(self, slots: Sequence[int]) -> None:
        now = self._monotonic()
        with self._state:
            for slot in slots:
                lease = self._leases.get(slot)
                if lease is not None and lease.draining_since is None:
                    lease.draining_since = now

    def _release_drained(self) -> int:
        now = self._monotonic()
        drain = self.config.drain.total_seconds()
        busy = self.in_use()
        with self._state:
            due = [
                lease
                for lease in self._leases.values()
                if lease.draining_since is not None
                and now - lease.draining_since >= drain
                and lease.slot not in busy
            ]
            for lease in due:
                del self._leases[lease.slot]
        for lease in due:
            self.store.lock_release(lease.fence)
        return len(due)


# -- cluster-singleton jobs ---------------------------------------------------------------------------------


class SingletonLock:
    """A named lock that makes one replica at a time run a job (cleanup, the state census).

    Leadership is sticky: the holder extends its term at every run and keeps the job; the others try to
    acquire at every run and take over only once the holder's term has ended (it stopped, crashed or was cut
    off). The term must outlast the job's interval, so ``lease`` is at least twice it.
    """

    def __init__(self, store: Store, name: str, holder: str, lease: timedelta) -> None:
        self.store = store
        self.name = name
        self.holder = holder
        self.lease = lease
        self._fence: Fence | None = None

    def acquire(self) -> bool:
        """True when this replica holds the lock now (renewed, or newly acquired)."""
        if self._fence is not None and self.store.lock_extend(self._fence, self.lease):
            return True
        self._fence = self.store.lock_try_acquire(self.name, self.holder, self.lease)
        return self._fence is not None

    def release(self) -> None:
        """Let another replica take the job at once (on shutdown); errors are logged, the term then expires."""
        fence, self._fence = self._fence, None
        if fence is None:
            return
        try:
            self.store.lock_release(fence)
        except StoreError as error:
            logger.warning("lock %s not released, it expires on its own: %s", self.name, error)


def _first_line(error: BaseException) -> str:
    """An unexpected error as one line: its type and the first line of its text."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
