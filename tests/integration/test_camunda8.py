"""The camunda8 correlator against a fake Camunda 8 REST API on loopback (tests/engines.py): the SDK resolves its
settings and credentials, the worker's own client makes the calls."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from tests.conftest import stop_at_teardown
from tests.engines import Answer, FakeCamunda8, make_certificates, problem
from tests.unit.factories import message
from worker.config import ConfigError, Settings
from worker.correlators import Router
from worker.correlators.camunda8 import Camunda8Correlator
from worker.correlators.network import TargetBusy, TargetUnavailable
from worker.db.store import NewMessage, Store
from worker.engine.engine import AllSlots, Engine
from worker.message import MessageState
from worker.policy.outcomes import AuthProblem, PermanentError, Reschedule, Result, Retry, result_of


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCamunda8]:
    fake = FakeCamunda8()
    for name, value in fake.env().items():
        monkeypatch.setenv(name, value)
    yield fake
    fake.close()


def correlator(**spec: object) -> Camunda8Correlator:
    built = Router.from_settings({"*": {"type": "camunda8", **spec}}).route("order.paid")
    assert isinstance(built, Camunda8Correlator)
    return built


def answer(outcome: Result) -> Any:
    return json.loads(result_of(outcome) or "null")


def test_correlate_sends_the_contracts_body_and_answers_the_keys_as_strings(cluster: FakeCamunda8) -> None:
    instance = cluster.wait_for("order.paid", "order-1")
    outcome = correlator(mode="correlate")(message(7, "order-1", payload={"amount": 3}))
    assert answer(outcome) == {
        "processInstanceKey": instance, "messageKey": "2251799813685250", "tenantId": "<default>",
    }
    request = cluster.recorded(FakeCamunda8.CORRELATE)[0]
    assert request.body == {"name": "order.paid", "correlationKey": "order-1", "variables": {"amount": 3}}


def test_correlate_404_is_not_yet_never_an_attempt_then_200_once_a_process_waits(cluster: FakeCamunda8) -> None:
    send = correlator()
    with pytest.raises(Reschedule, match=r"no process instance waits for message 'order\.paid' with correlation key"):
        send(message(1, "order-2"))
    cluster.wait_for("order.paid", "order-2")
    assert "processInstanceKey" in answer(send(message(1, "order-2")))


def test_publish_buffers_by_message_id_and_a_duplicate_is_success(cluster: FakeCamunda8) -> None:
    send = correlator(mode="publish", time_to_live="PT10M")
    first = answer(send(message(5, "order-3", message_id="shop-42")))
    assert first == {"messageKey": "2251799813685249", "tenantId": "<default>", "messageId": "shop-42"}
    assert answer(send(message(5, "order-3", message_id="shop-42"))) == {"messageId": "shop-42", "alreadyExists": True}
    body = cluster.recorded(FakeCamunda8.PUBLISH)[0].body
    assert body["messageId"] == "shop-42" and body["timeToLive"] == 600_000 and body["correlationKey"] == "order-3"
    # Without a message_id the row's id makes a stable one: a retry publishes the same id.
    send(message(6, "order-4"))
    send(message(6, "order-4"))
    ids = [r.body["messageId"] for r in cluster.recorded(FakeCamunda8.PUBLISH)[2:]]
    assert ids == ["correlation-worker-6", "correlation-worker-6"]
    assert cluster.recorded(FakeCamunda8.PUBLISH)[2].body["timeToLive"] == 600_000


def test_a_409_is_judged_by_its_title(cluster: FakeCamunda8) -> None:
    cluster.answer_next(Answer(409, problem(409, "INVALID_STATE", "not routed to the right partition; retry")))
    with pytest.raises(Retry, match="409: INVALID_STATE: not routed"):
        correlator(mode="publish")(message(1))


def test_a_400_is_dead_with_the_problems_title_and_detail(cluster: FakeCamunda8) -> None:
    cluster.answer_next(Answer(400, problem(400, "INVALID_ARGUMENT", "The value of timeToLive is negative")))
    with pytest.raises(PermanentError, match="answered 400: INVALID_ARGUMENT: The value of timeToLive is negative"):
        correlator()(message(1))


@pytest.mark.parametrize(
    ("queued", "after", "kind"),
    [
        (Answer(429, problem(429, "TOO_MANY_REQUESTS", "slow down"), {"Retry-After": "7"}), 7.0, TargetBusy),
        (Answer(503, problem(503, "RESOURCE_EXHAUSTED", "Expected to handle request, but"), {"Retry-After": "3"}), 3.0,
         TargetBusy),
        (Answer(500, problem(500, "INTERNAL", "RESOURCE_EXHAUSTED: the broker is busy")), None, TargetBusy),
        (Answer(503, raw=""), None, TargetUnavailable),
        (Answer(503, raw="", headers={"Retry-After": "2"}), 2.0, TargetUnavailable),
        (Answer(502, raw="<html>bad gateway</html>"), None, TargetUnavailable),
        (Answer(500, problem(500, "INTERNAL", "the handler failed")), None, Retry),
    ],
)
def test_back_pressure_and_outages_are_the_targets_and_wait_for_retry_after(
    cluster: FakeCamunda8, queued: Answer, after: float | None, kind: type[Retry]
) -> None:
    """Back-pressure (429, RESOURCE_EXHAUSTED) is the target's business, as are 502/503 (it is not there): the
    lanes hold such messages without an attempt. Another 5xx may be the message's: a retry, charged."""
    cluster.answer_next(queued)
    with pytest.raises(Retry) as raised:
        correlator(mode="publish")(message(1))
    assert type(raised.value) is kind
    assert raised.value.after == after and str(queued.status) in str(raised.value)


