"""The ``http`` correlator: POSTs each message as JSON to an endpoint (DESIGN.md §5).

2xx is success, and a JSON response body (up to 64 KiB) is the call's result, logged on the success line. What
is the endpoint's, not the message's (:mod:`worker.correlators.network`), is never an attempt: a connection
refused or reset, 502, 503 and 504 (the endpoint is not there) and 429 (it asks to be called less); the message
waits, in order, for ``Retry-After`` or for the destination's circuit to close. Other 5xx, 408 and timeouts are
retries, after the ``Retry-After`` the endpoint asks for (capped by the policy's ``backoff_cap``); 401 and 403 are
retries too when the route authenticates (``auth``, or the ``camunda7`` preset), logged as errors and counted
(:class:`~worker.policy.outcomes.AuthProblem`); any other 4xx is permanent. A 3xx is not followed: it is
permanent, and its reason names the ``Location`` the endpoint pointed to.

Requests are made by libcurl on the lane's thread (connections kept alive, the thread released from the interpreter
lock while it waits), the body encoded once.

The ``camunda7`` preset speaks the message-correlation API of Camunda 7 / Operaton (``POST {url}/message``, with
``resultEnabled``): the matched process instance id is the result; its 400 "no process definition or execution
matches" means the process is not waiting yet (:class:`~worker.policy.outcomes.Reschedule`: not an attempt);
any other 400 is dead with the engine's message.

Auth (``"auth"`` of the route; secrets are read from the environment variables it names, never from the spec):
``bearer`` (``token_env``), ``basic`` (``username``, ``password_env``) and ``oauth2`` client credentials
(``token_url``, ``client_id``, ``client_secret_env``, optional ``scope`` and ``audience``: the token is cached
until shortly before it expires, and fetched again once when the endpoint answers 401).

Configured as::

    {"*": {"type": "http", "url": "http://engine:8080/engine-rest", "preset": "camunda7", "timeout": "PT10S"}}

with, optionally, the destination's settings (:func:`worker.correlators.network.target_config`): ``max_in_flight``,
``breaker_failures``, ``breaker_probe``, ``breaker_probe_max`` and ``busy_open_after``.
"""

from __future__ import annotations

import base64
import json
import math
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlsplit

import orjson

from worker.config import ConfigError, parse_duration, secret_from_environment
from worker.correlators.network import (
    Destination,
    HttpClient,
    NetworkCorrelator,
    Reply,
    TargetBusy,
    TargetUnavailable,
    destination_for,
    target_config,
    wait_within_deadline,
)
from worker.message import Message, thaw
from worker.policy.outcomes import AuthProblem, PermanentError, Reschedule, Result, Retry, storable_text
from worker.redact import redact_url

NOT_WAITING_MARKERS = ("no process definition or execution matches",)
BODY_HEAD = 500


# A token is fetched again this long (or a tenth of its lifetime, if shorter) before it expires.
TOKEN_SKEW = 30.0


