"""Capped exponential backoff, with and without full jitter."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from worker.config import Jitter
from worker.policy.backoff import retry_delay

MINUTE = timedelta(minutes=1)


def delays(n: int, **policy: object) -> list[timedelta]:
    return [retry_delay(k, **policy) for k in range(1, n + 1)]  # type: ignore[arg-type]


def test_delay_doubles_from_the_unit_after_each_recorded_failure() -> None:
    got = delays(5, unit=MINUTE, base=2.0, cap=timedelta(minutes=180))
    assert got == [timedelta(minutes=m) for m in (1, 2, 4, 8, 16)]


def test_delay_is_capped() -> None:
    got = delays(6, unit=MINUTE, base=2.0, cap=timedelta(minutes=10))
    assert got == [timedelta(minutes=m) for m in (1, 2, 4, 8, 10, 10)]


def test_seed_000_three_retries_one_minute_apart_doubling_take_seven_minutes() -> None:
    total = sum(delays(3, unit=MINUTE, base=2.0, cap=timedelta(days=1)), timedelta(0))
    assert total == timedelta(minutes=7)


def test_worked_example_due_times_are_72_192_432_912() -> None:
    due, t = [], 12
    for delay in delays(4, unit=MINUTE, base=2.0, cap=timedelta(minutes=10)):
        t += int(delay.total_seconds())
        due.append(t)
    assert due == [72, 192, 432, 912]


@pytest.mark.parametrize("failures", [64, 1_000, 10**9])
def test_huge_attempt_counts_never_overflow(failures: int) -> None:
    cap = timedelta(minutes=180)
    assert retry_delay(failures, unit=MINUTE, base=2.0, cap=cap) == cap
    assert retry_delay(failures, unit=MINUTE, base=1e300, cap=cap) == cap
    assert retry_delay(failures, unit=MINUTE, base=2.0, cap=cap, jitter=Jitter.FULL) <= cap


def test_seed_001_full_jitter_ranges_are_3_6_then_3_12_then_3_24_then_3_30() -> None:
    rng = random.Random(7)
    unit, cap = timedelta(seconds=3), timedelta(seconds=30)
    for failures, upper in [(1, 6), (2, 12), (3, 24), (4, 30), (9, 30)]:
        draws = [
            retry_delay(failures, unit=unit, base=2.0, cap=cap, jitter=Jitter.FULL, rng=rng).total_seconds()
            for _ in range(2000)
        ]
        assert min(draws) >= 3 and max(draws) <= upper
        assert max(draws) > upper - 0.5 * (upper - 3) and min(draws) < 3 + 0.5 * (upper - 3)


def test_base_one_keeps_the_unit() -> None:
    assert delays(3, unit=MINUTE, base=1.0, cap=timedelta(hours=1)) == [MINUTE] * 3


def test_delay_before_any_failure_is_undefined() -> None:
    with pytest.raises(ValueError):
        retry_delay(0, unit=MINUTE, base=2.0, cap=MINUTE)
