"""The console's JSON API, every route, against real PostgreSQL: happy paths, errors, auth, bulk actions by
filter with dry runs, and the audit rows they write (the app in-process through Starlette's test client)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text
from starlette.testclient import TestClient

from tests.integration.test_store import add, set_columns
from worker.admin.console import Console
from worker.admin.routes import console_routes
from worker.config import AdminSettings, Mode
from worker.db.store import NewMessage, Store
from worker.service.endpoint import Heartbeat, application, probe_routes
from worker.service.metrics import Metrics

WRITE = "write-token-for-tests-0001"
READ = "read-token-for-tests-00001"


def console_app(store: Store, **admin: Any) -> TestClient:
    settings = AdminSettings(token=WRITE, read_token=READ, token_name="ops", read_token_name="viewer", **admin)
    console = Console(store, Mode.FAIL_FIRST, settings, correlated=lambda: 0.0)
    routes = [*probe_routes(Metrics(), Heartbeat(), 60.0, lambda: None), *console_routes(console)]
    return TestClient(application(routes, console=True))


@pytest.fixture
def client(store: Store) -> Iterator[TestClient]:
    with console_app(store) as test_client:
        yield test_client


def auth(token: str = WRITE) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def get(client: TestClient, path: str, token: str = WRITE, **params: Any) -> Any:
    response = client.get(path, headers=auth(token), params=params)
    assert response.status_code == 200, response.text
    return response.json()


def post(client: TestClient, path: str, body: Any, token: str = WRITE, status: int = 200) -> Any:
    response = client.post(path, headers=auth(token), json=body)
    assert response.status_code == status, response.text
    return response.json()


def state_of(store: Store, row_id: int) -> str | None:
    listed = store.console_message(row_id)
    return None if listed is None else listed.message.state.value


def insert_many(store: Store, count: int, name: str = "bulk.name", state: str = "ready") -> None:
    with store.engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO correlation_message (message_name, correlation_hint, state) "
                "SELECT :name, 'h-' || n, :state FROM generate_series(1, :count) AS n"
            ),
            {"name": name, "state": state, "count": count},
        )


# -- auth --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong-token-wrong-token"}, {"Authorization": f"Basic {WRITE}"}],
    ids=["none", "wrong", "not-bearer"],
)
def test_a_missing_or_wrong_token_is_401_on_every_route(client: TestClient, headers: dict[str, str]) -> None:
    for method, path in [
        ("GET", "/api/v1/status"), ("GET", "/api/v1/messages"), ("GET", "/api/v1/messages/1"),
        ("POST", "/api/v1/messages/requeue"), ("GET", "/api/v1/hints/h"), ("GET", "/api/v1/pauses"),
        ("POST", "/api/v1/pauses"), ("DELETE", "/api/v1/pauses/1"), ("GET", "/api/v1/audit"),
    ]:
        response = client.request(method, path, headers=headers, json={"all": True})
        assert response.status_code == 401, (method, path)
        assert "Bearer" in response.headers["www-authenticate"]
        assert "missing or wrong token" in response.json()["error"]


def test_the_read_token_reads_but_gets_403_on_every_mutation(client: TestClient, store: Store) -> None:
    row_id = add(store, "h", state="dead")
    assert get(client, "/api/v1/status", READ)["messages"]["dead"] == 1
    assert get(client, f"/api/v1/messages/{row_id}", READ)["id"] == row_id
    assert post(client, "/api/v1/messages/requeue", {"ids": [row_id], "dry_run": True}, READ)["matching"] == 1
    for action in ("requeue", "pause", "resume", "delete"):
        refused = post(client, f"/api/v1/messages/{action}", {"ids": [row_id]}, READ, status=403)
        assert "'viewer' may only read" in refused["error"]
    post(client, "/api/v1/pauses", {"hint": "h"}, READ, status=403)
    assert client.delete("/api/v1/pauses/1", headers=auth(READ)).status_code == 403
    assert state_of(store, row_id) == "dead" and store.pauses_list() == []
    assert store.audit_page(before=None, limit=10)[0] == []


def test_without_a_token_the_console_answers_404_and_the_probes_stay_open() -> None:
    app = application(probe_routes(Metrics(), Heartbeat(), 60.0, lambda: None))
    with TestClient(app) as bare:
        assert bare.get("/api/v1/status", headers=auth()).status_code == 404
        assert bare.get("/ui/").status_code == 404
        assert bare.get("/healthz").text == "ok\n"
        assert bare.get("/readyz").text == "ready\n"
        assert bare.get("/metrics").status_code == 200


def test_an_unknown_route_is_a_json_404(client: TestClient) -> None:
    response = client.get("/api/v1/nothing", headers=auth())
    assert response.status_code == 404 and "no such route" in response.json()["error"]


# -- status --------------------------------------------------------------------------------------------------------


def test_status_counts_by_state_bounded_with_age_and_replicas(client: TestClient, store: Store) -> None:
    insert_many(store, 120, state="dead")
    add(store, "r")
    add(store, "w", next_attempt_at=3600)
    add(store, "p", state="paused")
    add(store, "x", expires_at=-10)
    with store.engine.begin() as connection:
        connection.execute(text(
            "UPDATE correlation_lock SET locked_by = 'replica-1', lock_until = now() + interval '30 seconds' "
            "WHERE name IN ('slot:0', 'slot:5')"
        ))
    with console_app(store, count_limit=100) as bounded:
        shown = get(bounded, "/api/v1/status")
    assert shown["messages"] == {"ready": 1, "waiting": 1, "paused": 1, "dead": "100+", "expired": 1}
    assert shown["count_limit"] == 100
    assert shown["oldest_eligible_age_seconds"] is not None
    [replica] = shown["replicas"]
    assert replica["replica"] == "replica-1" and replica["slots"] == [0, 5] and replica["slot_count"] == 2
    assert 0 < replica["lease_expires_in_seconds"] <= 30
    assert shown["throughput"]["inserted_per_second"] is None  # one sample so far
    assert get(client, "/api/v1/status")["messages"]["dead"] == 120


# -- messages ----------------------------------------------------------------------------------------------------


def test_messages_are_listed_in_keyset_pages_under_every_filter(client: TestClient, store: Store) -> None:
    ids = [add(store, f"h{n % 2}", name=f"n{n % 3}") for n in range(9)]
    set_columns(store, ids[4], state="dead", last_error="RuntimeError: Target Refused the call")
    set_columns(store, ids[7], state="paused")
    first = get(client, "/api/v1/messages", limit=4)
    assert [item["id"] for item in first["items"]] == ids[:4] and first["next"] == ids[3]
    assert "payload" not in first["items"][0]
    second = get(client, "/api/v1/messages", limit=4, after=first["next"])
    assert [item["id"] for item in second["items"]] == ids[4:8]
    last = get(client, "/api/v1/messages", limit=4, after=second["next"])
    assert [item["id"] for item in last["items"]] == ids[8:] and last["next"] is None

    by_name = get(client, "/api/v1/messages", name="n1", limit=2)  # merged per state, in id order
    assert [i["id"] for i in by_name["items"]] == [ids[1], ids[4]] and by_name["next"] == ids[4]
    assert [i["id"] for i in get(client, "/api/v1/messages", name="n1", after=ids[4])["items"]] == [ids[7]]
    assert [i["id"] for i in get(client, "/api/v1/messages", hint="h1")["items"]] == ids[1::2]
    assert [i["id"] for i in get(client, "/api/v1/messages", state="dead")["items"]] == [ids[4]]
    assert [i["id"] for i in get(client, "/api/v1/messages", hint="h1", state="paused")["items"]] == [ids[7]]
    assert [i["id"] for i in get(client, "/api/v1/messages", error="target refused")["items"]] == [ids[4]]
    assert get(client, "/api/v1/messages", created_from="2999-01-01T00:00:00Z")["items"] == []


def test_a_filter_without_an_index_scans_a_bounded_window_and_goes_on_after_it(store: Store) -> None:
    from worker.db.console import ConsoleFilter

    ids = [add(store, "h") for _ in range(7)]
    set_columns(store, ids[6], last_error="boom")
    page = store.console_messages(ConsoleFilter(error="boom"), after=0, limit=10, scan=3)
    assert page.rows == [] and page.next == ids[2]
    page = store.console_messages(ConsoleFilter(error="boom"), after=ids[5], limit=10, scan=3)
    assert [row.message.id for row in page.rows] == [ids[6]] and page.next is None


@pytest.mark.parametrize(
    ("params", "complaint"),
    [
        ({"state": "sleeping"}, "'state' must be one of"),
        ({"limit": "0"}, "'limit' must be a whole number from 1 to 500"),
        ({"limit": "501"}, "'limit'"),
        ({"after": "-3"}, "'after' must be a message id"),
        ({"colour": "red"}, "unknown parameter(s) colour"),
        ({"created_from": "yesterday"}, "'created_from' must be an ISO-8601 time"),
        ({"name": "x" * 256}, "'name' must be a non-empty text of at most 255 characters"),
    ],
)
def test_a_bad_filter_is_a_400_naming_it(client: TestClient, params: dict[str, str], complaint: str) -> None:
    response = client.get("/api/v1/messages", headers=auth(), params=params)
    assert response.status_code == 400 and complaint in response.json()["error"]


def test_one_message_by_id_or_message_id_with_payload_and_headers(client: TestClient, store: Store) -> None:
    row_id = add(store, "h", payload={"amount": 10})
    with store.engine.begin() as connection:
        connection.execute(text("UPDATE correlation_message SET message_id = 'shop-1' WHERE id = :id"), {"id": row_id})
    shown = get(client, f"/api/v1/messages/{row_id}")
    assert shown["payload"] == {"amount": 10} and shown["headers"] == {} and shown["due"] == "now"
    assert get(client, "/api/v1/messages/shop-1")["id"] == row_id
    missing = client.get("/api/v1/messages/999999", headers=auth())
    assert missing.status_code == 404 and "no message with id or message_id '999999'" in missing.json()["error"]


# -- bulk actions -------------------------------------------------------------------------------------------------


def test_requeue_by_filter_counts_in_a_dry_run_then_acts_in_chunks_and_is_audited(store: Store) -> None:
    insert_many(store, 25, name="invoice.sent", state="dead")
    insert_many(store, 3, name="other", state="dead")
    with console_app(store, chunk_size=4) as client:
        preview = post(client, "/api/v1/messages/requeue", {"name": "invoice.sent", "dry_run": True})
        assert preview == {"action": "requeue", "filter": {"name": "invoice.sent"}, "dry_run": True, "matching": 25}
        assert store.console_count(store_filter(name="invoice.sent", state="dead"), 1000).count == 25
        done = post(client, "/api/v1/messages/requeue", {"name": "invoice.sent"})
        assert done["affected"] == 25
        audit = get(client, "/api/v1/audit")["items"]
    assert store.console_count(store_filter(name="invoice.sent", state="dead"), 1000).count == 0
    assert store.console_count(store_filter(name="invoice.sent", state="ready"), 1000).count == 25
    assert store.console_count(store_filter(name="other", state="dead"), 1000).count == 3
    assert [(a["actor"], a["via"], a["action"], a["target"], a["affected"]) for a in audit] == [
        ("ops", "api", "messages.requeue", {"name": "invoice.sent"}, 25)
    ]


def store_filter(**fields: Any) -> Any:
    from worker.db.store import MessageFilter
    from worker.message import MessageState

    state = fields.pop("state", None)
    return MessageFilter(state=MessageState(state) if state else None, **fields)


def test_pause_resume_and_delete_by_ids_hint_state_and_all(client: TestClient, store: Store) -> None:
    a = [add(store, "a") for _ in range(3)]
    b = add(store, "b", state="dead")
    assert post(client, "/api/v1/messages/pause", {"hint": "a"})["affected"] == 3
    assert {state_of(store, i) for i in a} == {"paused"}
    assert post(client, "/api/v1/messages/resume", {"ids": [a[0], a[1]]})["affected"] == 2
    assert [state_of(store, i) for i in a] == ["ready", "ready", "paused"]
    assert post(client, "/api/v1/messages/delete", {"state": "dead", "dry_run": True})["matching"] == 1
    assert post(client, "/api/v1/messages/delete", {"state": "dead"})["affected"] == 1
    deleted = get(client, f"/api/v1/messages/{b}")  # kept as its delivery record, deleted by the token's name
    assert (deleted["state"], deleted["outcome"], deleted["payload"]) == ("delivered", "deleted", {})
    assert deleted["finished_by"] and deleted["finished_at"]
    assert post(client, "/api/v1/messages/delete", {"all": True})["affected"] == 3  # records are not live messages
    assert {state_of(store, i) for i in a} == {"delivered"}
    assert post(client, "/api/v1/messages/delete", {"state": "delivered"})["affected"] == 4  # records removed
    assert {state_of(store, i) for i in [*a, b]} == {None}
    actions = [entry["action"] for entry in get(client, "/api/v1/audit")["items"]]
    assert actions == [
        "messages.delete", "messages.delete", "messages.delete", "messages.resume", "messages.pause"
    ]


@pytest.mark.parametrize(
    ("path", "body", "status", "complaint"),
    [
        ("/api/v1/messages/requeue", {}, 400, "the filter is empty"),
        ("/api/v1/messages/requeue", {"ids": "1,2"}, 400, "'ids' must be a list"),
        ("/api/v1/messages/requeue", {"ids": [0]}, 400, "'ids' must be a message id"),
        ("/api/v1/messages/requeue", {"state": "gone"}, 400, "'state' must be one of"),
        ("/api/v1/messages/requeue", {"colour": "red"}, 400, "unknown filter field(s) colour"),
        ("/api/v1/messages/requeue", {"all": "yes"}, 400, "'all' must be true or false"),
        ("/api/v1/messages/requeue", {"all": True, "dry_run": 1}, 400, "'dry_run' must be true or false"),
        ("/api/v1/messages/requeue", [1, 2], 400, "must be a JSON object"),
        ("/api/v1/messages/explode", {"all": True}, 404, "no bulk action 'explode'"),
        # A state the action never acts on: refused, not "0 affected".
        ("/api/v1/messages/requeue", {"state": "ready"}, 400, "requeue acts on dead messages only"),
        ("/api/v1/messages/resume", {"hint": "a", "state": "dead"}, 400, "resume acts on paused messages only"),
        ("/api/v1/messages/pause", {"state": "paused", "dry_run": True}, 400, "pause acts on ready messages only"),
    ],
)
def test_a_bad_bulk_request_is_refused_with_its_reason(
    client: TestClient, path: str, body: Any, status: int, complaint: str
) -> None:
    assert complaint in post(client, path, body, status=status)["error"]


def test_a_body_that_is_not_json_is_a_400(client: TestClient) -> None:
    response = client.post("/api/v1/messages/delete", headers=auth(), content=b"{nope")
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]


# -- hints ----------------------------------------------------------------------------------------------------


def test_a_hint_lists_its_messages_in_order_with_the_blocker_marked_and_why(client: TestClient, store: Store) -> None:
    first = add(store, "order-7")
    dead = add(store, "order-7", state="dead", attempt=3, last_error="RuntimeError: engine said no\n  at line 3")
    later = add(store, "order-7")
    shown = get(client, "/api/v1/hints/order-7")
    assert shown["blocker"] == {"id": dead, "reason": "dead: RuntimeError: engine said no"}
    assert [(i["id"], i["blocker"]) for i in shown["items"]] == [(first, False), (dead, True), (later, False)]
    assert shown["items"][2]["note"] == f"held back behind message {dead}"
    assert shown["items"][0]["note"] == "eligible"

    set_columns(store, dead, state="ready", next_attempt_at=600)
    assert get(client, "/api/v1/hints/order-7")["blocker"]["reason"].startswith("waiting until ")
    post(client, "/api/v1/pauses", {"hint": "order-7", "reason": "call the shop"}, status=201)
    assert get(client, "/api/v1/hints/order-7")["blocker"] == {
        "id": None, "reason": "the hint is paused by ops (call the shop)"
    }
    paged = get(client, "/api/v1/hints/order-7", limit=2)
    assert len(paged["items"]) == 2 and paged["next"] == dead


def test_a_hint_with_slashes_is_found_and_an_unknown_hint_is_404(client: TestClient, store: Store) -> None:
    add(store, "tenant/a/order 1")
    assert get(client, "/api/v1/hints/tenant%2Fa%2Forder%201")["hint"] == "tenant/a/order 1"
    missing = client.get("/api/v1/hints/none-such", headers=auth())
    assert missing.status_code == 404 and "no message with correlation_hint 'none-such'" in missing.json()["error"]


# -- pauses -----------------------------------------------------------------------------------------------------


def test_pauses_are_created_listed_refused_twice_and_lifted(client: TestClient, store: Store) -> None:
    created = post(client, "/api/v1/pauses", {"name": "order.paid", "reason": "target down"}, status=201)
    assert created["scope"] == "name" and created["target"] == "order.paid" and created["created_by"] == "ops"
    everything = post(client, "/api/v1/pauses", {"all": True}, status=201)
    assert everything["target"] is None
    assert [p["id"] for p in get(client, "/api/v1/pauses")["items"]] == [created["id"], everything["id"]]
    conflict = post(client, "/api/v1/pauses", {"name": "order.paid"}, status=409)
    assert f"already paused (pause {created['id']} by ops)" in conflict["error"]

    lifted = client.delete(f"/api/v1/pauses/{created['id']}", headers=auth())
    assert lifted.status_code == 200 and lifted.json()["lifted"]["id"] == created["id"]
    assert [p.id for p in store.pauses_list()] == [everything["id"]]
    gone = client.delete(f"/api/v1/pauses/{created['id']}", headers=auth())
    assert gone.status_code == 404 and f"no durable pause {created['id']}" in gone.json()["error"]
    actions = [(a["action"], a["affected"]) for a in get(client, "/api/v1/audit")["items"]]
    assert actions == [("pauses.remove", 0), ("pauses.add", 1), ("pauses.add", 1)]


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        ({}, "exactly one of"),
        ({"name": "a", "hint": "b"}, "exactly one of"),
        ({"hint": ""}, "'hint' must be a non-empty text"),
        ({"all": True, "reason": "x" * 1001}, "'reason' must be a text of at most 1000"),
        ({"scope": "all"}, "unknown field(s) scope"),
    ],
)
def test_a_bad_pause_is_a_400(client: TestClient, body: dict[str, Any], complaint: str) -> None:
    assert complaint in post(client, "/api/v1/pauses", body, status=400)["error"]


# -- audit -------------------------------------------------------------------------------------------------------


def test_the_audit_is_paged_newest_first(client: TestClient, store: Store) -> None:
    for hint in ("a", "b", "c"):
        post(client, "/api/v1/pauses", {"hint": hint}, status=201)
    first = get(client, "/api/v1/audit", limit=2)
    assert [a["target"]["target"] for a in first["items"]] == ["c", "b"] and first["next"] is not None
    rest = get(client, "/api/v1/audit", limit=2, after=first["next"])
    assert [a["target"]["target"] for a in rest["items"]] == ["a"] and rest["next"] is None
    bad = client.get("/api/v1/audit", headers=auth(), params={"limit": "x"})
    assert bad.status_code == 400


# -- schedules ----------------------------------------------------------------------------------------------------

NIGHTLY = {"name": "nightly", "cron": "0 0 3 * * ?", "message_name": "report.due", "payload": {"kind": "daily"}}


def test_schedules_are_added_shown_listed_switched_fired_and_deleted(client: TestClient, store: Store) -> None:
    added = post(client, "/api/v1/schedules", NIGHTLY, status=201)
    assert added["name"] == "nightly" and added["enabled"] and len(added["next_fire_times"]) == 5
    listed = get(client, "/api/v1/schedules")
    assert listed["scheduler_enabled"] and [s["name"] for s in listed["schedules"]] == ["nightly"]
    assert get(client, "/api/v1/schedules/nightly")["payload"] == {"kind": "daily"}

    patched = client.patch("/api/v1/schedules/nightly", headers=auth(), json={"enabled": False})
    assert patched.status_code == 200 and patched.json()["enabled"] is False
    assert store.schedule_get("nightly").enabled is False  # type: ignore[union-attr]

    fired = post(client, "/api/v1/schedules/nightly/fire", {"action": "stop"})
    assert fired["action"] == "stop" and fired["action_type"] == "manual"
    message = store.console_message(fired["id"])
    assert message is not None and message.message.name == "report.due"
    assert message.message.headers["action"] == "stop" and message.message.headers["action_type"] == "manual"

    assert post(client, "/api/v1/scheduler/disable", {})["scheduler_enabled"] is False
    assert store.scheduler_is_enabled() is False and get(client, "/api/v1/status")["scheduler"] == {"enabled": False}
    assert post(client, "/api/v1/scheduler/enable", {})["scheduler_enabled"] is True

    deleted = client.delete("/api/v1/schedules/nightly", headers=auth())
    assert deleted.status_code == 200 and store.schedule_get("nightly") is None
    actions = [a["action"] for a in get(client, "/api/v1/audit")["items"]]
    assert actions == ["schedules.delete", "scheduler.enable", "scheduler.disable", "schedules.fire",
                       "schedules.disable", "schedules.add"]


def test_schedule_errors_have_their_status(client: TestClient) -> None:
    post(client, "/api/v1/schedules", NIGHTLY, status=201)
    assert "exists already" in post(client, "/api/v1/schedules", NIGHTLY, status=409)["error"]
    assert "invalid cron expression" in post(
        client, "/api/v1/schedules", {**NIGHTLY, "name": "bad", "cron": "* * *"}, status=400)["error"]
    assert "unknown field(s) colour" in post(
        client, "/api/v1/schedules", {**NIGHTLY, "name": "c", "colour": "red"}, status=400)["error"]
    assert client.get("/api/v1/schedules/missing", headers=auth()).status_code == 404
    assert client.delete("/api/v1/schedules/missing", headers=auth()).status_code == 404
    assert post(client, "/api/v1/schedules/missing/fire", {}, status=404)["error"].startswith("there is no schedule")
    assert "unknown action 'explode'" in post(client, "/api/v1/schedules/nightly/fire", {"action": "explode"},
                                             status=400)["error"]
    patched = client.patch("/api/v1/schedules/nightly", headers=auth(), json={"cron": "0 0 4 * * ?"})
    assert patched.status_code == 400 and "delete it and add it again" in patched.json()["error"]
    assert post(client, "/api/v1/scheduler/explode", {}, status=404)["error"].startswith("no scheduler action")
    post(client, "/api/v1/schedules/nightly/fire", {}, READ, status=403)
    post(client, "/api/v1/scheduler/disable", {}, READ, status=403)
    assert get(client, "/api/v1/schedules", READ)["schedules"][0]["name"] == "nightly"


@pytest.mark.parametrize("action", ["requeue", "pause", "resume", "delete"])
def test_a_get_on_a_bulk_action_is_405_naming_the_method(client: TestClient, action: str) -> None:
    response = client.get(f"/api/v1/messages/{action}", headers=auth())
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert f"POST /api/v1/messages/{action}" in response.json()["error"]


def test_a_message_id_with_slashes_is_reached_by_url(client: TestClient, store: Store) -> None:
    row_id = store.messages_insert(NewMessage("order.paid", "o-1", message_id="shop/orders/4711"))
    response = client.get("/api/v1/messages/shop/orders/4711", headers=auth())
    assert response.status_code == 200, response.text
    assert response.json()["id"] == row_id


@pytest.mark.parametrize(
    ("query", "complaint"),
    [
        ("name=a%00b", "holds a NUL character"),
        ("hint=%00", "holds a NUL character"),
        ("error=x%00", "holds a NUL character"),
        ("created_from=2026-02-01T00:00:00Z&created_to=2026-01-01T00:00:00Z", "'created_from' (2026-02-01"),
    ],
)
def test_a_listing_filter_that_can_match_nothing_is_refused_naming_it(
    client: TestClient, query: str, complaint: str
) -> None:
    response = client.get(f"/api/v1/messages?{query}", headers=auth())
    assert response.status_code == 400 and complaint in response.json()["error"], response.text


def test_the_listing_filters_on_every_state_the_status_reports(client: TestClient, store: Store) -> None:
    ready = add(store, "r")
    waiting = add(store, "w", next_attempt_at=3600)
    paused = add(store, "p", state="paused")
    expired = add(store, "x", expires_at=-10)
    dead = add(store, "d", state="dead")
    listed = {
        state: [item["id"] for item in get(client, "/api/v1/messages", state=state)["items"]]
        for state in ("ready", "waiting", "paused", "dead", "expired")
    }
    assert listed["waiting"] == [waiting] and listed["expired"] == [expired]
    assert listed["paused"] == [paused] and listed["dead"] == [dead]
    assert ready in listed["ready"]
    assert get(client, "/api/v1/messages", state="waiting", hint="r")["items"] == []


def test_a_message_with_an_id_forced_past_the_sequence_is_shown_as_the_blocker_and_why(
    client: TestClient, store: Store
) -> None:
    first = add(store, "order-9")
    with store.engine.begin() as connection:
        forced = connection.execute(text(
            "INSERT INTO correlation_message (id, message_name, correlation_hint, payload)"
            " OVERRIDING SYSTEM VALUE VALUES (1000000, 'order.paid', 'order-9', '{}') RETURNING id"
        )).scalar_one()
    shown = get(client, "/api/v1/hints/order-9")
    assert shown["blocker"]["id"] == forced
    assert "past the id sequence's last value" in shown["blocker"]["reason"], shown["blocker"]
    assert [(i["id"], i["blocker"]) for i in shown["items"]] == [(first, False), (forced, True)]
    assert shown["items"][0]["note"] == "eligible"


@pytest.mark.parametrize(
    "path",
    ["/api/v1/hints/a%00b", "/api/v1/schedules/night%00ly", "/api/v1/messages/shop%00-1", "/api/v1/audit?action=%00"],
)
def test_a_nul_anywhere_in_a_request_is_a_400_naming_it(client: TestClient, path: str) -> None:
    response = client.get(path, headers=auth())
    assert response.status_code == 400 and "NUL character" in response.json()["error"], response.text


def test_a_get_on_a_schedules_fire_is_405_naming_the_method(client: TestClient, store: Store) -> None:
    response = client.get("/api/v1/schedules/nightly/fire", headers=auth())
    assert response.status_code == 405 and response.headers["allow"] == "POST", response.text


def test_a_delivered_message_is_answered_from_its_record_by_id_and_message_id_and_listed_by_state(
    client: TestClient, store: Store
) -> None:
    from tests.integration.test_pages import deliver

    delivered = deliver(store, "order-7", "shop-7-paid", {"processInstanceKey": "2251799813685249"})
    live = add(store, "order-8")
    for reference in (str(delivered), "shop-7-paid"):
        shown = get(client, f"/api/v1/messages/{reference}")
        assert (shown["id"], shown["state"], shown["outcome"], shown["finished_by"]) == (
            delivered, "delivered", "correlated", "replica-a"
        )
        assert shown["result"] == {"processInstanceKey": "2251799813685249"} and shown["finished_at"]
    assert [item["id"] for item in get(client, "/api/v1/messages", state="delivered")["items"]] == [delivered]
    assert [item["id"] for item in get(client, "/api/v1/messages")["items"]] == [live]
    assert get(client, "/api/v1/status")["messages"] == {"ready": 1, "waiting": 0, "paused": 0, "dead": 0, "expired": 0}


def test_status_and_the_overview_show_each_replicas_targets_fresh_ones_only(client: TestClient, store: Store) -> None:
    from worker.db.targets import TargetRow

    store.targets_record("replica-1", [
        TargetRow("replica-1", "http://engine:8080/correlate", "open", "POST … answered 503", 1, 0),
        TargetRow("replica-1", "http://other:8080/hook", "closed", "", 32, 3),
    ])
    store.targets_record("replica-2", [TargetRow("replica-2", "http://engine:8080/correlate", "closed", "", 16, 1)])
    with store.engine.begin() as connection:  # a replica that died long ago: its rows are not shown
        connection.execute(text("INSERT INTO correlation_target VALUES ('gone', 'http://x/', 'open', 'old', 1, 0, "
                                "now() - interval '1 hour', now() - interval '1 hour')"))
    shown = get(client, "/api/v1/status")["targets"]
    assert [(t["target"], t["replica"], t["circuit"]) for t in shown] == [
        ("http://engine:8080/correlate", "replica-1", "open"),
        ("http://engine:8080/correlate", "replica-2", "closed"),
        ("http://other:8080/hook", "replica-1", "closed"),
    ]
    assert shown[0]["reason"] == "POST … answered 503" and shown[0]["concurrency_limit"] == 1
    since = shown[0]["since"]
    store.targets_record("replica-1", [TargetRow("replica-1", "http://engine:8080/correlate", "open", "again", 1, 0)])
    assert get(client, "/api/v1/status")["targets"][0]["since"] == since  # still open since then


HUGE = "z" * 30_000  # (a URL holds at most 64 kB in the client)


@pytest.mark.parametrize(
    ("method", "path", "params", "body"),
    [
        ("GET", f"/api/v1/messages/{HUGE}", None, None),
        ("GET", "/api/v1/messages/" + "9" * 30_000, None, None),
        ("GET", "/api/v1/messages", {"name": HUGE}, None),
        ("GET", "/api/v1/messages", {"after": "1" * 30_000}, None),
        ("GET", "/api/v1/messages", {"limit": "1" * 30_000}, None),
        ("GET", "/api/v1/messages", {"created_from": HUGE}, None),
        ("GET", "/api/v1/messages", {HUGE: "1"}, None),
        ("GET", f"/api/v1/hints/{HUGE}", None, None),
        ("GET", "/api/v1/audit", {"after": "1" * 30_000}, None),
        ("GET", f"/api/v1/schedules/{HUGE}", None, None),
        ("GET", "/api/v1/charts", {"window": HUGE}, None),
        ("POST", f"/api/v1/messages/{HUGE}", None, {"all": True}),
        ("POST", "/api/v1/messages/requeue", None, {"ids": [HUGE]}),
        ("POST", "/api/v1/messages/requeue", None, {"state": HUGE}),
        ("POST", "/api/v1/pauses", None, {"name": HUGE}),
        ("POST", f"/api/v1/scheduler/{HUGE}", None, None),
    ],
    ids=lambda value: str(value)[:30],
)
def test_an_argument_echoed_in_an_error_is_cut_to_a_readable_length(
    client: TestClient, method: str, path: str, params: dict[str, str] | None, body: Any
) -> None:
    response = client.request(method, path, params=params, json=body, headers=auth())
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    said = response.json()["error"]
    assert len(said) <= 1_200 and HUGE[:200] not in said and "9" * 200 not in said, said[:300]