def test_tenant_from_the_header_else_the_route_else_none_sent(cluster: FakeCamunda8) -> None:
    cluster.multi_tenancy = True
    cluster.wait_for("order.paid", "k", tenant="shop-eu")
    assert answer(correlator()(message(1, "k", headers={"tenantId": "shop-eu"})))["tenantId"] == "shop-eu"
    cluster.wait_for("order.paid", "k", tenant="shop-us")
    assert answer(correlator(tenant_id="shop-us")(message(2, "k")))["tenantId"] == "shop-us"
    with pytest.raises(Reschedule):
        correlator()(message(3, "k"))
    assert "tenantId" not in cluster.recorded(FakeCamunda8.CORRELATE)[-1].body


def test_a_tenant_with_multi_tenancy_off_is_dead_with_the_clusters_words(cluster: FakeCamunda8) -> None:
    with pytest.raises(PermanentError, match="multi-tenancy is disabled"):
        correlator()(message(1, "k", headers={"tenantId": "shop-eu"}))


def test_oauth_one_token_per_expiry_and_a_revoked_token_is_fetched_again_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeCamunda8(auth="OAUTH", token_lifetime=10)  # short-lived: still one token for its 9 s
    try:
        for name, value in fake.env().items():
            monkeypatch.setenv(name, value)
        send = correlator(mode="publish")
        for row in range(1, 6):
            send(message(row))
        assert fake.token_requests == 1
        fake.revoke_tokens()
        send(message(6))  # 401, a new token, the same request again
        assert fake.token_requests == 2
        assert [r.headers["Authorization"] for r in fake.recorded(FakeCamunda8.PUBLISH)][-2:] == [
            "Bearer token-1", "Bearer token-2",
        ]
    finally:
        fake.close()


def test_refused_credentials_are_an_auth_problem_naming_what_to_check_never_the_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeCamunda8(auth="OAUTH")
    try:
        for name, value in fake.env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("CAMUNDA_CLIENT_SECRET", "wrong-secret")
        with pytest.raises(AuthProblem) as raised:
            correlator()(message(1))
        assert "CAMUNDA_CLIENT_SECRET" in str(raised.value) and "wrong-secret" not in str(raised.value)
        assert isinstance(raised.value, Retry)  # retried: fixing the credentials loses nothing
    finally:
        fake.close()


