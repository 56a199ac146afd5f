"""A destination's circuit and concurrency limit (worker.policy.targets), as functions of its answers."""

from __future__ import annotations

import random

import pytest

from worker.policy.targets import Answer, Circuit, TargetConfig, TargetState


def state(cap: int = 8, **config: float) -> TargetState:
    return TargetState(TargetConfig(**config), cap, rng=random.Random(7))  # type: ignore[arg-type]


def call(target: TargetState, answer: Answer, message: int, now: float = 0.0) -> str:
    """One admitted run making one call: admit, answer, release; the admission's verdict."""
    verdict = target.admit(now)
    if verdict in ("call", "probe"):
        target.answered(answer, message, now)
        target.release()
    return verdict


def test_one_message_failing_alone_never_opens_the_circuit_while_others_succeed() -> None:
    target = state(failures=3)
    for round_ in range(20):
        call(target, Answer.FAILURE, 1, round_)  # the same message, a 500 every time
        call(target, Answer.SUCCESS, 2 + round_, round_)
    assert target.circuit is Circuit.CLOSED
    for round_ in range(10):  # and alone: still one message
        call(target, Answer.FAILURE, 1, 100 + round_)
    assert target.circuit is Circuit.CLOSED


def test_distinct_messages_failing_in_a_row_open_it_and_a_success_starts_the_count_again() -> None:
    target = state(failures=3)
    call(target, Answer.FAILURE, 1)
    call(target, Answer.FAILURE, 2)
    call(target, Answer.SUCCESS, 3)
    call(target, Answer.FAILURE, 4)
    call(target, Answer.FAILURE, 5)
    assert target.circuit is Circuit.CLOSED
    call(target, Answer.FAILURE, 6)
    assert target.circuit is Circuit.OPEN


def test_an_unreachable_target_opens_it_whichever_messages_the_calls_were() -> None:
    target = state(failures=3)
    for _ in range(3):
        call(target, Answer.UNAVAILABLE, 1)  # one message, refused connections: the target's, not the message's
    assert target.circuit is Circuit.OPEN and target.admit(0.1) == "open"


def test_a_refusal_of_the_message_says_nothing_of_the_target() -> None:
    target = state(failures=2)
    for message in range(10):
        call(target, Answer.MESSAGE, message)
    assert target.circuit is Circuit.CLOSED


def test_one_probe_at_a_time_at_a_growing_jittered_capped_interval_then_closed_by_a_success() -> None:
    target = state(failures=1, probe_first=1.0, probe_max=4.0, jitter=0.2)
    transition = target.answered(Answer.UNAVAILABLE, 1, 0.0) if target.admit(0.0) == "call" else None
    target.release()
    assert transition is not None and transition.after is Circuit.OPEN
    intervals, now = [], 0.0
    for _ in range(5):
        probe_at = target.probe_at
        intervals.append(probe_at - now)
        assert target.admit(probe_at - 0.01) == "open"  # not before its time
        assert target.admit(probe_at) == "probe"
        assert target.admit(probe_at) == "open"  # one probe at a time
        now = probe_at
        failed = target.answered(Answer.UNAVAILABLE, 1, now)
        target.release()
        assert failed is not None and failed.after is Circuit.OPEN
    assert 0.8 <= intervals[0] <= 1.2
    assert 1.6 <= intervals[1] <= 2.4 and 3.2 <= intervals[2] <= 4.8 and 3.2 <= intervals[4] <= 4.8
    assert target.admit(target.probe_at) == "probe"
    closed = target.answered(Answer.SUCCESS, 2, target.probe_at)
    target.release()
    assert closed is not None and closed.after is Circuit.CLOSED
    assert target.admit(target.probe_at) == "call" and target.allowed() == 4  # the backlog flows, slow start


