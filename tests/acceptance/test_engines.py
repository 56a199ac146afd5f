"""Real ``correlation-worker run`` processes against the fake process engines of tests/engines.py.

Camunda 8 through the SDK's own environment variables: buffered until a subscription appears (404, never an
attempt), back-pressure retried after ``Retry-After``, a duplicate publication taken as success, a bad request
dead with the engine's detail, tenants passed through, one OAuth token per expiry period, results logged, refused
credentials counted; Camunda 7 likewise through the ``camunda7`` preset.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator

import pytest
from harness import Database, StartWorker, wait_until

from tests.engines import Answer, FakeCamunda7, FakeCamunda8, problem

FAST = {"poll__interval": "PT0.1S", "policy__reschedule_delay": "PT1S", "policy__backoff_unit": "PT0.1S"}


@pytest.fixture
def camunda8(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCamunda8]:
    fake = FakeCamunda8(auth="OAUTH", token_lifetime=3600, multi_tenancy=True)
    for name, value in fake.env().items():
        monkeypatch.setenv(name, value)  # the worker process inherits them, as from a Deployment's env
    yield fake
    fake.close()


def insert(db: Database, name: str, hint: str, payload: object, **columns: object) -> int:
    names = ", ".join(["message_name", "correlation_hint", "payload", *columns])
    marks = ", ".join(["%s", "%s", "%s::jsonb"] + ["%s::jsonb" if k == "headers" else "%s" for k in columns])
    values = [name, hint, json.dumps(payload)] + [json.dumps(v) if k == "headers" else v for k, v in columns.items()]
    rows = db.execute(f"INSERT INTO correlation_message ({names}) VALUES ({marks}) RETURNING id", values)
    return int(rows[0]["id"])


def test_camunda8_correlate_buffers_until_the_process_waits_then_correlates_in_order(
    pg_db: Database, start_worker: StartWorker, camunda8: FakeCamunda8
) -> None:
    process = start_worker(pg_db, correlators=json.dumps({"*": {"type": "camunda8", "mode": "correlate"}}), **FAST)
    first = insert(pg_db, "payment.received", "order-1", {"amount": 12.5})
    second = insert(pg_db, "payment.received", "order-1", {"amount": 7})

    def rescheduled() -> bool:
        row = pg_db.message(first)
        return row is not None and row["reschedule_count"] >= 1

    wait_until(rescheduled, what="the message rescheduled while no process waits", workers=[process])
    row = pg_db.message(first)
    assert row is not None and row["attempt"] == 0 and row["state"] == "ready"  # never counted as an attempt
    assert "no process instance waits" in process.log()
    instances = [camunda8.wait_for("payment.received", "order-1") for _ in range(2)]
    wait_until(lambda: pg_db.gone(first, second), what="both correlated", workers=[process])
    correlated = [r for r in camunda8.recorded(FakeCamunda8.CORRELATE) if r.body.get("variables", {}) != {}]
    successes = [r.body["variables"]["amount"] for r in correlated][-2:]
    assert successes == [12.5, 7]  # in order: the second never went before the first
    for instance in instances:
        record = pg_db.record(first if instance == instances[0] else second)  # the engine's answer, kept
        assert record is not None and f'"{instance}"' in json.dumps(record["result"])
    assert camunda8.token_requests == 1  # one token for every call of the run


def test_camunda8_publish_back_pressure_duplicates_tenants_and_bad_requests(
    pg_db: Database, start_worker: StartWorker, camunda8: FakeCamunda8
) -> None:
    camunda8.buffered[("<default>", "shop-7")] = "99"  # published before (an earlier delivery, say)
    camunda8.answer_next(Answer(503, problem(503, "RESOURCE_EXHAUSTED", "broker busy"), {"Retry-After": "1"}))
    process = start_worker(
        pg_db, correlators=json.dumps({"*": {"type": "camunda8", "mode": "publish", "time_to_live": "PT5M"}}), **FAST
    )
    pressed = insert(pg_db, "order.created", "o-1", {"n": 1})
    wait_until(lambda: pg_db.gone(pressed), what="the message published after the back-pressure", workers=[process])
    first, again = [r.at for r in camunda8.recorded(FakeCamunda8.PUBLISH)][:2]
    assert again - first >= 0.95  # not before the Retry-After second
    duplicate = insert(pg_db, "order.created", "o-2", {"n": 2}, message_id="shop-7")
    tenant = insert(pg_db, "order.created", "o-3", {"n": 3}, headers={"tenantId": "shop-eu"})
    wait_until(lambda: pg_db.gone(duplicate, tenant), what="duplicate and tenant published", workers=[process])
    record = pg_db.record(duplicate)
    assert record is not None and record["result"]["alreadyExists"] is True
    sent = {r.body["correlationKey"]: r.body for r in camunda8.recorded(FakeCamunda8.PUBLISH)}
    assert sent["o-3"]["tenantId"] == "shop-eu" and "tenantId" not in sent["o-2"]
    assert sent["o-1"]["timeToLive"] == 300_000
    camunda8.multi_tenancy = False
    refused = insert(pg_db, "order.created", "o-4", {"n": 4}, headers={"tenantId": "shop-us"})
    neighbour = insert(pg_db, "order.created", "o-5", {"n": 5})

    def dead() -> bool:
        row = pg_db.message(refused)
        return row is not None and row["state"] == "dead"

    wait_until(dead, what="the refused message dead", workers=[process])
    wait_until(lambda: pg_db.gone(neighbour), what="its neighbour published", workers=[process])
    row = pg_db.message(refused)
    assert row is not None and "INVALID_ARGUMENT" in row["last_error"]
    assert "multi-tenancy is disabled" in row["last_error"]


def test_camunda8_refused_credentials_are_retried_logged_and_counted_never_printed(
    pg_db: Database, start_worker: StartWorker, camunda8: FakeCamunda8, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CAMUNDA_CLIENT_SECRET", "not-the-s3cret")
    process = start_worker(pg_db, correlators=json.dumps({"*": {"type": "camunda8", "mode": "publish"}}),
                           metrics__port="0", **FAST)
    row_id = insert(pg_db, "order.created", "o-1", {})

    def counted() -> bool:
        base = re.search(r"serving /metrics\S* .*? on (\S+):(\d+)", process.log())
        if base is None:
            return False
        with urllib.request.urlopen(f"http://{base.group(1)}:{base.group(2)}/metrics", timeout=10) as response:
            text = response.read().decode()
        return 'correlation_target_auth_failures_total{message_name="order.created"}' in text

    wait_until(counted, what="the auth failure counted", workers=[process])
    row = pg_db.message(row_id)
    assert row is not None and row["state"] == "ready"  # kept for when the credentials are fixed
    assert "ERROR" in process.log() and "CAMUNDA_CLIENT_SECRET" in process.log()
    assert "not-the-s3cret" not in process.log()


def test_camunda7_not_yet_then_correlated_with_the_process_instance_recorded(
    pg_db: Database, start_worker: StartWorker
) -> None:
    engine = FakeCamunda7()
    try:
        route = {"type": "http", "preset": "camunda7", "url": engine.rest}
        process = start_worker(pg_db, correlators=json.dumps({"*": route}), **FAST)
        row_id = insert(pg_db, "invoice.paid", "inv-1", {"total": 10}, headers={"tenantId": "acme"})

        def rescheduled() -> bool:
            row = pg_db.message(row_id)
            return row is not None and row["reschedule_count"] >= 1

        wait_until(rescheduled, what="not yet while no process waits", workers=[process])
        row = pg_db.message(row_id)
        assert row is not None and row["attempt"] == 0
        instance = engine.wait_for("invoice.paid", "inv-1", tenant="acme")
        wait_until(lambda: pg_db.gone(row_id), what="correlated", workers=[process])
        record = pg_db.record(row_id)
        assert record is not None and record["result"] == {"processInstanceId": instance}
        assert engine.recorded(FakeCamunda7.MESSAGE)[-1].body["tenantId"] == "acme"
    finally:
        engine.close()
