"""The call layer of network targets (``http``, its ``camunda7`` preset, ``camunda8``): the process's event loop
(where the lanes run), an HTTP client per destination with its connections kept alive, and each destination's
state.

A request is made by libcurl on the thread of the lane's run (:mod:`worker.engine.lanes`), as a Python
correlator's call is: libcurl does the protocol in C and waits for the answer with the interpreter lock released,
so 32 calls in flight cost 32 waiting threads and a few dozen microseconds of Python each, not a share of one
loop thread's time (a pure-Python client, on threads or on a loop, costs several times that).

A *destination* is where a route's calls go (its URL, or an engine's REST address; routes naming the same one
share it). It holds the target's circuit and concurrency limit (:mod:`worker.policy.targets`): a correlator
says what an answer means by what it raises — :class:`TargetUnavailable` (refused, reset, 502/503/504) and
:class:`TargetBusy` (429, ``RESOURCE_EXHAUSTED``) are the target's, never the message's: the lanes charge no
attempt for them and let the hint wait while the destination is open or busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import threading
import time
import traceback
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlencode, urlsplit

from worker.config import ConfigError, format_duration, parse_duration
from worker.message import Message
from worker.policy.outcomes import HandlerTimeout, Result, Retry
from worker.policy.targets import TargetConfig, TargetState
from worker.redact import redact_text, redact_url

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The largest response body read; a longer one is read no further (its head is enough for an error's reason).
BODY_LIMIT = 64 * 1024


class TargetUnavailable(Retry):
    """The target is not there (connection refused or reset, 502, 503, 504): the target's failure, never the
    message's. Outside the lanes (a correlator called directly) it is a retry like any other."""


class TargetBusy(TargetUnavailable):
    """The target asks to be called less (429, ``RESOURCE_EXHAUSTED``): back-pressure, never the message's."""