def test_a_403_is_an_auth_problem(cluster: FakeCamunda8) -> None:
    cluster.answer_next(Answer(403, problem(403, "FORBIDDEN", "Unauthorized to perform operation 'CREATE'")))
    with pytest.raises(AuthProblem, match=r"403.*Unauthorized to perform operation"):
        correlator()(message(1))


def test_connection_refused_and_timeouts_are_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCamunda8()
    address = fake.rest
    fake.close()
    monkeypatch.setenv("CAMUNDA_REST_ADDRESS", address)
    with pytest.raises(Retry, match="failed"):
        correlator()(message(1))


@pytest.mark.parametrize("client_certificate", [True, False])
def test_mutual_tls_trusts_the_clusters_ca_and_presents_the_client_certificate_as_the_sdk_reads_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, client_certificate: bool
) -> None:
    """CAMUNDA_MTLS_* as the SDK reads them (a PEM inline or a path): the cluster's certificate is verified against
    the CA given, the client certificate presented; a cluster that requires one the worker lacks refuses the call,
    a retry, nothing correlated."""
    certificates = make_certificates(str(tmp_path))
    fake = FakeCamunda8(tls=certificates.server_context(client_certificates=True))
    try:
        for name, value in fake.env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("CAMUNDA_MTLS_CA_PATH", certificates.ca)
        if client_certificate:
            with open(certificates.client_cert) as file:
                monkeypatch.setenv("CAMUNDA_MTLS_CERT", file.read())
            monkeypatch.setenv("CAMUNDA_MTLS_KEY_PATH", certificates.client_key)
        fake.wait_for("order.paid", "order-1")
        if client_certificate:
            assert "processInstanceKey" in answer(correlator()(message(1, "order-1")))
        else:
            with pytest.raises(Retry, match="failed"):
                correlator()(message(1, "order-1"))
            assert not fake.recorded(FakeCamunda8.CORRELATE)
    finally:
        fake.close()


@pytest.mark.parametrize(
    ("spec", "refusal"),
    [
        ({"mode": "broadcast"}, "unknown camunda8 mode 'broadcast'"),
        ({"url": "camunda:8080"}, "starts with http"),
        ({"tenant_id": ""}, "'tenant_id' must be"),
        ({"mode": "correlate", "time_to_live": "PT1M"}, "'time_to_live' belongs to mode 'publish'"),
        ({"mode": "publish", "time_to_live": "soon"}, "time_to_live"),
        ({"timeout": "PT0S"}, "timeout must be a positive duration"),
        ({"modes": "publish"}, "did you mean 'mode'"),
    ],
)
def test_bad_specs_are_refused_in_one_line(cluster: FakeCamunda8, spec: dict[str, object], refusal: str) -> None:
    with pytest.raises(ConfigError, match=refusal) as raised:
        correlator(**spec)
    assert "\n" not in str(raised.value)


def test_the_sdks_settings_errors_are_one_line_without_the_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAMUNDA_AUTH_STRATEGY", "KERBEROS")
    monkeypatch.setenv("CAMUNDA_CLIENT_SECRET", "hunter2-secret")
    refusal = "invalid setting CAMUNDA_AUTH_STRATEGY: the Camunda SDK refused it"
    with pytest.raises(ConfigError, match=refusal) as raised:
        correlator()
    assert "hunter2" not in str(raised.value) and "\n" not in str(raised.value)


