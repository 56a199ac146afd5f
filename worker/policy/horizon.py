"""The commit-order horizon (DESIGN.md §3 "Order under concurrent producers"), pure.

An id is taken at INSERT but a row becomes visible at COMMIT, so two producers of one hint can commit out of
id order. Every producer transaction registers before it takes its first id (a trigger of the schema: a shared
advisory lock whose key carries the last id handed out before it, a *pin*); every id it takes is larger than
its pin. So when the worker has read the sequence's last value and then the pins still held, every id up to
the smallest of them belongs to a transaction that has finished: that is the *horizon*, and a message is
correlated only when its id is at or below it (the pins are read only when a common key every registered
producer also holds, the gate, is taken: schema revision 0012). A horizon stays valid forever (later
transactions take larger ids), so a reading may be reused; it is only ever conservative.

A producer transaction that stays open holds back the messages inserted after it, of every hint. That wait
is bounded: a pin seen for longer than ``max_wait`` is passed over (counted; the order of a hint whose earlier
message that transaction holds may then break, which is the documented trade-off).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Pin:
    """A running producer transaction: every id it takes is above ``after``; ``holder`` names it."""

    after: int
    holder: str


@dataclass(frozen=True, slots=True)
class Horizon:
    """The largest id that may be correlated, and what held it back."""

    id: int
    held: bool  # a running producer transaction holds back ids above it
    passed_over: int  # pins ignored this time because they outlived max_wait
    wait_left: float | None  # seconds until the oldest honoured pin is passed over


@dataclass(slots=True)
class PinClock:
    """When each pin was first seen (monotonic seconds), forgotten once the pin is gone."""

    first_seen: dict[Pin, float] = field(default_factory=dict)
    passed_over: set[Pin] = field(default_factory=set)


def horizon(last_id: int, pins: Sequence[Pin], clock: PinClock, now: float, max_wait: float) -> Horizon:
    """The horizon for this reading, updating ``clock`` (first sightings in, vanished pins out).

    ``passed_over`` counts pins passed over for the first time in this reading, so that each is counted once.
    """
    current = set(pins)
    for gone in set(clock.first_seen) - current:
        del clock.first_seen[gone]
    clock.passed_over &= current
    limit = last_id
    newly_passed = 0
    wait_left: float | None = None
    for pin in current:
        seen = clock.first_seen.setdefault(pin, now)
        if pin.after >= limit:
            continue
        waited = now - seen
        if waited > max_wait:
            if pin not in clock.passed_over:
                clock.passed_over.add(pin)
                newly_passed += 1
            continue
        limit = pin.after
        left = max_wait - waited
        wait_left = left if wait_left is None else min(wait_left, left)
    return Horizon(limit, limit < last_id, newly_passed, wait_left)


def overdue(clock: PinClock, now: float, max_wait: float) -> list[Pin]:
    """The pins seen for longer than ``max_wait``: a reading taken now passes them over (see :func:`horizon`),
    so a statement that works out the horizon itself is told to leave them out."""
    return [pin for pin, seen in clock.first_seen.items() if now - seen > max_wait]
