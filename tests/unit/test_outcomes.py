"""What a correlator call means for its row: TTL, backoff, max retries, permanent errors, reschedules."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from tests.unit.factories import T0, message, seconds
from worker.config import Policy
from worker.policy.outcomes import (
    RESULT_LIMIT,
    HandlerTimeout,
    Kind,
    PermanentError,
    Reschedule,
    Result,
    Retry,
    UnexpectedReturn,
    describe_exception,
    interpret_return,
    resolve,
    result_of,
)

POLL = seconds(6)
EXAMPLE = Policy(
    time_to_live=seconds(10), backoff_unit=seconds(60), backoff_base=2.0, backoff_cap=seconds(600), max_retries=5
)


def test_success_deletes_the_row() -> None:
    assert resolve(message(1), None, Policy(), T0, POLL).kind is Kind.DELETE


def test_worked_example_of_design_section_3() -> None:
    row = message(1)
    expected = [(6, Kind.BUFFER, 0, 12), (12, Kind.RETRY, 1, 72), (72, Kind.RETRY, 2, 192),
                (192, Kind.RETRY, 3, 432), (432, Kind.RETRY, 4, 912), (912, Kind.DEAD, 5, None)]
    for offset, kind, attempt, due in expected:
        d = resolve(row, RuntimeError("no process waiting"), EXAMPLE, T0 + seconds(offset), POLL)
        assert (d.kind, d.attempt) == (kind, attempt), offset
        assert d.next_attempt_at == (None if due is None else T0 + seconds(due)), offset
        if kind is Kind.BUFFER:
            assert d.last_error is None
        else:
            assert d.last_error is not None and "no process waiting" in d.last_error
        row = message(1, attempt=d.attempt, next_attempt_at=d.next_attempt_at, last_error=d.last_error)


def test_rows_own_time_to_live_overrides_the_policy() -> None:
    row = message(1, time_to_live=seconds(100))
    assert resolve(row, Retry(), EXAMPLE, T0 + seconds(50), POLL).kind is Kind.BUFFER
    assert resolve(message(1, time_to_live=seconds(0)), Retry(), EXAMPLE, T0 + seconds(1), POLL).kind is Kind.RETRY


def test_retry_after_delays_buffered_and_recorded_retries_up_to_the_backoff_cap() -> None:
    inside = resolve(message(1), Retry("busy", after=30), EXAMPLE, T0 + seconds(1), POLL)
    assert (inside.kind, inside.next_attempt_at) == (Kind.BUFFER, T0 + seconds(31))
    recorded = resolve(message(1), Retry("busy", after=seconds(200)), EXAMPLE, T0 + seconds(20), POLL)
    assert (recorded.kind, recorded.next_attempt_at) == (Kind.RETRY, T0 + seconds(220))
    capped = resolve(message(1), Retry("busy", after=10**9), EXAMPLE, T0 + seconds(20), POLL)
    assert capped.next_attempt_at == T0 + seconds(20 + 600)
    shorter = resolve(message(1), Retry("busy", after=1), EXAMPLE, T0 + seconds(20), POLL)
    assert shorter.next_attempt_at == T0 + seconds(20 + 60)  # the backoff when it is the longer
    ignored = resolve(message(1), Retry("busy", after="soon"), EXAMPLE, T0 + seconds(20), POLL)  # type: ignore[arg-type]
    assert ignored.next_attempt_at == T0 + seconds(20 + 60)


def test_max_retries_one_makes_the_first_recorded_failure_final() -> None:
    d = resolve(message(1), Retry(), Policy(max_retries=1), T0, POLL)
    assert (d.kind, d.attempt) == (Kind.DEAD, 1)


def test_max_retries_zero_is_refused_naming_one() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        Policy(max_retries=0)


def test_unlimited_retries_never_die() -> None:
    d = resolve(message(1, attempt=10**6), Retry(), Policy(max_retries=None), T0, POLL)
    assert d.kind is Kind.RETRY and d.attempt == 10**6 + 1


def test_permanent_error_is_dead_at_once_even_inside_the_time_to_live() -> None:
    d = resolve(message(1), PermanentError("unknown order"), EXAMPLE, T0, POLL)
    assert d.kind is Kind.DEAD and d.last_error is not None and "unknown order" in d.last_error


def test_reschedule_does_not_count_an_attempt() -> None:
    d = resolve(message(1, attempt=2, reschedule_count=4), Reschedule(delay=seconds(30)), EXAMPLE, T0, POLL)
    assert (d.kind, d.attempt, d.reschedule_count) == (Kind.RESCHEDULE, 2, 5)
    assert d.next_attempt_at == T0 + seconds(30)
    default = resolve(message(1), Reschedule(), Policy(reschedule_delay=seconds(7)), T0, POLL)
    assert default.next_attempt_at == T0 + seconds(7)


def test_timeout_counts_as_retry_or_reschedule_as_configured() -> None:
    assert resolve(message(1), HandlerTimeout(), Policy(), T0, POLL).kind is Kind.RETRY
    as_reschedule = Policy(timeout_outcome="reschedule")  # type: ignore[arg-type]
    assert resolve(message(1), HandlerTimeout(), as_reschedule, T0, POLL).kind is Kind.RESCHEDULE


def test_error_text_is_bounded_and_starts_with_the_exception() -> None:
    try:
        raise ValueError("x" * 10_000)
    except ValueError as error:
        text = describe_exception(error, limit=500)
    assert text.startswith("ValueError: xxx") and len(text) <= 500


def test_backoff_delays_of_a_policy_with_full_jitter_stay_in_range() -> None:
    policy = Policy(backoff_unit=seconds(3), backoff_cap=seconds(30), jitter="full")  # type: ignore[arg-type]
    for attempt, upper in [(0, 6), (1, 12), (2, 24), (3, 30)]:
        d = resolve(message(1, attempt=attempt), Retry(), policy, T0, POLL)
        assert d.next_attempt_at is not None
        assert seconds(3) <= d.next_attempt_at - T0 <= timedelta(seconds=upper)


def test_error_text_never_carries_a_nul_byte() -> None:
    assert "\x00" not in describe_exception(RuntimeError("binary \x00 body"))


# -- what a returned value means ---------------------------------------------------------------------------


def test_none_and_true_are_success() -> None:
    assert interpret_return(None) is None
    assert interpret_return(True) is None


def test_false_is_a_retry() -> None:
    outcome = interpret_return(False)
    assert isinstance(outcome, Retry) and "returned False" in str(outcome)


def test_a_returned_outcome_is_that_outcome() -> None:
    reschedule = Reschedule("not yet", timedelta(seconds=5))
    assert interpret_return(reschedule) is reschedule
    assert isinstance(interpret_return(PermanentError), PermanentError)
    assert isinstance(interpret_return(Retry), Retry)


@pytest.mark.parametrize("value", [(False, "not ready"), "ok", 0, 1, [], ["done"], object()])
def test_any_other_value_is_refused_as_dead_naming_its_type_never_taken_for_success(value: object) -> None:
    outcome = interpret_return(value)
    assert isinstance(outcome, UnexpectedReturn) and isinstance(outcome, PermanentError)
    assert type(value).__name__ in str(outcome)
    resolved = resolve(message(1), outcome, Policy(), T0, seconds(6))
    assert resolved.kind is Kind.DEAD and resolved.last_error is not None
    assert "return None (success), a dict or Result(answer)" in resolved.last_error


@pytest.mark.parametrize(
    ("returned", "text"),
    [
        ({"processInstanceKey": "2251799813685249"}, '{"processInstanceKey":"2251799813685249"}'),
        (Result(["a", 1]), '["a",1]'),
        (Result("accepted"), '"accepted"'),
        (Result({"at": T0}), '{"at":"' + str(T0) + '"}'),  # what JSON cannot hold is written as text
        (Result(None), None),
        (None, None),
        (True, None),
    ],
)
def test_a_dict_or_a_result_is_success_with_that_answer_as_bounded_json(returned: object, text: str | None) -> None:
    assert interpret_return(returned) is None
    assert result_of(returned) == text


@pytest.mark.parametrize(
    "answer",
    [
        "x" * 10_000,
        '"' * 5_000,  # every character escaped: the head is shortened until the whole fits
        "\x01" * 5_000,
        {"items": [{"sku": n, "name": "é" * 20} for n in range(300)]},
    ],
)
def test_an_answer_too_long_is_a_valid_document_within_the_limit(answer: object) -> None:
    long = result_of(Result(answer))
    assert long is not None and len(long) <= RESULT_LIMIT
    shown = json.loads(long)
    assert shown["truncated"] is True and shown["characters"] > RESULT_LIMIT
    assert json.dumps(answer, ensure_ascii=False, separators=(",", ":")).startswith(shown["head"])


def test_an_answer_json_columns_refuse_is_cleaned_or_named_never_a_failure() -> None:
    cyclic: dict[str, object] = {}
    cyclic["self"] = cyclic
    assert json.loads(result_of(cyclic) or "")["unreadable"].endswith("ValueError")
    assert json.loads(result_of({"ratio": float("nan")}) or "")["unreadable"].endswith("ValueError")
    assert result_of({1: "a", "b": 2}) is not None  # mixed key types: JSON text of their str()
    cleaned = json.loads(result_of({"nul\x00": "a\x00b", "lone": "\udc80"}) or "")
    assert cleaned == {"nul\ufffd": "a\ufffdb", "lone": "?"}  # jsonb takes neither NUL nor a lone surrogate


def test_a_coroutine_from_an_async_handler_is_refused_and_closed() -> None:
    async def handler() -> None:
        return None

    coroutine = handler()
    outcome = interpret_return(coroutine)
    assert isinstance(outcome, UnexpectedReturn) and "async" in str(outcome)
    assert coroutine.cr_frame is None  # closed: no "never awaited" warning


@pytest.mark.parametrize("max_retries", [1, 2, 5])
@pytest.mark.parametrize(
    "error", [RuntimeError("no process waiting"), Retry("engine busy"), HandlerTimeout("took 10 s")],
    ids=["exception", "retry", "timeout"],
)
def test_a_row_dead_after_failures_without_its_buffer_keeps_the_reason_in_its_last_error(
    max_retries: int, error: BaseException
) -> None:
    policy = Policy(time_to_live=seconds(3600), max_retries=max_retries)
    row = message(1, created_at=T0 + timedelta(days=365))
    kinds = []
    for n in range(1, max_retries + 1):
        d = resolve(row, error, policy, T0 + seconds(n), POLL)
        kinds.append(d.kind)
        assert d.last_error is not None and "not buffered by the time-to-live: created_at" in d.last_error, d
        assert str(error) in d.last_error
        row = message(1, created_at=row.created_at, attempt=d.attempt, last_error=d.last_error)
    assert kinds == [Kind.RETRY] * (max_retries - 1) + [Kind.DEAD]


def test_a_created_at_in_the_future_gets_no_buffer_its_failures_are_counted_and_shown() -> None:
    row = message(1, created_at=T0 + timedelta(days=365), time_to_live=seconds(3600))
    for n in range(1, 4):
        d = resolve(row, RuntimeError("no process waiting"), EXAMPLE, T0 + seconds(n), POLL)
        assert (d.kind, d.attempt) == (Kind.RETRY, n)
        assert d.last_error is not None and "no process waiting" in d.last_error and "created_at" in d.last_error
        row = message(1, created_at=row.created_at, time_to_live=row.time_to_live, attempt=d.attempt,
                      last_error=d.last_error)
    # Once the clock has passed created_at, the time-to-live buffers as for any row.
    later = resolve(row, Retry(), EXAMPLE, row.created_at + seconds(1), POLL)
    assert later.kind is Kind.BUFFER
