"""The console: what its two faces (the JSON API and the pages) share. :mod:`worker.admin.routes` mounts them.

It runs on a store of its own whose sessions have the console's statement timeout
(``CORRELATION_ADMIN__STATEMENT_TIMEOUT``), so that no console query, however filtered, runs long.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from worker.admin.auth import Auth
from worker.admin.overview import Throughput
from worker.config import AdminSettings, DatabaseSettings, Mode, Settings
from worker.db.store import Store

CONSOLE_POOL = 2  # connections the console keeps (as many again may be opened under load)


def console_database(settings: Settings) -> DatabaseSettings:
    """The database settings of the console's own store: the worker's, with the console's statement timeout."""
    return settings.database.model_copy(
        update={"statement_timeout": settings.admin.statement_timeout, "pool_size": CONSOLE_POOL}
    )


@dataclass
class Console:
    """The console's parts: its store, the policy mode (for explanations), its settings and the tokens."""

    store: Store
    mode: Mode
    settings: AdminSettings
    correlated: Callable[[], float] | None = None  # this replica's successful calls so far (throughput)
    sample_interval: timedelta = timedelta(seconds=15)  # how often the charts' samples are taken
    auth: Auth = field(init=False)
    throughput: Throughput = field(default_factory=Throughput)

    def __post_init__(self) -> None:
        self.auth = Auth(self.settings)

    @classmethod
    def from_settings(cls, settings: Settings, correlated: Callable[[], float] | None = None) -> Console:
        """A console on a store of its own for these settings."""
        store = Store.from_settings(console_database(settings))
        store.keep_delivery_records(settings.delivery.retention, "console")
        return cls(store, settings.policy.mode, settings.admin, correlated, settings.metrics.gauges_interval)

    def close(self) -> None:
        """Close the console's connections."""
        self.store.close()
