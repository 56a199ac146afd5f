"""Replicas that disagree: a message is never delivered by a replica whose route for its name differs from another
live replica's; it waits, uncharged, until they agree. Cluster-wide settings run differently are shown.

Real ``correlation-worker run`` processes on one PostgreSQL database: a replica with routes and one started as a
replica without ``CORRELATION_CORRELATORS`` would be (``{"*": "log"}``), as in a rolling update that adds a route.
"""

from __future__ import annotations

import json

from harness import Database, StartReplicas, cli, wait_until

ROUTED = json.dumps({"order.step": "recorder:handle", "*": "log"})
DEFAULT = json.dumps({"*": "log"})  # what a replica started without CORRELATION_CORRELATORS routes
FAST = {
    "lease__duration": "PT3S",
    "lease__renew_interval": "PT0.5S",
    "lease__safety_margin": "PT0.5S",
    "lease__drain": "PT0.5S",
    "policy__handler_timeout": "PT1S",
    "poll__interval": "PT0.2S",
}
HINTS = 16


def _insert(database: Database, name: str, hints: int) -> list[int]:
    return [database.insert(name, f"{name}-{n}", {"seq": 0}) for n in range(hints)]


def test_a_name_the_replicas_route_differently_waits_uncharged_and_flows_to_its_route_once_they_agree(
    pg_db: Database, start_replicas: StartReplicas
) -> None:
    routed, default = (
        start_replicas(pg_db, 1, correlators=ROUTED, **FAST)[0],
        start_replicas(pg_db, 1, correlators=DEFAULT, delivery__retention="PT1S", **FAST)[0],
    )
    both = [routed, default]
    wait_until(lambda: "routes differently" in routed.log() and "routes differently" in default.log(),
               what="each replica told of the other's routes", workers=both)
    held = _insert(pg_db, "order.step", HINTS)  # their hints fall into slots of both replicas
    agreed = _insert(pg_db, "audit.note", 4)  # routed to log by both: delivered meanwhile
    wait_until(lambda: pg_db.gone(*agreed), what="the names both replicas route alike delivered", workers=both)
    wait_until(lambda: routed.metric("correlation_route_holds_total") > 0
               and default.metric("correlation_route_holds_total") > 0,
               what="both replicas holding back the name they route differently", workers=both)
    rows = [pg_db.message(row_id) for row_id in held]
    assert all(row is not None and row["state"] == "ready" and row["attempt"] == 0 for row in rows), rows
    assert pg_db.calls() == [], "no call while the replicas disagree"
    assert routed.metric("correlation_replicas_routing_differently") == 1
    assert routed.metric("correlation_cluster_settings_differing") == 1
    assert "CORRELATION_DELIVERY__RETENTION=PT1S" in routed.log()

    status = cli(pg_db, "status", "--output", "table")
    assert status.returncode == 0, status.stderr
    assert "routes differ between replicas on order.step" in status.stdout
    assert "CORRELATION_DELIVERY__RETENTION differs between replicas" in status.stdout
    shown = json.loads(cli(pg_db, "status", "--output", "json").stdout)["routing"]
    assert shown["agree"] is False and shown["disputed"] == ["order.step"]
    assert len({replica["routes"] for replica in shown["replicas"]}) == 2

    assert default.stop() == 0  # the replica with the other routes leaves (the rolling update ends)
    wait_until(lambda: pg_db.gone(*held), timeout=30, what="the held name delivered by its route", workers=[routed])
    calls = pg_db.calls()
    assert sorted(call.message_row_id for call in calls) == sorted(held), "each called once, by its route"
    assert {call.replica for call in calls} == {routed.name}
    assert all(call.attempt == 0 for call in calls), "no attempt charged for the wait"
    assert json.loads(cli(pg_db, "status", "--output", "json").stdout)["routing"]["agree"] is True