def test_without_the_extra_the_route_says_how_to_install_it() -> None:
    script = (
        "import sys; sys.modules['camunda_orchestration_sdk'] = None\n"
        "from worker.correlators import Router\n"
        "from worker.config import ConfigError\n"
        "try:\n    Router.from_settings({'*': {'type': 'camunda8'}})\n"
        "except ConfigError as error:\n    print(error)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert "pip install '.[camunda8]' in a clone of correlation-worker" in out


def test_time_to_live_defaults_to_an_hour(cluster: FakeCamunda8) -> None:
    correlator(mode="publish")(message(1))
    hour = timedelta(hours=1) // timedelta(milliseconds=1)
    assert cluster.recorded(FakeCamunda8.PUBLISH)[0].body["timeToLive"] == hour


def test_check_config_says_where_messages_go_and_never_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCamunda8(auth="OAUTH")
    try:
        for name, value in fake.env().items():
            monkeypatch.setenv(name, value)
        shown = Router.from_settings({"*": {"type": "camunda8", "mode": "publish"}}).describe()["*"]
        assert f"{fake.rest}/messages/publication (auth OAUTH, client worker at {fake.oauth_url}" in shown
        assert fake.client_secret not in shown
    finally:
        fake.close()


# -- answers that are not Camunda's: charged failures naming what came back -------------------------------------

NO_SUBSCRIPTION = (
    "Expected to find subscription for message with name 'order.paid' and correlation key 'k', but none was found."
)


@pytest.mark.parametrize(
    "detail",
    [
        NO_SUBSCRIPTION,
        f"Command 'CORRELATE' rejected with code 'NOT_FOUND': {NO_SUBSCRIPTION}",
        "Expected to find subscription for message with name 'order.paid' and correlation key 'k', but no active "
        "subscription was found. A process instance with this correlation key is already active for a message start "
        "event with this message name.",
    ],
)
def test_camundas_no_subscription_404_is_not_yet(cluster: FakeCamunda8, detail: str) -> None:
    cluster.answer_next(Answer(404, problem(404, "NOT_FOUND", detail)))
    with pytest.raises(Reschedule, match="no process instance waits"):
        correlator()(message(1, "k"))


@pytest.mark.parametrize("mode", ["correlate", "publish"])
@pytest.mark.parametrize(
    ("queued", "shown"),
    [
        (Answer(404, raw="<html><head><title>404 Not Found</title></head><body><center>nginx</center></body></html>",
                headers={"Content-Type": "text/html"}), "(text/html) <html><head><title>404 Not Found"),
        (Answer(404, {"error": "no route for this host"}), '{"error": "no route for this host"}'),
        (Answer(404, problem(404, "Not Found", "No endpoint POST /api/v2/messages/correlation.")),
         "Not Found: No endpoint POST"),
        (Answer(404, problem(404, "NOT_FOUND", "Process definition with key '1' not found")),
         "NOT_FOUND: Process definition with key '1' not found"),
        (Answer(404, raw=""), "empty body"),
        (Answer(404, raw="x" * 5000, headers={"Content-Type": "text/plain"}), "(text/plain) " + "x" * 200 + "…"),
    ],
)
def test_any_other_404_is_a_charged_failure_naming_the_status_and_the_body(
    cluster: FakeCamunda8, mode: str, queued: Answer, shown: str
) -> None:
    """Only Camunda's own "no subscription" problem is "not yet": a wrong base path or an ingress's page answered
    404 would otherwise keep every message for ever without an attempt."""
    cluster.answer_next(queued)
    with pytest.raises(Retry) as raised:
        correlator(mode=mode)(message(1, "k"))
    assert type(raised.value) is Retry  # charged: not the target's back-pressure or outage
    reason = str(raised.value)
    assert "answered 404, not Camunda's REST API; check CAMUNDA_REST_ADDRESS" in reason and shown in reason
    assert len(reason) < 600


def test_a_wrong_base_path_is_a_charged_failure(cluster: FakeCamunda8, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAMUNDA_REST_ADDRESS", cluster.url + "/api")  # the SDK appends /v2: /api/v2/...
    with pytest.raises(Retry, match=r"404, not Camunda's REST API.*No endpoint /api/v2/messages/correlation"):
        correlator()(message(1, "k"))


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_a_charged_failure_naming_its_location(cluster: FakeCamunda8, status: int) -> None:
    cluster.answer_next(Answer(status, raw="", headers={"Location": "https://login.example.com/?user=a&token=s3"}))
    with pytest.raises(Retry) as raised:
        correlator()(message(1, "k"))
    assert type(raised.value) is Retry
    assert f"answered {status} to https://login.example.com/?user=a&token=***, not Camunda's" in str(raised.value)


@pytest.mark.parametrize("tenant", [42, 0, "", "   ", None, True, ["shop-eu"], {"id": "shop-eu"}])
def test_a_tenant_header_that_is_no_tenant_is_dead_naming_the_header_and_nothing_is_sent(
    cluster: FakeCamunda8, tenant: object
) -> None:
    for send in (correlator(), correlator(tenant_id="shop-us"), correlator(mode="publish")):
        with pytest.raises(PermanentError, match=r"header 'tenantId' is .*: a tenant is a non-empty string"):
            send(message(1, "k", headers={"tenantId": tenant}))
    assert cluster.recorded(FakeCamunda8.CORRELATE) == [] and cluster.recorded(FakeCamunda8.PUBLISH) == []


# -- the SDK's variables, refused at the door in one line naming the variable ------------------------------------


@pytest.mark.parametrize(
    ("environ", "refusal"),
    [
        ({"CAMUNDA_REST_ADRESS": "http://camunda:8080"},
         "CAMUNDA_REST_ADRESS: is not a setting of the Camunda SDK, which would ignore it; did you mean "
         "CAMUNDA_REST_ADDRESS?"),
        ({"CAMUNDA_CLIENTSECRET": "x"}, "CAMUNDA_CLIENTSECRET: .* did you mean CAMUNDA_CLIENT_SECRET?"),
        ({"CAMUNDA_TENNANT_ID": "shop"}, "CAMUNDA_TENNANT_ID: .* did you mean CAMUNDA_TENANT_ID?"),
        ({"ZEEBE_ADDRESS": "camunda:26500"}, "ZEEBE_ADDRESS: .* did you mean ZEEBE_REST_ADDRESS?"),
        ({"CAMUNDA_REST_ADDRESS": "notaurl"}, "CAMUNDA_REST_ADDRESS: 'notaurl' is not an http\\(s\\) URL"),
        ({"CAMUNDA_REST_ADDRESS": ""}, "CAMUNDA_REST_ADDRESS: '' is not an http\\(s\\) URL"),
        ({"CAMUNDA_REST_ADDRESS": "camunda:8080"}, "CAMUNDA_REST_ADDRESS: 'camunda:8080' is not an http"),
        ({"CAMUNDA_REST_ADDRESS": "ftp://camunda"}, "CAMUNDA_REST_ADDRESS: 'ftp://camunda' is not an http"),
        ({"CAMUNDA_REST_ADDRESS": "http://camunda:8080?tenant=a"}, "CAMUNDA_REST_ADDRESS: .* has a query"),
        ({"CAMUNDA_REST_ADDRESS": "http://camunda:8080/#v2"}, "CAMUNDA_REST_ADDRESS: .* has a query or fragment"),
        ({"CAMUNDA_REST_ADDRESS": "http://camunda:99999"}, "CAMUNDA_REST_ADDRESS: .* is not a URL"),
        ({"CAMUNDA_REST_ADDRESS": "http:///v2"}, "CAMUNDA_REST_ADDRESS: .* is not an http"),
        ({"ZEEBE_REST_ADDRESS": "notaurl"}, "ZEEBE_REST_ADDRESS: 'notaurl' is not an http"),
        ({"CAMUNDA_AUTH_STRATEGY": "OAUTH", "CAMUNDA_CLIENT_ID": "w", "CAMUNDA_CLIENT_SECRET": "s",
          "CAMUNDA_OAUTH_URL": "login/token"}, "CAMUNDA_OAUTH_URL: 'login/token' is not an http"),
        ({"CAMUNDA_AUTH_STRATEGY": "oauth"}, "CAMUNDA_AUTH_STRATEGY: the Camunda SDK refused it"),
        ({"CAMUNDA_SDK_LOG_LEVEL": "loud"}, "CAMUNDA_SDK_LOG_LEVEL: the Camunda SDK refused it"),
        ({"CAMUNDA_REST_ADDRESS_EXACT": "maybe"}, "CAMUNDA_REST_ADDRESS_EXACT: the Camunda SDK refused it"),
        ({"CAMUNDA_WORKER_TIMEOUT": "soon"}, "CAMUNDA_WORKER_TIMEOUT: the Camunda SDK refused it"),
        ({"CAMUNDA_AUTH_STRATEGY": "BASIC"}, "CAMUNDA_BASIC_AUTH_USERNAME: the Camunda SDK refused it"),
    ],
)
def test_a_misspelt_or_malformed_sdk_variable_is_refused_in_one_line_naming_it(
    cluster: FakeCamunda8, monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], refusal: str
) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    if "ZEEBE_REST_ADDRESS" in environ:
        monkeypatch.delenv("CAMUNDA_REST_ADDRESS")
    with pytest.raises(ConfigError, match=f"^invalid setting {refusal}") as raised:
        correlator()
    assert "\n" not in str(raised.value)


def test_kubernetes_service_links_of_a_service_named_camunda_or_zeebe_are_not_taken_for_settings(
    cluster: FakeCamunda8, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("CAMUNDA_SERVICE_HOST", "CAMUNDA_PORT", "CAMUNDA_PORT_8080_TCP_ADDR", "ZEEBE_SERVICE_PORT_REST",
                 "CAMUNDA_ZEEBE_GATEWAY_PORT_26500_TCP_PROTO"):
        monkeypatch.setenv(name, "10.0.0.7")
    cluster.wait_for("order.paid", "k")
    assert "processInstanceKey" in answer(correlator()(message(1, "k")))


@pytest.mark.parametrize("url", ["http://camunda:8080/v2?x=1", "http://camunda:8080 /v2", "http://:8080"])
def test_a_routes_url_that_cannot_be_the_rest_address_is_refused(cluster: FakeCamunda8, url: str) -> None:
    with pytest.raises(ConfigError, match=r"^invalid setting CORRELATION_CORRELATORS\[\*\]: url "):
        correlator(url=url)


# -- what the row keeps: the engine's answer, never the worker's frames -------------------------------------------


@pytest.mark.parametrize(
    ("queued", "headers", "reason"),
    [
        (Answer(400, problem(400, "INVALID_ARGUMENT", "The value of timeToLive is negative")), {},
         "PermanentError: POST {url} answered 400: INVALID_ARGUMENT: The value of timeToLive is negative"),
        (Answer(404, raw="<html><body>Not Found</body></html>", headers={"Content-Type": "text/html"}), {},
         "Retry: POST {url} answered 404, not Camunda's REST API; check CAMUNDA_REST_ADDRESS (or the route's url): "
         "(text/html) <html><body>Not Found</body></html>"),
        (Answer(302, raw="", headers={"Location": "https://camunda.example.com/v2/messages/correlation"}), {},
         "Retry: POST {url} answered 302 to https://camunda.example.com/v2/messages/correlation, not Camunda's REST "
         "API; check CAMUNDA_REST_ADDRESS (or the route's url): (no Content-Type, empty body)"),
        (Answer(500, problem(500, "INTERNAL", "the broker failed")), {},
         "Retry: POST {url} answered 500: INTERNAL: the broker failed"),
        (None, {"tenantId": 42}, "PermanentError: header 'tenantId' is 42: a tenant is a non-empty string"),
    ],
)
def test_last_error_is_the_engines_answer_never_a_traceback(
    any_store: Store, cluster: FakeCamunda8, queued: Answer | None, headers: dict[str, object], reason: str
) -> None:
    if queued is not None:
        cluster.answer_next(queued)
    router = Router.from_settings({"*": {"type": "camunda8"}})
    engine = Engine(any_store, router, Settings(policy={"max_retries": 1}, metrics={"enabled": False}),
                    AllSlots(any_store.slot_count))
    stop_at_teardown(lambda: engine.stop(grace=0))
    row_id = any_store.messages_insert(NewMessage(name="order.paid", hint="k", payload={}, headers=headers))
    assert row_id is not None
    engine.run_once()
    row = any_store.messages_get(row_id)
    assert row is not None and row.state is MessageState.DEAD
    assert (row.last_error or "").startswith(reason.format(url=f"{cluster.rest}/messages/correlation")), row.last_error
    assert "Traceback" not in (row.last_error or "") and 'File "' not in (row.last_error or "")
