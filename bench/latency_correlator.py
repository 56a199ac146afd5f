"""The correlator of ``bench/latency.py``: tells the benchmark each call's message id and start time.

One UDP datagram ``<id> <time>`` per call to the benchmark's port on the loopback (the machine clock): the
benchmark blocks on it instead of polling.
"""

from __future__ import annotations

import os
import socket
import time

from worker import Message

_address = ("127.0.0.1", int(os.environ["LATENCY_PORT"]))
_socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


def record(message: Message) -> None:
    """Send ``<id> <time>`` to the benchmark."""
    started = time.time()
    _socket.sendto(f"{message.id} {started:.6f}".encode(), _address)