class ClientCredentials:
    """An OAuth 2.0 client-credentials token, cached until shortly before it expires.

    Thirty lines of RFC 6749 §4.4 on the call loop's HTTP client: no library for it is worth its weight. One
    request at a time fetches a token; the calls waiting meanwhile take the one it brings.
    """

    def __init__(
        self, token_url: str, client_id: str, client_secret: str, *, scope: str | None = None,
        audience: str | None = None, client: HttpClient | None = None, clock: Callable[[], float] = time.monotonic,
        check: str = "the route's auth: its client_id and the variable its client_secret_env names",
    ) -> None:
        self.token_url = token_url
        self.check = check  # what an operator checks when the token endpoint refuses the client
        self._form = {"grant_type": "client_credentials", "client_id": client_id, "client_secret": client_secret}
        if scope:
            self._form["scope"] = scope
        if audience:
            self._form["audience"] = audience
        self._client = client or HttpClient(10.0, {"Accept": "application/json"})
        self._clock = clock
        self._lock = threading.Lock()  # one token fetch at a time; the lanes' threads share the token
        self._token: str | None = None
        self._expires = 0.0

    def header(self) -> str:
        """``Bearer <token>``: the cached token, or a new one when it is (nearly) expired."""
        # Another thread's fetch is waited for no longer than this call's deadline (its own fetch is bounded by it).
        wait_within_deadline(self._lock, f"a token from {redact_url(self.token_url)}")
        try:
            now = self._clock()
            if self._token is None or now >= self._expires:
                self._token, lifetime = self._fetch()
                self._expires = now + max(lifetime - min(TOKEN_SKEW, lifetime / 10), 0.0)
            return f"Bearer {self._token}"
        finally:
            self._lock.release()

    def forget(self, header: str) -> None:
        """The endpoint refused the token of ``header``: the next call fetches a new one."""
        if header == f"Bearer {self._token}":
            self._token = None

    def _fetch(self) -> tuple[str, float]:
        shown = redact_url(self.token_url)
        try:
            response = self._client.post(self.token_url, f"the token endpoint {shown}", data=self._form)
        except Retry as error:  # unreachable or timed out: the call is tried again later
            raise Retry(str(error)) from None
        if response.status in (400, 401, 403):  # RFC 6749 §5.2: invalid_client, unauthorized_client, ...
            raise AuthProblem(
                f"the token endpoint {shown} refused the client credentials ({response.status} "
                f"{_problem(response)}); check {self.check}"
            )
        if response.status != 200:
            raise Retry(f"the token endpoint {shown} answered {response.status}: {_problem(response)}")
        answer = answer_object(response)
        try:
            assert answer is not None
            token, lifetime = answer["access_token"], float(answer.get("expires_in", 60))
        except (AssertionError, ValueError, KeyError, TypeError):
            raise Retry(f"the token endpoint {shown} answered 200 without an access_token") from None
        if not isinstance(token, str) or not token:
            raise Retry(f"the token endpoint {shown} answered 200 without an access_token")
        # An unreadable lifetime (NaN, infinite) would keep the token forever: it is used for this call only.
        return token, lifetime if math.isfinite(lifetime) else 0.0

    def close(self) -> None:
        """Close the token endpoint's connections."""
        self._client.close()


Auth = str | ClientCredentials | None


def build_auth(auth: object, setting: str) -> Auth:
    """A route's ``auth``: a fixed Authorization header (bearer, basic) or an OAuth2 token source."""
    if auth is None:
        return None
    kind = auth.get("type") if isinstance(auth, Mapping) else None
    if not isinstance(auth, Mapping) or kind not in ("bearer", "basic", "oauth2"):
        raise ConfigError(
            f"invalid setting {setting}: 'auth' must be {{\"type\": \"bearer\", \"token_env\": ...}}, "
            '{"type": "basic", "username": ..., "password_env": ...} or '
            '{"type": "oauth2", "token_url": ..., "client_id": ..., "client_secret_env": ...}'
        )
    known = AUTH_KEYS[kind]
    for key in auth:
        if key not in known:
            raise ConfigError(
                f"invalid setting {setting}: {key!r} is not a key of {kind} auth; its keys: {', '.join(sorted(known))}"
            )
    if kind == "bearer":
        return f"Bearer {secret_from_environment(auth, 'token_env', setting)}"
    if kind == "basic":
        username = auth.get("username")
        if not isinstance(username, str) or not username or ":" in username:
            raise ConfigError(f"invalid setting {setting}: basic auth needs a 'username' without ':'")
        pair = f"{username}:{secret_from_environment(auth, 'password_env', setting)}".encode()
        return f"Basic {base64.b64encode(pair).decode()}"
    token_url, client_id = auth.get("token_url"), auth.get("client_id")
    if not isinstance(token_url, str) or not token_url.startswith(("http://", "https://")):
        raise ConfigError(f"invalid setting {setting}: oauth2 auth needs a 'token_url' starting with http(s)://")
    if not isinstance(client_id, str) or not client_id:
        raise ConfigError(f"invalid setting {setting}: oauth2 auth needs a 'client_id'")
    for key in ("scope", "audience"):
        if not isinstance(auth.get(key, ""), str):
            raise ConfigError(f"invalid setting {setting}: oauth2 auth's {key!r} must be text")
    return ClientCredentials(
        token_url, client_id, secret_from_environment(auth, "client_secret_env", setting),
        scope=auth.get("scope"), audience=auth.get("audience"),
    )


