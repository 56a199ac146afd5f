"""The correlator of ``bench/latency.py``: notes each call's message id and start time (the machine clock)."""

from __future__ import annotations

import os
import time

from worker import Message

_journal = os.environ["LATENCY_JOURNAL"]


def record(message: Message) -> None:
    """Append ``<id> <time>`` to the journal file the benchmark reads."""
    started = time.time()
    with open(_journal, "a") as journal:
        journal.write(f"{message.id} {started:.6f}\n")
