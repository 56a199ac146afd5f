"""The HTTP endpoint on the metrics port: ``/metrics``, ``/healthz``, ``/readyz``, and the console when it is on.

``/healthz`` is liveness: the main loop ticked within the liveness window (a hung loop turns it red), and
the engine can still take work (calls stuck past their timeout do not hold every lane).
``/readyz`` is readiness: the database answers and its schema is the one this version needs.

The routes are a Starlette application served by uvicorn on a thread of its own, beside the worker's loops:
the socket is bound here first (so that a taken port or an unknown host is one line naming the setting), then
handed to uvicorn. The console (:mod:`worker.admin.api` under ``/api/v1``, :mod:`worker.admin.pages` under
``/ui``) is mounted beside the probes when a token is configured; without one those paths answer 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from worker.service.metrics import Metrics

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT = 10.0  # seconds the server may take to start listening
STOP_TIMEOUT = 5.0  # seconds it may take to stop


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


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or an EndpointError naming the setting to fix."""
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as error:
        raise EndpointError(
            f"cannot serve metrics: the host {host!r} of {HOST_SETTING} does not resolve ({error.strerror}); "
            "use an address of this machine, or 0.0.0.0 for all of them"
        ) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as error:
        sock.close()
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
    return sock


def probe_routes(
    metrics: Metrics,
    heartbeat: Heartbeat,
    liveness_window: float,
    readiness: Callable[[], str | None],
    health: Callable[[], str | None] = lambda: None,
) -> list[BaseRoute]:
    """``/metrics``, ``/healthz`` and ``/readyz`` (plain functions: Starlette runs them on its thread pool, so a
    slow database answer never blocks the event loop)."""

    def scrape(_request: Request) -> Response:
        """GET /metrics: every metric in Prometheus' text format."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def healthz(_request: Request) -> Response:
        """GET /healthz: liveness: 503 when the fetch loop has been silent too long or stuck calls hold every lane."""
        age = heartbeat.age()
        problem = health()
        if age > liveness_window:
            return PlainTextResponse(f"main loop silent for {age:.0f}s\n", status_code=503)
        if problem is not None:
            return PlainTextResponse(f"{problem}\n", status_code=503)
        return PlainTextResponse("ok\n")

    def readyz(_request: Request) -> Response:
        """GET /readyz: readiness: 503 with the reason while the replica cannot do its job (database, schema)."""
        problem = readiness()
        return PlainTextResponse("ready\n") if problem is None else PlainTextResponse(f"{problem}\n", status_code=503)

    return [Route("/metrics", scrape), Route("/healthz", healthz), Route("/readyz", readyz)]


def application(routes: Sequence[BaseRoute], console: bool = False) -> Starlette:
    """The endpoint's application: these routes, and a plain-text 404 that says where to go."""
    places = "/ui/, /api/v1/status, /metrics, /healthz or /readyz" if console else "/metrics, /healthz or /readyz"

    async def not_found(_request: Request, error: Exception) -> Response:
        if isinstance(error, HTTPException) and error.status_code != 404:
            return PlainTextResponse(f"{error.detail}\n", status_code=error.status_code)
        return PlainTextResponse(f"not found: try {places}\n", status_code=404)

    return Starlette(routes=list(routes), exception_handlers={404: not_found, 405: not_found})


class _Server(uvicorn.Server):
    """uvicorn's server, its main loop waking once a second, and at once when asked to stop (:meth:`stop`).

    uvicorn's own loop wakes ten times a second to see whether it should exit (and refreshes the ``Date`` header
    every tenth time). Each wake-up takes the interpreter's lock from the threads fetching and calling: an idle
    replica spent 0.4 % of a core on it, a replica at full drain about a microsecond per message."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864_000  # a tenth tick each time: the Date header refreshed every second
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)
            should_exit = await self.on_tick(counter)

    def stop(self) -> None:
        """Ask the server to stop, from any thread."""
        self.should_exit = True
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server has stopped already
                loop.call_soon_threadsafe(wake.set)


class Endpoint:
    """The HTTP server of a replica (uvicorn on a thread of its own), stopped with :meth:`close`."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: Metrics,
        heartbeat: Heartbeat,
        liveness_window: float,
        readiness: Callable[[], str | None],
        health: Callable[[], str | None] = lambda: None,
        console: Sequence[BaseRoute] = (),
    ) -> None:
        routes = [*probe_routes(metrics, heartbeat, liveness_window, readiness, health), *console]
        self.app = application(routes, console=bool(console))
        self._socket = _bind(host, port)
        self.port = int(self._socket.getsockname()[1])
        config = uvicorn.Config(
            self.app,
            log_config=None,  # the worker's logging, not uvicorn's
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
            server_header=False,
            ws="none",  # no WebSocket route: its protocol (and its library) is not even imported
        )
        self._server = _Server(config)
        self._thread = threading.Thread(target=self._serve, name="endpoint", daemon=True)
        self._failure: BaseException | None = None
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        if not self._server.started:
            self.close()
            raise EndpointError(
                f"cannot serve metrics on {host}:{self.port}: the HTTP server did not start "
                f"({self._failure or 'it took longer than ' + str(STARTUP_TIMEOUT) + ' s'}); check {PORT_SETTING}"
            )
        served = "/metrics, /healthz, /readyz, the console API /api/v1 and pages /ui" if console else (
            "/metrics, /healthz and /readyz"
        )
        logger.info("serving %s on %s:%s", served, host, self.port)

    def _serve(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._socket]))
        except BaseException as error:  # reported by the constructor (startup) or logged (later)
            self._failure = error
            if self._server.started:
                logger.exception("the HTTP endpoint stopped")

    def close(self) -> None:
        """Stop serving."""
        self._server.stop()
        self._thread.join(timeout=STOP_TIMEOUT)
        self._socket.close()
