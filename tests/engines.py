"""Fake process engines on loopback, written from their public REST contracts, for the correlator tests.

- :class:`FakeCamunda8`: the Orchestration Cluster REST API (``/v2``) of Camunda 8 — message correlation
  (``POST /v2/messages/correlation``: 200 with the keys, 404 while no subscription waits) and publication
  (``POST /v2/messages/publication``: buffered by ``messageId``, 409 ``ALREADY_EXISTS`` for a duplicate), RFC 9457
  problem bodies, tenants (refused unless multi-tenancy is on), an OAuth 2.0 client-credentials token endpoint
  whose tokens expire, or basic auth; answers can be queued ahead (back-pressure: 429, 503 ``RESOURCE_EXHAUSTED``,
  empty bodies, ``Retry-After``).
- :class:`FakeCamunda7`: the Camunda 7 / Operaton engine's ``POST /engine-rest/message`` — business key,
  correlation keys, tenants, process instance ids, ``all`` and ``resultEnabled``; the engine's 400 bodies
  (``RestException``) for no match and for several matches; optional basic auth.

Both record every request (path, JSON body, headers, monotonic time) and are thread-safe.
"""

from __future__ import annotations

import base64
import itertools
import json
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DEFAULT_TENANT = "<default>"


@dataclass
class Request:
    """One request the fake received."""

    path: str
    body: Any
    headers: dict[str, str]
    at: float = field(default_factory=time.monotonic)


@dataclass
class Answer:
    """An answer queued ahead of the contract's own (status, JSON body or raw text, headers)."""

    status: int
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    raw: str | None = None


