"""The replica's long-lived threads, supervised: a thread that dies of an exception (a bug, or a failure nothing
below it handled) is not left dead while the rest runs on crippled. Its death is logged once, the replica is
unhealthy from then on (``/healthz``), and the worker stops with exit code 1 so that its supervisor (Kubernetes,
systemd) starts a whole one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from worker.policy.outcomes import first_line

logger = logging.getLogger(__name__)


class Supervisor:
    """Starts threads whose death is noticed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failure: str | None = None
        self.failed = threading.Event()  # set when a supervised thread died

    def thread(self, target: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> threading.Thread:
        """A daemon thread running ``target``; not started."""

        def run() -> None:
            try:
                target(*args, **kwargs)
            except BaseException as error:  # any death is the replica's
                self._died(name, error)

        return threading.Thread(target=run, name=name, daemon=True)

    def _died(self, name: str, error: BaseException) -> None:
        with self._lock:
            first = self._failure is None
            if first:
                self._failure = f"the {name} thread died: {type(error).__name__}: {first_line(error)}"
        logger.critical("the %s thread died; the replica is unhealthy and stops", name, exc_info=error)
        if first:
            self.failed.set()

    def failure(self) -> str | None:
        """Why the replica is unhealthy (the first thread that died), or None."""
        with self._lock:
            return self._failure
