"""The ``camunda8`` correlator: hands each message to Camunda 8 (Zeebe) over its REST API (``/v2``).

Two modes, by the route's ``mode``:

- ``correlate`` (the default): ``POST /v2/messages/correlation``. Camunda does not buffer such a message: when no
  process instance waits for it yet (404), the worker keeps it (:class:`~worker.policy.outcomes.Reschedule`: not
  yet, not an attempt) and tries again later, in order. Success answers the process instance and message keys.
- ``publish``: ``POST /v2/messages/publication`` with a ``messageId`` (the row's ``message_id``, else one derived
  from its id) and the route's ``time_to_live`` (default ``PT1H``): the broker buffers it; publishing the same id
  again while it is buffered (409 ``ALREADY_EXISTS``) is success, so a retry after an unclear answer is safe.

Connection and authentication are the official SDK's (``camunda-orchestration-sdk``, the ``camunda8`` extra),
configured by its own environment variables (``CAMUNDA_REST_ADDRESS``, ``CAMUNDA_AUTH_STRATEGY``,
``CAMUNDA_CLIENT_ID``, ``CAMUNDA_CLIENT_SECRET``, ``CAMUNDA_OAUTH_URL``, ``CAMUNDA_TOKEN_AUDIENCE``,
``CAMUNDA_BASIC_AUTH_USERNAME`` / ``_PASSWORD``, ``CAMUNDA_TENANT_ID``, mTLS, …); a route may override ``url``
and ``tenant_id``. One SDK client per process and address: one connection pool, one cached OAuth token.

The requests go through the SDK client's own httpx client (its auth hook adds the token) rather than its typed
``correlate_message``/``publish_message``: those raise errors without the response headers, so ``Retry-After``
could not be honoured; they cannot read a 503 with an empty body or a 429; and their adaptive back-pressure gate
blocks a lane's thread beyond its handler timeout. The bodies follow the REST contract (``name``,
``correlationKey``, ``variables``, ``tenantId``, ``messageId``, ``timeToLive``).

With ``CAMUNDA_AUTH_STRATEGY=OAUTH`` the token comes from the worker's own client-credentials source, fed from the
settings as the SDK resolves them: cached until 30 s (or a tenth of its lifetime, if shorter) before it expires.

Outcomes: 2xx success (the keys, as strings, are the result); 404 in correlate mode not yet; 409 by its title
(``ALREADY_EXISTS`` success, any other a retry); 400 dead with the problem's title and detail; 401 a new token and
one more try, then, like 403 or a token endpoint refusing the client, :class:`~worker.policy.outcomes.AuthProblem`;
back-pressure (429, 503, a 500 whose problem says ``RESOURCE_EXHAUSTED``), other 5xx, 408, timeouts and connection
errors a retry after the answer's ``Retry-After``; any other 4xx dead.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import httpx

from worker.config import ConfigError, parse_duration
from worker.correlators.http import BODY_HEAD, ClientCredentials, answer_object, retry_after
from worker.message import Message, thaw
from worker.policy.outcomes import AuthProblem, PermanentError, Reschedule, Result, Retry, storable_text
from worker.redact import redact_text, redact_url

MODES = ("correlate", "publish")
ENDPOINTS = {"correlate": "messages/correlation", "publish": "messages/publication"}
DEFAULT_TIME_TO_LIVE = timedelta(hours=1)
BACK_PRESSURE = "RESOURCE_EXHAUSTED"

_clients: dict[tuple[object, ...], Any] = {}
_clients_lock = threading.Lock()


def sdk_client(url: str | None, timeout: float, setting: str, httpx_args: Mapping[str, Any] | None = None) -> Any:
    """The process's SDK client for this address (built once, then shared by every route that names it).

    ``httpx_args`` (tests: an ``httpx.MockTransport``) builds a client of its own, not shared.
    """
    # The SDK's settings are its environment variables: a client is shared only under the same ones.
    sdk_env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(("CAMUNDA_", "ZEEBE_"))))
    key = (url, timeout, sdk_env)
    with _clients_lock:
        if httpx_args is None and key in _clients:
            return _clients[key]
        client = _build_client(url, timeout, setting, httpx_args)
        if httpx_args is None:
            _clients[key] = client
        return client


def _build_client(url: str | None, timeout: float, setting: str, httpx_args: Mapping[str, Any] | None) -> Any:
    try:
        from camunda_orchestration_sdk import CamundaClient
        from camunda_orchestration_sdk.runtime.configuration_resolver import ConfigurationResolver, read_environment
        from camunda_orchestration_sdk.runtime.tls import build_ssl_context
    except ImportError:
        raise ConfigError(
            f"invalid setting {setting}: the camunda8 correlator needs Camunda's SDK: "
            "pip install 'correlation-worker[camunda8]'"
        ) from None
    overrides: dict[str, Any] = {"CAMUNDA_REST_ADDRESS": url} if url else {}
    try:
        # The settings exactly as the SDK resolves them (aliases, .env file, inferred strategy), read once here
        # to give OAuth its token source: the SDK's own keeps a token until 30 s before it expires, so a token
        # living 30 s or less would be fetched again for every call.
        config = ConfigurationResolver(
            environment=read_environment(), explicit_configuration=overrides or None
        ).resolve().effective
        provider = None
        if config.CAMUNDA_AUTH_STRATEGY == "OAUTH":
            verify = build_ssl_context(config)
            transport = (httpx_args or {}).get("transport")
            tokens = ClientCredentials(
                config.CAMUNDA_OAUTH_URL, config.CAMUNDA_CLIENT_ID or "", config.CAMUNDA_CLIENT_SECRET or "",
                audience=config.CAMUNDA_TOKEN_AUDIENCE,
                check="CAMUNDA_CLIENT_ID, CAMUNDA_CLIENT_SECRET, CAMUNDA_TOKEN_AUDIENCE and CAMUNDA_OAUTH_URL",
                client=httpx.Client(timeout=timeout, transport=transport, verify=verify if verify else True),
            )
            provider = TokenProvider(tokens)
        return CamundaClient(
            configuration=overrides or None,  # type: ignore[arg-type]  # a partial mapping of its settings
            auth_provider=provider,
            # The SDK's own lines go through the worker's logging (its format, JSON or text), not loguru's stderr.
            logger=logging.getLogger("worker.correlators.camunda8.sdk"),
            timeout=httpx.Timeout(timeout),
            httpx_args=dict(httpx_args or {}),
        )
    except Exception as error:  # the SDK's own validation of the CAMUNDA_* variables
        problem = _sdk_problem(error)
        raise ConfigError(f"invalid setting {setting}: the Camunda SDK refused its settings: {problem}") from None


class TokenProvider:
    """The SDK's auth-provider protocol (``get_headers``) over the worker's cached client-credentials token."""

    def __init__(self, tokens: ClientCredentials) -> None:
        self.tokens = tokens

    def get_headers(self) -> dict[str, str]:
        """The Authorization header: the cached token, or a new one shortly before it expires."""
        return {"Authorization": self.tokens.header()}

    def close(self) -> None:
        """Close the token endpoint's pool."""
        self.tokens.close()


