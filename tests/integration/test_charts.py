"""Samples in the database (PostgreSQL and SQLite) and the charts' series from the API: what replicas write is
what every console reads; old samples leave in chunks."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import text
from starlette.testclient import TestClient

from tests.integration.test_api import WRITE, auth, console_app
from worker.db.base import StateCounts
from worker.db.store import Store


def census(ready: int, dead: int = 0) -> StateCounts:
    return StateCounts(ready, 1, 0, dead, 0, timedelta(seconds=12.5))


def backdate(store: Store, seconds: float) -> None:
    """Move every sample ``seconds`` into the past (as if written then)."""
    if store.dialect == "postgresql":
        moved = f"taken_at - interval '{seconds} seconds'"
    else:
        moved = f"strftime('%Y-%m-%d %H:%M:%f000', taken_at, '-{seconds} seconds')"
    with store.engine.begin() as connection:
        connection.execute(text(f"UPDATE correlation_sample SET taken_at = {moved}"))


def test_replicas_write_their_counts_and_the_holder_the_census(any_store: Store) -> None:
    any_store.samples_record("pod-a-1", {"success": 10, "retry": 2}, census(5, dead=1), inserted_total=40)
    any_store.samples_record("pod-b-2", {"success": 7, "dead": 1})
    _now, rows = any_store.samples_read(timedelta(minutes=5))
    by_replica = {row.replica: row for row in rows}
    a, b = by_replica["pod-a-1"], by_replica["pod-b-2"]
    assert a.calls == {"success": 10, "retry": 2, "buffered": 0, "rescheduled": 0, "dead": 0}
    assert a.backlog == {"ready": 5, "waiting": 1, "paused": 0, "dead": 1, "expired": 0}
    assert a.inserted_total == 40 and a.oldest_eligible_seconds == 12.5
    assert b.calls["dead"] == 1 and b.backlog is None and b.inserted_total is None


def test_old_samples_leave_in_chunks_and_recent_ones_stay(any_store: Store) -> None:
    for n in range(5):
        any_store.samples_record(f"old-{n}", {"success": n})
    backdate(any_store, 26 * 3600)
    any_store.samples_record("recent", {"success": 1})
    assert any_store.samples_prune(timedelta(hours=25), chunk=3) == 3
    assert any_store.samples_prune(timedelta(hours=25), chunk=3) == 2
    assert any_store.samples_prune(timedelta(hours=25), chunk=3) == 0
    _now, rows = any_store.samples_read(timedelta(days=3))
    assert [row.replica for row in rows] == ["recent"]


def test_the_api_draws_rates_backlog_and_calls_per_replica_from_the_samples(any_store: Store) -> None:
    any_store.samples_record("pod-a", {"success": 0}, census(3), inserted_total=100)
    any_store.samples_record("pod-b", {"success": 0})
    backdate(any_store, 20)
    any_store.samples_record("pod-a", {"success": 200, "retry": 5}, census(8), inserted_total=500)
    any_store.samples_record("pod-b", {"success": 100, "dead": 2})
    with console_app(any_store) as client:
        response = client.get("/api/v1/charts", headers=auth(WRITE), params={"window": "1h"})
        assert response.status_code == 200, response.text
        drawn = response.json()
        # A cluster 20 s old: the chart spans its samples, not the hour.
        assert drawn["window"] == "1h" and drawn["step_seconds"] == 15 and 2 <= len(drawn["at"]) <= 4
        series = drawn["series"]

        def latest(name: str) -> float:
            return [v for v in series[name] if v is not None][-1]

        assert latest("correlated_per_second") == pytest.approx(300 / 20, rel=0.05)
        assert latest("inserted_per_second") == pytest.approx(400 / 20, rel=0.05)
        assert latest("backlog_ready") == 8 and latest("oldest_eligible_age_seconds") == 12.5
        assert latest("retries_per_minute") == pytest.approx(5 / 20 * 60, rel=0.05)
        assert latest("dead_per_minute") == pytest.approx(2 / 20 * 60, rel=0.05)
        assert set(drawn["calls_per_replica"]) == {"pod-a", "pod-b"}
        day = client.get("/api/v1/charts", headers=auth(WRITE), params={"window": "24h"}).json()
        assert day["at"] == drawn["at"]  # younger than either window: the same span
        refused = client.get("/api/v1/charts", headers=auth(WRITE), params={"window": "7d"})
        assert refused.status_code == 400 and "1h, 24h" in refused.json()["error"]
        assert client.get("/api/v1/charts").status_code == 401


def test_two_consoles_read_the_same_picture(store: Store) -> None:
    store.samples_record("pod-a", {"success": 0}, census(1), inserted_total=0)
    backdate(store, 15)
    store.samples_record("pod-a", {"success": 30}, census(2), inserted_total=30)
    with console_app(store) as first, console_app(store) as second:
        one = first.get("/api/v1/charts", headers=auth(WRITE)).json()
        two = second.get("/api/v1/charts", headers=auth(WRITE)).json()
    if one["at"] != two["at"]:  # a step boundary passed between the two reads: the newer one is one step on
        assert one["at"][1:] == two["at"][:-1]
        return
    assert one["series"] == two["series"] and one["calls_per_replica"] == two["calls_per_replica"]


def test_a_read_of_the_charts_is_a_page_route_too(store: Store) -> None:
    client: TestClient
    with console_app(store) as client:
        assert client.get("/ui/overview/charts", follow_redirects=False).status_code == 303  # login first
