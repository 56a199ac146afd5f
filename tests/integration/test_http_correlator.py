"""The http correlator against a real HTTP server on loopback: status codes to outcomes, Camunda 7 preset."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.engines import Answer, FakeCamunda7, FakeCamunda8, make_certificates
from tests.unit.factories import message
from worker.config import ConfigError
from worker.correlators import Router
from worker.correlators.http import ClientCredentials, HttpCorrelator, retry_after
from worker.correlators.network import call_deadline
from worker.policy.outcomes import AuthProblem, HandlerTimeout, PermanentError, Reschedule, Retry, result_of


class Target:
    """A loopback HTTP server that answers with the next queued (status, body) and records requests."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.authorizations: list[str | None] = []
        self.answers: list[tuple[int, str] | tuple[int, str, dict[str, str]]] = []
        target = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                target.requests.append((self.path, json.loads(self.rfile.read(length))))
                target.authorizations.append(self.headers.get("Authorization"))
                status, body, *extra = target.answers.pop(0) if target.answers else (204, "")
                self.send_response(status)
                for name, value in (extra[0] if extra else {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, format: str, *args: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def target() -> Iterator[Target]:
    server = Target()
    yield server
    server.close()


def test_2xx_is_success_and_the_message_is_posted_as_json(target: Target) -> None:
    correlator = HttpCorrelator(target.url + "/inbox")
    correlator(message(7, "order-1", payload={"amount": 3}, headers={"tenant": "acme"}))
    path, body = target.requests[0]
    assert path == "/inbox"
    assert body["messageName"] == "order.paid" and body["correlationHint"] == "order-1"
    assert body["payload"] == {"amount": 3} and body["headers"] == {"tenant": "acme"} and body["id"] == 7


@pytest.mark.parametrize("status", [500, 503, 429])
def test_5xx_and_throttling_are_retries(target: Target, status: int) -> None:
    target.answers.append((status, "busy"))
    with pytest.raises(Retry, match=str(status)):
        HttpCorrelator(target.url)(message(1))


@pytest.mark.parametrize("status", [400, 404, 422])
def test_other_4xx_are_permanent(target: Target, status: int) -> None:
    target.answers.append((status, "bad request"))
    with pytest.raises(PermanentError, match=str(status)):
        HttpCorrelator(target.url)(message(1))


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_redirect_is_permanent_and_names_its_location_without_credentials(target: Target, status: int) -> None:
    target.answers.append((status, "", {"Location": "https://user:secret@engine.example/new"}))
    with pytest.raises(PermanentError) as raised:
        HttpCorrelator(target.url + "/old")(message(1))
    reason = str(raised.value)
    assert f"answered {status} redirecting to https://engine.example/new; redirects are not followed" in reason
    assert "secret" not in reason and len(target.requests) == 1


def test_credentials_in_the_url_beside_an_authorization_header_are_refused() -> None:
    spec = {"type": "http", "url": "https://user:pw@engine.example/x", "headers": {"authorization": "Bearer t"}}
    refusal = r"CORRELATION_CORRELATORS\[\*\]: credentials in 'url'.*Authorization"
    with pytest.raises(ConfigError, match=refusal) as raised:
        Router.from_settings({"*": spec})
    assert "\n" not in str(raised.value) and "pw" not in str(raised.value)
    Router.from_settings({"*": {**spec, "headers": {"X-Trace": "1"}}})
    Router.from_settings({"*": {**spec, "url": "https://engine.example/x"}})


@pytest.mark.parametrize(("header", "seconds"), [("120", 120.0), ("soon", None)])
@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_is_handed_to_the_retry(target: Target, status: int, header: str, seconds: float | None) -> None:
    target.answers.append((status, "busy", {"Retry-After": header}))
    with pytest.raises(Retry) as raised:
        HttpCorrelator(target.url)(message(1))
    assert raised.value.after == seconds


def test_retry_after_reads_an_http_date_against_the_answers_date() -> None:
    date = "Wed, 25 Nov 2026 10:00:00 GMT"
    assert retry_after("Wed, 25 Nov 2026 10:00:30 GMT", date) == 30.0
    assert retry_after("Wed, 25 Nov 2026 09:00:00 GMT", date) == 0.0
    assert retry_after(" 7 ", date) == 7.0 and retry_after("", date) is None and retry_after("-3", date) is None


def test_bearer_and_basic_auth_send_secrets_from_the_environment(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENGINE_TOKEN", "t0k3n")
    monkeypatch.setenv("ENGINE_PASSWORD", "s3cret")
    routes = {
        "bearer": {"type": "http", "url": target.url, "auth": {"type": "bearer", "token_env": "ENGINE_TOKEN"}},
        "basic": {"type": "http", "url": target.url,
                  "auth": {"type": "basic", "username": "demo", "password_env": "ENGINE_PASSWORD"}},
    }
    router = Router.from_settings(routes)
    for name in ("bearer", "basic"):
        correlator = router.route(name)
        assert correlator is not None
        correlator(message(1))
    assert target.authorizations == ["Bearer t0k3n", "Basic ZGVtbzpzM2NyZXQ="]
    assert "t0k3n" not in str(router.describe()) and "s3cret" not in str(router.describe())


def test_bad_auth_specs_are_refused_in_one_line_naming_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINE_TOKEN", raising=False)
    monkeypatch.setenv("ENGINE_PASSWORD", "s3cret")
    bad = [
        ({"type": "bearer", "token_env": "ENGINE_TOKEN"}, "names ENGINE_TOKEN, which is not set"),
        ({"type": "bearer"}, "needs 'token_env'"),
        ({"type": "digest"}, "'auth' must be"),
        ({"type": "basic", "password_env": "ENGINE_PASSWORD"}, "needs a 'username'"),
        ({"type": "oauth2", "client_id": "w", "client_secret_env": "ENGINE_PASSWORD"}, "needs a 'token_url'"),
        ({"type": "oauth2", "token_url": "https://idp/token", "client_secret_env": "ENGINE_PASSWORD"}, "'client_id'"),
        ({"type": "oauth2", "token_url": "https://idp/token", "client_id": "w"}, "needs 'client_secret_env'"),
        ({"type": "bearer", "token_env": "ENGINE_PASSWORD", "token": "x"}, "'token' is not a key of bearer auth"),
    ]
    for auth, rule in bad:
        with pytest.raises(ConfigError, match=rule) as raised:
            Router.from_settings({"*": {"type": "http", "url": "http://127.0.0.1:1/x", "auth": auth}})
        assert "\n" not in str(raised.value) and "s3cret" not in str(raised.value)
    with pytest.raises(ConfigError, match="not both"):
        Router.from_settings({"*": {"type": "http", "url": "http://127.0.0.1:1/x", "headers": {"Authorization": "x"},
                                    "auth": {"type": "basic", "username": "u", "password_env": "ENGINE_PASSWORD"}}})


def test_connection_refused_is_a_retry(target: Target) -> None:
    url = target.url
    target.close()
    with pytest.raises(Retry, match="failed"):
        HttpCorrelator(url)(message(1))


def test_camunda7_preset_posts_a_message_correlation_request(target: Target) -> None:
    correlator = HttpCorrelator(target.url + "/engine-rest", preset="camunda7")
    correlator(message(1, "order-9", payload={"paid": True}, headers={"correlationKeys": {"orderId": 9}}))
    path, body = target.requests[0]
    assert path == "/engine-rest/message"
    assert body == {
        "messageName": "order.paid",
        "businessKey": "order-9",
        "processVariables": {"paid": {"value": True}},
        "correlationKeys": {"orderId": {"value": 9}},
        "all": False,
        "resultEnabled": True,
    }


def test_camunda7_passes_tenant_and_process_instance_from_headers_and_all_from_the_spec(target: Target) -> None:
    spec = {"type": "http", "preset": "camunda7", "url": target.url, "all": True, "without_tenant_id": True}
    correlator = Router.from_settings({"*": spec}).route("order.paid")
    assert correlator is not None
    correlator(message(1, "order-9", headers={"tenantId": "acme", "processInstanceId": "pi-7"}))
    correlator(message(2, "order-9"))
    first, second = (body for _path, body in target.requests)
    assert (first["tenantId"], first["processInstanceId"], first["all"]) == ("acme", "pi-7", True)
    assert "withoutTenantId" not in first
    assert second["withoutTenantId"] is True and "tenantId" not in second and "processInstanceId" not in second
    with pytest.raises(ConfigError, match="'all' must be true or false"):
        Router.from_settings({"*": {**spec, "all": "yes"}})
    with pytest.raises(ConfigError, match="belongs to the camunda7 preset"):
        Router.from_settings({"*": {"type": "http", "url": target.url, "all": True}})


def test_camunda7_no_matching_execution_is_not_yet_other_400_is_dead_with_the_engines_message() -> None:
    engine = FakeCamunda7()
    try:
        correlator = HttpCorrelator(engine.rest, preset="camunda7")
        with pytest.raises(Reschedule, match=r"no process is waiting for 'order.paid' with business key 'order-1'"):
            correlator(message(1, "order-1"))
        engine.wait_for("order.paid", "order-1")
        engine.wait_for("order.paid", "order-1")
        with pytest.raises(PermanentError, match=r"answered 400: RestException: Cannot correlate a message .* 2 exec"):
            correlator(message(1, "order-1"))
        engine.queued.append(Answer(400, {"type": "InvalidRequestException", "message": "Cannot deserialize"}))
        with pytest.raises(PermanentError, match="InvalidRequestException: Cannot deserialize"):
            correlator(message(1))
    finally:
        engine.close()


def test_camunda7_answers_the_matched_process_instance_as_the_result() -> None:
    engine = FakeCamunda7()
    try:
        one = engine.wait_for("order.paid", "order-1")
        assert result_of(HttpCorrelator(engine.rest, preset="camunda7")(message(1, "order-1"))) == (
            f'{{"processInstanceId":"{one}"}}'
        )
        both = [engine.wait_for("order.paid", "order-2"), engine.wait_for("order.paid", "order-2")]
        every = HttpCorrelator(engine.rest, preset="camunda7", correlate_all=True)(message(2, "order-2"))
        assert json.loads(result_of(every) or "") == {"processInstanceId": both[0], "processInstanceIds": both}
    finally:
        engine.close()


def test_camunda7_refused_credentials_are_an_auth_problem_and_basic_auth_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = FakeCamunda7(username="demo", password="s3cret")
    monkeypatch.setenv("ENGINE_PASSWORD", "wrong")
    try:
        engine.wait_for("order.paid", "h")
        spec = {"type": "http", "preset": "camunda7", "url": engine.rest,
                "auth": {"type": "basic", "username": "demo", "password_env": "ENGINE_PASSWORD"}}
        with pytest.raises(AuthProblem, match="answered 401: the endpoint refused the worker's credentials"):
            route(spec)(message(1))
        monkeypatch.setenv("ENGINE_PASSWORD", "s3cret")
        assert "processInstanceId" in (result_of(route(spec)(message(1))) or "")
    finally:
        engine.close()


def test_a_json_answer_is_the_result_and_other_bodies_give_none(target: Target) -> None:
    target.answers.append((200, '{"accepted": true, "ticket": "T-1"}', {"Content-Type": "application/json"}))
    target.answers.append((200, "ok", {"Content-Type": "text/plain"}))
    target.answers.append((200, "[" * 100_000, {"Content-Type": "application/json"}))
    correlator = HttpCorrelator(target.url)
    assert result_of(correlator(message(1))) == '{"accepted":true,"ticket":"T-1"}'
    assert result_of(correlator(message(2))) is None
    assert result_of(correlator(message(3))) is None  # too large to keep: success, no result
    assert result_of(correlator(message(4))) is None  # 204


def test_oauth2_client_credentials_one_token_until_it_expires_and_once_more_after_a_401(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    issuer = FakeCamunda8(auth="OAUTH", token_lifetime=3600)
    monkeypatch.setenv("ENGINE_CLIENT_SECRET", issuer.client_secret)
    auth = {"type": "oauth2", "token_url": issuer.oauth_url, "client_id": issuer.client_id,
            "client_secret_env": "ENGINE_CLIENT_SECRET", "audience": issuer.audience}
    try:
        correlator = route({"type": "http", "url": target.url, "auth": auth})
        for row in range(3):
            correlator(message(row))
        assert issuer.token_requests == 1
        target.answers.append((401, "token revoked"))
        correlator(message(4))  # refused, a new token, sent again
        assert issuer.token_requests == 2
        assert target.authorizations == ["Bearer token-1"] * 4 + ["Bearer token-2"]
        target.answers.extend([(401, "no"), (401, "still no")])
        with pytest.raises(AuthProblem):
            correlator(message(5))
        monkeypatch.setenv("ENGINE_CLIENT_SECRET", "wrong")
        with pytest.raises(AuthProblem, match="refused the client credentials"):
            route({"type": "http", "url": target.url, "auth": auth})(message(6))
    finally:
        issuer.close()


def test_an_oauth2_token_is_fetched_again_shortly_before_it_expires() -> None:
    issuer = FakeCamunda8(auth="OAUTH", token_lifetime=100)
    now = [0.0]
    try:
        tokens = ClientCredentials(
            issuer.oauth_url, issuer.client_id, issuer.client_secret, audience=issuer.audience, clock=lambda: now[0]
        )
        assert tokens.header() == "Bearer token-1"
        now[0] = 89.0  # a tenth of the lifetime before it expires: still the same
        assert tokens.header() == "Bearer token-1"
        now[0] = 90.0
        assert tokens.header() == "Bearer token-2"
    finally:
        issuer.close()


def route(spec: Mapping[str, object]) -> Any:
    correlator = Router.from_settings({"*": spec}).route("order.paid")
    assert correlator is not None
    return correlator


def test_routes_build_http_correlators_and_refuse_bad_specs() -> None:
    router = Router.from_settings({"*": {"type": "http", "url": "http://127.0.0.1:1/x", "timeout": "PT1S"}})
    assert isinstance(router.route("any"), HttpCorrelator)
    with pytest.raises(ConfigError, match=r"CORRELATION_CORRELATORS\[\*\].*url"):
        Router.from_settings({"*": {"type": "http"}})
    with pytest.raises(ConfigError, match="preset"):
        Router.from_settings({"*": {"type": "http", "url": "http://x", "preset": "zeebe"}})


def test_a_token_whose_lifetime_cannot_be_read_serves_one_call_only() -> None:
    issuer = FakeCamunda8(auth="OAUTH")
    try:
        tokens = ClientCredentials(issuer.oauth_url, issuer.client_id, issuer.client_secret, audience=issuer.audience)
        issuer.token_lifetime = float("nan")  # the endpoint answers "expires_in": NaN
        tokens.header()
        tokens.header()
        assert issuer.token_requests == 2
    finally:
        issuer.close()


def test_https_trusts_the_cas_python_trusts_and_refuses_a_certificate_it_cannot_verify(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A target's certificate is checked against the CAs Python's default TLS context trusts (SSL_CERT_FILE
    honoured); one signed by no CA trusted is a retry naming the problem, never a call made unverified."""
    certificates = make_certificates(str(tmp_path))
    engine = FakeCamunda7(tls=certificates.server_context(client_certificates=False))
    try:
        engine.wait_for("order.paid", "order-1")
        with pytest.raises(Retry, match="certificate"):
            HttpCorrelator(engine.rest, preset="camunda7")(message(1, "order-1"))
        assert not engine.recorded(FakeCamunda7.MESSAGE), "nothing was sent over an unverified connection"
        monkeypatch.setenv("SSL_CERT_FILE", certificates.ca)
        outcome = HttpCorrelator(engine.rest, preset="camunda7")(message(1, "order-1"))
        assert "processInstanceId" in (result_of(outcome) or "")
    finally:
        engine.close()


def test_a_request_ends_at_its_calls_deadline_as_the_handler_timeout_it_is() -> None:
    """The lanes give each network call its handler timeout as a deadline: a request still waiting then ends and is
    the call's HandlerTimeout (a call may make two requests, a token's and its own); the route's own timeout is a
    retry that says so."""
    with socket.socket() as server:  # connections accepted by the kernel, never answered
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"http://127.0.0.1:{server.getsockname()[1]}/x"
        started = time.monotonic()
        with call_deadline(0.3), pytest.raises(HandlerTimeout, match=r"did not return within PT0\.3S"):
            HttpCorrelator(url, timeout=timedelta(seconds=5))(message(1))
        assert time.monotonic() - started < 2
        with call_deadline(5), pytest.raises(Retry, match=r"timed out after 0\.2s") as raised:
            HttpCorrelator(url, timeout=timedelta(seconds=0.2))(message(1))
        assert not isinstance(raised.value, HandlerTimeout)


def test_a_call_waits_for_another_calls_token_fetch_no_longer_than_its_own_deadline() -> None:
    """The lanes' threads share one token: a call whose deadline passes while another thread fetches it is the
    call's HandlerTimeout, never a thread stuck past its handler timeout."""
    issuer = FakeCamunda8(auth="OAUTH")
    try:
        tokens = ClientCredentials(issuer.oauth_url, issuer.client_id, issuer.client_secret, audience=issuer.audience)
        tokens._lock.acquire()  # another thread's fetch under way
        try:
            started = time.monotonic()
            with call_deadline(0.2), pytest.raises(HandlerTimeout, match="waiting for a token from"):
                tokens.header()
            assert time.monotonic() - started < 1.5
        finally:
            tokens._lock.release()
        with call_deadline(5):
            assert tokens.header() == "Bearer token-1"
    finally:
        issuer.close()