class LoopbackServer:
    """A threaded loopback HTTP server calling ``self.handle(method, path, body_bytes, headers)``."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.lock = threading.Lock()
        self.requests: list[Request] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                status, body, headers = fake.handle(self.path, raw, {k: v for k, v in self.headers.items()})
                payload = body if isinstance(body, bytes) else (b"" if body is None else json.dumps(body).encode())
                self.send_response(status)
                if body is not None and not isinstance(body, bytes):
                    kind = "application/problem+json" if status >= 400 else "application/json"
                    self.send_header("Content-Type", kind)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        if tls is not None:  # HTTPS, its certificate for localhost
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True, do_handshake_on_connect=False)
            self.url = f"https://localhost:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def handle(self, path: str, raw: bytes, headers: dict[str, str]) -> tuple[int, Any, dict[str, str]]:
        raise NotImplementedError

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def recorded(self, path: str) -> list[Request]:
        """The requests to ``path`` so far."""
        with self.lock:
            return [request for request in self.requests if request.path == path]


def problem(status: int, title: str, detail: str, instance: str = "") -> dict[str, Any]:
    """An RFC 9457 problem detail as Camunda 8 writes it."""
    return {"type": "about:blank", "title": title, "status": status, "detail": detail, "instance": instance}


class FakeCamunda8(LoopbackServer):
    """Camunda 8's REST API for messages, with optional OAuth or basic auth and tenants."""

    CORRELATE = "/v2/messages/correlation"
    PUBLISH = "/v2/messages/publication"
    TOKEN = "/oauth/token"

    def __init__(
        self, *, auth: str = "NONE", client_id: str = "worker", client_secret: str = "s3cret-client",
        audience: str = "zeebe-api", token_lifetime: float = 60.0, username: str = "demo", password: str = "demo",
        multi_tenancy: bool = False, tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(tls)
        self.auth = auth
        self.client_id, self.client_secret, self.audience = client_id, client_secret, audience
        self.username, self.password = username, password
        self.token_lifetime = token_lifetime
        self.multi_tenancy = multi_tenancy
        self.tokens: dict[str, float] = {}  # token -> expiry (monotonic)
        self.token_requests = 0
        self.queued: list[Answer] = []
        self.subscriptions: dict[tuple[str, str, str], list[str]] = {}
        self.buffered: dict[tuple[str, str], str] = {}  # (tenant, messageId) -> messageKey
        self._keys: Iterator[int] = itertools.count(2251799813685249)

    @property
    def rest(self) -> str:
        """What CAMUNDA_REST_ADDRESS is set to."""
        return self.url + "/v2"

    @property
    def oauth_url(self) -> str:
        """What CAMUNDA_OAUTH_URL is set to."""
        return self.url + self.TOKEN

    def env(self) -> dict[str, str]:
        """The SDK's environment variables for this cluster, as a Camunda user sets them."""
        env = {"CAMUNDA_REST_ADDRESS": self.rest, "CAMUNDA_AUTH_STRATEGY": self.auth}
        if self.auth == "OAUTH":
            env.update(
                CAMUNDA_CLIENT_ID=self.client_id, CAMUNDA_CLIENT_SECRET=self.client_secret,
                CAMUNDA_OAUTH_URL=self.oauth_url, CAMUNDA_TOKEN_AUDIENCE=self.audience,
            )
        if self.auth == "BASIC":
            env.update(CAMUNDA_BASIC_AUTH_USERNAME=self.username, CAMUNDA_BASIC_AUTH_PASSWORD=self.password)
        return env

    def key(self) -> str:
        """A new 64-bit key, as Camunda 8 writes keys: a string."""
        return str(next(self._keys))

    def wait_for(self, name: str, correlation_key: str, tenant: str = DEFAULT_TENANT) -> str:
        """A process instance reaches a message catch event: returns its key."""
        instance = self.key()
        with self.lock:
            self.subscriptions.setdefault((tenant, name, correlation_key), []).append(instance)
        return instance

    def answer_next(self, *answers: Answer) -> None:
        """Answer the next message requests with these, before the contract's own answers."""
        with self.lock:
            self.queued.extend(answers)

    def revoke_tokens(self) -> None:
        """Every token issued so far is refused from now on (401)."""
        with self.lock:
            self.tokens.clear()

    def handle(self, path: str, raw: bytes, headers: dict[str, str]) -> tuple[int, Any, dict[str, str]]:
        if path == self.TOKEN:
            return self._token(raw)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        with self.lock:
            self.requests.append(Request(path, body, headers))
            refused = self._refused(path, headers)
            if refused is not None:
                return refused
            if path not in (self.CORRELATE, self.PUBLISH):
                return 404, problem(404, "NOT_FOUND", f"No endpoint {path}", path), {}
            if self.queued:
                answer = self.queued.pop(0)
                return answer.status, (answer.raw.encode() if answer.raw is not None else answer.body), answer.headers
            if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
                return 400, problem(400, "INVALID_ARGUMENT", "No name provided.", path), {}
            tenant = body.get("tenantId") or DEFAULT_TENANT
            if tenant != DEFAULT_TENANT and not self.multi_tenancy:
                detail = (
                    f"Expected to handle request with tenant identifier '{tenant}', but multi-tenancy is disabled"
                )
                return 400, problem(400, "INVALID_ARGUMENT", detail, path), {}
            variables = body.get("variables", {})
            if variables is not None and not isinstance(variables, dict):
                return 400, problem(400, "INVALID_ARGUMENT", "variables must be a JSON object", path), {}
            if path == self.CORRELATE:
                return self._correlate(body, tenant)
            return self._publish(body, tenant)

    def _refused(self, path: str, headers: dict[str, str]) -> tuple[int, Any, dict[str, str]] | None:
        given = headers.get("Authorization", "")
        if self.auth == "OAUTH":
            token = given.removeprefix("Bearer ")
            if not given.startswith("Bearer ") or self.tokens.get(token, 0) <= time.monotonic():
                return 401, problem(401, "Unauthorized", "The token is missing, invalid or expired", path), {}
        if self.auth == "BASIC":
            expected = "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
            if given != expected:
                return 401, problem(401, "Unauthorized", "Invalid credentials", path), {}
        return None

    def _token(self, raw: bytes) -> tuple[int, Any, dict[str, str]]:
        form = dict(urllib.parse.parse_qsl(raw.decode()))
        with self.lock:
            self.token_requests += 1
            if (
                form.get("grant_type") != "client_credentials"
                or form.get("client_id") != self.client_id
                or form.get("client_secret") != self.client_secret
            ):
                return 401, {"error": "invalid_client", "error_description": "Invalid client credentials"}, {}
            if form.get("audience") != self.audience:
                return 400, {"error": "invalid_request", "error_description": "unknown audience"}, {}
            token = f"token-{self.token_requests}"
            self.tokens[token] = time.monotonic() + self.token_lifetime
            lifetime = self.token_lifetime
            expires_in = int(lifetime) if lifetime == lifetime and float(lifetime).is_integer() else lifetime  # NaN too
            answer = {"access_token": token, "token_type": "Bearer", "expires_in": expires_in}
            return 200, answer, {}

    def _correlate(self, body: dict[str, Any], tenant: str) -> tuple[int, Any, dict[str, str]]:
        name, key = body["name"], str(body.get("correlationKey") or "")
        waiting = self.subscriptions.get((tenant, name, key))
        if not waiting:
            detail = (
                f"Expected to find subscription for message with name '{name}' and correlation key '{key}', "
                "but none was found."
            )
            return 404, problem(404, "NOT_FOUND", detail, self.CORRELATE), {}
        instance = waiting.pop(0)
        return 200, {"tenantId": tenant, "messageKey": self.key(), "processInstanceKey": instance}, {}

    def _publish(self, body: dict[str, Any], tenant: str) -> tuple[int, Any, dict[str, str]]:
        message_id = body.get("messageId")
        if message_id and (tenant, message_id) in self.buffered:
            detail = (
                f"Expected to publish a new message with id '{message_id}', but a message with that id was "
                "already published"
            )
            return 409, problem(409, "ALREADY_EXISTS", detail, self.PUBLISH), {}
        message_key = self.key()
        if message_id:
            self.buffered[(tenant, message_id)] = message_key
        return 200, {"tenantId": tenant, "messageKey": message_key}, {}


class FakeCamunda7(LoopbackServer):
    """Camunda 7 / Operaton's ``POST /engine-rest/message``, with optional basic auth."""

    MESSAGE = "/engine-rest/message"

    def __init__(
        self, *, username: str | None = None, password: str | None = None, tls: ssl.SSLContext | None = None
    ) -> None:
        super().__init__(tls)
        self.username, self.password = username, password
        self.queued: list[Answer] = []
        self._ids = itertools.count(1)
        # (tenant or None, message name, business key) -> waiting process instance ids
        self.executions: dict[tuple[str | None, str, str], list[str]] = {}

    @property
    def rest(self) -> str:
        """The route's url."""
        return self.url + "/engine-rest"

    def wait_for(self, name: str, business_key: str, tenant: str | None = None) -> str:
        """A process instance waits at a message event: returns its id."""
        instance = f"pi-{next(self._ids)}"
        with self.lock:
            self.executions.setdefault((tenant, name, business_key), []).append(instance)
        return instance

    def handle(self, path: str, raw: bytes, headers: dict[str, str]) -> tuple[int, Any, dict[str, str]]:
        body = json.loads(raw) if raw else {}
        with self.lock:
            self.requests.append(Request(path, body, headers))
            if self.username is not None:
                expected = "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
                if headers.get("Authorization") != expected:
                    return 401, {"type": "AuthenticationException", "message": "Unauthorized"}, {}
            if path != self.MESSAGE:
                return 404, {"type": "NotFoundException", "message": f"no resource {path}"}, {}
            if self.queued:
                answer = self.queued.pop(0)
                return answer.status, answer.body, answer.headers
            name = body.get("messageName")
            if not isinstance(name, str) or not name:
                return 400, {"type": "InvalidRequestException", "message": "No message name supplied"}, {}
            if body.get("tenantId") and body.get("withoutTenantId"):
                message = "Parameter 'tenantId' cannot be used together with parameter 'withoutTenantId'."
                return 400, {"type": "InvalidRequestException", "message": message}, {}
            tenant = body.get("tenantId")
            key = (tenant, name, str(body.get("businessKey")))
            waiting = self.executions.get(key, [])
            if body.get("processInstanceId"):
                waiting = [i for i in waiting if i == body["processInstanceId"]]
            if not waiting:
                message = (
                    f"Cannot correlate message '{name}': No process definition or execution matches the parameters"
                )
                return 400, {"type": "RestException", "message": message}, {}
            if len(waiting) > 1 and not body.get("all"):
                message = (
                    f"Cannot correlate a message with name '{name}' to a single execution. {len(waiting)} executions "
                    "match the correlation keys: CorrelationSet [businessKey=" + str(body.get("businessKey")) + "]"
                )
                return 400, {"type": "RestException", "message": message}, {}
            matched = list(waiting) if body.get("all") else waiting[:1]
            for instance in matched:
                self.executions[key].remove(instance)
            if not body.get("resultEnabled"):
                return 204, None, {}
            results = [
                {"resultType": "Execution", "execution": {"id": f"ex-{i}", "processInstanceId": i, "ended": False},
                 "processInstance": None, "variables": None}
                for i in matched
            ]
            return 200, results, {}


@dataclass(frozen=True)
class Certificates:
    """A throwaway CA, a server certificate for localhost and a client certificate it signed (PEM files)."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    def server_context(self, *, client_certificates: bool) -> ssl.SSLContext:
        """A server's TLS context; ``client_certificates``: it requires one the CA signed (mutual TLS)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.server_cert, self.server_key)
        if client_certificates:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(self.ca)
        return context


def make_certificates(directory: str) -> Certificates:
    """Certificates made by the openssl command, in ``directory``."""
    import subprocess

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test-ca")
    for name, extension in (("server", "subjectAltName=DNS:localhost"), ("client", "extendedKeyUsage=clientAuth")):
        run("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        with open(f"{directory}/{name}.ext", "w") as file:
            file.write(extension + "\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    return Certificates(*(f"{directory}/{name}" for name in
                          ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")))
