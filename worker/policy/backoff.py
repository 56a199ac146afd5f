"""Capped exponential backoff (DESIGN.md §3), pure.

After the k-th recorded failure the next attempt is due after ``min(unit * base^(k-1), cap)``. With full
jitter the delay is drawn uniformly from ``[unit, min(unit * base^k, cap)]``. Exponents are compared in log
space, so that attempt counts in the millions never overflow a float.
"""

from __future__ import annotations

import math
import random
from datetime import timedelta

from worker.config import Jitter


def _capped_exponential(unit: timedelta, base: float, exponent: int, cap: timedelta) -> timedelta:
    """``min(unit * base^exponent, cap)`` without overflow."""
    unit_s, cap_s = unit.total_seconds(), cap.total_seconds()
    if unit_s <= 0:
        return timedelta(0)
    if cap_s <= unit_s:
        return cap
    if base <= 1.0 or exponent <= 0:
        return unit
    if exponent * math.log(base) >= math.log(cap_s / unit_s):
        return cap
    return timedelta(seconds=unit_s * base**exponent)


def retry_delay(
    failures: int,
    *,
    unit: timedelta,
    base: float,
    cap: timedelta,
    jitter: Jitter = Jitter.NONE,
    rng: random.Random | None = None,
) -> timedelta:
    """The delay before the next attempt after ``failures`` recorded failures (1, 2, ...)."""
    if failures < 1:
        raise ValueError("retry_delay is defined from the first recorded failure on")
    if jitter is Jitter.FULL:
        upper = _capped_exponential(unit, base, failures, cap)
        lower = min(unit, upper)
        draw = (rng or random).uniform(lower.total_seconds(), upper.total_seconds())
        return timedelta(seconds=draw)
    return _capped_exponential(unit, base, failures - 1, cap)
