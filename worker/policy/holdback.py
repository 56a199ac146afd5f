"""Why a hint is held back: which of its messages stops it, and the reason in an operator's words.

The engine's rule (DESIGN.md §3, docs/explanations/processing.md): a hint's batch ends at its first
unexpired message that is paused, waiting for a retry not yet due, or (in ``fail_first`` mode) dead; a message
whose name has a durable pause is paused when the engine meets it, so it stops the batch too. A durable pause
of the hint, or of everything, holds the whole hint. Expired messages never hold anything back: they are never
correlated and cleanup removes them.

Pure functions of the rows, the mode, the durable pauses and ``now``; the console shows their answers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from worker.config import Mode
from worker.message import Message, MessageState


@dataclass(frozen=True, slots=True)
class PauseInfo:
    """A durable pause as the explanations need it."""

    id: int
    scope: str  # 'all', 'name' or 'hint'
    target: str
    reason: str
    created_by: str


@dataclass(frozen=True, slots=True)
class Holdback:
    """What holds a hint back: a message (None when the whole hint is paused) and why."""

    message_id: int | None
    reason: str


def _by(pause: PauseInfo) -> str:
    return f"paused by {pause.created_by}" + (f" ({pause.reason})" if pause.reason else "")


def why_held(
    message: Message,
    pause_id: int | None,
    mode: Mode,
    now: datetime,
    pauses: Mapping[int, PauseInfo],
    paused_names: Mapping[str, PauseInfo],
    id_limit: int | None = None,
) -> str | None:
    """Why this message holds back its hint's later messages, or None if it does not.

    ``id_limit``: the id sequence's last value (PostgreSQL), past which the engine takes no message: an earlier
    id may still commit, and ids are correlated in order.
    """
    if message.is_expired(now):
        return None
    if message.state is MessageState.PAUSED:
        pause = pauses.get(pause_id) if pause_id is not None else None
        if pause is not None:
            return f"its name {message.name!r} is {_by(pause)}"
        return "paused by an operator (resume it to go on)"
    if message.state is MessageState.DEAD:
        return "dead: " + _first_line(message.last_error) if mode is Mode.FAIL_FIRST else None
    if message.is_waiting(now):
        assert message.next_attempt_at is not None
        after = f" after {message.attempt} failed attempts" if message.attempt else ""
        return f"waiting until {message.next_attempt_at.isoformat(timespec='seconds')}{after}"
    if message.state is MessageState.READY and id_limit is not None and message.id > id_limit:
        return (
            f"its id {message.id} is past the id sequence's last value {id_limit} (it was written with an explicit "
            "id, e.g. OVERRIDING SYSTEM VALUE): it waits until the sequence passes it; delete it and insert it "
            "again without an id to correlate it now"
        )
    name_pause = paused_names.get(message.name)
    if name_pause is not None:
        return f"its name {message.name!r} is {_by(name_pause)}"
    return None


def _first_line(error: str | None) -> str:
    if not error:
        return "no error recorded"
    line = error.strip().splitlines()[0] if error.strip() else ""
    return line[:200] or "no error recorded"


def hint_holdback(
    hint: str,
    candidates: Sequence[tuple[Message, int | None]],
    mode: Mode,
    now: datetime,
    pauses: Iterable[PauseInfo],
    id_limit: int | None = None,
) -> Holdback | None:
    """What holds the hint back now, or None when nothing does (``id_limit``: see :func:`why_held`).

    ``candidates`` are the hint's messages that may hold it back (any order; more rows are fine): a durable
    pause of everything or of the hint comes first, then the lowest id for which :func:`why_held` has a reason.
    """
    known = list(pauses)
    for pause in known:
        if pause.scope == "all":
            return Holdback(None, f"every hint is {_by(pause)}")
    for pause in known:
        if pause.scope == "hint" and pause.target == hint:
            return Holdback(None, f"the hint is {_by(pause)}")
    by_id = {pause.id: pause for pause in known}
    names = {pause.target: pause for pause in known if pause.scope == "name"}
    for message, pause_id in sorted(candidates, key=lambda pair: pair[0].id):
        reason = why_held(message, pause_id, mode, now, by_id, names, id_limit)
        if reason is not None:
            return Holdback(message.id, reason)
    return None


def message_note(message: Message, holdback: Holdback | None, now: datetime) -> str:
    """One message's standing in its hint, in a few words: expired, the blocker, held back behind it, waiting,
    or next in line."""
    if message.is_expired(now):
        return "expired: never correlated, cleanup removes it"
    if holdback is not None:
        if holdback.message_id is None:
            return "held: " + holdback.reason
        if message.id == holdback.message_id:
            return "holds the hint back: " + holdback.reason
        if message.id > holdback.message_id:
            return f"held back behind message {holdback.message_id}"
    if message.state is MessageState.DEAD:
        return "dead (mode all: it does not hold the hint back)"
    if message.state is MessageState.PAUSED:
        return "paused"
    if message.is_waiting(now):
        assert message.next_attempt_at is not None
        return f"waiting until {message.next_attempt_at.isoformat(timespec='seconds')}"
    return "eligible"