def _sdk_problem(error: Exception) -> str:
    """What the SDK's configuration error says, without the values it was given (they may be secrets)."""
    errors = getattr(error, "errors", None)
    if callable(errors):
        try:
            found = errors(include_input=False, include_url=False)
            return "; ".join(f"{'.'.join(str(p) for p in item['loc']) or 'settings'}: {item['msg']}" for item in found)
        except Exception:  # not pydantic's: fall back to the text, redacted
            pass
    return redact_text(f"{type(error).__name__}: {error}")


class Camunda8Correlator:
    """Correlates or publishes messages to Camunda 8 through the SDK's client."""

    def __init__(
        self, client: Any, *, mode: str = "correlate", tenant_id: str | None = None,
        time_to_live: timedelta = DEFAULT_TIME_TO_LIVE,
    ) -> None:
        self.client = client
        self.mode = mode
        self.tenant_id = tenant_id or getattr(client.configuration, "CAMUNDA_TENANT_ID", None) or None
        self.time_to_live_ms = int(time_to_live.total_seconds() * 1000)
        self.http: httpx.Client = client.client.get_httpx_client()
        self.shown_url = redact_url(str(self.http.base_url).rstrip("/") + "/" + ENDPOINTS[mode])

    @classmethod
    def from_spec(
        cls, spec: Mapping[str, Any], setting: str, *, httpx_args: Mapping[str, Any] | None = None
    ) -> Camunda8Correlator:
        """Build from a route's JSON spec; a wrong mode, url, tenant or duration is a ConfigError."""
        mode = spec.get("mode", "correlate")
        if mode not in MODES:
            raise ConfigError(
                f"invalid setting {setting}: unknown camunda8 mode {mode!r}; use 'correlate' or 'publish'"
            )
        url = spec.get("url")
        if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
            raise ConfigError(f"invalid setting {setting}: a camunda8 'url' starts with http(s)://")
        tenant_id = spec.get("tenant_id")
        if tenant_id is not None and (not isinstance(tenant_id, str) or not tenant_id.strip()):
            raise ConfigError(f"invalid setting {setting}: 'tenant_id' must be a tenant's id")
        if "time_to_live" in spec and mode != "publish":
            raise ConfigError(
                f"invalid setting {setting}: 'time_to_live' belongs to mode 'publish' (a correlated message is not "
                "buffered by Camunda)"
            )
        durations = {}
        for key, default in (("time_to_live", DEFAULT_TIME_TO_LIVE), ("timeout", timedelta(seconds=10))):
            try:
                durations[key] = parse_duration(spec[key]) if key in spec else default
            except (ValueError, TypeError) as error:
                raise ConfigError(f"invalid setting {setting}: {key} {error}") from None
            if durations[key] < timedelta(0) or (key == "timeout" and durations[key] == timedelta(0)):
                raise ConfigError(f"invalid setting {setting}: {key} must be a positive duration, e.g. PT10S")
        client = sdk_client(url, durations["timeout"].total_seconds(), setting, httpx_args)
        return cls(client, mode=mode, tenant_id=tenant_id, time_to_live=durations["time_to_live"])

    def body(self, message: Message) -> dict[str, Any]:
        """The request of the REST contract for this message."""
        payload = thaw(message.payload)
        variables = payload if isinstance(payload, dict) else ({} if payload is None else {"payload": payload})
        body: dict[str, Any] = {"name": message.name, "correlationKey": message.hint, "variables": variables}
        tenant = message.headers.get("tenantId")
        tenant = tenant if isinstance(tenant, str) and tenant else self.tenant_id
        if tenant:  # without multi-tenancy the cluster refuses any tenant but <default>: send one only if given
            body["tenantId"] = tenant
        if self.mode == "publish":
            body["messageId"] = self.message_id(message)
            body["timeToLive"] = self.time_to_live_ms
        return body

    @staticmethod
    def message_id(message: Message) -> str:
        """The publication's id: the row's ``message_id``, else one derived from the row (stable across retries)."""
        return message.message_id or f"correlation-worker-{message.id}"

    def __call__(self, message: Message) -> Result:
        """Send the message; the keys Camunda answers are the result. Raise an outcome unless it succeeded."""
        body = self.body(message)
        response = self._post(body)
        if response.status_code == 401:  # the token may have been revoked or expired early: a new one, once
            self._forget_token(response)
            response = self._post(body)
        status = response.status_code
        if 200 <= status < 300:
            return Result(self._result(response, body))
        title, detail = _problem(response)
        said = f"{title}: {detail}" if title and detail else title or detail or "(no problem detail)"
        said = storable_text(said, BODY_HEAD)
        after = retry_after(response.headers.get("Retry-After"), response.headers.get("Date"))
        waits = "" if after is None else f" (Retry-After {after:.0f}s)"
        if status == 409:
            if title == "ALREADY_EXISTS":  # this messageId is still buffered: published before
                return Result({"messageId": body.get("messageId"), "alreadyExists": True})
            raise Retry(f"POST {self.shown_url} answered 409{waits}: {said}", after=after)
        if status == 404 and self.mode == "correlate":
            raise Reschedule(
                f"no process instance waits for message {message.name!r} with correlation key {message.hint!r} yet "
                f"(404 {said})"
            )
        if status in (401, 403):
            raise AuthProblem(
                f"POST {self.shown_url} answered {status}: Camunda refused the worker's credentials; check "
                f"CAMUNDA_AUTH_STRATEGY and its settings: {said}"
            )
        if status == 429 or status >= 500 or status == 408:
            pressure = " (back-pressure)" if status in (429, 503) or BACK_PRESSURE in said else ""
            raise Retry(f"POST {self.shown_url} answered {status}{pressure}{waits}: {said}", after=after)
        raise PermanentError(f"POST {self.shown_url} answered {status}: {said}")

    def _post(self, body: Mapping[str, Any]) -> httpx.Response:
        try:
            return self.http.post(ENDPOINTS[self.mode], json=body)
        except httpx.TimeoutException as error:
            raise Retry(f"POST {self.shown_url} timed out: {redact_text(str(error))}") from None
        except httpx.HTTPError as error:
            raise Retry(f"POST {self.shown_url} failed: {redact_text(str(error))}") from None

    def _forget_token(self, refused: httpx.Response) -> None:
        """The token of a refused request is dropped: the next request fetches a new one (OAuth only)."""
        provider = self.client.auth_provider
        if isinstance(provider, TokenProvider):
            provider.tokens.forget(refused.request.headers.get("Authorization", ""))

    def _result(self, response: httpx.Response, body: Mapping[str, Any]) -> dict[str, Any]:
        answer = answer_object(response) or {}
        result = {
            key: str(answer[key])  # Camunda 8 keys are strings (64-bit numbers): kept as strings
            for key in ("processInstanceKey", "messageKey")
            if answer.get(key) is not None
        }
        if answer.get("tenantId"):
            result["tenantId"] = str(answer["tenantId"])
        if self.mode == "publish":
            result["messageId"] = str(body["messageId"])
        return result

    def describe(self) -> str:
        """Where the messages go, as the SDK resolved its settings (never a secret): for check-config."""
        config = self.client.configuration
        auth = config.CAMUNDA_AUTH_STRATEGY
        who = {"OAUTH": f", client {config.CAMUNDA_CLIENT_ID} at {redact_url(config.CAMUNDA_OAUTH_URL)}",
               "BASIC": f", user {config.CAMUNDA_BASIC_AUTH_USERNAME}"}.get(auth, "")
        return f"{self.shown_url} (auth {auth}{who}, tenant {self.tenant_id or 'none sent'})"

    def close(self) -> None:
        """Nothing of its own: the SDK client is the process's, shared by routes."""


def _problem(response: httpx.Response) -> tuple[str, str]:
    """The problem detail (RFC 9457) of an error answer: its title and detail (or the head of the text)."""
    body = answer_object(response)
    if body is None:
        return "", response.text[:BODY_HEAD]
    title, detail = body.get("title"), body.get("detail")
    return (title if isinstance(title, str) else ""), (detail if isinstance(detail, str) else "")

