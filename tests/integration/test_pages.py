"""The pages' protections without a browser: login, cookie flags, CSRF on every form, read-only sessions, no
open redirects, security headers (the browser suite covers what an operator does)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.integration.test_api import READ, WRITE, console_app
from tests.integration.test_store import add
from worker.config import DatabaseSettings
from worker.db.calls import SlotWrite
from worker.db.store import NewMessage, Store, build_engine
from worker.policy.outcomes import Disposition, Kind


@pytest.fixture
def client(store: Store) -> Iterator[TestClient]:
    with console_app(store) as test_client:
        yield test_client


def log_in(client: TestClient, token: str = WRITE, target: str = "/ui/") -> str:
    """Log in through the form; returns a CSRF token of the session's forms."""
    form = client.get("/ui/login")
    nonce = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert nonce is not None
    response = client.post("/ui/login", data={"csrf": nonce.group(1), "token": token, "next": target},
                           follow_redirects=False)
    assert response.status_code == 303, response.text
    page = client.get("/ui/pauses")
    found = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert found is not None
    return found.group(1)


def test_a_login_sets_an_httponly_samesite_strict_session_cookie(client: TestClient) -> None:
    assert client.get("/ui/", follow_redirects=False).headers["location"] == "/ui/login?next=%2Fui%2F"
    form = client.get("/ui/login")
    nonce = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert nonce is not None
    response = client.post("/ui/login", data={"csrf": nonce.group(1), "token": WRITE, "next": "/ui/dead"},
                           follow_redirects=False)
    assert response.headers["location"] == "/ui/dead"
    cookie = next(value for key, value in response.headers.multi_items()
                  if key == "set-cookie" and value.startswith("cw_session="))
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
    assert WRITE not in cookie


def test_the_login_form_needs_its_csrf_token_and_the_right_token(client: TestClient) -> None:
    client.get("/ui/login")
    refused = client.post("/ui/login", data={"csrf": "forged", "token": WRITE})
    assert refused.status_code == 403 and "expired" in refused.text
    form = client.get("/ui/login")
    nonce = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert nonce is not None
    wrong = client.post("/ui/login", data={"csrf": nonce.group(1), "token": "wrong-token-wrong-token"})
    assert wrong.status_code == 401 and "wrong token" in wrong.text


def test_a_form_without_the_session_s_csrf_token_changes_nothing(client: TestClient, store: Store) -> None:
    row_id = add(store, "h", state="dead")
    log_in(client)
    for data in ({}, {"csrf": "forged"}):
        response = client.post(f"/ui/messages/{row_id}/requeue", data=data)
        assert response.status_code == 403 and "did not come from this console" in response.text
    assert store.console_message(row_id).message.state.value == "dead"  # type: ignore[union-attr]


def test_a_form_with_the_csrf_token_acts_and_says_so(client: TestClient, store: Store) -> None:
    row_id = add(store, "h", state="dead")
    csrf = log_in(client)
    done = client.post(f"/ui/messages/{row_id}/requeue", data={"csrf": csrf})
    assert done.status_code == 200 and f"requeued message {row_id}" in done.text
    assert store.console_message(row_id).message.state.value == "ready"  # type: ignore[union-attr]


def test_a_read_only_session_cannot_act(client: TestClient, store: Store) -> None:
    row_id = add(store, "h", state="dead")
    csrf = log_in(client, READ)
    refused = client.post(f"/ui/messages/{row_id}/requeue", data={"csrf": csrf})
    assert refused.status_code == 403 and "may only read" in refused.text
    assert client.post("/ui/pauses", data={"csrf": csrf, "scope": "all"}).status_code == 403
    assert store.pauses_list() == []


def test_logged_out_forms_are_refused_and_redirects_stay_in_the_console(client: TestClient) -> None:
    assert client.post("/ui/pauses", data={"scope": "all"}).status_code == 403
    form = client.get("/ui/login?next=https://evil.example/")
    assert 'name="next" value="/ui/"' in form.text
    nonce = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert nonce is not None
    response = client.post("/ui/login", data={"csrf": nonce.group(1), "token": WRITE, "next": "//evil.example/"},
                           follow_redirects=False)
    assert response.headers["location"] == "/ui/"


