"""The replicas' board: each replica publishes its routes and cluster-wide settings, and reads the others'.

Every lease renewal a replica replaces its row of ``correlation_replica`` and reads the rows seen within a lease
term. From them it knows, for a message name, whether every live replica would send it to the same route
(:class:`~worker.policy.routing.Routing`): the lanes call a message only then. A replica whose routes differ is
told once at WARNING, with the route keys that differ; a cluster-wide setting another replica runs differently
once at WARNING too. When the replicas' routes change, the hints held back are fetched again at once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from worker.config import Settings
from worker.db.replicas import ReplicaRow
from worker.db.store import Store
from worker.policy.routing import Routing, settings_differing
from worker.service.metrics import Metrics

logger = logging.getLogger(__name__)

# How recently a replica must have written its row to count as live, for those who do not know its lease
# (status, the console): a replica writes it every lease renewal (5 s by default).
REPLICAS_FRESH = timedelta(seconds=60)

# Settings whose effect is the cluster's, not one replica's: the replica holding the cleanup lock applies its
# retention to every record, the leases' timing is one protocol, a message's policy is whichever replica calls it.
CLUSTER_SETTINGS = (
    "delivery.retention", "cleanup.interval", "cleanup.chunk_size", "lease.duration", "lease.renew_interval",
    "lease.safety_margin", "lease.drain", "order.max_wait", "scheduler.enabled", "scheduler.misfire_threshold",
    "scheduler.fire_all_limit", "policy", "policies",
)


def setting_name(path: str) -> str:
    """A setting's environment variable (``delivery.retention`` -> ``CORRELATION_DELIVERY__RETENTION``)."""
    return "CORRELATION_" + path.upper().replace(".", "__")


def cluster_settings(settings: Settings) -> dict[str, str]:
    """The cluster-wide settings this replica runs with, each as text (durations in ISO 8601, objects as JSON)."""
    dumped = settings.model_dump(mode="json", exclude_none=True)
    found = {}
    for path in CLUSTER_SETTINGS:
        value: Any = dumped
        for part in path.split("."):
            value = value[part]
        found[path] = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return found


@dataclass(frozen=True, slots=True)
class BoardRound:
    """What one look at the board found."""

    replicas: int  # live replicas, this one included
    routing_differently: int
    settings_differing: int


class ReplicaBoard:
    """This replica's row on the board and its reading of the others' (``routing``, replaced at each look)."""

    def __init__(
        self,
        store: Store,
        holder: str,
        routes: Mapping[str, str],
        settings: Mapping[str, str],
        fresh: timedelta,
        metrics: Metrics,
        on_look: Callable[[Routing, bool], None] = lambda routing, changed: None,
    ) -> None:
        self.store = store
        self.holder = holder
        self.row = ReplicaRow(holder, dict(routes), dict(settings))
        self.fresh = fresh
        self.metrics = metrics
        # Each look's routing, and whether it changed (names held back may be called now: fetched again).
        self.on_look = on_look
        self.routing = Routing(dict(routes), known=False)  # nothing is called before the first look
        self._told_routes: dict[str, tuple[str, ...]] = {}  # replica -> the keys it was told to differ on
        self._told_settings: set[tuple[str, str, str]] = set()

    def run_once(self) -> BoardRound:
        """Write this replica's row, read the live ones, and replace ``routing``."""
        self.store.replicas_record(self.row)
        others = {row.replica: row for row in self.store.replicas_read(self.fresh) if row.replica != self.holder}
        before = self.routing
        routing = Routing(self.row.routes, {replica: row.routes for replica, row in others.items()})
        self.routing = routing
        self._tell_routes(routing)
        differing = settings_differing(self.row.settings, {replica: row.settings for replica, row in others.items()})
        self._tell_settings(differing)
        self.metrics.replicas_routing_differently.set(len(routing.differing))
        self.metrics.settings_differing.set(len({setting for setting, *_ in differing}))
        self.on_look(routing, not before.known or dict(before.differing) != dict(routing.differing))
        return BoardRound(len(others) + 1, len(routing.differing), len({setting for setting, *_ in differing}))

    def stop(self) -> None:
        """Take this replica's row off the board (it stops): the others no longer wait for it to agree."""
        self.store.replicas_forget(self.holder)

    def _tell_routes(self, routing: Routing) -> None:
        for replica in sorted(routing.differing):
            keys = tuple(routing.keys_differing(replica))
            if self._told_routes.get(replica) != keys:
                logger.warning(
                    "replica %s routes differently from this one (%s): messages of those names wait, uncharged, "
                    "until the replicas agree (give every replica the same CORRELATION_CORRELATORS)",
                    replica, ", ".join(keys) or "routes", extra={"replica": replica},
                )
                self._told_routes[replica] = keys
        for replica in [replica for replica in self._told_routes if replica not in routing.differing]:
            del self._told_routes[replica]
            logger.info("replica %s routes as this one does now (or stopped)", replica, extra={"replica": replica})

    def _tell_settings(self, differing: list[tuple[str, str, str, str]]) -> None:
        current = {(setting, replica, theirs) for setting, replica, theirs, _ in differing}
        for setting, replica, theirs, ours in differing:
            if (setting, replica, theirs) not in self._told_settings:
                logger.warning(
                    "replica %s runs with %s=%s, this one with %s: a cluster-wide setting should be the same on "
                    "every replica", replica, setting_name(setting), _short(theirs), _short(ours),
                    extra={"replica": replica},
                )
        self._told_settings = current


def _short(value: str, limit: int = 200) -> str:
    return value if len(value) <= limit else value[: limit - 1] + "…"
