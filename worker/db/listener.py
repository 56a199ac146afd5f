"""Wake-ups: the replica learns at once which slots have new messages, instead of waiting for a poll.

On PostgreSQL a statement-level trigger of ``correlation_message`` sends one ``NOTIFY correlation_message``
per producer statement, naming the slots it inserted into (schema/ddl/0003); operator actions that make
messages due again (requeue, resume) notify the same way. One connection per replica listens. Notifications
sent while it was not listening are lost, so after any gap (start, a dropped connection, a restarted server)
it reports ``None``, "look at every slot", before listening again. Polling stays as the backstop.

On SQLite another process's commit changes the file's ``data_version``; it is checked every
``notify.sqlite_check_interval``.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable
from typing import Protocol

import psycopg
from sqlalchemy.engine import make_url

from worker.config import DatabaseSettings, NotifySettings
from worker.db.base import PostgresLogin, normalise_url, postgres_connect_args
from worker.db.schema import NOTIFY_CHANNEL

logger = logging.getLogger(__name__)

RECONNECT_FIRST, RECONNECT_MAX = 0.2, 5.0  # seconds between attempts to listen again

WakeSlots = Callable[[frozenset[int] | None], None]  # slots to look at, or None for every slot


class Gauge(Protocol):
    """A value that is set (a Prometheus gauge)."""

    def set(self, value: float) -> None:
        """Set the value."""


class Counter(Protocol):
    """A count that grows (a Prometheus counter)."""

    def inc(self, amount: float = 1) -> None:
        """Add ``amount``."""


class ListenerMetrics(Protocol):
    """What the listener reports (the service's :class:`~worker.service.metrics.Metrics` has both): 1 while it
    listens, else 0; and every reconnect."""

    @property
    def listener_up(self) -> Gauge:
        """1 while the listener is connected, else 0."""

    @property
    def listener_reconnects(self) -> Counter:
        """Times the listener reconnected."""


def parse_slots(payload: str) -> frozenset[int] | None:
    """The slots named in a notification's payload (``"3,17"``); None (every slot) if it is not such a list."""
    try:
        return frozenset(int(part) for part in payload.split(",") if part.strip())
    except ValueError:
        return None


class Listener:
    """Listens for wake-ups until stopped; call :meth:`run` on a thread of its own."""

    def __init__(
        self, database: DatabaseSettings, notify: NotifySettings, wake: WakeSlots, metrics: ListenerMetrics
    ) -> None:
        self.database = database
        self.notify = notify
        self.wake = wake
        self.metrics = metrics
        self.sqlite = normalise_url(database.url).startswith("sqlite")
        self._stop = threading.Event()
        self._connection: psycopg.Connection[tuple[object, ...]] | None = None
        self._login = None if self.sqlite else PostgresLogin(database)

    def stop(self) -> None:
        """Stop listening (returns from :meth:`run` within a second)."""
        self._stop.set()

    def run(self) -> None:
        """Listen, reconnecting after every failure with a backoff, until stopped."""
        delay = RECONNECT_FIRST
        first = True
        while not self._stop.is_set():
            try:
                if self.sqlite:
                    self._watch_sqlite()
                else:
                    self._listen_postgres(first)
                return
            except (psycopg.Error, sqlite3.Error, OSError) as error:
                self.metrics.listener_up.set(0)
                logger.warning("wake-up listener lost (%s); polling meanwhile, reconnecting in %.1fs", error, delay)
            first = False
            self.metrics.listener_reconnects.inc()
            self._stop.wait(delay)
            delay = min(RECONNECT_MAX, delay * 2)

    def _listen_postgres(self, first: bool) -> None:
        url = make_url(normalise_url(self.database.url)).set(drivername="postgresql")
        conninfo = url.render_as_string(hide_password=False)
        args = postgres_connect_args(self.database)
        args["application_name"] = "correlation-worker listener"
        assert self._login is not None

        def login(options: str) -> psycopg.Connection[tuple[object, ...]]:
            return psycopg.connect(conninfo, autocommit=True, **{**args, "options": options})

        connection: psycopg.Connection[tuple[object, ...]] = self._login.connect(login)
        with connection:
            connection.execute(f"LISTEN {NOTIFY_CHANNEL}")
            self.metrics.listener_up.set(1)
            if not first:
                logger.info("wake-up listener connected again: looking at every slot")
            self.wake(None)  # whatever was notified while nobody listened
            while not self._stop.is_set():
                for notification in connection.notifies(timeout=1.0):
                    self.wake(parse_slots(notification.payload))
                    if self._stop.is_set():
                        break
        self.metrics.listener_up.set(0)

    def _watch_sqlite(self) -> None:
        path = make_url(self.database.url).database or ""
        interval = self.notify.sqlite_check_interval.total_seconds()
        connection = sqlite3.connect(path, timeout=30, check_same_thread=False)
        try:
            version = connection.execute("PRAGMA data_version").fetchone()[0]
            self.metrics.listener_up.set(1)
            while not self._stop.wait(interval):
                current = connection.execute("PRAGMA data_version").fetchone()[0]
                if current != version:
                    version = current
                    self.wake(None)
        finally:
            connection.close()
            self.metrics.listener_up.set(0)
