"""A target's state (DESIGN.md §5 "Targets have a state"), pure: what a destination's answers mean for the calls
that follow, as functions of the answers and ``now`` (monotonic seconds).

A *destination* is where a network route sends its calls (a URL, an engine's address). Each answer of a call is
one of:

- ``success``: the target took the call;
- ``message``: the target refused this message (a 4xx, a problem of its payload): it says nothing of the target;
- ``failure``: a failure that may be the target's or the message's (a timeout, a 500): the message is charged an
  attempt, and the destination counts it;
- ``unavailable``: the target is not there (connection refused or reset, 502, 503, 504): never the message's;
- ``busy``: the target asks to be called less (429, ``RESOURCE_EXHAUSTED``): never the message's.

::

                 N calls failed with no success between (distinct messages for failure),
                 or only refusals for longer than busy_open_after
       CLOSED ─────────────────────────────────────────────────────────────► OPEN
         ▲                                                                   │ probe_at passed
         │ the probe succeeded                                               ▼
         └─────────────────────────────────────────────────────────── HALF_OPEN (one call)
                                           the probe failed: OPEN again, the next probe twice as late (capped)

A message that always fails alone (a 500, a timeout) never opens the circuit: for ``failure`` only *distinct*
messages count, and any success starts the count again. ``unavailable`` counts every call: it is never the
message's. While the circuit is open no call goes out but the probe.

The *concurrency limit* paces a busy target, as TCP paces a connection: a slow start (the limit begins at
:data:`SLOW_START` calls in flight and grows by one a success, doubling a round, until the first busy answer or
the cap), then additive increase (one more call in flight for every ``limit`` successes) and multiplicative
decrease (``limit * decrease`` on a busy answer, once a round: a busy answer of a call admitted before the last
decrease says nothing new), between 1 and the most the route allows. The step back onto the level a target
refused (its *ceiling*) is taken :data:`CAUTION` times more slowly: a target with a fixed capacity is asked above
it once in a while, not every few rounds. At the least (1), a busy answer counts towards opening the circuit like
an unavailable one.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from enum import StrEnum

SLOW_START = 4  # calls in flight to a target at first, and again once its circuit closed
CAUTION = 8  # rounds at one below the ceiling before the limit steps onto it again


class Answer(StrEnum):
    """What one call's answer says of its destination."""

    SUCCESS = "success"
    MESSAGE = "message"
    FAILURE = "failure"
    UNAVAILABLE = "unavailable"
    BUSY = "busy"