AUTH_KEYS = {
    "bearer": frozenset({"type", "token_env"}),
    "basic": frozenset({"type", "username", "password_env"}),
    "oauth2": frozenset({"type", "token_url", "client_id", "client_secret_env", "scope", "audience"}),
}


def answer_json(response: Reply) -> object:
    """An answer's body as JSON (None when it is empty, cut short or not JSON)."""
    if not response.body or response.truncated:
        return None
    try:
        return json.loads(response.body)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than a decoder goes
        return None


def answer_object(response: Reply) -> Mapping[str, Any] | None:
    """An answer's body when it is a JSON object (a problem detail, a Camunda answer), else None."""
    body = answer_json(response)
    return body if isinstance(body, Mapping) else None


def _problem(response: Reply) -> str:
    """What an error answer says: a problem+json or Camunda 7 body's type/title and detail/message, else the
    head of its text."""
    body = answer_object(response)
    if body is not None:
        parts = [str(body[key]) for key in ("title", "type", "error", "detail", "message", "error_description")
                 if isinstance(body.get(key), str | int) and body.get(key) != ""]
        if parts:
            return storable_text(": ".join(parts), BODY_HEAD)
    return storable_text(response.body[:BODY_HEAD * 4].decode("utf-8", "replace"), BODY_HEAD) or "(empty body)"


def _json_result(response: Reply) -> object:
    """A 2xx answer's JSON body, if it has one that is small enough to keep (else None)."""
    if "json" not in response.headers.get("Content-Type", ""):
        return None
    return answer_json(response)


