"""The console's chart series from samples (``correlation_sample``), pure: no database, no clock of its own.

Each replica's rows hold cumulative call counts; a rate is the difference between two consecutive rows of the
same replica over the time between them, put in the step the later row falls in (a replica's first row in the
window only sets its baseline). Cluster rates are the sum of the replicas' rates. The census (backlog by state,
oldest eligible age, the id sequence for arrivals) comes from the census holder's rows, whichever replica that
was: the last one in a step is the step's value. A step without data is ``None`` (a gap in the chart).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

WINDOWS = {"1h": timedelta(hours=1), "24h": timedelta(hours=24)}
POINTS = 240  # the most points a chart gets: the step is the window over this, at least one sample interval
STATES = ("ready", "waiting", "paused", "dead", "expired")
FAILED = ("retry", "buffered")  # failed attempts: recorded retries and those buffered inside the time-to-live


class Sample(Protocol):
    """What a sample row offers (see :class:`worker.db.samples.SampleRow`)."""

    @property
    def taken_at(self) -> datetime: ...
    @property
    def replica(self) -> str: ...
    @property
    def calls(self) -> Any: ...
    @property
    def inserted_total(self) -> int | None: ...
    @property
    def backlog(self) -> Any: ...
    @property
    def oldest_eligible_seconds(self) -> float | None: ...


def shown_span(samples: Sequence[Sample], now: datetime, window: timedelta, sample_interval: timedelta) -> timedelta:
    """How far back the charts reach: the window asked, or less while the cluster is younger than it (from its
    first sample, one sample interval before it included), so that four minutes of samples fill the chart rather
    than its last few points of an hour. Without samples, the window."""
    if not samples:
        return window
    first = min(row.taken_at for row in samples)
    return min(window, max(now - first, timedelta(0)) + sample_interval)


def step_for(window: timedelta, sample_interval: timedelta) -> timedelta:
    """The step of a window's points: the window over :data:`POINTS`, never finer than the samples."""
    seconds = max(window.total_seconds() / POINTS, sample_interval.total_seconds(), 1.0)
    return timedelta(seconds=math.ceil(seconds))


def series(
    samples: Sequence[Sample], now: datetime, window: timedelta, step: timedelta
) -> dict[str, Any]:
    """Aligned arrays for the charts: ``at`` (the end of each step, epoch seconds) and one array per series."""
    seconds = step.total_seconds()
    count = max(1, math.ceil(window.total_seconds() / seconds))
    # Steps end at whole multiples of the step (epoch time), the last one at or after now: every replica's
    # console, asked at nearly the same moment, draws the same points.
    last_end = math.ceil(now.timestamp() / seconds) * seconds
    start = datetime.fromtimestamp(last_end - seconds * count, tz=now.tzinfo or UTC)
    ends = [start + step * (index + 1) for index in range(count)]

    def bucket(moment: datetime) -> int | None:
        index = math.floor((moment - start).total_seconds() / seconds)
        return index if 0 <= index < count else None

    # Per replica and step: counts by kind and the seconds they were counted over.
    counted: dict[str, list[dict[str, float]]] = defaultdict(lambda: [defaultdict(float) for _ in range(count)])
    last: dict[str, Sample] = {}
    for row in sorted(samples, key=lambda r: (r.replica, r.taken_at)):
        previous = last.get(row.replica)
        last[row.replica] = row
        if previous is None:
            continue
        elapsed = (row.taken_at - previous.taken_at).total_seconds()
        index = bucket(row.taken_at)
        if elapsed <= 0 or index is None:
            continue
        cell = counted[row.replica][index]
        cell["seconds"] += elapsed
        for outcome, total in row.calls.items():
            cell[outcome] += max(0, total - previous.calls.get(outcome, 0))  # a counter never goes back
    per_replica: dict[str, list[float | None]] = {}
    correlated: list[float | None] = [None] * count
    failed: list[float | None] = [None] * count
    dead: list[float | None] = [None] * count
    for replica, cells in sorted(counted.items()):
        rates: list[float | None] = []
        for index, cell in enumerate(cells):
            span = cell.get("seconds", 0.0)
            if not span:
                rates.append(None)
                continue
            calls = sum(v for k, v in cell.items() if k != "seconds")
            rates.append(_round(calls / span))
            correlated[index] = (correlated[index] or 0.0) + cell.get("success", 0.0) / span
            failed[index] = (failed[index] or 0.0) + sum(cell.get(k, 0.0) for k in FAILED) / span * 60
            dead[index] = (dead[index] or 0.0) + cell.get("dead", 0.0) / span * 60
        per_replica[replica] = rates

    census = sorted((r for r in samples if r.backlog is not None), key=lambda r: r.taken_at)
    backlog: dict[str, list[int | None]] = {state: [None] * count for state in STATES}
    oldest: list[float | None] = [None] * count
    inserted_counts: list[list[float]] = [[0.0, 0.0] for _ in range(count)]
    for previous, row in zip([None, *census], census, strict=False):
        index = bucket(row.taken_at)
        if index is None:
            continue
        for state in STATES:
            backlog[state][index] = int(row.backlog.get(state, 0))
        oldest[index] = None if row.oldest_eligible_seconds is None else _round(row.oldest_eligible_seconds)
        if previous is not None and previous.inserted_total is not None and row.inserted_total is not None:
            elapsed = (row.taken_at - previous.taken_at).total_seconds()
            if elapsed > 0:
                inserted_counts[index][0] += max(0, row.inserted_total - previous.inserted_total)
                inserted_counts[index][1] += elapsed
    inserted = [_round(n / span) if span else None for n, span in inserted_counts]
    return {
        "at": [int(end.timestamp()) for end in ends],
        "step_seconds": seconds,
        "series": {
            "inserted_per_second": inserted,
            "correlated_per_second": [_maybe(v) for v in correlated],
            "retries_per_minute": [_maybe(v) for v in failed],
            "dead_per_minute": [_maybe(v) for v in dead],
            **{f"backlog_{state}": values for state, values in backlog.items()},
            "oldest_eligible_age_seconds": oldest,
        },
        "calls_per_replica": per_replica,
    }


def _round(value: float) -> float:
    return round(value, 3)


def _maybe(value: float | None) -> float | None:
    return None if value is None else _round(value)