def test_a_probe_whose_run_made_no_call_lets_the_next_probe_go() -> None:
    target = state(failures=1)
    call(target, Answer.UNAVAILABLE, 1)
    assert target.admit(target.probe_at) == "probe"
    target.release()  # its mark was refused, say: no answer
    assert target.admit(target.probe_at) == "probe"


def test_a_slow_start_doubles_a_round_up_to_the_cap() -> None:
    target = state(cap=16)
    assert target.allowed() == 4  # not a burst of every lane at a target not heard from yet
    for message in range(4):
        call(target, Answer.SUCCESS, message)
    assert target.allowed() == 8
    for message in range(20):
        call(target, Answer.SUCCESS, 10 + message)
    assert target.allowed() == 16


def test_busy_answers_lower_the_limit_once_a_round_successes_raise_it_one_at_a_time() -> None:
    target = state(cap=16, decrease=0.5)
    for message in range(12):
        call(target, Answer.SUCCESS, message)
    assert target.allowed() == 16
    out = []
    for _ in range(8):  # eight calls out at once; the first to answer is busy
        assert target.admit(0.0) == "call"
        out.append(target.admissions)
    target.answered(Answer.BUSY, 100, 0.0, admitted=out[0])
    assert target.allowed() == 8
    for number in out[1:]:  # the calls in flight when it came: busy too, nothing new
        target.answered(Answer.BUSY, 100 + number, 0.0, admitted=number)
        target.release()
    target.release()
    assert target.allowed() == 8
    call(target, Answer.BUSY, 200)  # a call admitted since: lower again
    assert target.allowed() == 4 and target.circuit is Circuit.CLOSED
    for message in range(4):  # past the slow start: one more once `allowed` calls succeeded at it
        call(target, Answer.SUCCESS, 300 + message)
    assert target.allowed() == 5


def test_the_step_back_onto_a_refused_level_is_taken_slowly() -> None:
    """A target with a fixed capacity (4 here) refuses the fifth call: the limit comes back to 4 at the usual
    pace, and asks for 5 again only after CAUTION rounds at 4."""
    target = state(cap=32)
    in_service: list[int] = []
    busy = successes = 0
    for message in range(4000):
        if target.admit(0.0) != "call":
            target.answered(Answer.SUCCESS, in_service.pop(0), 0.0)  # the oldest call ends: room again
            target.release()
            successes += 1
            continue
        if len(in_service) >= 4:  # beyond the capacity: refused at once
            target.answered(Answer.BUSY, message, 0.0, admitted=target.admissions)
            target.release()
            busy += 1
        else:
            in_service.append(message)
    assert busy / (busy + successes) < 0.05, (busy, successes)
    assert 3 <= target.allowed() <= 5


def test_the_limit_bounds_the_calls_in_flight() -> None:
    target = state(cap=2)
    assert [target.admit(0.0) for _ in range(3)] == ["call", "call", "wait"]
    target.release()
    assert target.admit(0.0) == "call"


def test_a_target_that_only_pushes_back_for_longer_than_the_bound_opens() -> None:
    target = state(cap=4, failures=1000, busy_open_after=10.0)
    for second in range(10):
        call(target, Answer.BUSY, second, float(second))
    assert target.circuit is Circuit.CLOSED
    call(target, Answer.BUSY, 99, 10.0)
    assert target.circuit is Circuit.OPEN


def test_at_the_least_limit_a_busy_answer_counts_towards_opening() -> None:
    target = state(cap=1, failures=3, busy_open_after=1000.0)
    for message in range(3):
        call(target, Answer.BUSY, message)
    assert target.circuit is Circuit.OPEN


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"max_in_flight": 0}, "max_in_flight"),
        ({"failures": 0}, "breaker_failures"),
        ({"probe_first": 5.0, "probe_max": 1.0}, "breaker_probe"),
        ({"busy_open_after": 0.0}, "busy_open_after"),
    ],
)
def test_bad_settings_are_refused(config: dict[str, float], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        TargetConfig(**config)  # type: ignore[arg-type]
