"""What a correlator call comes to, and what that means for the row (DESIGN.md §3), pure.

A handler returns (success) or raises:

- any exception, or :class:`Retry`: a failed attempt, subject to the time-to-live, backoff and max retries;
- :class:`PermanentError`: dead at once, no retries;
- :class:`Reschedule`: try again after a delay without counting an attempt.

What a handler *returns* is read by :func:`interpret_return`: ``None`` and ``True`` are success, ``False`` a
retry, an outcome (an exception instance or class) that outcome, and anything else is refused: the message is
dead with a reason naming the returned type, because a message is deleted on success and a value the worker
cannot read must never be taken for one (``return (False, "not ready")`` would otherwise lose the message).

:func:`resolve` turns the outcome into a :class:`Disposition` for the store to write.
"""

from __future__ import annotations

import inspect
import random
import traceback
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from worker.config import Policy
from worker.message import Message
from worker.policy.backoff import retry_delay

ERROR_HEAD_LIMIT = 2000


class Retry(Exception):
    """The target could not take the message now; try again after the backoff."""


class PermanentError(Exception):
    """The message can never succeed; mark it dead at once."""


class Reschedule(Exception):
    """Not yet: try again after ``delay`` (the policy's ``reschedule_delay`` if None) without counting."""

    def __init__(self, reason: str = "rescheduled", delay: timedelta | None = None) -> None:
        super().__init__(reason)
        self.delay = delay


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

    @property
    def outcome(self) -> str:
        """The outcome label counted in metrics: success, buffered, retry, dead, rescheduled."""
        return {
            Kind.DELETE: "success",
            Kind.BUFFER: "buffered",
            Kind.RETRY: "retry",
            Kind.DEAD: "dead",
            Kind.RESCHEDULE: "rescheduled",
        }[self.kind]

    @property
    def stops_batch(self) -> bool:
        """True when later messages of the same hint must not be tried after this one in fail_first mode."""
        return self.kind is not Kind.DELETE


class UnexpectedReturn(PermanentError):
    """The correlator returned a value that is neither None, a bool nor an outcome."""


def interpret_return(value: object) -> BaseException | None:
    """What a correlator's return value means: None for success, else the outcome as an exception.

    ``None`` or ``True``: success. ``False``: a failed attempt (:class:`Retry`). An exception instance (or an
    exception class, returned by mistake instead of raised): that outcome. A coroutine (an ``async def``
    handler) never ran: dead, as is any other value, with a reason naming its type.
    """
    if value is None or value is True:
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
        f"the correlator returned a value of type {type(value).__name__}; return None (success) or False "
        "(retry), or raise Retry, Reschedule or PermanentError"
    )


def describe_exception(error: BaseException, limit: int = ERROR_HEAD_LIMIT) -> str:
    """A readable, bounded head of an exception: the message first, then the innermost frames."""
    summary = f"{type(error).__name__}: {error}"
    frames = traceback.format_exception(error)
    # A NUL byte (e.g. from a binary response body) cannot be stored in a PostgreSQL text column.
    text = (summary + "\n" + "".join(frames[-6:])).replace("\x00", "\\0")
    return text if len(text) <= limit else text[: limit - 12] + "\n…truncated"


def resolve(
    message: Message,
    error: BaseException | None,
    policy: Policy,
    now: datetime,
    poll_interval: timedelta,
    rng: random.Random | None = None,
) -> Disposition:
    """Decide what one correlator call means for its row; ``error`` is None on success."""
    if error is None:
        return Disposition(message.id, Kind.DELETE, message.attempt)
    if isinstance(error, HandlerTimeout) and policy.timeout_outcome == "reschedule":
        error = Reschedule(str(error))
    if isinstance(error, Reschedule):
        delay = error.delay if error.delay is not None else policy.reschedule_delay
        return Disposition(
            message.id,
            Kind.RESCHEDULE,
            message.attempt,
            next_attempt_at=now + delay,
            reschedule_count=message.reschedule_count + 1,
            last_error=message.last_error,
        )
    reason = describe_exception(error)
    if isinstance(error, PermanentError):
        return Disposition(
            message.id, Kind.DEAD, message.attempt + 1, last_error=reason,
            reschedule_count=message.reschedule_count,
        )
    time_to_live = message.time_to_live if message.time_to_live is not None else policy.time_to_live
    if time_to_live is not None and now < message.created_at + time_to_live:
        return Disposition(
            message.id,
            Kind.BUFFER,
            message.attempt,
            next_attempt_at=now + poll_interval,
            reschedule_count=message.reschedule_count,
            last_error=message.last_error,
        )
    failures = message.attempt + 1
    if policy.max_retries is not None and failures >= policy.max_retries:
        return Disposition(
            message.id, Kind.DEAD, failures, last_error=reason, reschedule_count=message.reschedule_count
        )
    delay = retry_delay(
        failures,
        unit=policy.backoff_unit,
        base=policy.backoff_base,
        cap=policy.backoff_cap,
        jitter=policy.jitter,
        rng=rng,
    )
    return Disposition(
        message.id,
        Kind.RETRY,
        failures,
        next_attempt_at=now + delay,
        reschedule_count=message.reschedule_count,
        last_error=reason,
    )
