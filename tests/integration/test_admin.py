"""Operator views over real PostgreSQL."""

from __future__ import annotations

from tests.integration.test_slot_leases import leaser
from worker.admin import operations as admin
from worker.db.store import NewMessage, Store


def test_status_shows_counts_and_which_replica_holds_how_many_slots(store: Store) -> None:
    first, second = leaser(store, "a"), leaser(store, "b")
    for _ in range(3):
        first.run_once()
        second.run_once()
    store.messages_insert(NewMessage("n", "order-1"))
    shown = admin.status(store)
    assert shown["messages_by_state"]["ready"] == 1 and shown["messages_by_state"]["total"] == 1
    assert shown["oldest_eligible_age_seconds"] is not None
    assert sorted(shown["slots_per_replica"].values()) == [32, 32] and shown["slots"] == 64
    assert set(shown["slots_per_replica"]) == {first.holder, second.holder}
