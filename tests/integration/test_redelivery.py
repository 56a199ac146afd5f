"""In-flight marks on slot leases: a replica taking over a dead holder's slot counts what it delivers again."""

from __future__ import annotations

from sqlalchemy import text

from tests.integration.test_slot_leases import SHORT, STEADY, leaser, wait_until
from worker.config import Settings
from worker.correlators import Router
from worker.db.store import NewMessage, Store
from worker.engine.poller import Poller
from worker.message import Message
from worker.service.metrics import Metrics


def in_flight_marks(store: Store) -> dict[str, str]:
    with store.engine.connect() as connection:
        rows = connection.execute(text("SELECT name, in_flight FROM correlation_lock WHERE in_flight IS NOT NULL"))
        return {row.name: row.in_flight for row in rows}


def poller_of(store: Store, slots: object, metrics: Metrics, calls: list[int]) -> Poller:
    def handler(message: Message) -> None:
        calls.append(message.id)

    settings = Settings(poll={"interval": "PT1S"}, metrics={"enabled": False})
    return Poller(store, Router({"*": handler}), settings, slots, metrics)  # type: ignore[arg-type]


def test_a_clean_page_leaves_no_in_flight_mark(store: Store) -> None:
    a = leaser(store, "a")
    a.run_once()
    store.messages_insert(NewMessage("n", "order-1"))
    calls: list[int] = []
    result = poller_of(store, a, Metrics(), calls).run_once()
    assert result.correlated == 1 and result.redelivered == 0
    assert in_flight_marks(store) == {}


def test_messages_in_flight_at_a_holders_death_are_counted_when_delivered_again(store: Store) -> None:
    dead = leaser(store, "dead", SHORT)
    dead.run_once()
    first = store.messages_insert(NewMessage("n", "order-1"))
    second = store.messages_insert(NewMessage("n", "order-1"))
    untouched = store.messages_insert(NewMessage("n", "order-2"))
    assert first is not None and second is not None and untouched is not None
    slot = store.messages_get(first).slot  # type: ignore[union-attr]
    (fence,) = dead.fences(slot)
    # What the dying holder's poller did before calling the correlator; then it was killed.
    assert store.lock_mark_in_flight(fence, [first, second])
    wait_until(lambda: dead.slots() == (), "the dead holder's term is past its local deadline")

    metrics = Metrics()
    heir = leaser(store, "heir", STEADY, metrics)  # a long term: the poll below must not outlive it
    wait_until(lambda: heir.run_once() and slot in heir.slots(), "the heir took the slot over")
    calls: list[int] = []
    result = poller_of(store, heir, metrics, calls).run_once()
    assert set(calls) == {first, second, untouched}
    assert result.redelivered == 2
    assert metrics.redeliveries._value.get() == 2
    assert in_flight_marks(store) == {}
