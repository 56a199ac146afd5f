"""The ``camunda8`` correlator: hands each message to Camunda 8 (Zeebe) over its REST API (``/v2``).

Two modes, by the route's ``mode``:

- ``correlate`` (the default): ``POST /v2/messages/correlation``. Camunda does not buffer such a message: when no
  process instance waits for it yet (404 whose problem says ``NOT_FOUND``: no subscription for the message), the
  worker keeps it (:class:`~worker.policy.outcomes.Reschedule`: not yet, not an attempt) and tries again later, in
  order. Success answers the process instance and message keys.
- ``publish``: ``POST /v2/messages/publication`` with a ``messageId`` (the row's ``message_id``, else one derived
  from its id) and the route's ``time_to_live`` (default ``PT1H``): the broker buffers it; publishing the same id
  again while it is buffered (409 ``ALREADY_EXISTS``) is success, so a retry after an unclear answer is safe.

The settings are the official SDK's (``camunda-orchestration-sdk``, the ``camunda8`` extra), read by its own
resolver from its environment variables (``CAMUNDA_REST_ADDRESS``, ``CAMUNDA_AUTH_STRATEGY``,
``CAMUNDA_CLIENT_ID``, ``CAMUNDA_CLIENT_SECRET``, ``CAMUNDA_OAUTH_URL``, ``CAMUNDA_TOKEN_AUDIENCE``,
``CAMUNDA_BASIC_AUTH_USERNAME`` / ``_PASSWORD``, ``CAMUNDA_TENANT_ID``, ``CAMUNDA_MTLS_*``, an ``.env`` file, …);
a route may override ``url`` and ``tenant_id``. With a camunda8 route, a ``CAMUNDA_*`` / ``ZEEBE_*`` variable the
SDK does not read (a misspelling: its setting would silently be the default) and an address that cannot be a REST
base (not http(s), no host, a query or fragment the SDK would append ``/v2`` after) are ConfigErrors naming it.
The requests go out on the process's call loop
(:mod:`worker.correlators.network`: libcurl, connections kept alive), not through the SDK's httpx client: a call
then costs a fraction of the CPU, ``Retry-After`` and an empty 503 are read, and no back-pressure gate of the SDK
blocks past the handler timeout. The bodies follow the REST contract (``name``, ``correlationKey``,
``variables``, ``tenantId``, ``messageId``, ``timeToLive``). One connection pool and one cached OAuth token per
address and settings.

With ``CAMUNDA_AUTH_STRATEGY=OAUTH`` the token comes from the worker's own client-credentials source, fed from the
settings as the SDK resolves them: cached until 30 s (or a tenth of its lifetime, if shorter) before it expires.

Outcomes: 2xx success (the keys, as strings, are the result); Camunda's own "no subscription" 404 in correlate mode
not yet; any other 404 (a wrong base path, an ingress's page) and any 3xx (its ``Location`` in the reason) are not
Camunda's REST API answering: retries, charged like any failure, the status and the head of the body in the reason;
409 by its title
(``ALREADY_EXISTS`` success, any other a retry); 400 dead with the problem's title and detail; 401 a new token and
one more try, then, like 403 or a token endpoint refusing the client, :class:`~worker.policy.outcomes.AuthProblem`.
The cluster's, never the message's (no attempt: the message waits for ``Retry-After`` or for the destination's
circuit to close): back-pressure (429, or any error whose problem says ``RESOURCE_EXHAUSTED``), 502/503/504, and a
connection refused or reset. Other 5xx, 408 and timeouts are retries after the answer's ``Retry-After``; any other
4xx is dead. A message whose ``tenantId`` header is not a non-empty string is dead, never sent without it.
"""

from __future__ import annotations

import base64
import difflib
import json
import os
import re
import threading
from collections.abc import Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from worker.config import ConfigError, kubernetes_service_link, parse_duration
from worker.correlators.http import (
    BODY_HEAD,
    ClientCredentials,
    answer_object,
    back_pressure_or_outage,
    encode,
    retry_after,
)
from worker.correlators.network import (
    Destination,
    HttpClient,
    NetworkCorrelator,
    Reply,
    TargetBusy,
    Tls,
    destination_for,
    target_config,
)
from worker.message import Message, thaw
from worker.policy.outcomes import AuthProblem, PermanentError, Reschedule, Result, Retry, storable_text
from worker.redact import redact_text, redact_url

