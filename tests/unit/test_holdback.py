"""Why a hint is held back: the blocker and its reason from the rows, the mode, the pauses and the clock."""

from __future__ import annotations

from tests.unit.factories import T0, message, seconds
from worker.config import Mode
from worker.message import MessageState
from worker.policy.holdback import Holdback, PauseInfo, hint_holdback, message_note

DEAD = MessageState.DEAD
PAUSED = MessageState.PAUSED


def test_nothing_holds_back_a_hint_of_ready_due_messages() -> None:
    rows = [(message(1), None), (message(2), None)]
    assert hint_holdback("h", rows, Mode.FAIL_FIRST, T0, []) is None


def test_the_first_dead_message_holds_the_hint_in_fail_first_mode_with_its_error() -> None:
    rows = [(message(3, state=DEAD, last_error="ValueError: bad\nTraceback ..."), None), (message(5, state=DEAD), None)]
    assert hint_holdback("h", rows, Mode.FAIL_FIRST, T0, []) == Holdback(3, "dead: ValueError: bad")
    assert hint_holdback("h", rows, Mode.ALL, T0, []) is None


def test_a_waiting_retry_holds_the_hint_until_its_time() -> None:
    rows = [(message(2, attempt=2, next_attempt_at=T0 + seconds(90)), None)]
    assert hint_holdback("h", rows, Mode.ALL, T0, []) == Holdback(
        2, "waiting until 2026-01-01T12:01:30+00:00 after 2 failed attempts"
    )
    assert hint_holdback("h", rows, Mode.ALL, T0 + seconds(90), []) is None


def test_a_paused_message_names_who_paused_its_name_and_why() -> None:
    pause = PauseInfo(7, "name", "order.paid", "target down", "ops")
    rows = [(message(4, state=PAUSED), 7), (message(6, state=DEAD), None)]
    assert hint_holdback("h", rows, Mode.FAIL_FIRST, T0, [pause]) == Holdback(
        4, "its name 'order.paid' is paused by ops (target down)"
    )
    by_hand = [(message(4, state=PAUSED), None)]
    assert hint_holdback("h", by_hand, Mode.FAIL_FIRST, T0, [])== Holdback(
        4, "paused by an operator (resume it to go on)"
    )


def test_a_ready_message_of_a_paused_name_holds_the_hint_before_the_engine_parks_it() -> None:
    pause = PauseInfo(1, "name", "order.cancelled", "", "cli:root")
    rows = [(message(9, name="order.cancelled"), None)]
    assert hint_holdback("h", rows, Mode.FAIL_FIRST, T0, [pause]) == Holdback(
        9, "its name 'order.cancelled' is paused by cli:root"
    )


def test_a_pause_of_everything_or_of_the_hint_holds_the_whole_hint() -> None:
    rows = [(message(1, state=DEAD), None)]
    everything = PauseInfo(1, "all", "", "maintenance", "ops")
    of_hint = PauseInfo(2, "hint", "h", "", "ops")
    other_hint = PauseInfo(3, "hint", "other", "", "ops")
    assert hint_holdback("h", rows, Mode.FAIL_FIRST, T0, [of_hint, everything]) == Holdback(
        None, "every hint is paused by ops (maintenance)"
    )
    assert hint_holdback("h", rows, Mode.FAIL_FIRST, T0, [of_hint]) == Holdback(None, "the hint is paused by ops")
    assert hint_holdback("h", rows, Mode.FAIL_FIRST, T0, [other_hint]) == Holdback(1, "dead: no error recorded")


def test_expired_messages_hold_nothing_back() -> None:
    rows = [(message(1, state=DEAD, expires_at=T0 - seconds(1)), None), (message(2, state=PAUSED), None)]
    holdback = hint_holdback("h", rows, Mode.FAIL_FIRST, T0, [])
    assert holdback is not None and holdback.message_id == 2
    assert message_note(rows[0][0], holdback, T0) == "expired: never correlated, cleanup removes it"


def test_each_message_s_standing_relative_to_the_blocker() -> None:
    holdback = Holdback(5, "dead: boom")
    assert message_note(message(3), holdback, T0) == "eligible"
    assert message_note(message(5, state=DEAD), holdback, T0) == "holds the hint back: dead: boom"
    assert message_note(message(8), holdback, T0) == "held back behind message 5"
    assert message_note(message(8), Holdback(None, "the hint is paused by ops"), T0) == (
        "held: the hint is paused by ops"
    )
    assert message_note(message(2, state=DEAD), None, T0) == "dead (mode all: it does not hold the hint back)"


def test_a_ready_message_past_the_id_sequence_holds_its_hint_back_and_says_why() -> None:
    rows = [(message(1), None), (message(50), None)]
    held = hint_holdback("h", rows, Mode.FAIL_FIRST, T0, [], id_limit=10)
    assert held is not None and held.message_id == 50 and "past the id sequence's last value 10" in held.reason
    assert hint_holdback("h", rows, Mode.FAIL_FIRST, T0, [], id_limit=50) is None
