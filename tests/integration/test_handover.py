"""A slot handed back to balance the cluster is released only once its page and calls are done."""

from __future__ import annotations

from tests.integration.test_slot_leases import leaser
from worker.db.store import Store


def test_a_surplus_slot_in_use_is_kept_until_the_poller_is_done_with_it(store: Store) -> None:
    first = leaser(store, "a")
    first.run_once()
    assert len(first.slots()) == 64
    busy = set(range(64))
    first.in_use = lambda: busy
    second = leaser(store, "b")
    for _ in range(3):
        second.run_once()
        first.run_once()
    assert len(first.slots()) == 32  # its share; the surplus is handed back: no new page starts on it
    assert second.slots() == ()  # but it is not released while a page or call of this replica is on it
    busy.clear()
    first.run_once()
    second.run_once()
    assert len(second.slots()) == 32 and len(first.slots()) == 32