def test_a_session_cookie_copied_before_logout_opens_nothing_after_it_on_any_replica(
    client: TestClient, store: Store
) -> None:
    csrf = log_in(client)
    copied = client.cookies.get("cw_session")
    assert copied is not None
    assert client.post("/ui/logout", data={"csrf": csrf}, follow_redirects=False).status_code == 303
    with console_app(store) as other:  # another replica, the same database
        other.cookies.set("cw_session", copied, path="/ui")
        page = other.get("/ui/pauses", follow_redirects=False)
        assert page.status_code == 303 and "/ui/login" in page.headers["location"]
        refused = other.post("/ui/pauses", data={"csrf": csrf, "scope": "all"}, follow_redirects=False)
        assert refused.status_code == 403
    assert store.pauses_list() == []


def test_pages_carry_security_headers_and_escape_what_producers_wrote(client: TestClient, store: Store) -> None:
    add(store, "<script>alert(1)</script>", state="dead")
    log_in(client)
    page = client.get("/ui/dead")
    assert "<script>alert(1)</script>" not in page.text and "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-frame-options"] == "DENY" and page.headers["cache-control"] == "no-store"


def test_every_page_answers_for_a_logged_in_operator(client: TestClient, store: Store) -> None:
    row_id = add(store, "order-1", state="dead", last_error="boom")
    with store.engine.begin() as connection:
        connection.exec_driver_sql(
            "INSERT INTO correlation_schedule (name, cron, message_name) VALUES ('nightly', '0 0 3 * * ?', 'r')"
        )
    log_in(client)
    for path in ("/ui/schedules", "/ui/schedules/nightly", "/ui/", "/ui/overview/live", "/ui/messages?state=dead",
                 f"/ui/messages/{row_id}",
                 "/ui/hints/order-1", "/ui/dead", "/ui/bulk?action=requeue&state=dead", "/ui/pauses", "/ui/audit"):
        response = client.get(path)
        assert response.status_code == 200, (path, response.text)
    assert client.get("/ui/messages?state=sleeping").status_code == 400
    assert client.get("/ui/messages/999999").status_code == 404
    assert client.get("/ui/schedules/missing").status_code == 404


@pytest.mark.parametrize("path", ["/ui/messages?name=a%00b", "/ui/hints/a%00b", "/ui/messages/shop%00-1"])
def test_a_nul_in_a_pages_request_is_a_readable_400(client: TestClient, path: str) -> None:
    log_in(client)
    page = client.get(path)
    assert page.status_code == 400 and "NUL character" in page.text


def test_a_delivered_message_s_page_shows_its_record_and_the_list_filters_records(
    client: TestClient, store: Store
) -> None:
    delivered = deliver(store, "order-7", "shop-7-paid", {"processInstanceKey": "2251799813685249"})
    live = add(store, "order-8")
    log_in(client)
    page = client.get(f"/ui/messages/{delivered}")
    assert page.status_code == 200, page.text
    assert 'id="outcome">correlated<' in page.text and "2251799813685249" in page.text
    assert 'id="finished-by">replica-a<' in page.text and 'id="action-delete"' not in page.text
    listed = client.get("/ui/messages?state=delivered")
    assert f'data-id="{delivered}"' in listed.text and f'data-id="{live}"' not in listed.text
    assert "delivered (correlated)" in listed.text
    every = client.get("/ui/messages")
    assert f'data-id="{live}"' in every.text and f'data-id="{delivered}"' not in every.text


def deliver(store: Store, hint: str, message_id: str, result: object) -> int:
    """A message correlated by a replica, kept as its delivery record with the target's answer."""
    row_id = store.messages_insert(NewMessage(name="order.paid", hint=hint, message_id=message_id))
    assert row_id is not None
    store.keep_delivery_records(timedelta(days=7), "replica-a")
    done = Disposition(row_id, Kind.DELETE, 0, result=json.dumps(result))
    assert store.messages_record([SlotWrite(0, None, (done,))]).written == {row_id}
    return row_id


