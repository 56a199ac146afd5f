"""What a correlator call comes to, and what that means for the row (DESIGN.md §3), pure.

A handler returns (success) or raises:

- any exception, or :class:`Retry`: a failed attempt, subject to the time-to-live, backoff and max retries;
- :class:`PermanentError`: dead at once, no retries;
- :class:`Reschedule`: try again after a delay without counting an attempt.

What a handler *returns* is read by :func:`interpret_return`: ``None`` and ``True`` are success, a
:class:`Result` or a mapping success with that answer (:func:`result_of`), ``False`` a retry, an outcome (an
exception instance or class) that outcome, and anything else is refused: the message is dead with a reason
naming the returned type, because a message is deleted on success and a value the worker cannot read must
never be taken for one (``return (False, "not ready")`` would otherwise lose the message).

:func:`resolve` turns the outcome into a :class:`Disposition` for the store to write. It never raises and
always produces values the schema accepts, whatever the handler handed back: a delay of a wrong type or one
that overflows, an exception whose ``str()`` raises, text a database cannot store. One message's outcome can
therefore never keep the outcomes of others from being recorded.
"""

from __future__ import annotations

import inspect
import json
import math
import random
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from worker.config import Policy
from worker.message import COUNTER_MAX, NEXT_ATTEMPT_MAX, Message, slot_constructor
from worker.policy.backoff import retry_delay

ERROR_HEAD_LIMIT = 2000
# The longest delay the worker schedules; longer ones (or ones that overflow) are cut to it.
MAX_DELAY = timedelta(days=365 * 1000)


class Retry(Exception):
    """The target could not take the message now; try again after the backoff.

    ``after`` (a :class:`~datetime.timedelta` or seconds; e.g. an HTTP ``Retry-After``) is the earliest the
    target wants to be called again: the next attempt is due no sooner, capped by the policy's ``backoff_cap``.
    """

    def __init__(self, *args: object, after: timedelta | float | None = None) -> None:
        super().__init__(*args)
        self.after = after


class PermanentError(Exception):
    """The message can never succeed; mark it dead at once."""


class Reschedule(Exception):
    """Not yet: try again after ``delay`` without counting an attempt.

    ``delay`` is a :class:`~datetime.timedelta` or a number of seconds; None means the policy's
    ``reschedule_delay``.
    """

    def __init__(self, reason: str = "rescheduled", delay: timedelta | float | None = None) -> None:
        super().__init__(reason)
        self.delay = delay


class AuthProblem(Retry):
    """The target refused the worker's credentials (HTTP 401 or 403): a retry, logged as an error and counted
    in ``correlation_target_auth_failures_total`` so that an operator is told, while no message is lost."""


class Result:
    """Success with the target's answer, e.g. ``return Result({"processInstanceKey": key})``.

    The answer is logged on the message's success line; a correlator may also return a mapping (a dict) for
    the same effect. Any other value stays refused (see :func:`interpret_return`).
    """

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Result({self.value!r})"


class HandlerTimeout(Exception):
    """The correlator call exceeded the handler timeout."""


class Kind(StrEnum):
    """What the store does with the row."""

    DELETE = "delete"  # success
    BUFFER = "buffer"  # failure inside the time-to-live: not recorded, tried at the next poll
    RETRY = "retry"  # failure recorded, due again after the backoff
    DEAD = "dead"  # permanent error or max retries reached
    RESCHEDULE = "reschedule"  # not yet, without counting an attempt


@dataclass(frozen=True, slots=True)
class Disposition:
    """The new values of a row after one correlator call."""

    message_id: int
    kind: Kind
    attempt: int
    next_attempt_at: datetime | None = None
    reschedule_count: int = 0
    last_error: str | None = None
    result: str | None = None  # a success's answer from the target, bounded JSON text (see result_of)

    @property
    def outcome(self) -> str:
        """The outcome label counted in metrics: success, buffered, retry, dead, rescheduled."""
        return _OUTCOMES[self.kind]

    @property
    def stops_batch(self) -> bool:
        """True when later messages of the same hint must not be tried after this one in fail_first mode."""
        return self.kind is not Kind.DELETE

    @property
    def holds_back_hint(self) -> bool:
        """True when the message stays in the table due later (or dead), holding back its hint's later ones."""
        return self.kind in (Kind.BUFFER, Kind.RESCHEDULE)


_MAKE_DISPOSITION = slot_constructor(Disposition, 7)


def succeeded(message_id: int, attempt: int, result: str | None) -> Disposition:
    """A success's disposition (made for every message: without the dataclass's slower ``__init__``)."""
    return _MAKE_DISPOSITION(message_id, Kind.DELETE, attempt, None, 0, None, result)  # type: ignore[no-any-return]


_OUTCOMES = {
    Kind.DELETE: "success",
    Kind.BUFFER: "buffered",
    Kind.RETRY: "retry",
    Kind.DEAD: "dead",
    Kind.RESCHEDULE: "rescheduled",
}


