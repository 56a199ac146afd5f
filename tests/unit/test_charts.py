"""The console's chart series from samples, pure: rates from cumulative counts per replica, the census from the
census holder's rows, steps aligned to the clock, gaps where nothing was sampled."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from worker.policy.charts import POINTS, series, shown_span, step_for

NOW = datetime(2026, 11, 25, 10, 0, 0, tzinfo=UTC)
STEP = timedelta(seconds=15)
HOUR = timedelta(hours=1)


@dataclass
class Row:
    taken_at: datetime
    replica: str
    calls: dict[str, int] = field(default_factory=dict)
    inserted_total: int | None = None
    backlog: dict[str, int] | None = None
    oldest_eligible_seconds: float | None = None


def at(seconds_ago: float) -> datetime:
    return NOW - timedelta(seconds=seconds_ago)


def last(values: list[Any]) -> Any:
    return [v for v in values if v is not None][-1]


def test_steps_cover_the_window_and_end_at_whole_multiples_of_the_step() -> None:
    drawn = series([], NOW + timedelta(seconds=7), HOUR, STEP)
    assert len(drawn["at"]) == 240 and drawn["step_seconds"] == 15
    assert drawn["at"][-1] % 15 == 0 and drawn["at"][-1] >= (NOW + timedelta(seconds=7)).timestamp()
    assert all(b - a == 15 for a, b in zip(drawn["at"], drawn["at"][1:], strict=False))
    assert all(v is None for v in drawn["series"]["correlated_per_second"])  # nothing sampled: gaps, not zeros


def test_two_replicas_at_nearly_the_same_moment_draw_the_same_points() -> None:
    rows = [Row(at(45), "a", {"success": 0}), Row(at(30), "a", {"success": 150}), Row(at(15), "a", {"success": 300})]
    first = series(rows, NOW + timedelta(seconds=1), HOUR, STEP)
    second = series(rows, NOW + timedelta(seconds=3), HOUR, STEP)
    assert first == second


def test_rates_are_count_differences_per_replica_summed_for_the_cluster() -> None:
    rows = [
        Row(at(44), "a", {"success": 100, "retry": 1}),
        Row(at(29), "a", {"success": 400, "retry": 4, "dead": 1}),  # 300 ok in 15 s: 20/s; 3 retries, 1 dead
        Row(at(40), "b", {"success": 0, "buffered": 0}),
        Row(at(25), "b", {"success": 150, "buffered": 2}),  # 10/s; 2 failed attempts buffered
    ]
    drawn = series(rows, NOW, HOUR, STEP)
    s = drawn["series"]
    assert last(s["correlated_per_second"]) == 30.0
    assert last(s["retries_per_minute"]) == pytest.approx((3 + 2) / 15 * 60)
    assert last(s["dead_per_minute"]) == 4.0
    assert last(drawn["calls_per_replica"]["a"]) == pytest.approx((300 + 3 + 1) / 15, abs=0.001)
    assert last(drawn["calls_per_replica"]["b"]) == pytest.approx(152 / 15, abs=0.001)


def test_a_replicas_first_row_only_sets_its_baseline_and_a_new_replica_starts_from_zero() -> None:
    rows = [Row(at(20), "a", {"success": 5000})]  # a long-running replica seen once: no rate yet
    assert all(v is None for v in series(rows, NOW, HOUR, STEP)["series"]["correlated_per_second"])


def test_the_census_comes_from_whichever_replica_held_it_last_in_each_step() -> None:
    backlog = {"ready": 7, "waiting": 1, "paused": 0, "dead": 2, "expired": 0}
    rows = [
        Row(at(50), "a", inserted_total=1000, backlog={**backlog, "ready": 9}, oldest_eligible_seconds=4.0),
        Row(at(35), "b", inserted_total=1300, backlog=backlog, oldest_eligible_seconds=2.5),  # the lock moved to b
        Row(at(34), "a"),  # a's own row no longer carries the census
    ]
    s = series(rows, NOW, HOUR, STEP)["series"]
    assert last(s["backlog_ready"]) == 7 and last(s["backlog_dead"]) == 2
    assert last(s["oldest_eligible_age_seconds"]) == 2.5
    assert last(s["inserted_per_second"]) == 20.0  # 300 inserted in 15 s, across the change of holder


def test_a_counter_never_goes_back_and_rows_outside_the_window_do_not_count() -> None:
    rows = [
        Row(at(7200), "a", {"success": 0}),
        Row(at(7185), "a", {"success": 999}),  # two hours ago: outside
        Row(at(40), "a", {"success": 50}),
        Row(at(25), "a", {"success": 20}),  # impossible for one replica id: clamped, never negative
    ]
    s = series(rows, NOW, HOUR, STEP)["series"]
    assert last(s["correlated_per_second"]) == 0.0


@pytest.mark.parametrize(
    ("window", "interval", "step"),
    [
        (HOUR, timedelta(seconds=15), 15),
        (HOUR, timedelta(seconds=1), 15),
        (HOUR, timedelta(minutes=1), 60),
        (timedelta(hours=24), timedelta(seconds=15), 360),
    ],
)
def test_the_step_is_the_window_over_the_points_never_finer_than_the_samples(
    window: timedelta, interval: timedelta, step: int
) -> None:
    assert step_for(window, interval) == timedelta(seconds=step)
    assert window / step_for(window, interval) <= POINTS


@pytest.mark.parametrize(
    ("first_sample_ago", "window", "spans"),
    [
        (timedelta(minutes=4), HOUR, timedelta(minutes=4, seconds=15)),  # a young cluster: from its first sample
        (timedelta(minutes=4), timedelta(hours=24), timedelta(minutes=4, seconds=15)),
        (timedelta(hours=3), HOUR, HOUR),  # older than the window: the window asked
        (timedelta(hours=3), timedelta(hours=24), timedelta(hours=3, seconds=15)),
        (timedelta(0), HOUR, STEP),
    ],
)
def test_charts_span_from_the_clusters_first_sample_or_the_window_asked(
    first_sample_ago: timedelta, window: timedelta, spans: timedelta
) -> None:
    rows = [Row(NOW - first_sample_ago, "a", {"success": 0}), Row(NOW, "a", {"success": 10})]
    shown = shown_span(rows, NOW, window, STEP)
    assert shown == spans
    drawn = series(rows, NOW, shown, step_for(shown, STEP))
    assert drawn["at"][0] <= max(NOW - first_sample_ago, NOW - window).timestamp() + drawn["step_seconds"]
    assert drawn["at"][-1] - drawn["at"][0] <= shown.total_seconds()


def test_charts_without_samples_span_the_window() -> None:
    assert shown_span([], NOW, HOUR, STEP) == HOUR