# -- the event loop ---------------------------------------------------------------------------------------------


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (a third of the CPU of asyncio's per call), else asyncio's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class CallLoop:
    """An event loop on a thread of its own, for the process's network calls and lanes.

    The thread lives as long as the process; :meth:`failure` says why it ended if it did (a replica whose call
    loop died is unhealthy and stops).
    """

    def __init__(self, name: str = "calls") -> None:
        self.loop = new_event_loop()
        self.loop.set_exception_handler(_log_loop_error)
        self._failure: BaseException | None = None
        self._stopped = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        except BaseException as error:  # a bug in a callback: the replica must not run on without its loop
            self._failure = error
            logger.critical("the call loop died: %s", error, exc_info=error)

    def failure(self) -> str | None:
        """Why the loop is not running (None while it runs)."""
        if self.thread.is_alive() or self._stopped:
            return None
        return f"the call loop thread ended: {self._failure!r}" if self._failure else "the call loop thread ended"

    def in_loop(self) -> bool:
        """True on the loop's own thread."""
        return threading.current_thread() is self.thread

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Any:
        """Run a coroutine on the loop; returns a :class:`concurrent.futures.Future` of its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop and wait for its result (never from the loop's own thread)."""
        if self.in_loop():
            coroutine.close()
            raise RuntimeError("CallLoop.run would wait for itself: await the coroutine instead")
        result: T = self.submit(coroutine).result(timeout)
        return result

    def call_soon(self, callback: Callable[..., object], *args: object) -> None:
        """Have the loop call ``callback(*args)`` (from any thread)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending
            self.loop.call_soon_threadsafe(callback, *args)

    def stop(self) -> None:
        """Stop the loop (its thread ends)."""
        self._stopped = True
        self.call_soon(self.loop.stop)


def _log_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    error = context.get("exception")
    logger.error("call loop: %s", context.get("message", "an error"), exc_info=error)


_shared: CallLoop | None = None
_shared_lock = threading.Lock()


def call_loop_stacks() -> list[str]:
    """The stack of every task on the process's call loop (the lanes, the watchdog), by name, for SIGUSR1; none
    before the loop started. Read from another thread while the loop runs: a task set changing meanwhile is read
    again."""
    loop = _shared
    if loop is None:
        return []
    for _ in range(5):
        try:
            tasks = list(asyncio.all_tasks(loop.loop))
            break
        except RuntimeError:  # the set changed during the copy
            continue
    else:
        return []
    stacks = []
    for task in sorted(tasks, key=lambda task: task.get_name()):
        frames = []  # the whole chain of awaits (a task's own stack has only its outermost coroutine)
        awaited: Any = task.get_coro()
        while awaited is not None:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is not None:
                frames.append((frame, frame.f_lineno))
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        summary = traceback.StackSummary.extract(frames)
        stacks.append(f"Task {task.get_name()} on the call loop (most recent call last):\n" + "".join(summary.format()))
    return stacks


def shared_loop() -> CallLoop:
    """The process's call loop, started at its first use."""
    global _shared
    with _shared_lock:
        if _shared is None or (not _shared.thread.is_alive()):
            _shared = CallLoop()
        return _shared


# -- destinations -----------------------------------------------------------------------------------------------


TARGET_KEYS = frozenset(
    {"max_in_flight", "breaker_failures", "breaker_probe", "breaker_probe_max", "busy_open_after"}
)


def target_config(spec: Mapping[str, Any], setting: str) -> TargetConfig:
    """A route's destination settings (its keys in :data:`TARGET_KEYS`); a bad value is a ConfigError."""
    values: dict[str, Any] = {}
    for key, field in (("max_in_flight", "max_in_flight"), ("breaker_failures", "failures")):
        if key in spec:
            value = spec[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"invalid setting {setting}: {key!r} is a whole number of at least 1, not {value!r}")
            values[field] = value
    for key, field in (("breaker_probe", "probe_first"), ("breaker_probe_max", "probe_max"),
                       ("busy_open_after", "busy_open_after")):
        if key in spec:
            try:
                seconds = parse_duration(spec[key]).total_seconds()
            except (ValueError, TypeError) as error:
                raise ConfigError(f"invalid setting {setting}: {key} {error}") from None
            if seconds <= 0:
                raise ConfigError(f"invalid setting {setting}: {key} must be a positive duration, e.g. PT1S")
            values[field] = seconds
    if "probe_first" in values and "probe_max" not in values:
        values["probe_max"] = max(values["probe_first"], TargetConfig().probe_max)
    if "probe_max" in values and "probe_first" not in values:
        values["probe_first"] = min(values["probe_max"], TargetConfig().probe_first)
    try:
        return TargetConfig(**values)
    except ValueError as error:
        raise ConfigError(f"invalid setting {setting}: {error}") from None


class Destination:
    """Where a route's calls go: its shown address, its settings, and (once lanes call it) its state."""

    def __init__(self, key: str, shown: str, config: TargetConfig) -> None:
        self.key = key
        self.shown = shown  # never a credential: what logs, metrics and the console name it by
        self.config = config
        self.state: TargetState | None = None

    def bind(self, lanes: int) -> TargetState:
        """The state the lanes keep (its limit no more than the lanes)."""
        if self.state is None or self.state.limit_cap != max(1, min(lanes, self.config.max_in_flight)):
            self.state = TargetState(self.config, lanes)
        return self.state

    def __repr__(self) -> str:
        return f"Destination({self.shown!r})"


def destination_for(
    registry: dict[str, Destination], key: str, shown: str, config: TargetConfig, setting: str
) -> Destination:
    """The destination of ``key`` in ``registry`` (routes naming the same one share it); two routes giving it
    different settings is a ConfigError."""
    known = registry.get(key)
    if known is None:
        known = registry[key] = Destination(key, shown, config)
    elif known.config != config:
        raise ConfigError(
            f"invalid setting {setting}: another route sends to {shown} with other target settings "
            "(max_in_flight, breaker_*, busy_open_after): give them once, the same on every route to it"
        )
    return known


# -- the HTTP client --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reply:
    """A target's answer: its status, headers and (the head of) its body."""

    status: int
    headers: Mapping[str, str]
    body: bytes
    truncated: bool = False

    @property
    def text(self) -> str:
        """The body as text (undecodable bytes replaced)."""
        return self.body.decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class Tls:
    """TLS material of a destination beyond the defaults (PEM text): a CA to trust besides the system's, and a
    client certificate and key (mutual TLS)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    passphrase: str | None = None


# libcurl's errors that say the target is not there (a name that does not resolve, refused, reset, closed with no
# answer): the target's failure, not the message's. Any other (a timeout among them) may have reached it.
_NOT_THERE = frozenset({5, 6, 7, 35, 52, 55, 56})
_TIMED_OUT = 28

_calls = threading.local()  # the deadline of the call a thread makes (see call_deadline)


@contextlib.contextmanager
def call_deadline(seconds: float) -> Iterator[None]:
    """The requests this thread makes meanwhile end within ``seconds`` (a call's handler timeout): a request cut
    short by it raises :class:`~worker.policy.outcomes.HandlerTimeout`."""
    _calls.deadline = time.monotonic() + seconds
    _calls.seconds = seconds
    try:
        yield
    finally:
        _calls.deadline = None


def wait_within_deadline(lock: threading.Lock, what: str) -> None:
    """Take ``lock``, waiting no longer than the thread's call deadline (:func:`call_deadline`): past it, the call's
    :class:`~worker.policy.outcomes.HandlerTimeout`, naming what it waited for."""
    deadline = getattr(_calls, "deadline", None)
    if deadline is None:
        lock.acquire()
        return
    if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
        within = format_duration(timedelta(seconds=_calls.seconds))
        raise HandlerTimeout(f"the correlator did not return within {within} (waiting for {what})")


class HttpClient:
    """An HTTP client for one destination, by libcurl: a request is made on the calling thread (a lane's), which
    the interpreter lock is released for while libcurl does the protocol in C and waits for the answer; each thread
    keeps its own connection alive. No cookies, no redirects followed, compressed answers decoded, every failure
    raised as an outcome naming ``shown``. Each request is a client span carrying the call's trace context onward
    when tracing is on (:func:`trace_requests`)."""

    def __init__(self, timeout: float, headers: Mapping[str, str] | None = None, tls: Tls | None = None) -> None:
        self.timeout = timeout
        self.headers = dict(headers or {})
        self.tls = tls
        self._local = threading.local()
        self._handles: list[Any] = []  # every thread's handle, closed at close()
        self._lock = threading.Lock()

    def _handle(self) -> Any:
        """This thread's transfer handle with this client's options (its settings stay, its connection is kept)."""
        handle = getattr(self._local, "handle", None)
        if handle is not None:
            return handle
        import pycurl

        handle = pycurl.Curl()
        handle.setopt(pycurl.NOSIGNAL, 1)
        handle.setopt(pycurl.FOLLOWLOCATION, 0)
        handle.setopt(pycurl.ACCEPT_ENCODING, "")  # every encoding libcurl decodes, announced and decoded
        handle.setopt(pycurl.POST, 1)
        # The CAs Python's default TLS context trusts (SSL_CERT_FILE / SSL_CERT_DIR honoured), and a destination's
        # own CA besides them.
        cafile, capath = _system_trust()
        tls = self.tls
        if tls is not None and tls.ca:
            handle.setopt(pycurl.CAINFO_BLOB, (_read(cafile) + "\n" + tls.ca).encode())
        elif cafile:
            handle.setopt(pycurl.CAINFO, cafile)
        if capath:
            handle.setopt(pycurl.CAPATH, capath)
        if tls is not None and tls.cert and tls.key:
            handle.setopt(pycurl.SSLCERT_BLOB, tls.cert.encode())
            handle.setopt(pycurl.SSLKEY_BLOB, tls.key.encode())
            if tls.passphrase:
                handle.setopt(pycurl.KEYPASSWD, tls.passphrase)
        self._local.handle = handle
        with self._lock:
            self._handles.append(handle)
        return handle

    def post(
        self, url: str, shown: str, *, data: bytes | Mapping[str, str], headers: Mapping[str, str] | None = None
    ) -> Reply:
        """POST and read the answer; a connection failure is :class:`TargetUnavailable`, a timeout a
        :class:`~worker.policy.outcomes.Retry` (the target may have acted on it), or the call's
        :class:`~worker.policy.outcomes.HandlerTimeout` when its deadline came first."""
        import pycurl

        sent = {**self.headers, **(headers or {})}
        if not isinstance(data, bytes):
            data = urlencode(data).encode()
            sent.setdefault("Content-Type", "application/x-www-form-urlencoded")
        timeout, handler = self.timeout, False
        deadline = getattr(_calls, "deadline", None)
        if deadline is not None and deadline - time.monotonic() < timeout:
            timeout, handler = max(0.001, deadline - time.monotonic()), True
        span = _client_span(url, sent) if _tracer is not None else None
        body = bytearray()

        def write(chunk: bytes) -> None:
            if len(body) <= BODY_LIMIT:
                body.extend(chunk[: BODY_LIMIT + 1 - len(body)])

        handle = self._handle()
        handle.setopt(pycurl.URL, url)
        handle.setopt(pycurl.TIMEOUT_MS, max(1, round(timeout * 1000)))
        handle.setopt(pycurl.POSTFIELDS, data)
        handle.setopt(pycurl.HTTPHEADER, [f"{name}: {value}" for name, value in sent.items()] + ["Expect:"])
        handle.setopt(pycurl.WRITEFUNCTION, write)
        try:
            handle.perform()
        except pycurl.error as error:
            number, text = error.args[0], str(error.args[1]) if len(error.args) > 1 else ""
            _end_span(span, None, error)
            if number == _TIMED_OUT and handler:
                within = format_duration(timedelta(seconds=_calls.seconds))
                raise HandlerTimeout(f"the correlator did not return within {within} (POST {shown})") from None
            if number == _TIMED_OUT:
                raise Retry(f"POST {shown} timed out after {self.timeout:g}s") from None
            if number in _NOT_THERE:
                raise TargetUnavailable(f"POST {shown} failed: {redact_text(_said_by_curl(text))}") from None
            raise Retry(f"POST {shown} failed: {redact_text(_said_by_curl(text))}") from None
        finally:
            handle.setopt(pycurl.WRITEFUNCTION, _discard)
        status = int(handle.getinfo(pycurl.RESPONSE_CODE))
        _end_span(span, status, None)
        return Reply(status, _answer_headers(handle, status), bytes(body[:BODY_LIMIT]), len(body) > BODY_LIMIT)

    def close(self) -> None:
        """Close the client's connections (every thread's)."""
        import pycurl

        with self._lock:
            handles, self._handles = self._handles, []
        for handle in handles:
            with contextlib.suppress(pycurl.error):  # a call given up on still runs on it: it ends with its thread
                handle.close()
        self._local = threading.local()


def _answer_headers(handle: Any, status: int) -> dict[str, str]:
    """The answer's headers the correlators read, as libcurl parsed them: read after the transfer, so that no
    header costs the thread the interpreter lock during it. ``Retry-After`` in seconds (an HTTP date converted;
    ``0`` is left out), ``Location`` made absolute."""
    import pycurl

    headers = {}
    kind = handle.getinfo(pycurl.CONTENT_TYPE)
    if kind:
        headers["Content-Type"] = str(kind)
    if 300 <= status < 400 and (location := handle.getinfo(pycurl.REDIRECT_URL)):
        headers["Location"] = str(location)
    if after := handle.getinfo(pycurl.RETRY_AFTER):
        headers["Retry-After"] = str(after)
    return headers


def _discard(data: bytes) -> None:
    """A finished transfer's callbacks: nothing is kept of a handle's last request."""


def _system_trust() -> tuple[str | None, str | None]:
    """The CA file and directory Python's default TLS context trusts, where they exist."""
    paths = ssl.get_default_verify_paths()
    cafile = next((path for path in (paths.cafile, paths.openssl_cafile) if path and os.path.isfile(path)), None)
    capath = next((path for path in (paths.capath, paths.openssl_capath) if path and os.path.isdir(path)), None)
    return cafile, capath


def _read(path: str | None) -> str:
    if not path:
        return ""
    with open(path, encoding="ascii", errors="replace") as file:
        return file.read()


def _said_by_curl(text: str) -> str:
    """libcurl's words for a failure, in the system's where it quotes them (``connection refused``)."""
    for words in ("Connection refused", "Connection reset by peer", "Could not resolve host",
                  "Empty reply from server"):
        if words in text:
            return words.lower()
    return text or "the transfer failed"


# -- client spans ----------------------------------------------------------------------------------------------

_tracer: Any = None  # the tracer of the requests' client spans (None: tracing off)
_inject: Callable[..., None] | None = None


def trace_requests(tracer: Any, inject: Callable[..., None]) -> None:
    """Make every request of the network correlators a client span (child of the current span, the call's) and
    carry its context to the target (``traceparent``, by ``inject``)."""
    global _tracer, _inject
    _tracer, _inject = tracer, inject


def _client_span(url: str, headers: dict[str, str]) -> Any:
    from opentelemetry.trace import SpanKind, set_span_in_context

    parts = urlsplit(url)
    span = _tracer.start_span(
        "POST", kind=SpanKind.CLIENT,
        attributes={"http.request.method": "POST", "url.full": redact_url(url), "server.address": parts.hostname or "",
                    "server.port": parts.port or (443 if parts.scheme == "https" else 80)},
    )
    if _inject is not None:
        _inject(headers, context=set_span_in_context(span))
    return span


def _end_span(span: Any, status: int | None, error: BaseException | None) -> None:
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    if status is not None:
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
    elif error is not None:
        span.set_attribute("error.type", type(error).__name__)
        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end()


class NetworkCorrelator:
    """A correlator whose calls go over the network: lanes call :meth:`call` on their threads, with the
    destination's state (its circuit, its limit) kept around it."""

    destination: Destination

    def call(self, message: Message) -> Result:
        """Send one message; its answer is the result. Raises an outcome unless the target took it."""
        raise NotImplementedError

    def __call__(self, message: Message) -> Result:
        return self.call(message)

    def close(self) -> None:
        """Close the connections."""