MODES = ("correlate", "publish")
ENDPOINTS = {"correlate": "messages/correlation", "publish": "messages/publication"}
DEFAULT_TIME_TO_LIVE = timedelta(hours=1)
BACK_PRESSURE = "RESOURCE_EXHAUSTED"
# Camunda's 404 when no process instance waits: "Expected to find subscription for message with name '…' and
# correlation key '…', but none was found." (also when one is active for a message start event with that key).
NO_SUBSCRIPTION = "find subscription for message"
TENANT_HEADER = "tenantId"
SDK_PREFIXES = ("CAMUNDA_", "ZEEBE_")  # the SDK's variables; a camunda8 route refuses one it does not read
EXCERPT = 200  # characters of an answer's body that is not a problem detail, in a failure's reason


class Cluster:
    """A Camunda 8 cluster as the SDK's settings describe it: its REST address, authentication and TLS."""

    def __init__(self, configuration: Any, client: HttpClient, auth: ClientCredentials | str | None) -> None:
        self.configuration = configuration
        self.base_url = str(configuration.CAMUNDA_REST_ADDRESS).rstrip("/")
        self.client = client
        self.auth = auth

    def authorization(self) -> str | None:
        """The Authorization header of a request (None without authentication)."""
        if isinstance(self.auth, ClientCredentials):
            return self.auth.header()
        return self.auth


_clusters: dict[tuple[object, ...], Cluster] = {}
_clusters_lock = threading.Lock()


def address_problem(url: str) -> str | None:
    """Why an address cannot be Camunda's REST API base (or its token endpoint), or None: an http(s) URL with a
    host, and no query or fragment (``/v2`` and the endpoint are appended to its path)."""
    shown = repr(redact_url(url))
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        return f"{shown} is not a URL ({error})"
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        return f"{shown} is not an http(s) URL; use e.g. https://camunda.example.com"
    if not parts.hostname:
        return f"{shown} names no host"
    if any(char.isspace() for char in url):
        return f"{shown} holds a space"
    if parts.query or parts.fragment or url.rstrip().endswith(("?", "#")):
        return f"{shown} has a query or fragment, which the request path would be appended after; remove it"
    if port == 0:
        return f"{shown} has port 0"
    return None


def unknown_variable_problem(names: Iterable[str], known: Iterable[str]) -> tuple[str, str] | None:
    """The first ``CAMUNDA_*`` / ``ZEEBE_*`` variable that the SDK does not read, and why (with the known name it
    is closest to), or None. Such a variable is a misspelling whose setting silently falls back to the default."""
    known = sorted(known)
    for name in sorted(names):
        if name.upper().startswith(SDK_PREFIXES) and name not in known and not kubernetes_service_link(name):
            guess = difflib.get_close_matches(name.upper(), known, n=1, cutoff=0.6)
            hint = f"; did you mean {guess[0]}?" if guess else f"; the SDK reads {', '.join(known)}"
            return name, f"is not a setting of the Camunda SDK, which would ignore it{hint}"
    return None


def cluster_for(url: str | None, timeout: float, setting: str) -> Cluster:
    """The process's cluster for this address (built once, then shared by every route that names it)."""
    # The SDK's settings are its environment variables: a cluster is shared only under the same ones.
    sdk_env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(("CAMUNDA_", "ZEEBE_"))))
    key = (url, timeout, sdk_env)
    with _clusters_lock:
        if key not in _clusters:
            _clusters[key] = _build_cluster(url, timeout, setting)
        return _clusters[key]


def _tls(config: Any) -> Tls | None:
    """The CAMUNDA_MTLS_* material as the SDK reads it (inline PEM before a path), or None when none is set."""

    def pem(inline: str | None, path: str | None) -> str | None:
        if inline:
            return inline
        return Path(path).read_text(encoding="utf-8") if path else None

    tls = Tls(
        ca=pem(config.CAMUNDA_MTLS_CA, config.CAMUNDA_MTLS_CA_PATH),
        cert=pem(config.CAMUNDA_MTLS_CERT, config.CAMUNDA_MTLS_CERT_PATH),
        key=pem(config.CAMUNDA_MTLS_KEY, config.CAMUNDA_MTLS_KEY_PATH),
        passphrase=config.CAMUNDA_MTLS_KEY_PASSPHRASE or None,
    )
    return tls if tls.ca or tls.cert or tls.key else None


