"""Eligibility and grouping of a page into batches."""

from __future__ import annotations

from tests.unit.factories import T0, message, seconds
from worker.config import Mode
from worker.message import MessageState
from worker.policy.batching import CycleState, eligible, plan_batches


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


def test_page_is_grouped_by_hint_in_id_order() -> None:
    page = [message(1, "a"), message(2, "b"), message(3, "a"), message(4, "b"), message(5, "c")]
    batches = plan_batches(page, -1, CycleState())
    assert [(b.hint, ids(list(b.messages))) for b in batches] == [("a", [1, 3]), ("b", [2, 4]), ("c", [5])]


def test_batch_size_one_takes_only_the_head_of_each_group_per_cycle() -> None:
    cycle = CycleState()
    first = plan_batches([message(1, "a"), message(2, "a"), message(3, "b")], 1, cycle)
    assert [ids(list(b.messages)) for b in first] == [[1], [3]]
    assert plan_batches([message(4, "a"), message(5, "c")], 1, cycle)[0].hint == "c"


def test_batch_size_n_takes_up_to_n_per_cycle() -> None:
    cycle = CycleState()
    page = [message(i, "a") for i in range(1, 6)]
    assert ids(list(plan_batches(page, 3, cycle)[0].messages)) == [1, 2, 3]


def test_stopped_and_busy_hints_take_nothing_more_this_cycle() -> None:
    cycle = CycleState()
    cycle.stop("a")
    batches = plan_batches([message(1, "a"), message(2, "b"), message(3, "c")], -1, cycle, busy={"b"})
    assert [b.hint for b in batches] == ["c"]
    assert "b" in cycle.stopped
