"""The console's charts from real ``run`` processes: every replica writes its samples, the census holder the
backlog, and each replica's console serves the same series."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from harness import Database, StartWorker, wait_until
from test_service import endpoint, replica_of

TOKEN = "acceptance-charts-token-01"


def charts(base: str) -> dict[str, Any]:
    request = urllib.request.Request(base + "/api/v1/charts?window=1h", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def latest(values: list[Any]) -> Any:
    found = [v for v in values if v is not None]
    return found[-1] if found else None


def test_two_replicas_sample_their_calls_and_both_consoles_draw_them(
    pg_db: Database, start_worker: StartWorker
) -> None:
    settings = {"admin__token": TOKEN, "metrics__gauges_interval": "PT0.5S", "correlators": json.dumps({"*": "log"})}
    first, second = start_worker(pg_db, **settings), start_worker(pg_db, **settings)
    bases = [endpoint(first), endpoint(second)]
    replicas = {replica_of(first), replica_of(second)}
    wait_until(lambda: len({r["locked_by"] for r in pg_db.execute(
        "SELECT locked_by FROM correlation_lock WHERE name LIKE 'slot:%%'")}) == 2,
        what="both replicas holding slots", workers=[first, second])
    ids = [pg_db.insert("order.paid", f"order-{n}", {}) for n in range(300)]
    wait_until(lambda: pg_db.gone(*ids), what="every message correlated", workers=[first, second])

    def drawn() -> dict[str, Any] | None:
        shown = charts(bases[0])
        per_replica = {name: latest(values) for name, values in shown["calls_per_replica"].items()}
        if set(per_replica) != replicas or latest(shown["series"]["backlog_ready"]) != 0:
            return None
        return shown

    def counted() -> list[dict[str, Any]] | None:
        rows = pg_db.execute("SELECT replica, max(success) AS success FROM correlation_sample GROUP BY replica")
        return rows if sum(int(row["success"]) for row in rows) >= 300 else None

    # Each replica samples its counts every half second: the last calls are in its next sample.
    rows = wait_until(counted, what="every call in the samples", workers=[first, second])
    assert {row["replica"] for row in rows} == replicas
    assert sum(int(row["success"]) for row in rows) == 300  # every call counted once, by the replica that made it
    shown = wait_until(drawn, what="both replicas' calls and an empty backlog drawn", workers=[first, second])
    assert shown is not None
    assert any(v for v in shown["series"]["correlated_per_second"] if v)
    assert any(v for v in shown["series"]["inserted_per_second"] if v)
    other = charts(bases[1])
    assert other["calls_per_replica"].keys() == shown["calls_per_replica"].keys()
    assert other["step_seconds"] == shown["step_seconds"]