def _build_cluster(url: str | None, timeout: float, setting: str) -> Cluster:
    try:
        from camunda_orchestration_sdk.runtime.configuration_resolver import (
            CAMUNDA_SDK_CONFIG_KEYS,
            ConfigurationResolver,
            read_environment,
        )
        from camunda_orchestration_sdk.runtime.tls import build_ssl_context
    except ImportError:
        raise ConfigError(
            f"invalid setting {setting}: the camunda8 correlator needs Camunda's SDK: "
            "pip install '.[camunda8]' in a clone of correlation-worker"
        ) from None
    unknown = unknown_variable_problem(os.environ, [*CAMUNDA_SDK_CONFIG_KEYS, "CAMUNDA_LOAD_ENVFILE"])
    if unknown is not None:
        raise ConfigError(f"invalid setting {unknown[0]}: {unknown[1]}")
    overrides: dict[str, Any] = {"CAMUNDA_REST_ADDRESS": url} if url else {}
    environment = read_environment()
    try:
        # The settings exactly as the SDK resolves them (aliases, .env file, inferred strategy, /v2 appended).
        config = ConfigurationResolver(
            environment=environment, explicit_configuration=overrides or None
        ).resolve().effective
    except Exception as error:  # the SDK's own validation of the CAMUNDA_* variables
        variable, problem = _sdk_problem(error)
        raise ConfigError(
            f"invalid setting {variable or setting}: the Camunda SDK refused it: {problem}"
        ) from None
    rest = setting if url else _given("CAMUNDA_REST_ADDRESS", environment)
    addresses = [(rest, url or environment.get(rest), config.CAMUNDA_REST_ADDRESS)]
    if config.CAMUNDA_AUTH_STRATEGY == "OAUTH":
        addresses.append(("CAMUNDA_OAUTH_URL", environment.get("CAMUNDA_OAUTH_URL"), config.CAMUNDA_OAUTH_URL))
    for variable, given, effective in addresses:
        # As given (the words the operator wrote), then as the SDK resolved it (a .env file, /v2 appended).
        wrong = (address_problem(str(given)) if given is not None else None) or address_problem(str(effective))
        if wrong is not None:
            raise ConfigError(f"invalid setting {variable}: {wrong}")
    try:
        build_ssl_context(config)  # the SDK's own reading of the CAMUNDA_MTLS_* material: what it refuses, we do
        tls = _tls(config)
    except Exception as error:  # unreadable certificates or key
        variable, problem = _sdk_problem(error)
        raise ConfigError(f"invalid setting {variable or 'CAMUNDA_MTLS_*'}: {problem}") from None
    auth: ClientCredentials | str | None = None
    if config.CAMUNDA_AUTH_STRATEGY == "OAUTH":
        auth = ClientCredentials(
            config.CAMUNDA_OAUTH_URL, config.CAMUNDA_CLIENT_ID or "", config.CAMUNDA_CLIENT_SECRET or "",
            audience=config.CAMUNDA_TOKEN_AUDIENCE,
            check="CAMUNDA_CLIENT_ID, CAMUNDA_CLIENT_SECRET, CAMUNDA_TOKEN_AUDIENCE and CAMUNDA_OAUTH_URL",
            client=HttpClient(timeout, {"Accept": "application/json"}, tls),
        )
    elif config.CAMUNDA_AUTH_STRATEGY == "BASIC":
        pair = f"{config.CAMUNDA_BASIC_AUTH_USERNAME or ''}:{config.CAMUNDA_BASIC_AUTH_PASSWORD or ''}"
        auth = f"Basic {base64.b64encode(pair.encode()).decode()}"
    return Cluster(config, HttpClient(timeout, {"Accept": "application/json"}, tls), auth)


