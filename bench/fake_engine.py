"""A fake engine for the benchmarks: an HTTP/1.1 server on one asyncio loop, in a process of its own.

Not a benchmark: the target that ``targets.py`` (and a user trying the worker by hand) points routes at. It
answers every ``POST`` after ``--latency-ms``, keeps connections alive and writes each answer in one write, so
that the client's cost is what a benchmark measures. It speaks enough of each contract for the worker's routes:
a JSON body on 200 (Camunda 8's ``processInstanceKey``/``messageKey`` on ``/v2/messages/…``, Camunda 7's
``resultEnabled`` list on ``…/message``, ``{}`` elsewhere).

Behaviours, by option (combine them):

- ``--capacity N``: at most N requests are served at once; a request beyond that is answered at once with 429
  and ``Retry-After: --retry-after`` (an engine's back-pressure);
- ``--down``: it starts down; SIGUSR1 takes it down, SIGUSR2 brings it back. Down, every request is answered 503
  (``--down-mode 503``), or the listening socket and every open connection are closed (``--down-mode refuse``:
  connections refused);
- ``--fail-when TEXT``: a request whose body holds TEXT is answered 500 (a message that breaks the engine's
  handler, while the others are taken);
- ``GET /stats`` answers the counts so far as JSON (requests by status, the most served at once).

::

    python bench/fake_engine.py --port 8089 --latency-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
from collections import Counter
from typing import Any

REASONS = {200: "OK", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error",
           503: "Service Unavailable"}


class Engine:
    """The fake engine's state, shared by its connections."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.latency = args.latency_ms / 1000
        self.capacity = args.capacity
        self.retry_after = args.retry_after
        self.fail_when = args.fail_when.encode() if args.fail_when else b""
        self.is_down: bool = bool(args.down)
        self.down_mode = args.down_mode
        self.connections: set[Connection] = set()
        self.serving = 0
        self.most = 0
        self.statuses: Counter[int] = Counter()
        self.keys = 2251799813685249

    def down(self) -> bool:
        """True while the outage runs."""
        return self.is_down

    def stats(self) -> dict[str, Any]:
        """Requests by status so far, and the most served at once."""
        return {"statuses": {str(k): v for k, v in self.statuses.items()}, "most_at_once": self.most,
                "down": self.down()}

    def body(self, path: str) -> bytes:
        """The answer of a correlation on ``path``."""
        self.keys += 1
        if path.startswith("/v2/messages/"):
            return b'{"tenantId":"<default>","messageKey":"%d","processInstanceKey":"%d"}' % (self.keys, self.keys)
        if path.endswith("/message"):
            return (b'[{"resultType":"Execution","execution":{"id":"ex","processInstanceId":"pi-%d","ended":false},'
                    b'"processInstance":null,"variables":null}]' % self.keys)
        return b"{}"


def answer(status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    """One HTTP/1.1 response, keep-alive."""
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}", f"Content-Length: {len(body)}"]
    if body:
        lines.append("Content-Type: application/json")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Connection(asyncio.Protocol):
    """One client connection: requests parsed from the stream, answered in order."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.queue: asyncio.Queue[tuple[str, str, bytes] | None] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.engine.connections.add(self)
        self.task = asyncio.get_running_loop().create_task(self.serve())

    def connection_lost(self, exc: Exception | None) -> None:
        self.engine.connections.discard(self)
        self.queue.put_nowait(None)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if len(self.buffer) < head_end + 4 + length:
                return
            body = self.buffer[head_end + 4:head_end + 4 + length]
            self.buffer = self.buffer[head_end + 4 + length:]
            method, path, _ = head.split(" ", 2)
            self.queue.put_nowait((method, path, body))

    async def serve(self) -> None:
        engine = self.engine
        while True:
            request = await self.queue.get()
            if request is None or self.transport is None or self.transport.is_closing():
                return
            method, path, body = request
            if method == "GET" and path == "/stats":
                self.transport.write(answer(200, json.dumps(engine.stats()).encode()))
                continue
            if engine.fail_when and engine.fail_when in body:
                engine.statuses[500] += 1
                self.transport.write(answer(500, b'{"title":"INTERNAL","detail":"this message breaks the handler"}'))
                continue
            if engine.down() and engine.down_mode == "503":
                engine.statuses[503] += 1
                self.transport.write(answer(503, b'{"title":"UNAVAILABLE","detail":"engine down"}'))
                continue
            if engine.capacity and engine.serving >= engine.capacity:
                engine.statuses[429] += 1
                body = b'{"title":"RESOURCE_EXHAUSTED","detail":"at capacity"}'
                self.transport.write(answer(429, body, {"Retry-After": str(engine.retry_after)}))
                continue
            engine.serving += 1
            engine.most = max(engine.most, engine.serving)
            try:
                await asyncio.sleep(engine.latency)
            finally:
                engine.serving -= 1
            engine.statuses[200] += 1
            if not self.transport.is_closing():
                self.transport.write(answer(200, engine.body(path)))


async def main(args: argparse.Namespace) -> None:
    engine = Engine(args)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    changed = asyncio.Event()

    def turn(down: bool) -> None:
        engine.is_down = down
        changed.set()

    def end() -> None:
        stop.set()
        changed.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, end)
    loop.add_signal_handler(signal.SIGUSR1, turn, True)
    loop.add_signal_handler(signal.SIGUSR2, turn, False)

    async def listen() -> asyncio.Server:
        return await loop.create_server(
            lambda: Connection(engine), "127.0.0.1", args.port, reuse_address=True, backlog=1024
        )

    refusing = args.down_mode == "refuse"
    server: asyncio.Server | None = None if refusing and engine.down() else await listen()
    print(f"listening on 127.0.0.1:{args.port}", flush=True)
    while not stop.is_set():
        if refusing and engine.down() and server is not None:
            server.close()
            for connection in list(engine.connections):
                if connection.transport is not None:
                    connection.transport.abort()  # a reset, as an engine's crash leaves its connections
            server = None
        elif refusing and not engine.down() and server is None:
            server = await listen()
        changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), 1.0)
    if server is not None:
        server.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The fake engine's options (see the module's docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8089)
    parser.add_argument("--latency-ms", type=float, default=10.0)
    parser.add_argument("--capacity", type=int, default=0)
    parser.add_argument("--retry-after", type=int, default=1)
    parser.add_argument("--down", action="store_true")
    parser.add_argument("--fail-when", default="")
    parser.add_argument("--down-mode", choices=("503", "refuse"), default="503")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
