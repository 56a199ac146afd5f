"""Exactly-once effects of a transactional correlator, with real worker processes against one PostgreSQL.

Several replicas make calls whose handler inserts one row per message into a table without a unique
constraint, in the transaction that records the outcome. Replicas are SIGKILLed and replaced, one is frozen
(SIGSTOP) past its lease and resumed, and PostgreSQL is restarted, all mid-drain; afterwards every message is
delivered (its record says correlated) and its effect row is there exactly once.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import time

import psycopg
import pytest
from effects import EFFECT_TABLE_DDL
from harness import Database, PostgresDatabase, StartReplicas, StartWorker, run_cli, wait_until
from test_cluster import DRAIN_DEADLINE, FAST_LEASES, LEASE, Server, insert_messages, kill, remaining

ROUTE = json.dumps({"*": {"type": "python", "handler": "effects:apply", "transactional": True}})


def test_a_transactional_handler_has_its_effect_exactly_once_through_kills_freezes_and_a_database_restart(
    private_pg: tuple[Server, str], start_replicas: StartReplicas
) -> None:
    server, url = private_pg
    database = PostgresDatabase(url)
    try:
        database.execute(EFFECT_TABLE_DDL)
        settings = {**FAST_LEASES, "correlators": ROUTE, "poll__concurrency": "2",
                    "policy__backoff_unit": "PT0.1S", "policy__backoff_cap": "PT0.5S"}
        replicas = start_replicas(database, 3, **settings)
        hints, per_hint = 60, 10
        total = hints * per_hint
        insert_messages(database, hints, per_hint, sleep_seconds=0.05)

        def effects() -> int:
            return int(database.execute("SELECT count(*) AS n FROM shop_effect")[0]["n"])

        wait_until(lambda: effects() > total // 10, what="effects committing", workers=replicas)
        kill(database, replicas[0])  # SIGKILL mid-calls: their writes are rolled back with their transactions
        replicas += start_replicas(database, 1, **settings)
        wait_until(lambda: effects() > total // 4, what="more effects", workers=replicas[1:])

        frozen = replicas[1]
        frozen.send(signal.SIGSTOP)  # in the middle of a call, its transaction open
        time.sleep(LEASE + 2)  # past the lease: its slots go to the others
        frozen.send(signal.SIGCONT)
        wait_until(lambda: effects() > total // 2, what="effects after the freeze", workers=replicas[1:])

        server.stop("fast")  # every open transaction is cut off
        time.sleep(1.0)
        server.start()
        database.close()
        database = PostgresDatabase(url)
        wait_until(lambda: remaining(database) == 0, DRAIN_DEADLINE, "every message delivered",
                   workers=replicas[1:], interval=0.5)

        counts = database.execute("SELECT message, count(*) AS n FROM shop_effect GROUP BY message")
        twice = {row["message"]: row["n"] for row in counts if row["n"] != 1}
        assert twice == {}, f"effects committed more than once: {twice}"
        records = database.execute(
            "SELECT id, outcome, result->>'replica' AS replica FROM correlation_message WHERE state = 'delivered'"
        )
        assert len(records) == total and {row["outcome"] for row in records} == {"correlated"}
        effect_of = {row["message"] for row in counts}
        assert effect_of == {row["id"] for row in records}, "a message delivered without its effect, or the reverse"
        writers = dict(
            (row["message"], row["replica"]) for row in database.execute("SELECT message, replica FROM shop_effect")
        )
        assert all(writers[row["id"]] == row["replica"] for row in records), "the effect and the record disagree"
        assert any("database unavailable" in replica.log() for replica in replicas[1:]), "the restart went unnoticed"
    finally:
        database.close()


def test_a_message_correlated_by_the_process_is_answered_from_its_record_and_its_id_stays_taken(
    any_db: Database, start_worker: StartWorker
) -> None:
    """The path "The lifecycle of a call" describes, on both databases: a transactional handler's answer on the
    record, `messages show` and `messages list --state delivered` answering from it, and both insert forms refused
    inside the window."""
    any_db.execute(EFFECT_TABLE_DDL)
    worker = start_worker(any_db, correlators=ROUTE, replica__name="shop-1")
    mark = "%s" if isinstance(any_db, PostgresDatabase) else "?"
    insert = (
        "INSERT INTO correlation_message (message_id, message_name, correlation_hint, payload) "
        f"VALUES ({mark}, 'order.paid', 'order-4711', '{{\"amount\": 10}}')"
    )
    any_db.execute(insert, ("shop-4711-paid",))
    wait_until(lambda: any_db.execute("SELECT count(*) AS n FROM shop_effect")[0]["n"] == 1, what="the effect",
               workers=[worker])
    wait_until(lambda: any_db.execute("SELECT count(*) AS n FROM correlation_message WHERE state = 'delivered'")[0][
        "n"] == 1, what="the record", workers=[worker])
    shown = json.loads(run_cli(any_db, "messages", "show", "shop-4711-paid", "-o", "json").stdout)
    assert (shown["state"], shown["outcome"], shown["result"], shown["payload"]) == (
        "delivered", "correlated", {"replica": "shop-1"}, {}
    )
    assert shown["finished_by"].startswith("shop-1") and shown["finished_at"]
    listed = json.loads(run_cli(any_db, "messages", "list", "--state", "delivered", "-o", "json").stdout)
    assert [row["message_id"] for row in listed] == ["shop-4711-paid"]
    assert json.loads(run_cli(any_db, "messages", "list", "-o", "json").stdout) == []

    refused = (psycopg.errors.UniqueViolation,) if isinstance(any_db, PostgresDatabase) else (sqlite3.IntegrityError,)
    with pytest.raises(refused, match="message_id"):
        any_db.execute(insert, ("shop-4711-paid",))
    any_db.execute(insert + " ON CONFLICT (message_id) DO NOTHING", ("shop-4711-paid",))
    # Nothing was inserted, so nothing can be called again: the record is the only row.
    assert any_db.execute("SELECT count(*) AS n FROM correlation_message")[0]["n"] == 1
