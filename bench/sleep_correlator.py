"""The correlator of ``bench/run.py``'s slow-target figure: it waits ``BENCH_CALL_MS`` milliseconds (10 by
default) and succeeds, as a remote target answering in that time would; see ``noop_correlator`` for why the
endpoint's logger is let through."""

from __future__ import annotations

import os
import time

import noop_correlator  # noqa: F401  (its import lets the endpoint's start-up line through)

from worker.message import Message

_SECONDS = float(os.environ.get("BENCH_CALL_MS", "10")) / 1000


def call(message: Message) -> None:
    """Wait, then succeed."""
    time.sleep(_SECONDS)