def encode(body: object) -> bytes:
    """A request body as JSON bytes, once (orjson; Python's encoder for what orjson refuses, such as an integer
    past 64 bits)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body, separators=(",", ":")).encode()


def back_pressure_or_outage(status: int, shown: str, head: str, after: float | None) -> Retry | None:
    """The outcome of an answer that is the target's, not the message's: 429 (busy), 502/503/504 (not there);
    None for any other status."""
    waits = "" if after is None else f" (Retry-After {after:.0f}s)"
    if status == 429:
        return TargetBusy(f"POST {shown} answered 429{waits}: {head}", after=after)
    if status in (502, 503, 504):
        return TargetUnavailable(f"POST {shown} answered {status}{waits}: {head}", after=after)
    return None


def retry_after(value: str | None, date: str | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (delta-seconds or an HTTP date), or None when unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
        now = parsedate_to_datetime(date) if date else datetime.now(UTC)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None or now.tzinfo is None:
        return None
    return max((when - now).total_seconds(), 0.0)


def generic_body(message: Message) -> dict[str, Any]:
    """The message as JSON: its ids, name, hint, payload, headers, times and attempt."""
    return {
        "id": message.id,
        "messageId": message.message_id,
        "messageName": message.name,
        "correlationHint": message.hint,
        "payload": thaw(message.payload),
        "headers": thaw(message.headers),
        "createdAt": message.created_at.isoformat(),
        "attempt": message.attempt,
    }


def camunda7_body(message: Message, *, correlate_all: bool = False, without_tenant: bool = False) -> dict[str, Any]:
    """A Camunda 7 / Operaton message-correlation request: the hint is the business key.

    The ``tenantId`` and ``processInstanceId`` headers narrow the correlation; without a ``tenantId`` header,
    ``without_tenant`` asks for definitions and executions that belong to no tenant.
    """
    payload = thaw(message.payload)
    variables = payload if isinstance(payload, dict) else {"payload": payload}
    body: dict[str, Any] = {
        "messageName": message.name,
        "businessKey": message.hint,
        "processVariables": {name: {"value": value} for name, value in variables.items()},
        "all": correlate_all,
        "resultEnabled": True,
    }
    headers = thaw(message.headers)
    if isinstance(headers.get("tenantId"), str) and headers["tenantId"]:
        body["tenantId"] = headers["tenantId"]
    elif without_tenant:
        body["withoutTenantId"] = True
    if isinstance(headers.get("processInstanceId"), str) and headers["processInstanceId"]:
        body["processInstanceId"] = headers["processInstanceId"]
    keys = headers.get("correlationKeys")
    if isinstance(keys, dict):
        body["correlationKeys"] = {name: {"value": value} for name, value in keys.items()}
    return body


class HttpCorrelator(NetworkCorrelator):
    """POSTs messages to one endpoint from the call loop, its connections kept alive."""

    def __init__(
        self,
        url: str,
        *,
        preset: str | None = None,
        timeout: timedelta = timedelta(seconds=10),
        headers: Mapping[str, str] | None = None,
        correlate_all: bool = False,
        without_tenant: bool = False,
        auth: Auth = None,
        destination: Destination | None = None,
    ) -> None:
        self.preset = preset
        # A 401 or 403 is a credentials problem to fix, retried, where the route authenticates: with 'auth', or
        # an engine (whose REST API may sit behind its own authentication); else a plain permanent 4xx.
        self.authenticates = auth is not None or preset == "camunda7"
        self.auth = auth
        self.correlate_all = correlate_all
        self.without_tenant = without_tenant
        self.url = url.rstrip("/") + "/message" if preset == "camunda7" else url
        # What errors (and so last_error and the logs) name: the URL without its credentials.
        self.shown_url = redact_url(self.url)
        self.destination = destination or Destination(self.url, self.shown_url, target_config({}, "http"))
        self.client = HttpClient(timeout.total_seconds(), dict(headers or {}))

    @classmethod
    def from_spec(
        cls, spec: Mapping[str, Any], setting: str, destinations: dict[str, Destination] | None = None
    ) -> HttpCorrelator:
        """Build from a route's JSON spec; a missing URL or unknown preset is a ConfigError."""
        url = spec.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"invalid setting {setting}: an http correlator needs a 'url' starting with http(s)://")
        try:
            host = urlsplit(url).hostname
        except ValueError as error:
            raise ConfigError(f"invalid setting {setting}: the url is not one ({error})") from None
        if not host:
            raise ConfigError(f"invalid setting {setting}: the url {redact_url(url)!r} names no host")
        preset = spec.get("preset")
        if preset not in (None, "camunda7"):
            raise ConfigError(f"invalid setting {setting}: unknown preset {preset!r}; the known one is 'camunda7'")
        try:
            timeout = parse_duration(spec.get("timeout", "PT10S"))
        except ValueError as error:
            raise ConfigError(f"invalid setting {setting}: timeout {error}") from None
        if timeout <= timedelta(0):
            raise ConfigError(f"invalid setting {setting}: timeout PT0S would fail every call at once; use e.g. PT10S")
        headers = spec.get("headers") or {}
        if not isinstance(headers, dict):
            raise ConfigError(f"invalid setting {setting}: 'headers' must be an object")
        for key, value in headers.items():
            if any(char in f"{key}{value}" for char in "\r\n\0"):
                raise ConfigError(
                    f"invalid setting {setting}: the header {str(key)!r} holds a line break or NUL, which would split "
                    "the request"
                )
        headers = {str(k): str(v) for k, v in headers.items()}
        auth = build_auth(spec.get("auth"), setting)
        if auth is not None and any(k.lower() == "authorization" for k in headers):
            raise ConfigError(f"invalid setting {setting}: give 'auth' or an 'Authorization' header, not both")
        parts = urlsplit(url)
        if "@" in parts.netloc:
            if auth is not None or any(k.lower() == "authorization" for k in headers):
                # URL credentials become an Authorization header that would replace the configured one.
                raise ConfigError(
                    f"invalid setting {setting}: credentials in 'url' would replace the 'Authorization' header; "
                    "give one of the two"
                )
            if parts.username is not None:  # user:password@ in the URL: basic auth, as a browser would send it
                from urllib.parse import unquote

                pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
                auth = f"Basic {base64.b64encode(pair).decode()}"
                url = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
        flags = {}
        for key in ("all", "without_tenant_id"):
            if not isinstance(spec.get(key, False), bool):
                raise ConfigError(f"invalid setting {setting}: '{key}' must be true or false")
            if key in spec and preset != "camunda7":
                raise ConfigError(f"invalid setting {setting}: '{key}' belongs to the camunda7 preset")
            flags[key] = bool(spec.get(key, False))
        endpoint = url.rstrip("/") + "/message" if preset == "camunda7" else url
        destination = destination_for(
            {} if destinations is None else destinations, endpoint.split("?", 1)[0], redact_url(endpoint),
            target_config(spec, setting), setting,
        )
        return cls(
            url, preset=preset, timeout=timeout, headers=headers,
            correlate_all=flags["all"], without_tenant=flags["without_tenant_id"], auth=auth,
            destination=destination,
        )

    def call(self, message: Message) -> Result:
        """POST the message; its answer's JSON is the result. Raise an outcome unless the answer is 2xx."""
        if self.preset == "camunda7":
            body = camunda7_body(message, correlate_all=self.correlate_all, without_tenant=self.without_tenant)
        else:
            body = generic_body(message)
        content = encode(body)
        response, sent = self._post(content)
        if response.status == 401 and isinstance(self.auth, ClientCredentials):
            self.auth.forget(sent)
            response, _ = self._post(content)  # once, with a new token
        status = response.status
        if 200 <= status < 300:
            answer = _json_result(response)
            return Result(camunda7_result(answer) if self.preset == "camunda7" else answer)
        head = _problem(response)
        if 300 <= status < 400:  # not followed: a POST redirected is a route to fix, not a call to repeat
            location = redact_url(response.headers.get("Location", "(no Location header)"))
            raise PermanentError(
                f"POST {self.shown_url} answered {status} redirecting to {location}; redirects are not followed: "
                "set the route's url to the endpoint itself"
            )
        after = retry_after(response.headers.get("Retry-After"), response.headers.get("Date"))
        targets = back_pressure_or_outage(status, self.shown_url, head, after)
        if targets is not None:
            raise targets
        if status >= 500 or status == 408:
            waits = "" if after is None else f" (Retry-After {after:.0f}s)"
            raise Retry(f"POST {self.shown_url} answered {status}{waits}: {head}", after=after)
        if status in (401, 403) and self.authenticates:
            raise AuthProblem(
                f"POST {self.shown_url} answered {status}: the endpoint refused the worker's credentials; fix the "
                f"route's auth: {head}"
            )
        if self.preset == "camunda7" and status == 400 and any(m in head.lower() for m in NOT_WAITING_MARKERS):
            raise Reschedule(
                f"no process is waiting for {message.name!r} with business key {message.hint!r} yet: {head}"
            )
        raise PermanentError(f"POST {self.shown_url} answered {status}: {head}")

    def _post(self, content: bytes) -> tuple[Reply, str]:
        """The answer, and the Authorization header sent (a refused token is forgotten by it)."""
        headers = {"Content-Type": "application/json"}
        if isinstance(self.auth, ClientCredentials):
            headers["Authorization"] = self.auth.header()
        elif self.auth is not None:
            headers["Authorization"] = self.auth
        reply = self.client.post(self.url, self.shown_url, data=content, headers=headers)
        return reply, headers.get("Authorization", "")

    def close(self) -> None:
        """Close the connections."""
        self.client.close()
        if isinstance(self.auth, ClientCredentials):
            self.auth.close()


def camunda7_result(answer: object) -> dict[str, Any] | None:
    """The process instance(s) a Camunda 7 correlation with ``resultEnabled`` matched: ``processInstanceId``
    (the first) and, when it matched several (``all``), ``processInstanceIds``."""
    if not isinstance(answer, list):
        return None
    ids = []
    for item in answer:
        if not isinstance(item, Mapping):
            continue
        instance = item.get("processInstance") if item.get("resultType") == "ProcessDefinition" else None
        execution = item.get("execution")
        if isinstance(instance, Mapping) and instance.get("id"):
            ids.append(str(instance["id"]))
        elif isinstance(execution, Mapping) and execution.get("processInstanceId"):
            ids.append(str(execution["processInstanceId"]))
    if not ids:
        return None
    return {"processInstanceId": ids[0]} if len(ids) == 1 else {"processInstanceId": ids[0], "processInstanceIds": ids}
