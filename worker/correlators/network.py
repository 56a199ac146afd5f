"""The call layer of network targets (``http``, its ``camunda7`` preset, ``camunda8``): one event loop for the
process, an HTTP client per destination with its connections kept alive, and each destination's state.

Calls to engines wait on the network, not on the interpreter: they run as coroutines on one event loop (uvloop
where it is installed) with aiohttp's client, so 32 calls in flight cost one thread, not 32 contending for the
interpreter lock between socket operations. The engine's lanes run there too (:mod:`worker.engine.lanes`).

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
import ssl
import threading
import traceback
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from worker.config import ConfigError, parse_duration
from worker.message import Message
from worker.policy.outcomes import Result, Retry
from worker.policy.targets import TargetConfig, TargetState
from worker.redact import redact_text

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


class HttpClient:
    """An aiohttp session (made on the call loop at its first request): connections kept alive, no cookies, no
    redirects followed, every failure raised as an outcome naming ``shown``."""

    def __init__(
        self, timeout: float, headers: Mapping[str, str] | None = None, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.timeout = timeout
        self.headers = dict(headers or {})
        self.ssl_context = ssl_context
        self._session: Any = None

    def _open(self) -> Any:
        import aiohttp

        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, ssl=self.ssl_context if self.ssl_context else True)
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self.headers, cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=self.timeout), auto_decompress=True,
            )
        return self._session

    async def post(
        self, url: str, shown: str, *, data: bytes | Mapping[str, str], headers: Mapping[str, str] | None = None
    ) -> Reply:
        """POST and read the answer; a connection failure is :class:`TargetUnavailable`, a timeout a
        :class:`~worker.policy.outcomes.Retry` (the target may have acted on it)."""
        import aiohttp

        session = self._open()
        try:
            async with session.post(url, data=data, headers=headers, allow_redirects=False) as response:
                body = bytearray()  # read() returns what has come so far: up to the limit, or the end
                while len(body) <= BODY_LIMIT and (chunk := await response.content.read(BODY_LIMIT + 1 - len(body))):
                    body += chunk
                truncated = len(body) > BODY_LIMIT
                return Reply(response.status, response.headers, bytes(body[:BODY_LIMIT]), truncated)
        except TimeoutError as error:
            raise Retry(f"POST {shown} timed out after {self.timeout:g}s{_said(error)}") from None
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError, ConnectionError) as error:  # not there
            raise TargetUnavailable(f"POST {shown} failed: {redact_text(_describe(error))}") from None
        except aiohttp.ClientError as error:
            raise Retry(f"POST {shown} failed: {redact_text(_describe(error))}") from None

    async def close(self) -> None:
        """Close the session's connections."""
        if self._session is not None and not self._session.closed:
            await self._session.close()


def _describe(error: BaseException) -> str:
    """What failed, in the system's words where it said them (``connection refused``)."""
    cause = getattr(error, "os_error", None) or (error if isinstance(error, OSError) else None)
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror.lower()
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _said(error: BaseException) -> str:
    text = str(error)
    return f" ({redact_text(text)})" if text else ""


class NetworkCorrelator:
    """A correlator whose calls go over the network: lanes await :meth:`call` on the call loop; called as a
    plain function (embedding, tests) it runs there and waits."""

    destination: Destination

    async def call(self, message: Message) -> Result:
        """Send one message; its answer is the result. Raises an outcome unless the target took it."""
        raise NotImplementedError

    def __call__(self, message: Message) -> Result:
        return shared_loop().run(self.call(message))

    async def aclose(self) -> None:
        """Close the connections."""

    def close(self) -> None:
        """Close the connections (from any thread but the loop's)."""
        loop = shared_loop()
        if not loop.in_loop():
            loop.run(self.aclose(), timeout=5)

