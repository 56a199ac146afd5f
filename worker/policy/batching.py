"""Eligibility and batch grouping (DESIGN.md §3), pure.

The store decides eligibility in SQL; :func:`eligible` states the same rule in Python so that it can be
tested without a database and so that a test can check the SQL against it.

A *poll cycle* reads every eligible message page by page (keyset paging on ``id``). Within one cycle a hint
whose batch stopped (a failure in ``fail_first`` mode, a buffered or rescheduled message in any mode) takes no
further messages, and a hint takes at most ``batch_size`` messages; :class:`CycleState` remembers both across
the pages of a cycle.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
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


def eligible(messages: Iterable[Message], mode: Mode, now: datetime) -> list[Message]:
    """The eligible messages among ``messages``, in id order: due, and no earlier sibling blocks them."""
    blocked: set[str] = set()
    result = []
    for message in sorted(messages, key=lambda m: m.id):
        if message.hint in blocked:
            continue
        if is_due(message, now):
            result.append(message)
        elif blocks_group(message, mode, now):
            blocked.add(message.hint)
    return result


@dataclass(frozen=True, slots=True)
class Batch:
    """The messages of one hint taken in one page, in id order."""

    hint: str
    messages: tuple[Message, ...]


@dataclass(slots=True)
class CycleState:
    """What one poll cycle has done so far, per hint."""

    taken: dict[str, int] = field(default_factory=dict)
    stopped: set[str] = field(default_factory=set)

    def stop(self, hint: str) -> None:
        """Take nothing more of this hint in this cycle."""
        self.stopped.add(hint)


def plan_batches(
    page: Sequence[Message],
    batch_size: int,
    cycle: CycleState,
    busy: frozenset[str] | set[str] = frozenset(),
) -> list[Batch]:
    """Group a page (in id order) into batches by hint, honouring the batch size and the cycle so far.

    Hints in ``busy`` (a call still running from an earlier, abandoned batch) are skipped and stopped.
    """
    groups: dict[str, list[Message]] = {}
    for message in page:
        hint = message.hint
        if hint in cycle.stopped:
            continue
        if hint in busy:
            cycle.stop(hint)
            continue
        taken = cycle.taken.get(hint, 0)
        if batch_size != -1 and taken >= batch_size:
            continue
        cycle.taken[hint] = taken + 1
        groups.setdefault(hint, []).append(message)
    return [Batch(hint, tuple(messages)) for hint, messages in groups.items()]