def _given(variable: str, environment: Mapping[str, Any]) -> str:
    """The variable that gave a setting: ``ZEEBE_REST_ADDRESS`` is an alias of ``CAMUNDA_REST_ADDRESS``."""
    if variable == "CAMUNDA_REST_ADDRESS" and variable not in environment and "ZEEBE_REST_ADDRESS" in environment:
        return "ZEEBE_REST_ADDRESS"
    return variable


def _sdk_problem(error: Exception) -> tuple[str | None, str]:
    """The variable the SDK's configuration error names (None if it names none) and what it says, without the
    values it was given (they may be secrets)."""
    errors = getattr(error, "errors", None)
    if callable(errors):
        try:
            found = errors(include_input=False, include_url=False)
            named = [".".join(str(p) for p in item["loc"]) for item in found]
            said = "; ".join(str(item["msg"]).removeprefix("Value error, ") for item in found)
            return next((name for name in named if name), None) or _first_variable(said), said
        except Exception:  # not pydantic's: fall back to the text, redacted
            pass
    said = redact_text(str(error) or type(error).__name__)
    return _first_variable(said), said


def _first_variable(text: str) -> str | None:
    found = re.search(r"\b(?:CAMUNDA|ZEEBE)_[A-Z_]+\b", text)
    return found.group(0) if found else None


