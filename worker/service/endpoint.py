"""The HTTP endpoint on the metrics port: ``/metrics``, ``/healthz`` and ``/readyz``.

``/healthz`` is liveness: the main loop ticked within the liveness window (a hung loop turns it red), and
the engine can still take work (calls stuck past their timeout do not hold every lane).
``/readyz`` is readiness: the database answers and its schema is the one this version needs.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from worker.service.metrics import Metrics

logger = logging.getLogger(__name__)


class Heartbeat:
    """The main loop calls :meth:`tick`; liveness asks :meth:`age`."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._last = monotonic()

    def tick(self) -> None:
        """The loop is alive now."""
        self._last = self._monotonic()

    def age(self) -> float:
        """Seconds since the last tick."""
        return self._monotonic() - self._last


class EndpointError(Exception):
    """The metrics endpoint cannot be served as configured; the message names the setting to change."""


PORT_SETTING = "CORRELATION_METRICS__PORT"
HOST_SETTING = "CORRELATION_METRICS__HOST"


def _bind(host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    """The HTTP server bound to host:port, or an EndpointError naming the setting to fix."""
    try:
        return ThreadingHTTPServer((host, port), handler)
    except socket.gaierror as error:
        raise EndpointError(
            f"cannot serve metrics: the host {host!r} of {HOST_SETTING} does not resolve ({error.strerror}); "
            "use an address of this machine, or 0.0.0.0 for all of them"
        ) from None
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            reason = f"port {port} on {host} is already in use by another process"
            fix = f"stop it, or choose another port with {PORT_SETTING} (0 picks a free one)"
        elif error.errno == errno.EACCES:
            reason = f"port {port} needs privileges this process does not have"
            fix = f"choose a port above 1023 with {PORT_SETTING}"
        elif error.errno == errno.EADDRNOTAVAIL:
            reason = f"{host!r} is not an address of this machine"
            fix = f"fix {HOST_SETTING} (0.0.0.0 listens on every address)"
        else:
            reason = f"{host}:{port}: {error.strerror or error}"
            fix = f"check {HOST_SETTING} and {PORT_SETTING}"
        raise EndpointError(f"cannot serve metrics: {reason} ({PORT_SETTING}={port}); {fix}") from None


class Endpoint:
    """A small threaded HTTP server for metrics and probes, stopped with :meth:`close`."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: Metrics,
        heartbeat: Heartbeat,
        liveness_window: float,
        readiness: Callable[[], str | None],
        health: Callable[[], str | None] = lambda: None,
    ) -> None:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    age = heartbeat.age()
                    problem = health()
                    if age > liveness_window:
                        self._send(503, f"main loop silent for {age:.0f}s\n".encode())
                    elif problem is not None:
                        self._send(503, f"{problem}\n".encode())
                    else:
                        self._send(200, b"ok\n")
                elif path == "/readyz":
                    problem = readiness()
                    self._send(200, b"ready\n") if problem is None else self._send(503, f"{problem}\n".encode())
                else:
                    self._send(404, b"not found: try /metrics, /healthz or /readyz\n")

            def _send(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return

        self.server = _bind(host, port, Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="endpoint", daemon=True)
        self._thread.start()
        logger.info("serving /metrics, /healthz and /readyz on %s:%s", host, endpoint.port)

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()