class Circuit(StrEnum):
    """The circuit of a destination."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class TargetConfig:
    """How a destination reacts to its answers (a route's settings; see ``worker.config``)."""

    max_in_flight: int = 1_000_000  # the most calls in flight at once (the lanes are the other bound)
    failures: int = 5  # distinct messages failing in a row that open the circuit
    probe_first: float = 0.5  # seconds from opening to the first probe
    probe_max: float = 5.0  # the longest wait between two probes
    busy_open_after: float = 10.0  # seconds of nothing but refusals that open the circuit
    decrease: float = 0.75  # the limit is multiplied by this on a busy answer
    jitter: float = 0.2  # probes come at their interval ± this share of it

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        if self.failures < 1:
            raise ValueError("breaker_failures must be at least 1")
        if not (0 < self.probe_first <= self.probe_max):
            raise ValueError("breaker_probe must be positive and no longer than breaker_probe_max")
        if self.busy_open_after <= 0:
            raise ValueError("busy_open_after must be positive")
        if not (0 < self.decrease < 1):
            raise ValueError("the decrease must be between 0 and 1")
        if not (0 <= self.jitter < 1):
            raise ValueError("the jitter must be at least 0 and below 1")


@dataclass(frozen=True, slots=True)
class Transition:
    """The circuit changed: from, to, and why (for the one log line and the metrics)."""

    before: Circuit
    after: Circuit
    reason: str


@dataclass(slots=True)
class TargetState:
    """One destination's circuit and concurrency limit. Not thread-safe: one event loop owns it."""

    config: TargetConfig
    limit_cap: int  # the most in flight: the route's max_in_flight, or the lanes
    rng: random.Random = field(default_factory=random.Random)
    circuit: Circuit = Circuit.CLOSED
    limit: float = 0.0
    in_flight: int = 0
    probing: bool = False  # the half-open probe is out
    probe_at: float = 0.0  # when the next probe may go (open)
    probe_delay: float = 0.0  # the interval that set probe_at
    failed: set[int] = field(default_factory=set)  # distinct messages failed since the last success
    unanswered: int = 0  # calls the target did not take (not there, or busy at the least limit) since then
    refused_since: float | None = None  # the first refusal since the last success
    reason: str = ""  # why it is open
    successes: int = 0  # since the limit last grew
    slow_start: bool = True  # the limit doubles a round until the first busy answer
    admissions: int = 0  # calls admitted so far: the number of the latest (see :meth:`answered`)
    decreased_at: int = -1  # the admissions when the limit last went down
    ceiling: int = 0  # the calls in flight a busy answer came at last (0: none yet)

    def __post_init__(self) -> None:
        self.limit_cap = max(1, min(self.limit_cap, self.config.max_in_flight))
        self.limit = float(min(SLOW_START, self.limit_cap))
        self.probe_delay = self.config.probe_first

    # -- before a call ------------------------------------------------------------------------------------------

    def admit(self, now: float) -> str:
        """May a call go now? ``call`` (counted in flight), ``probe`` (the half-open probe, counted in flight),
        ``wait`` (the limit is reached: wait for a call to end) or ``open`` (not before :attr:`probe_at`). An
        admitted run's number is :attr:`admissions` right after (its answers give it back)."""
        if self.circuit is Circuit.CLOSED:
            if self.in_flight >= self.allowed():
                return "wait"
            self.in_flight += 1
            self.admissions += 1
            return "call"
        if self.circuit is Circuit.OPEN and now >= self.probe_at:
            self.circuit = Circuit.HALF_OPEN
        if self.circuit is Circuit.HALF_OPEN and not self.probing:
            self.probing = True
            self.in_flight += 1
            self.admissions += 1
            return "probe"
        return "open"

    def allowed(self) -> int:
        """Calls allowed in flight now."""
        return max(1, math.floor(self.limit))

    def release(self) -> None:
        """An admitted run ended (its calls answered, or none made: its mark refused, say). The probe is out
        until every admitted run ended or an answer came (:meth:`answered`)."""
        self.in_flight = max(0, self.in_flight - 1)
        if not self.in_flight:
            self.probing = False

    # -- after a call -------------------------------------------------------------------------------------------

    def answered(
        self, answer: Answer, message_id: int, now: float, reason: str = "", admitted: int | None = None
    ) -> Transition | None:
        """One answer of an admitted run's calls (a run may make several; ``admitted`` is its admission's number,
        None for one admitted just now); returns the circuit's transition, if any. While half-open, the first
        answer is the probe's."""
        was_probe, self.probing = self.probing, False
        if answer is Answer.SUCCESS:
            self.failed.clear()
            self.unanswered = 0
            self.refused_since = None
            self._grow()
            if self.circuit is not Circuit.CLOSED:
                return self._close(now)
            return None
        if answer is Answer.MESSAGE:  # says nothing of the target: a probe it was counts as an answer
            if was_probe:
                return self._close(now)
            return None
        at_least = False
        if answer is Answer.BUSY:
            at_least = self.limit <= 1.0
            self.slow_start = False
            if admitted is None or admitted > self.decreased_at:  # once a round: not for calls already out then
                self.ceiling = self.allowed()
                self.limit = max(1.0, self.limit * self.config.decrease)
                self.decreased_at = self.admissions
            self.successes = 0
        if answer in (Answer.BUSY, Answer.UNAVAILABLE) and self.refused_since is None:
            self.refused_since = now
        if answer is Answer.FAILURE:  # may be the message's: only distinct messages count
            self.failed.add(message_id)
        elif answer is Answer.UNAVAILABLE or at_least:  # the target's, whichever message it was
            self.unanswered += 1
        if was_probe:
            return self._open(now, reason or "the probe failed", again=True)
        if self.circuit is not Circuit.CLOSED:  # a call made before it opened: the probe decides
            return None
        if len(self.failed) + self.unanswered >= self.config.failures:
            return self._open(now, reason or f"{len(self.failed) + self.unanswered} calls failed in a row")
        if self.refused_since is not None and now - self.refused_since >= self.config.busy_open_after:
            return self._open(now, reason or "it refused every call")
        return None

    def _grow(self) -> None:
        """One more call in flight a success in slow start, else once ``limit`` calls succeeded at it."""
        if self.limit >= self.limit_cap:
            return
        if self.slow_start:
            self.limit = min(float(self.limit_cap), self.limit + 1.0)
            return
        self.successes += 1
        rounds = CAUTION if self.allowed() + 1 == self.ceiling else 1
        if self.successes >= self.allowed() * rounds:
            self.successes = 0
            self.limit = min(float(self.limit_cap), self.limit + 1.0)

    def _open(self, now: float, reason: str, *, again: bool = False) -> Transition:
        before = self.circuit
        if again:
            self.probe_delay = min(self.config.probe_max, self.probe_delay * 2)
        else:
            self.probe_delay = self.config.probe_first
        spread = self.probe_delay * self.config.jitter
        self.probe_at = now + self.probe_delay + self.rng.uniform(-spread, spread)
        self.circuit = Circuit.OPEN
        self.reason = reason
        return Transition(before, Circuit.OPEN, reason)

    def _close(self, now: float) -> Transition:
        before = self.circuit
        self.circuit = Circuit.CLOSED
        self.failed.clear()
        self.unanswered = 0
        self.refused_since = None
        self.probe_delay = self.config.probe_first
        # The held backlog flows in a slow start: doubling a round (a few calls' time to the lanes' pace), without
        # a burst at a target that has just come back.
        self.limit = float(min(SLOW_START, self.limit_cap))
        self.slow_start = True
        self.ceiling = 0
        self.reason = ""
        return Transition(before, Circuit.CLOSED, "a call succeeded")

    def retry_in(self, now: float) -> float:
        """Seconds until a call may be tried (0 when closed)."""
        return 0.0 if self.circuit is Circuit.CLOSED else max(0.0, self.probe_at - now)