def storable_text(text: str, limit: int = ERROR_HEAD_LIMIT) -> str:
    """Text any database column takes: no NUL bytes, no lone surrogates, at most ``limit`` characters."""
    cleaned = text.replace("\x00", "\\0").encode("utf-8", "backslashreplace").decode("utf-8")
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 12] + "\n…truncated"


def _safe_str(error: BaseException) -> str:
    try:
        return str(error)
    except BaseException as failure:  # a handler's exception whose __str__ itself fails
        return f"<str() of the exception raised {type(failure).__name__}>"


class UnexpectedReturn(PermanentError):
    """The correlator returned a value that is neither None, a bool nor an outcome."""


def interpret_return(value: object) -> BaseException | None:
    """What a correlator's return value means: None for success, else the outcome as an exception.

    ``None``, ``True``, a :class:`Result` or a mapping: success. ``False``: a failed attempt (:class:`Retry`).
    An exception instance (or an exception class, returned by mistake instead of raised): that outcome. A
    coroutine (an ``async def`` handler) never ran: dead, as is any other value, with a reason naming its type.
    """
    if value is None or value is True or isinstance(value, Result | Mapping):
        return None
    if value is False:
        return Retry("the correlator returned False")
    if isinstance(value, BaseException):
        return value
    if isinstance(value, type) and issubclass(value, Exception):
        try:
            return value(f"the correlator returned {value.__name__} instead of raising it")
        except Exception:  # an exception class that needs other arguments
            return UnexpectedReturn(f"the correlator returned the class {value.__name__}; raise an instance of it")
    if inspect.iscoroutine(value):
        value.close()  # never awaited: close it quietly, the reason below says what happened
        return UnexpectedReturn(
            "the correlator returned a coroutine: async handlers are not supported; use a plain function"
        )
    if inspect.isawaitable(value):
        return UnexpectedReturn(
            f"the correlator returned an awaitable ({type(value).__name__}): async handlers are not supported"
        )
    return UnexpectedReturn(
        f"the correlator returned a value of type {type(value).__name__}; return None (success), a dict or "
        "Result(answer) (success with an answer) or False (retry), or raise Retry, Reschedule or PermanentError"
    )


# The longest result text a success line (and the delivery record) carries.
RESULT_LIMIT = 2000


