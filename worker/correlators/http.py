"""The ``http`` correlator: POSTs each message as JSON to an endpoint (DESIGN.md §5).

2xx is success; 5xx, timeouts and connection errors are retries; any other 4xx is permanent. A 3xx is not
followed: it is permanent, and its reason names the ``Location`` the endpoint pointed to. The ``camunda7``
preset speaks the message-correlation API of Camunda 7 / Operaton (``POST {url}/message``): its 400 "no process
definition or execution matches" means the process is not waiting yet, which is a retry, not an error.

Configured as::

    {"*": {"type": "http", "url": "http://engine:8080/engine-rest", "preset": "camunda7", "timeout": "PT10S"}}
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlsplit

import httpx

from worker.config import ConfigError, parse_duration
from worker.message import Message
from worker.policy.outcomes import PermanentError, Retry
from worker.redact import redact_text, redact_url

NOT_WAITING_MARKERS = ("no process definition or execution matches", "cannot correlate message")
BODY_HEAD = 500


def _plain(value: Any) -> Any:
    """Read-only payload values back to JSON-ready ones."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def _secret(spec: Mapping[str, Any], key: str, setting: str) -> str:
    """The value of the environment variable a route names under ``key`` (the secret never sits in the spec)."""
    name = spec.get(key)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"invalid setting {setting}: auth needs '{key}', the name of an environment variable")
    value = os.environ.get(name)
    if not value:
        raise ConfigError(f"invalid setting {setting}: auth '{key}' names {name}, which is not set or empty")
    return value


def auth_header(auth: object, setting: str) -> str | None:
    """The Authorization header of a route's ``auth``: bearer or basic, secrets read from the environment."""
    if auth is None:
        return None
    kind = auth.get("type") if isinstance(auth, Mapping) else None
    if not isinstance(auth, Mapping) or kind not in ("bearer", "basic"):
        raise ConfigError(
            f"invalid setting {setting}: 'auth' must be {{\"type\": \"bearer\", \"token_env\": ...}} or "
            '{"type": "basic", "username": ..., "password_env": ...}'
        )
    if kind == "bearer":
        return f"Bearer {_secret(auth, 'token_env', setting)}"
    username = auth.get("username")
    if not isinstance(username, str) or not username or ":" in username:
        raise ConfigError(f"invalid setting {setting}: basic auth needs a 'username' without ':'")
    pair = f"{username}:{_secret(auth, 'password_env', setting)}".encode()
    return f"Basic {base64.b64encode(pair).decode()}"


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
        "payload": _plain(message.payload),
        "headers": _plain(message.headers),
        "createdAt": message.created_at.isoformat(),
        "attempt": message.attempt,
    }


def camunda7_body(message: Message, *, correlate_all: bool = False, without_tenant: bool = False) -> dict[str, Any]:
    """A Camunda 7 / Operaton message-correlation request: the hint is the business key.

    The ``tenantId`` and ``processInstanceId`` headers narrow the correlation; without a ``tenantId`` header,
    ``without_tenant`` asks for definitions and executions that belong to no tenant.
    """
    payload = _plain(message.payload)
    variables = payload if isinstance(payload, dict) else {"payload": payload}
    body: dict[str, Any] = {
        "messageName": message.name,
        "businessKey": message.hint,
        "processVariables": {name: {"value": value} for name, value in variables.items()},
        "all": correlate_all,
    }
    headers = _plain(message.headers)
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


class HttpCorrelator:
    """POSTs messages to one endpoint with a shared connection pool."""

    def __init__(
        self,
        url: str,
        *,
        preset: str | None = None,
        timeout: timedelta = timedelta(seconds=10),
        headers: Mapping[str, str] | None = None,
        client: httpx.Client | None = None,
        correlate_all: bool = False,
        without_tenant: bool = False,
    ) -> None:
        self.preset = preset
        self.correlate_all = correlate_all
        self.without_tenant = without_tenant
        self.url = url.rstrip("/") + "/message" if preset == "camunda7" else url
        # What errors (and so last_error and the logs) name: the URL without its credentials.
        self.shown_url = redact_url(self.url)
        self.client = client or httpx.Client(timeout=timeout.total_seconds(), headers=dict(headers or {}))

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], setting: str) -> HttpCorrelator:
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
        authorization = auth_header(spec.get("auth"), setting)
        if authorization is not None:
            if any(k.lower() == "authorization" for k in headers):
                raise ConfigError(f"invalid setting {setting}: give 'auth' or an 'Authorization' header, not both")
            headers["Authorization"] = authorization
        if "@" in urlsplit(url).netloc and any(k.lower() == "authorization" for k in headers):
            # httpx turns URL credentials into an Authorization header that replaces the configured one.
            raise ConfigError(
                f"invalid setting {setting}: credentials in 'url' would replace the 'Authorization' header; "
                "give one of the two"
            )
        flags = {}
        for key in ("all", "without_tenant_id"):
            if not isinstance(spec.get(key, False), bool):
                raise ConfigError(f"invalid setting {setting}: '{key}' must be true or false")
            if key in spec and preset != "camunda7":
                raise ConfigError(f"invalid setting {setting}: '{key}' belongs to the camunda7 preset")
            flags[key] = bool(spec.get(key, False))
        return cls(
            url, preset=preset, timeout=timeout, headers=headers,
            correlate_all=flags["all"], without_tenant=flags["without_tenant_id"],
        )

    def __call__(self, message: Message) -> None:
        """POST the message; raise Retry or PermanentError unless the answer is 2xx."""
        if self.preset == "camunda7":
            body = camunda7_body(message, correlate_all=self.correlate_all, without_tenant=self.without_tenant)
        else:
            body = generic_body(message)
        try:
            response = self.client.post(
                self.url, content=json.dumps(body), headers={"Content-Type": "application/json"}
            )
        except httpx.TimeoutException as error:
            raise Retry(f"POST {self.shown_url} timed out: {redact_text(str(error))}") from None
        except httpx.TransportError as error:
            raise Retry(f"POST {self.shown_url} failed: {redact_text(str(error))}") from None
        status = response.status_code
        if 200 <= status < 300:
            return
        head = response.text[:BODY_HEAD]
        if 300 <= status < 400:  # not followed: a POST redirected is a route to fix, not a call to repeat
            location = redact_url(response.headers.get("Location", "(no Location header)"))
            raise PermanentError(
                f"POST {self.shown_url} answered {status} redirecting to {location}; redirects are not followed: "
                "set the route's url to the endpoint itself"
            )
        if status >= 500 or status in (408, 429):
            after = retry_after(response.headers.get("Retry-After"), response.headers.get("Date"))
            waits = "" if after is None else f" (Retry-After {after:.0f}s)"
            raise Retry(f"POST {self.shown_url} answered {status}{waits}: {head}", after=after)
        if self.preset == "camunda7" and status == 400 and any(m in head.lower() for m in NOT_WAITING_MARKERS):
            raise Retry(f"no process is waiting for {message.name!r} with business key {message.hint!r} yet: {head}")
        raise PermanentError(f"POST {self.shown_url} answered {status}: {head}")

    def close(self) -> None:
        """Close the connection pool."""
        self.client.close()