def test_the_overview_says_when_replicas_route_or_run_cluster_settings_differently(
    client: TestClient, store: Store
) -> None:
    from worker.db.replicas import ReplicaRow
    from worker.policy.routing import route_digests

    alike = route_digests({"order.paid": "shop:on_paid", "*": "log"})
    store.replicas_record(ReplicaRow("replica-a", alike, {"delivery.retention": "P7D"}))
    store.replicas_record(ReplicaRow("replica-b", alike, {"delivery.retention": "P7D"}))
    log_in(client)
    page = client.get("/ui/").text
    assert 'id="routes-disputed"' not in page and "setting-differs" not in page
    store.replicas_record(ReplicaRow("replica-c", route_digests({"*": "log"}), {"delivery.retention": "PT1S"}))
    page = client.get("/ui/").text
    banner = re.search(r'id="routes-disputed">([^<]*)', page)
    assert banner is not None and "order.paid differently" in banner.group(1)
    assert "CORRELATION_DELIVERY__RETENTION differs between replicas" in page and "PT1S" in page


def test_the_overview_shows_the_targets_circuits(client: TestClient, store: Store) -> None:
    from worker.db.targets import TargetRow

    store.targets_record("replica-1", [TargetRow("replica-1", "http://engine:8080/correlate", "open", "refused", 1, 0)])
    log_in(client)
    page = client.get("/ui/").text
    assert 'id="targets"' in page and "http://engine:8080/correlate" in page and ">open<" in page


PAGES = ("/ui/", "/ui/overview/live", "/ui/overview/charts?window=1h", "/ui/messages?state=dead", "/ui/messages/1",
         "/ui/hints/order-1", "/ui/dead", "/ui/bulk?action=requeue&state=dead", "/ui/pauses", "/ui/audit",
         "/ui/schedules", "/ui/schedules/nightly")
API = ("/api/v1/status", "/api/v1/charts?window=1h", "/api/v1/messages", "/api/v1/messages/1", "/api/v1/hints/h",
       "/api/v1/pauses", "/api/v1/audit", "/api/v1/schedules", "/api/v1/schedules/nightly")


def test_a_database_outage_is_a_readable_503_on_every_page_and_route_then_they_answer_again(private_pg: Any) -> None:
    server, url = private_pg
    store = Store(build_engine(DatabaseSettings(url=url, connect_timeout=timedelta(seconds=2))))
    try:
        add(store, "order-1", state="dead", last_error="boom")
        with console_app(store) as client:
            log_in(client)
            assert client.get("/ui/").status_code == 200  # the pool holds a connection the restart breaks
            server.stop("fast")
            try:
                for path in PAGES:
                    response = client.get(path)
                    assert response.status_code == 503, (path, response.status_code, response.text[:300])
                    said = re.search(r'<p class="error" id="error">(.*?)</p>', response.text, re.DOTALL)
                    assert said is not None and "database" in said.group(1), (path, response.text[:300])
                for path in API:
                    response = client.get(path, headers={"Authorization": f"Bearer {WRITE}"})
                    assert response.status_code == 503, (path, response.status_code, response.text[:300])
                    assert "database" in response.json()["error"], path
            finally:
                server.start()
            assert client.get("/ui/").status_code == 200  # the first page after the restart
            assert client.get("/ui/dead").status_code == 200
    finally:
        store.close()


def test_the_first_page_and_read_after_a_restart_while_the_console_was_idle_answer(private_pg: Any) -> None:
    server, url = private_pg
    store = Store(build_engine(DatabaseSettings(url=url, connect_timeout=timedelta(seconds=2))))
    try:
        add(store, "order-1", state="dead", last_error="boom")
        with console_app(store) as client:
            log_in(client)
            for path in ("/ui/", "/ui/dead", "/api/v1/status"):
                assert client.get(path, headers={"Authorization": f"Bearer {WRITE}"}).status_code == 200
                server.stop("fast")
                server.start()
                response = client.get(path, headers={"Authorization": f"Bearer {WRITE}"})
                assert response.status_code == 200, (path, response.status_code, response.text[:300])
    finally:
        store.close()