def result_of(value: object) -> str | None:
    """A successful call's answer as JSON text that any database's JSON column takes (None when it gave none);
    never raises. Past :data:`RESULT_LIMIT` characters it is ``{"truncated": true, "characters": N, "head": …}``
    (the head of its JSON text): still a valid document, never a cut one."""
    if value is None or value is True:  # most calls: no answer, and no ABC check for it
        return None
    if isinstance(value, Result):
        value = value.value
    elif not isinstance(value, Mapping):
        return None
    if value is None:
        return None
    try:
        text = _json(value)
        if "\\u0000" in text or not _encodable(text):  # NUL or a lone surrogate: refused by jsonb
            text = _json(_storable(value))
    except (TypeError, ValueError, RecursionError) as error:  # keys of mixed types, a cycle, NaN or infinity
        return json.dumps({"unreadable": f"the result could not be written as JSON: {type(error).__name__}"})
    if len(text) <= RESULT_LIMIT:
        return text
    head = RESULT_LIMIT // 2
    while True:  # escaping may lengthen the head: shorter until the whole fits
        bounded = _json({"truncated": True, "characters": len(text), "head": text[:head]})
        if len(bounded) <= RESULT_LIMIT:
            return bounded
        head //= 2


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, default=str, separators=(",", ":"), allow_nan=False)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _storable(value: object) -> object:
    """``value`` with every string (keys too) free of NUL characters and lone surrogates."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, Mapping):
        return {_storable(key) if isinstance(key, str) else key: _storable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_storable(item) for item in value]
    return value


def describe_exception(error: BaseException, limit: int = ERROR_HEAD_LIMIT) -> str:
    """A readable, bounded head of an exception: the message first, then the innermost frames (none for an
    exception that carries none: a target's answer, whose words are the whole reason)."""
    summary = f"{type(error).__name__}: {_safe_str(error)}"
    if error.__traceback__ is None and error.__cause__ is None and (
        error.__context__ is None or error.__suppress_context__
    ):
        return storable_text(summary, limit)
    try:
        frames = "".join(traceback.format_exception(error)[-6:])
    except BaseException:  # formatting calls str() again, and may fail the same way
        frames = "".join(traceback.format_tb(error.__traceback__)[-5:]) if error.__traceback__ else ""
    return storable_text(summary + "\n" + frames, limit)


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, for log lines (never raises)."""
    text = _safe_str(error)
    return text.splitlines()[0] if text else ""


def _delay(value: object, default: timedelta) -> tuple[timedelta, str | None]:
    """A reschedule delay as a bounded timedelta, and a note when the handler's value had to be replaced."""
    if value is None:
        return default, None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        return default, f"delay {type(value).__name__} is neither seconds nor a timedelta; used {default}"
    if math.isnan(seconds) or seconds < 0:
        return default, f"delay {value!r} is not a duration; used {default}"
    if seconds > MAX_DELAY.total_seconds():
        return MAX_DELAY, None
    return timedelta(seconds=seconds), None


# How far created_at may be ahead of ``now`` and still be trusted for the time-to-live buffer: the engine's ``now`` is
# the database clock estimated between readings, and a row inserted a moment ago may look a hair ahead of it.
CREATED_AT_SLACK = timedelta(seconds=1)


def _due(now: datetime, delay: timedelta) -> datetime:
    """``now + delay``, never past the latest time the schema stores (and never overflowing)."""
    try:
        due = now + delay
    except OverflowError:
        return NEXT_ATTEMPT_MAX
    return min(due, NEXT_ATTEMPT_MAX)


def resolve(
    message: Message,
    error: BaseException | None,
    policy: Policy,
    now: datetime,
    poll_interval: timedelta,
    rng: random.Random | None = None,
) -> Disposition:
    """Decide what one correlator call means for its row; ``error`` is None on success. Never raises."""
    if error is None:
        return Disposition(message.id, Kind.DELETE, message.attempt)
    reschedules = min(message.reschedule_count + 1, COUNTER_MAX)
    if isinstance(error, HandlerTimeout) and policy.timeout_outcome == "reschedule":
        error = Reschedule(_safe_str(error))
    if isinstance(error, Reschedule):
        delay, note = _delay(getattr(error, "delay", None), policy.reschedule_delay)
        last_error = message.last_error
        if note is not None:
            last_error = storable_text(f"Reschedule: {note}")
        return Disposition(
            message.id, Kind.RESCHEDULE, message.attempt, _due(now, delay), reschedules, last_error
        )
    reason = describe_exception(error)
    if isinstance(error, PermanentError):
        return Disposition(
            message.id, Kind.DEAD, min(message.attempt + 1, COUNTER_MAX), None, message.reschedule_count, reason
        )
    # The target's own Retry-After, never past the policy's cap (a bad value is ignored: the backoff rules).
    after, _note = _delay(getattr(error, "after", None), timedelta(0))
    after = min(after, policy.backoff_cap)
    time_to_live = message.time_to_live if message.time_to_live is not None else policy.time_to_live
    # The buffer window starts at created_at, which a producer may write: one in the future (a wrong clock, a typo)
    # would buffer every failure unrecorded for as long as it likes. Such a row gets no buffer: its failures are
    # counted and shown like any other's.
    future = message.created_at > now + CREATED_AT_SLACK
    if time_to_live is not None and not future and now < _due(message.created_at, time_to_live):
        return Disposition(
            message.id,
            Kind.BUFFER,
            message.attempt,
            _due(now, max(poll_interval, after)),
            message.reschedule_count,
            message.last_error,
        )
    # Why the buffer did not apply stays in last_error on every path from here, the last retry's dead letter too.
    if future and time_to_live is not None:
        reason = storable_text(
            f"not buffered by the time-to-live: created_at {message.created_at.isoformat()} is after the database "
            f"clock {now.isoformat()}; {reason}"
        )
    failures = min(message.attempt + 1, COUNTER_MAX)
    if policy.max_retries is not None and failures >= policy.max_retries:
        return Disposition(message.id, Kind.DEAD, failures, None, message.reschedule_count, reason)
    delay = retry_delay(
        failures,
        unit=policy.backoff_unit,
        base=policy.backoff_base,
        cap=policy.backoff_cap,
        jitter=policy.jitter,
        rng=rng,
    )
    return Disposition(
        message.id, Kind.RETRY, failures, _due(now, max(delay, after)), message.reschedule_count, reason
    )


@dataclass(frozen=True, slots=True)
class LostCallOutcome:
    """What a call that ended without a recorded outcome (its replica died) means for its row."""

    lost_calls: int
    crashed_calls: int
    dead: bool
    last_error: str | None


def settle_lost_call(
    lost_calls: int, crashed_calls: int, last_error: str | None, *, crashed: bool, alone: bool,
    poison_after: int,
) -> LostCallOutcome:
    """Count one lost call; a message is dead once ``poison_after`` of its calls ended in a crash (0: never).

    Every call marked in flight without a recorded outcome is lost: it may have been made (its message is
    delivered again, flagged as such). ``crashed``: it was under way when its replica died, as far as the marks
    tell: the adoption says so of a call marked *alone* only (a message delivered again is called with no other
    call running in its replica, marked just before it starts), since of a run marked beside others the marks
    cannot tell which call had returned with its outcome unwritten and which had not started. Only a crash during
    a call made alone is attributable to the message, so only one may make it dead; a message that merely ran
    beside a poison one is never blamed for it.
    """
    lost = min(lost_calls + 1, COUNTER_MAX)
    crashes = min(crashed_calls + 1, lost) if crashed else crashed_calls
    if crashed and alone and poison_after > 0 and crashes >= poison_after:
        reason = (
            f"poison message: its replica died during {crashes} calls of it without recording an outcome "
            f"(poison_after={poison_after}); the correlator may crash the process (exit, segfault, out of memory)"
        )
        return LostCallOutcome(lost, crashes, True, reason)
    return LostCallOutcome(lost, crashes, False, last_error)
