"""Eligibility and batching (DESIGN.md §3), pure.

The store decides eligibility in SQL; :func:`eligible` states the same rule in Python so that it can be
tested without a database and so that a test can check the SQL against it.

A hint's *batch* is the prefix of its eligible messages in id order that one lane takes; :func:`cut_batch`
ends it before a message a durable pause holds. A lane marks the calls it is about to make (so that a replica
taking the slot over knows what was in flight); :func:`run_length` decides how many calls one mark covers.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from datetime import datetime

from worker.config import Mode
from worker.message import Message, MessageState


def blocks_group(message: Message, mode: Mode, now: datetime) -> bool:
    """True when this message holds back the later messages of its hint."""
    if message.is_expired(now):
        return False
    if message.state is MessageState.PAUSED:
        return True
    if message.state is MessageState.DEAD:
        return mode is Mode.FAIL_FIRST
    return message.is_waiting(now)


def is_due(message: Message, now: datetime) -> bool:
    """True when the message itself may be attempted now (ignoring its earlier siblings)."""
    return message.state is MessageState.READY and not message.is_expired(now) and not message.is_waiting(now)


def eligible(
    messages: Iterable[Message], mode: Mode, now: datetime, horizon: int | None = None
) -> list[Message]:
    """The eligible messages among ``messages``, in id order: due, and no earlier sibling blocks them.

    With ``horizon``, messages with a larger id are held back (an earlier id may still commit) and so are the
    later messages of their hints.
    """
    blocked: set[str] = set()
    result = []
    for message in sorted(messages, key=lambda m: m.id):
        if message.hint in blocked:
            continue
        if horizon is not None and message.id > horizon and message.state is MessageState.READY:
            blocked.add(message.hint)
            continue
        if is_due(message, now):
            result.append(message)
        elif blocks_group(message, mode, now):
            blocked.add(message.hint)
    return result


def cut_batch(
    batch: Sequence[Message], paused_names: Collection[str]
) -> tuple[tuple[Message, ...], Message | None]:
    """A hint's batch up to (not including) its first message whose name is paused, and that message."""
    for index, message in enumerate(batch):
        if message.name in paused_names:
            return tuple(batch[:index]), message
    return tuple(batch), None


# A mark costs about one database commit; calls share one so that marking stays a small part of their time.
MARK_SHARE = 0.1  # the most of a run's time its mark should cost
RUN_SECONDS = 0.05  # a run is no longer than this (unless one call is): what a crash may count as lost beyond
MAX_RUN = 1000  # the calls in flight, per lane


def run_length(call_seconds: float | None, mark_seconds: float, remaining: int) -> int:
    """How many of a hint's next calls one mark covers.

    Enough calls that their mark costs at most ``MARK_SHARE`` of their time, but no more than fit in
    ``RUN_SECONDS`` (one, for correlators slower than that): if the process dies during a run, its calls not
    yet made are counted as lost too, and this bounds them. ``call_seconds`` is None before the first call of
    a correlator has been timed: then one.
    """
    if remaining <= 1 or call_seconds is None:
        return 1
    call = max(call_seconds, 1e-7)
    wanted = math.ceil(mark_seconds / (MARK_SHARE * call))
    longest = int(RUN_SECONDS / call)
    return max(1, min(wanted, longest, remaining, MAX_RUN))


def next_cursor(cursor: str, fresh: Sequence[str], budget: int, no_room: Collection[str]) -> str:
    """Where a slot's round robin over its hints goes on after a fetch that began after ``cursor`` and found the
    ``fresh`` candidate hints (in round-robin order), of which the full page had ``no_room`` for some.

    Not cut by the budget: every fresh hint was seen, so the next fetch starts over (one statement, no wrap
    round). Cut by it: after the last candidate (every hint gets its turn), or, when the page left some out, at
    the first of those (the hints it took are busy then, and the next fetch passes them over).
    """
    if len(fresh) < budget:
        return ""
    first = next((index for index, hint in enumerate(fresh) if hint in no_room), None)
    if first is None:
        return fresh[-1]
    return fresh[first - 1] if first > 0 else cursor
