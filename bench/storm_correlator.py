"""The correlator of ``bench/storm.py``'s replicas: tells the benchmark the slot and start time of each call.

One UDP datagram ``<slot> <time>`` per call to the benchmark's port on the loopback (``STORM_PORT``), then
success; see ``noop_correlator`` for why the endpoint's logger is let through.
"""

from __future__ import annotations

import os
import socket
import time

import noop_correlator  # noqa: F401  (its import lets the endpoint's start-up line through)

from worker.message import Message

_address = ("127.0.0.1", int(os.environ["STORM_PORT"]))
_socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


def record(message: Message) -> None:
    """Send ``<slot> <time>`` to the benchmark."""
    _socket.sendto(f"{message.slot} {time.time():.6f}".encode(), _address)