class Camunda8Correlator(NetworkCorrelator):
    """Correlates or publishes messages to a Camunda 8 cluster from the call loop."""

    def __init__(
        self, cluster: Cluster, *, mode: str = "correlate", tenant_id: str | None = None,
        time_to_live: timedelta = DEFAULT_TIME_TO_LIVE, destination: Destination | None = None,
    ) -> None:
        self.cluster = cluster
        self.mode = mode
        self.tenant_id = tenant_id or getattr(cluster.configuration, "CAMUNDA_TENANT_ID", None) or None
        self.time_to_live_ms = int(time_to_live.total_seconds() * 1000)
        self.url = f"{cluster.base_url}/{ENDPOINTS[mode]}"
        self.shown_url = redact_url(self.url)
        self.destination = destination or Destination(
            cluster.base_url, redact_url(cluster.base_url), target_config({}, "camunda8")
        )

    @classmethod
    def from_spec(
        cls, spec: Mapping[str, Any], setting: str, destinations: dict[str, Destination] | None = None
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
        if url is not None and (problem := address_problem(url)) is not None:
            raise ConfigError(f"invalid setting {setting}: url {problem}")
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
        config = target_config(spec, setting)
        cluster = cluster_for(url, durations["timeout"].total_seconds(), setting)
        destination = destination_for(
            {} if destinations is None else destinations, cluster.base_url, redact_url(cluster.base_url),
            config, setting,
        )
        return cls(cluster, mode=mode, tenant_id=tenant_id, time_to_live=durations["time_to_live"],
                   destination=destination)

    def body(self, message: Message) -> dict[str, Any]:
        """The request of the REST contract for this message."""
        payload = thaw(message.payload)
        variables = payload if isinstance(payload, dict) else ({} if payload is None else {"payload": payload})
        body: dict[str, Any] = {"name": message.name, "correlationKey": message.hint, "variables": variables}
        tenant = message.headers.get(TENANT_HEADER, self.tenant_id)
        if TENANT_HEADER in message.headers and (not isinstance(tenant, str) or not tenant.strip()):
            shown = json.dumps(thaw(tenant), default=str)
            raise PermanentError(
                f"header {TENANT_HEADER!r} is {shown}: a tenant is a non-empty string such as \"shop-eu\"; fix or "
                "remove the header"
            )
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

    def call(self, message: Message) -> Result:
        """Send the message; the keys Camunda answers are the result. Raise an outcome unless it succeeded."""
        body = self.body(message)
        content = encode(body)
        response, sent = self._post(content)
        if response.status == 401 and isinstance(self.cluster.auth, ClientCredentials):
            # The token may have been revoked or expired early: a new one, once.
            self.cluster.auth.forget(sent)
            response, _ = self._post(content)
        status = response.status
        if 200 <= status < 300:
            return Result(self._result(response, body))
        title, detail = _problem(response)
        said = f"{title}: {detail}" if title and detail else title or detail or _excerpt(response)
        said = storable_text(said, BODY_HEAD)
        after = retry_after(response.headers.get("Retry-After"), response.headers.get("Date"))
        waits = "" if after is None else f" (Retry-After {after:.0f}s)"
        if status >= 400 and BACK_PRESSURE in said:
            raise TargetBusy(f"POST {self.shown_url} answered {status} (back-pressure){waits}: {said}", after=after)
        targets = back_pressure_or_outage(status, self.shown_url, said, after)
        if targets is not None:
            raise targets
        if status == 409:
            if title == "ALREADY_EXISTS":  # this messageId is still buffered: published before
                return Result({"messageId": body.get("messageId"), "alreadyExists": True})
            raise Retry(f"POST {self.shown_url} answered 409{waits}: {said}", after=after)
        if status == 404 and self.mode == "correlate" and _no_subscription(title, detail):
            raise Reschedule(
                f"no process instance waits for message {message.name!r} with correlation key {message.hint!r} yet "
                f"(404 {said})"
            )
        if status == 404 or 300 <= status < 400:  # not Camunda's REST API answering: the address is wrong
            location = response.headers.get("Location")
            moved = f" to {redact_url(location)}" if location and status < 400 else ""
            raise Retry(
                f"POST {self.shown_url} answered {status}{moved}, not Camunda's REST API; check CAMUNDA_REST_ADDRESS "
                f"(or the route's url): {_excerpt(response) if not (title or detail) else said}"
            )
        if status in (401, 403):
            raise AuthProblem(
                f"POST {self.shown_url} answered {status}: Camunda refused the worker's credentials; check "
                f"CAMUNDA_AUTH_STRATEGY and its settings: {said}"
            )
        if status >= 500 or status == 408:
            raise Retry(f"POST {self.shown_url} answered {status}{waits}: {said}", after=after)
        raise PermanentError(f"POST {self.shown_url} answered {status}: {said}")

    def _post(self, content: bytes) -> tuple[Reply, str]:
        """The answer, and the Authorization header sent (a refused token is forgotten by it)."""
        headers = {"Content-Type": "application/json"}
        authorization = self.cluster.authorization()
        if authorization:
            headers["Authorization"] = authorization
        reply = self.cluster.client.post(self.url, self.shown_url, data=content, headers=headers)
        return reply, authorization or ""

    def _result(self, response: Reply, body: Mapping[str, Any]) -> dict[str, Any]:
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
        config = self.cluster.configuration
        auth = config.CAMUNDA_AUTH_STRATEGY
        who = {"OAUTH": f", client {config.CAMUNDA_CLIENT_ID} at {redact_url(config.CAMUNDA_OAUTH_URL)}",
               "BASIC": f", user {config.CAMUNDA_BASIC_AUTH_USERNAME}"}.get(auth, "")
        return f"{self.shown_url} (auth {auth}{who}, tenant {self.tenant_id or 'none sent'})"


def _problem(response: Reply) -> tuple[str, str]:
    """The problem detail (RFC 9457) of an error answer: its title and detail; ("", "") when it is none."""
    body = answer_object(response)
    if body is None:
        return "", ""
    title, detail = body.get("title"), body.get("detail")
    return (title if isinstance(title, str) else ""), (detail if isinstance(detail, str) else "")


def _no_subscription(title: str, detail: str) -> bool:
    """Camunda's own answer that no process instance waits for the message (yet): the problem's title is
    ``NOT_FOUND`` and its detail says no subscription for the message was found."""
    return title == "NOT_FOUND" and NO_SUBSCRIPTION in detail.lower()


def _excerpt(response: Reply) -> str:
    """The head of an answer that is no problem detail (an HTML page, other JSON): its type and first characters,
    spaces collapsed."""
    text = " ".join(response.body[: EXCERPT * 4].decode("utf-8", "replace").split())
    kind = response.headers.get("Content-Type", "").split(";")[0].strip() or "no Content-Type"
    if not text:
        return f"({kind}, empty body)"
    return f"({kind}) {text[:EXCERPT]}{'…' if len(text) > EXCERPT or response.truncated else ''}"
