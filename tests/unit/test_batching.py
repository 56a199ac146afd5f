"""Eligibility and grouping of a page into batches."""

from __future__ import annotations

from tests.unit.factories import T0, message, seconds
from worker.config import Mode
from worker.message import MessageState
from worker.policy.batching import MAX_RUN, RUN_SECONDS, cut_batch, eligible, next_cursor, run_length


def ids(messages: list) -> list[int]:  # type: ignore[type-arg]
    return [m.id for m in messages]


def test_waiting_message_holds_back_its_group() -> None:
    rows = [message(1, "a", next_attempt_at=T0 + seconds(60), attempt=1), message(2, "a"), message(3, "b")]
    assert ids(eligible(rows, Mode.FAIL_FIRST, T0)) == [3]


def test_due_retry_is_eligible_with_its_followers() -> None:
    rows = [message(1, "a", next_attempt_at=T0 - seconds(1), attempt=1), message(2, "a")]
    assert ids(eligible(rows, Mode.FAIL_FIRST, T0)) == [1, 2]


def test_paused_message_holds_back_its_group_in_every_mode() -> None:
    rows = [message(1, "a", state=MessageState.PAUSED), message(2, "a")]
    assert eligible(rows, Mode.FAIL_FIRST, T0) == [] and eligible(rows, Mode.ALL, T0) == []


def test_dead_message_holds_back_its_group_only_in_fail_first_mode() -> None:
    rows = [message(1, "a", state=MessageState.DEAD), message(2, "a")]
    assert eligible(rows, Mode.FAIL_FIRST, T0) == []
    assert ids(eligible(rows, Mode.ALL, T0)) == [2]


def test_expired_messages_are_never_eligible_and_never_block() -> None:
    rows = [
        message(1, "a", expires_at=T0 - seconds(1), state=MessageState.PAUSED),
        message(2, "a", expires_at=T0),
        message(3, "a"),
    ]
    assert ids(eligible(rows, Mode.FAIL_FIRST, T0)) == [3]


def test_a_message_above_the_commit_horizon_holds_back_its_hint_but_not_others() -> None:
    rows = [message(1, "a"), message(5, "a"), message(6, "a"), message(7, "b"), message(2, "c")]
    assert ids(eligible(rows, Mode.FAIL_FIRST, T0, horizon=4)) == [1, 2]


def test_a_batch_ends_before_the_first_message_of_a_paused_name() -> None:
    batch = [message(1, "a"), message(2, "a", name="held"), message(3, "a")]
    taken, held = cut_batch(batch, {"held"})
    assert ids(list(taken)) == [1] and held is not None and held.id == 2
    assert cut_batch(batch, set()) == (tuple(batch), None)


def test_one_call_per_mark_before_the_first_is_timed_and_for_calls_longer_than_a_run() -> None:
    assert run_length(None, 0.002, 50) == 1  # not timed yet
    assert run_length(RUN_SECONDS, 0.002, 50) == 1
    assert run_length(1.0, 0.5, 50) == 1


def test_calls_share_a_mark_until_it_costs_a_tenth_of_their_time() -> None:
    assert run_length(0.010, 0.004, 50) == 4  # an I/O-bound correlator: 1 ms of mark per call
    assert run_length(0.010, 0.001, 50) == 1  # marks cheap enough already
    assert run_length(0.0001, 0.002, 500) == 200


def test_a_run_lasts_at_most_run_seconds_and_takes_what_the_hint_has() -> None:
    assert run_length(0.010, 0.050, 50) == 5  # a tenth would need 50 calls: capped at 50 ms of calls
    assert run_length(0.000001, 0.002, 50) == 50
    assert run_length(0.0, 0.002, 5000) == MAX_RUN
    assert run_length(0.0001, 0.002, 1) == 1


def test_the_round_robin_starts_over_when_the_budget_saw_every_fresh_hint() -> None:
    assert next_cursor("c", ("d", "e"), 4, set()) == ""
    assert next_cursor("c", ("d", "e"), 4, {"e"}) == ""


def test_cut_by_the_budget_the_round_robin_goes_on_after_the_last_candidate() -> None:
    assert next_cursor("c", ("d", "e", "a", "b"), 4, set()) == "b"  # wrapped round: after the last one read


def test_a_full_page_has_the_next_fetch_begin_at_the_first_hint_it_had_no_room_for() -> None:
    assert next_cursor("c", ("d", "e", "f", "g"), 4, {"f", "g"}) == "e"
    assert next_cursor("c", ("d", "e", "f", "g"), 4, {"g", "e"}) == "d"  # the first in round-robin order
    assert next_cursor("c", ("d", "e", "f", "g"), 4, {"d"}) == "c"  # the first candidate: where it began
