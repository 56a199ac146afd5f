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

from tests.engines import Answer, FakeCamunda8, problem
from tests.unit.factories import message
from worker.config import ConfigError
from worker.correlators import Router
from worker.correlators.camunda8 import Camunda8Correlator
from worker.correlators.network import TargetBusy, TargetUnavailable
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
    with pytest.raises(ConfigError, match="the Camunda SDK refused its settings") as raised:
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
