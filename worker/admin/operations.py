"""Operator actions on the message table, shared by the CLI, the JSON API and the pages.

Each action returns plain data ready to print as JSON and raises an :class:`~worker.admin.errors.AdminError`
(whose kind the API answers with its status) for a request it cannot carry out. Bulk actions act on a filter
in bounded chunks and write an audit row; ``dry_run`` returns the bounded count instead.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from worker.admin.errors import AdminError
from worker.config import Mode, format_duration
from worker.db.store import MessageFilter, StateCounts, Store
from worker.engine.leases import SLOT_PREFIX
from worker.engine.replicas import REPLICAS_FRESH, setting_name
from worker.message import Message, thaw
from worker.policy.routing import resolve, routes_fingerprint

__all__ = ["AdminError", "message_as_dict", "require_selection", "status"]


def message_as_dict(message: Message) -> dict[str, Any]:
    """A message as JSON-ready data, under the column names operators query."""
    return {
        "id": message.id,
        "message_id": message.message_id,
        "message_name": message.name,
        "correlation_hint": message.hint,
        "state": message.state.value,
        "attempt": message.attempt,
        "next_attempt_at": message.next_attempt_at.isoformat() if message.next_attempt_at else None,
        "reschedule_count": message.reschedule_count,
        "created_at": message.created_at.isoformat(),
        "time_to_live": format_duration(message.time_to_live) if message.time_to_live is not None else None,
        "expires_at": message.expires_at.isoformat() if message.expires_at else None,
        "slot": message.slot,
        "payload": thaw(message.payload),
        "headers": thaw(message.headers),
        "last_error": message.last_error,
        **delivery_as_dict(message),
    }


def delivery_as_dict(message: Message) -> dict[str, Any]:
    """How a message left the table, from its delivery record (all None while it is live)."""
    delivery = message.delivery
    return {
        "outcome": None if delivery is None else delivery.outcome,
        "finished_at": None if delivery is None else delivery.finished_at.isoformat(),
        "finished_by": None if delivery is None else delivery.finished_by,
        "result": None if delivery is None else thaw(delivery.result),
    }


def status(store: Store) -> dict[str, Any]:
    """The table and the cluster at a glance, each number under a name that says what it counts.

    ``messages_by_state``: rows by state (``waiting``: ready, due later; ``expired``: past ``expires_at``,
    awaiting cleanup) and their ``total``. ``oldest_eligible_age_seconds``: how long the oldest message that
    could be correlated now has waited (None: none). ``slots``: how many slots hints are spread over;
    ``slots_per_replica``: how many of them each live replica holds a lease on. ``targets``: see :func:`targets`.
    """
    oldest = store.messages_oldest_eligible(range(store.slot_count), Mode.FAIL_FIRST)
    counts: StateCounts = store.messages_count_by_state(oldest)
    age: timedelta | None = counts.oldest_eligible_age
    replicas: dict[str, int] = {}
    for lock in store.locks_list_held():
        if lock.name.startswith(SLOT_PREFIX):
            replicas[lock.locked_by] = replicas.get(lock.locked_by, 0) + 1
    return {
        "messages_by_state": {
            "ready": counts.ready,
            "waiting": counts.waiting,
            "paused": counts.paused,
            "dead": counts.dead,
            "expired": counts.expired,
            "total": counts.total,
        },
        "oldest_eligible_age_seconds": None if age is None else round(age.total_seconds(), 3),
        "slots": store.slot_count,
        "slots_per_replica": dict(sorted(replicas.items())),
        "targets": targets(store),
        "routing": routing(store),
    }


def routing(store: Store) -> dict[str, Any]:
    """Whether the live replicas route alike and run the cluster-wide settings alike.

    ``agree``: every live replica sends every message name where the others do. ``disputed``: the route keys (a
    message name or ``*``) some replica routes differently: their messages wait, uncharged, until the replicas
    agree. ``replicas``: each live replica with a fingerprint of its routes (alike routes, alike fingerprints).
    ``settings_differ``: each cluster-wide setting (``CORRELATION_…``) run with different
    values, by replica."""
    rows = store.replicas_read(REPLICAS_FRESH)
    keys = sorted({key for row in rows for key in row.routes})
    disputed = [key for key in keys if len({resolve(row.routes, key) for row in rows}) > 1]
    settings: dict[str, dict[str, str]] = {}
    for row in rows:
        for name, value in row.settings.items():
            settings.setdefault(name, {})[row.replica] = value
    return {
        "agree": not disputed,
        "disputed": disputed,
        "replicas": [
            {"replica": row.replica, "routes": routes_fingerprint(row.routes)} for row in rows
        ],
        "settings_differ": [
            {"setting": setting_name(name), "values": values}
            for name, values in sorted(settings.items()) if len(set(values.values())) > 1
        ],
    }


def targets(store: Store) -> list[dict[str, Any]]:
    """The network targets as each live replica sees them: circuit (closed, open, half_open), why it is open and
    since when, the calls allowed in flight (lowered by back-pressure) and in flight."""
    return [
        {
            "target": row.target, "replica": row.replica, "circuit": row.circuit, "reason": row.reason or None,
            "since": row.since.isoformat() if row.since else None, "concurrency_limit": row.concurrency_limit,
            "in_flight": row.in_flight,
        }
        for row in store.targets_read()
    ]


def require_selection(selection: MessageFilter, everything: bool, action: str) -> None:
    """Refuse to act on the whole table unless the operator said so."""
    if selection.is_empty() and not everything:
        raise AdminError(
            f"{action} needs message ids or message_ids, --name, --hint or --state (or --all for every message)"
        )
