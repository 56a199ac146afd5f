"""The correlator of the cluster benchmark's worker processes: it does nothing, so the engine's cost is measured.

``bench/cluster.py`` starts ``correlation-worker run`` with ``bench/`` on ``PYTHONPATH`` and
``CORRELATION_CORRELATORS='{"*": "noop_correlator:correlate"}'``.

The workers run with ``CORRELATION_LOG__LEVEL=WARNING`` so that logging costs nothing during the drain, but
the benchmark finds each replica's /metrics port (``CORRELATION_METRICS__PORT=0``: any free port) in the
endpoint's start-up line, which is logged at INFO. The worker imports this module while it builds its routes,
before it opens the endpoint, so that logger alone is let through here. Nothing else in the worker changes.
"""

from __future__ import annotations

import logging

from worker.message import Message

ENDPOINT_LOGGER = "worker.service.endpoint"

logging.getLogger(ENDPOINT_LOGGER).setLevel(logging.INFO)


def correlate(message: Message) -> None:
    """Succeed at once."""
