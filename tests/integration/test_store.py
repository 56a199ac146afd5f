"""Every statement of the store against real databases (PostgreSQL, and SQLite where it runs the same)."""

from __future__ import annotations

import json
import random
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from tests.conftest import left
from worker.config import Mode
from worker.db.base import text_array
from worker.db.calls import FlushOutcome, SlotWrite
from worker.db.store import MessageFilter, MessageRejected, NewMessage, Store
from worker.message import Message, MessageState
from worker.policy.batching import eligible
from worker.policy.outcomes import Disposition, Kind


def _slot(store: Store, hint: str) -> int:
    if store.slot_count == 1:
        return 0
    with store.engine.connect() as connection:
        return int(connection.execute(text("SELECT ((hashtext(:h) % 64) + 64) % 64"), {"h": hint}).scalar_one())


def add(store: Store, hint: str = "h", name: str = "order.paid", **columns: Any) -> int:
    columns.pop("slot_hint", None)
    if "created_at_offset" in columns:  # created that many seconds from now
        columns["created_at"] = columns.pop("created_at_offset")
    row_id = store.messages_insert(NewMessage(name=name, hint=hint, payload=columns.pop("payload", {})))
    assert row_id is not None
    if columns:
        set_columns(store, row_id, **columns)
    return row_id


def set_columns(store: Store, row_id: int, **columns: Any) -> None:
    """Set worker columns directly, with times given as seconds relative to the database clock."""
    now = store.now()
    values = {k: now + timedelta(seconds=v) if k.endswith("_at") else v for k, v in columns.items()}
    if "expires_at" in values:
        values["created_at"] = min(values["expires_at"], now)
    from sqlalchemy import update

    from worker.db.schema import message_table

    with store.engine.begin() as connection:
        connection.execute(update(message_table).where(message_table.c.id == row_id).values(**values))


def fetch_slot(store: Store, slot: int, mode: Mode = Mode.FAIL_FIRST, budget: int = 1000) -> list[Message]:
    """Every eligible message of one slot, as the engine reads it: candidate hints, then their batches."""
    candidates = store.messages_candidates(slot, "", budget)
    hints = list(dict.fromkeys(candidates.due + candidates.fresh))
    horizon = store.order_horizon()
    limit = horizon.last_id if horizon is not None else 2**62
    return list(store.messages_fetch_batches(hints, horizon=limit, per_hint=1000, limit=10_000, mode=mode).messages)


def fetch(store: Store, mode: Mode = Mode.FAIL_FIRST) -> list[int]:
    """The ids of every eligible message of every slot, in id order."""
    return sorted(m.id for slot in range(store.slot_count) for m in fetch_slot(store, slot, mode))


def test_fresh_messages_are_eligible_in_id_order(any_store: Store) -> None:
    ids = [add(any_store, hint) for hint in ("a", "b", "a", "c")]
    assert fetch(any_store) == ids


def test_candidate_hints_go_round_robin_after_a_cursor_and_wrap_around(any_store: Store) -> None:
    for i in range(7):
        add(any_store, f"h{i}", slot_hint=True)
    slot = any_store.messages_get(add(any_store, "h0"))
    assert slot is not None
    same = [h for h in (f"h{i}" for i in range(7)) if _slot(any_store, h) == slot.slot]
    first = any_store.messages_candidates(slot.slot, "", 2).fresh
    assert list(first) == sorted(same)[:2]
    after = any_store.messages_candidates(slot.slot, first[-1], 100).fresh
    assert list(after) == sorted(same)[2:] + sorted(same)[:2]  # the rest, then round to the start


def test_a_hint_with_many_messages_is_one_candidate_and_its_batch_is_a_prefix(any_store: Store) -> None:
    ids = [add(any_store, "hot") for _ in range(30)]
    slot = _slot(any_store, "hot")
    assert any_store.messages_candidates(slot, "", 10).fresh == ("hot",)
    batch = any_store.messages_fetch_batches(["hot"], horizon=2**62, per_hint=7, limit=100, mode=Mode.FAIL_FIRST)
    assert [m.id for m in batch.messages] == ids[:7]


def test_a_full_page_takes_whole_batches_oldest_first(any_store: Store) -> None:
    # Interleaved ids, as producers write them: c, b, a, c, b, a, ...
    ids: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    for _ in range(4):
        for hint in ("c", "b", "a"):
            ids[hint].append(add(any_store, hint))
    fetched = any_store.messages_fetch_batches(["a", "b", "c"], horizon=2**62, per_hint=100, limit=6,
                                               mode=Mode.FAIL_FIRST)
    # c's batch whole (its first message is the oldest), then b's cut by the page: not the six lowest ids spread
    # over the three hints, nor the hints in the order given.
    assert [m.id for m in fetched.messages] == ids["c"] + ids["b"][:2]
    if fetched.cut is not None:  # PostgreSQL says which batches the page cut short
        assert fetched.cut == {"b"}


@pytest.mark.parametrize(
    ("blob", "page_bytes", "taken", "full"),
    [
        (100_000, 250_000, 3, True),  # stops once the payloads reach the bound: the third one reaches it
        (100_000, 200_100, 3, True),
        (100_000, 200_000, 2, True),  # (each payload is 100 012 bytes of JSON text)
        (100_000, 1024, 1, True),  # the first message is taken whatever its size
        (1000, 16 * 1024 * 1024, 6, False),  # small payloads: the rows' limit alone
        (1000, 100 * 1024 * 1024, 6, False),  # a bound the page cannot reach (100 rows of 1 MiB): not summed
        (1000, 6 * 1012, 6, True),  # ends at the bound exactly
    ],
)
@pytest.mark.parametrize("how", ["batches", "slot"])
def test_a_fetch_takes_no_further_message_once_its_payloads_reach_the_bound(
    any_store: Store, blob: int, page_bytes: int, taken: int, full: bool, how: str
) -> None:
    slot, hints = _hints_of_one_slot(any_store, 3)
    ids = [add(any_store, hint, payload={"blob": "x" * blob}) for hint in hints for _ in range(2)]
    if how == "batches":
        fetched = any_store.messages_fetch_batches(hints, horizon=2**62, per_hint=100, limit=100,
                                                   mode=Mode.FAIL_FIRST, page_bytes=page_bytes)
    else:
        _, fetched = any_store.messages_fetch_slot(slot, "", 100, per_hint=100, limit=100, mode=Mode.FAIL_FIRST,
                                                   page_bytes=page_bytes)
    assert [m.id for m in fetched.messages] == ids[:taken]  # a prefix of the page the rows' limit gives
    assert fetched.bytes_full is full
    sizes = [len(json.dumps(dict(m.payload))) for m in fetched.messages]
    assert sum(sizes[:-1]) < page_bytes and (sum(sizes) >= page_bytes) is full
    if fetched.cut is not None and taken % 2:  # PostgreSQL: the batch the bytes split is cut short
        assert hints[taken // 2] in fetched.cut


def test_a_fetch_bounded_by_bytes_counts_the_bytes_of_text_beyond_ascii(store: Store) -> None:
    """PostgreSQL keeps a payload's text as UTF-8 (SQLite's is JSON with ASCII escapes)."""
    slot, hints = _hints_of_one_slot(store, 1)
    ids = [add(store, hints[0], payload={"t": "€" * 1000}) for _ in range(3)]  # 3 bytes a character
    _, fetched = store.messages_fetch_slot(slot, "", 100, per_hint=100, limit=100, mode=Mode.FAIL_FIRST,
                                               page_bytes=4000)
    assert [m.id for m in fetched.messages] == ids[:2] and fetched.bytes_full


def _hints_of_one_slot(store: Store, count: int) -> tuple[int, list[str]]:
    """``count`` hints that share a slot, in hint order, and that slot."""
    by_slot: dict[int, list[str]] = {}
    for number in range(10_000):
        hint = f"h{number:04d}"
        same = by_slot.setdefault(_slot(store, hint), [])
        same.append(hint)
        if len(same) == count:
            return _slot(store, hint), same
    raise AssertionError("no slot with enough hints")


def test_a_slots_fetch_wraps_round_its_cursor_and_passes_over_the_hints_it_is_told_to_skip(any_store: Store) -> None:
    slot, hints = _hints_of_one_slot(any_store, 7)
    ids = {hint: add(any_store, hint) for hint in reversed(hints)}  # ids against hint order
    skipped = hints[4]

    def fetch_from(after: str, budget: int) -> tuple[list[str], list[int]]:
        candidates, fetched = any_store.messages_fetch_slot(
            slot, after, budget, per_hint=10, limit=100, mode=Mode.FAIL_FIRST, skip=[skipped]
        )
        return list(candidates.fresh), [message.id for message in fetched.messages]

    fresh, fetched = fetch_from(hints[2], 100)
    assert fresh == [hints[3], *hints[5:], *hints[:3]]  # after the cursor, then round from the start to it
    assert fetched == sorted(ids[hint] for hint in hints if hint != skipped)
    fresh, fetched = fetch_from(hints[2], 2)
    assert fresh == [hints[3], hints[5]]  # the budget is for hints it may take
    assert fetched == sorted([ids[hints[3]], ids[hints[5]]])
    assert fetch_from("", 3)[0] == hints[:3]


def test_a_slots_fetch_takes_hints_whatever_characters_they_hold(any_store: Store) -> None:
    """The hints to take travel as an array literal (set for the transaction on PostgreSQL): quoting survives."""
    hints = ["NULL", "null", "a,b", "{x}", '"q"', "back\\slash", " sp ", "ü", "x'y", "[1:2]={3}"]
    ids = {hint: add(any_store, hint) for hint in hints}
    taken: dict[str, int] = {}
    for slot in {_slot(any_store, hint) for hint in hints}:
        _, fetched = any_store.messages_fetch_slot(slot, "", 100, per_hint=10, limit=100, mode=Mode.FAIL_FIRST)
        taken.update((m.hint, m.id) for m in fetched.messages)
    assert taken == ids


def test_a_slots_fetch_is_one_round_trip(store: Store, tmp_path: Any) -> None:
    """The candidates, the horizon and the batches below it: one exchange with the server (one Sync)."""
    import psycopg.pq

    slot, hints = _hints_of_one_slot(store, 3)
    for hint in hints:
        add(store, hint)
    trace = tmp_path / "trace"
    pooled = store.engine.raw_connection()  # the pool hands this connection out next (it was used last)
    driver: Any = pooled.driver_connection
    with trace.open("w") as sink:
        driver.pgconn.trace(sink.fileno())
        driver.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS | psycopg.pq.Trace.REGRESS_MODE)
        pooled.close()
        _, fetched = store.messages_fetch_slot(slot, "", 10, per_hint=10, limit=100, mode=Mode.FAIL_FIRST)
        driver.pgconn.untrace()
    assert len(fetched.messages) == 3
    # What the statements set was for their transaction alone.
    settings = driver.execute("SELECT current_setting('plan_cache_mode'), current_setting('enable_seqscan'), "
                              "current_setting('correlation.page_hints', true)").fetchone()
    driver.rollback()
    assert settings[:2] == ("auto", "on") and not settings[2]
    sent = [line.split("\t") for line in trace.read_text().splitlines()]
    assert [line[2] for line in sent if line[0] == "F" and line[2] == "Sync"] == ["Sync"]


def test_the_slots_statement_sets_how_the_batches_after_it_are_planned(store: Store) -> None:
    """Without pipelines the batches' statement follows the slot's in one transaction (a round trip each): what the
    slot's statement sets there, the generic plan and sequential scans priced out, is what the batches are planned
    under."""
    from worker.db.base import driver_sql
    from worker.db.fetch import _slot_fetch_sql

    params = {"slot": 0, "after": "", "budget": 10, "skip": "{}", "passed": "{}"}
    with store.engine.connect() as connection:
        driver: Any = connection.connection.driver_connection
        with driver.transaction():
            driver.execute(driver_sql(_slot_fetch_sql()), params).fetchall()
            settings = driver.execute(
                "SELECT current_setting('plan_cache_mode'), current_setting('enable_seqscan')"
            ).fetchone()
    assert settings == ("force_generic_plan", "off")


def test_a_slots_fetch_reads_below_the_horizon_less_the_producers_it_is_told_to_pass_over(
    store: Store, pg_url: str
) -> None:
    import psycopg

    slot, (early, late) = _hints_of_one_slot(store, 2)
    with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql")) as producer:
        producer.execute(
            "INSERT INTO correlation_message (message_name, correlation_hint) VALUES ('n', %s)", (early,)
        )  # open: its pin holds back every id above it
        committed = add(store, late)

        def fetch(passed_over: list[tuple[int, str]]) -> tuple[Any, list[int]]:
            candidates, fetched = store.messages_fetch_slot(
                slot, "", 10, per_hint=10, limit=100, mode=Mode.FAIL_FIRST, passed_over=passed_over
            )
            return candidates, [message.id for message in fetched.messages]

        candidates, fetched = fetch([])
        assert candidates.fresh == (late,) and fetched == []
        reading = candidates.horizon
        assert reading is not None and len(reading.pins) == 1 and reading.pins[0][0] < committed
        (after, holder), = reading.pins
        assert fetch([(after + 1, holder), (after, "9/9")])[1] == []  # other pins: still held back
        assert fetch(list(reading.pins))[1] == [committed]


def _pins(store: Store) -> int:
    reading = store.order_horizon()
    assert reading is not None
    return len(reading.pins)


_GATE = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 AND classid = 1668808704"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


def test_a_producer_transaction_holds_the_horizons_gate_until_it_ends_and_a_reading_never_keeps_it(
    store: Store, pg_url: str
) -> None:
    """Revision 0012: every producer transaction holds the gate (shared) from before its first id; a reading
    tries it and lets it go at once, even inside a transaction that stays open, so a producer registering then
    never waits on the reader."""
    import psycopg

    conninfo = pg_url.replace("postgresql+psycopg", "postgresql")
    with psycopg.connect(conninfo) as producer, psycopg.connect(conninfo) as reader, \
            psycopg.connect(conninfo, autocommit=True) as observer:
        assert _pins(store) == 0
        producer.execute("INSERT INTO correlation_message (message_name, correlation_hint) VALUES ('n', 'a')")
        assert observer.execute(_GATE).fetchone() == (1,)
        assert _pins(store) == 1  # the gate is held: the registrations are read
        producer.rollback()
        assert observer.execute(_GATE).fetchone() == (0,)

        # A reading in a transaction left open keeps no lock: a producer registers without waiting.
        last_id, pins, _ = reader.execute("SELECT * FROM correlation_order_horizon()").fetchone()
        assert pins is None
        assert observer.execute(_GATE).fetchone() == (0,)
        producer.execute("SET lock_timeout = '1s'")
        producer.execute("INSERT INTO correlation_message (message_name, correlation_hint) VALUES ('n', 'b')")
        assert reader.execute("SELECT pin_ids FROM correlation_order_horizon()").fetchone()[0] == [last_id]
        producer.commit()
        reader.rollback()

        # A registration rolled back with its savepoint lets the gate go with it, and a later insert of the
        # same transaction registers again.
        producer.execute("SAVEPOINT s")
        producer.execute("INSERT INTO correlation_message (message_name, correlation_hint) VALUES ('n', 'c')")
        producer.execute("ROLLBACK TO SAVEPOINT s")
        assert _pins(store) == 0
        producer.execute("INSERT INTO correlation_message (message_name, correlation_hint) VALUES ('n', 'd')")
        assert _pins(store) == 1
        producer.rollback()
        assert _pins(store) == 0


def test_waiting_message_holds_back_its_group(any_store: Store) -> None:
    waiting = add(any_store, "a", attempt=1, next_attempt_at=60)
    add(any_store, "a")
    other = add(any_store, "b")
    assert fetch(any_store) == [other]
    set_columns(any_store, waiting, next_attempt_at=-1)
    assert len(fetch(any_store)) == 3


def test_dead_message_blocks_its_group_only_in_fail_first_mode(any_store: Store) -> None:
    add(any_store, "a", state="dead", attempt=3)
    later = add(any_store, "a")
    assert fetch(any_store, Mode.FAIL_FIRST) == []
    assert fetch(any_store, Mode.ALL) == [later]


def test_expired_messages_are_never_fetched(any_store: Store) -> None:
    add(any_store, "a", expires_at=-5)
    fresh = add(any_store, "a")
    assert fetch(any_store) == [fresh]


def test_a_slot_fetch_returns_only_that_slots_messages(store: Store) -> None:
    ids = [add(store, f"hint-{i}") for i in range(40)]
    by_slot: dict[int, list[int]] = {}
    for row_id in ids:
        message = store.messages_get(row_id)
        assert message is not None
        by_slot.setdefault(message.slot, []).append(row_id)
    for slot, expected in by_slot.items():
        assert sorted(m.id for m in fetch_slot(store, slot)) == expected


def _plan(store: Store, sql: str, params: dict[str, Any]) -> str:
    """EXPLAIN of a statement written for psycopg."""
    with store.engine.connect() as connection:
        driver = connection.connection.driver_connection
        assert driver is not None
        rows = driver.execute("EXPLAIN " + sql, params).fetchall()
    return "\n".join(row[0] for row in rows)


def test_candidates_keep_to_the_slots_index_when_statistics_saw_no_ready_row(store: Store) -> None:
    """A backlog paused when the table was last vacuumed and analyzed (or a queue empty then), released, and a
    drain under way: the statistics price every index on ready rows at one row. The candidates' probes must still
    walk the slot's own fresh hints, not the ready rows of every slot (which gives hint order too: a probe then
    reads every ready row up to the slot's next hint; 6-10 ms a statement in a drain, against 0.3)."""
    from worker.db.base import driver_sql
    from worker.db.fetch import _slot_fetch_sql

    def run(*statements: str) -> None:
        with store.engine.connect() as connection:
            autocommit = connection.execution_options(isolation_level="AUTOCOMMIT")
            for statement in statements:
                autocommit.execute(text(statement))

    run(
        "INSERT INTO correlation_message (message_name, correlation_hint, payload) "
        "SELECT 'order.paid', 'hint-' || (i % 1000), jsonb_build_object('n', i) FROM generate_series(1, 20000) i",
        "UPDATE correlation_message SET state = 'paused'",
        "VACUUM ANALYZE correlation_message",
        "UPDATE correlation_message SET state = 'ready'",
        # three in four delivered since, as a drain leaves them (their records kept)
        "UPDATE correlation_message SET state = 'delivered', outcome = 'correlated', finished_at = now(), "
        "payload = '{}' WHERE id % 4 <> 0",
    )
    slot = _slot(store, "hint-7")
    params = {"slot": slot, "after": "", "budget": 100, "skip": "{}", "passed": "{}"}
    # The probe as it was written before (the slot a constant, hint order, sorts allowed) takes the other index
    # here: this is the case that went wrong.
    old = (
        "SELECT m.correlation_hint FROM correlation_message m WHERE m.slot = %(slot)s AND m.state = 'ready' "
        "AND m.next_attempt_at IS NULL AND m.correlation_hint > %(after)s ORDER BY m.correlation_hint LIMIT 1"
    )
    assert "correlation_message_hint_ready_idx" in _plan(store, old, params)
    # Both rounds of the cursor (after it, then from the start up to it) are in the plan.
    for after in ("", "hint-5"):
        plan = _plan(store, driver_sql(_slot_fetch_sql()), params | {"after": after})
        assert plan.count("correlation_message_fresh_hint_idx") == 2, plan  # each round's first probe (EXPLAIN
        # leaves out the probes of a recursive step)
        assert "correlation_message_hint_ready_idx" not in plan, plan
    candidates = store.messages_candidates(slot, "", 1000)
    ready = {f"hint-{i}" for i in range(0, 1000, 4)}  # 1000 hints: message n's hint is n mod 1000
    assert sorted(candidates.fresh) == sorted(hint for hint in ready if _slot(store, hint) == slot)


def test_a_fetch_leaving_out_many_hints_compares_them_through_a_hash_and_still_leaves_them_out(store: Store) -> None:
    """Hints a fetch leaves out (busy here, resting after a batch, paused) are walked past, and every step of the
    walk is compared with them: compared one by one, a slot with thousands of resting hints made each fetch grow
    with their square. Past SKIP_HASHED the comparison goes through a hash; below it, one by one (cheaper for a
    few). Either way the hints left out are left out and the others taken."""
    from worker.db.base import driver_sql
    from worker.db.fetch import SKIP_HASHED, _slot_fetch

    with store.engine.connect() as connection:
        connection.execution_options(isolation_level="AUTOCOMMIT").execute(text(
            "INSERT INTO correlation_message (message_name, correlation_hint, payload) "
            "SELECT 'order.paid', 'hint-' || i, '{}' FROM generate_series(1, 20000) i"
        ))
    slot = _slot(store, "hint-7")
    hints = sorted(store.messages_candidates(slot, "", 100_000).fresh)
    assert len(hints) > SKIP_HASHED + 50
    taken = set(hints[::40])
    skipped = [hint for hint in hints if hint not in taken]
    assert len(skipped) > SKIP_HASHED

    for skip in (skipped, skipped[:SKIP_HASHED]):
        candidates = store.messages_candidates(slot, hints[3], 100_000, skip=skip)
        assert sorted(candidates.fresh) == sorted(set(hints) - set(skip))
        _, fetched = store.messages_fetch_slot(slot, hints[3], 100_000, per_hint=10, limit=100_000,
                                               mode=Mode.FAIL_FIRST, skip=skip)
        assert {message.hint for message in fetched.messages} == set(hints) - set(skip)
    params = {"slot": slot, "after": "", "budget": 100, "passed": "{}"}
    many = _plan(store, driver_sql(_slot_fetch(len(skipped))), params | {"skip": text_array(skipped)})
    few = _plan(store, driver_sql(_slot_fetch(3)), params | {"skip": text_array(skipped[:3])})
    assert "hashed SubPlan" in many and "hashed SubPlan" not in few, (many, few)


def test_sql_eligibility_matches_the_pure_rule_on_random_tables(any_store: Store) -> None:
    rng = random.Random(20261121)
    for _ in range(120):
        hint = f"h{rng.randrange(8)}"
        state = rng.choice(["ready"] * 6 + ["paused", "dead"])
        columns: dict[str, Any] = {"state": state}
        if rng.random() < 0.4:
            columns["next_attempt_at"] = rng.choice([-30, 30])
            columns["attempt"] = 1
        if rng.random() < 0.15:
            columns["expires_at"] = rng.choice([-10, 10])
        add(any_store, hint, **columns)
    everything = any_store.messages_list(MessageFilter(), limit=1000)
    now = any_store.now()
    for mode in Mode:
        expected = [m.id for m in eligible(everything, mode, now)]
        assert fetch(any_store, mode) == expected


def record(store: Store, *dispositions: Disposition) -> FlushOutcome:
    """Write outcomes without a lease (as an unfenced engine does)."""
    return store.messages_record([SlotWrite(0, None, dispositions)])


def test_recording_results_deletes_successes_and_updates_failures(any_store: Store) -> None:
    done, failed, dead = (add(any_store, h) for h in "abc")
    now = any_store.now()
    record(
        any_store,
        Disposition(done, Kind.DELETE, 0),
        Disposition(failed, Kind.RETRY, 1, next_attempt_at=now + timedelta(minutes=1), last_error="boom"),
        Disposition(dead, Kind.DEAD, 5, last_error="gave up"),
    )
    assert left(any_store, done)
    retry = any_store.messages_get(failed)
    assert retry is not None and retry.attempt == 1 and retry.last_error == "boom"
    assert retry.next_attempt_at is not None and abs(retry.next_attempt_at - now - timedelta(minutes=1)) < timedelta(
        seconds=1
    )
    gone = any_store.messages_get(dead)
    assert gone is not None and gone.state is MessageState.DEAD and gone.attempt == 5


def test_a_message_paused_during_its_call_stays_paused(any_store: Store) -> None:
    row_id = add(any_store, "a")
    any_store.messages_pause(MessageFilter(ids=(row_id,)))
    record(any_store, Disposition(row_id, Kind.RETRY, 1, last_error="x"))
    message = any_store.messages_get(row_id)
    assert message is not None and message.state is MessageState.PAUSED and message.attempt == 1


def test_insert_with_a_known_message_id_is_a_no_op(any_store: Store) -> None:
    first = any_store.messages_insert(NewMessage("n", "h", {"a": 1}, message_id="m-1"))
    again = any_store.messages_insert(NewMessage("n", "h", {"a": 2}, message_id="m-1"))
    assert first is not None and again is None
    assert len(any_store.messages_list(MessageFilter())) == 1


def test_insert_of_a_bad_row_names_the_broken_rule(any_store: Store) -> None:
    with pytest.raises(MessageRejected) as info:
        any_store.messages_insert(NewMessage("n", ""))
    assert info.value.constraint == "correlation_message_hint_not_empty"


def test_payload_and_headers_round_trip_as_read_only_values(any_store: Store) -> None:
    row_id = any_store.messages_insert(
        NewMessage("n", "h", {"order": {"id": 7, "lines": [1, 2]}}, headers={"tenant": "acme"})
    )
    assert row_id is not None
    message = any_store.messages_get(row_id)
    assert message is not None
    assert message.payload["order"]["id"] == 7 and list(message.payload["order"]["lines"]) == [1, 2]
    assert message.headers["tenant"] == "acme"
    with pytest.raises(TypeError):
        message.payload["order"] = None


def test_pause_resume_requeue_and_delete_by_name_hint_and_id(any_store: Store) -> None:
    a1, a2 = add(any_store, "a", name="x"), add(any_store, "a", name="y")
    b1 = add(any_store, "b", name="x")
    assert any_store.messages_pause(MessageFilter(hint="a")) == 2
    assert fetch(any_store) == [b1]
    assert any_store.messages_resume(MessageFilter(ids=(a2,))) == 1
    assert fetch(any_store) == [b1]  # a1 is still paused and holds back a2
    assert any_store.messages_resume(MessageFilter(name="x")) == 1
    assert fetch(any_store) == [a1, a2, b1]
    set_columns(any_store, b1, state="dead", attempt=100, next_attempt_at=3600)
    assert any_store.messages_requeue(MessageFilter(state=MessageState.DEAD)) == 1
    requeued = any_store.messages_get(b1)
    assert requeued is not None and requeued.state is MessageState.READY and requeued.attempt == 0
    assert requeued.next_attempt_at is None  # due at once, in its hint's order (no cycle to overtake it)
    assert any_store.messages_delete(MessageFilter(name="x")) == 2
    assert [m.id for m in any_store.messages_list(MessageFilter())] == [a2]


def test_counts_by_state_and_oldest_eligible_age(any_store: Store) -> None:
    add(any_store, "a")
    add(any_store, "b", attempt=1, next_attempt_at=60)
    add(any_store, "c", state="paused")
    add(any_store, "d", state="dead")
    add(any_store, "e", expires_at=-1)
    oldest = any_store.messages_oldest_eligible(range(any_store.slot_count), Mode.FAIL_FIRST)
    counts = any_store.messages_count_by_state(oldest)
    assert (counts.ready, counts.waiting, counts.paused, counts.dead, counts.expired) == (1, 1, 1, 1, 1)
    assert counts.oldest_eligible_age is not None and counts.oldest_eligible_age >= timedelta(0)


def test_the_oldest_eligible_message_is_the_oldest_the_engine_would_fetch(any_store: Store) -> None:
    """Over every slot, in whatever state each hint's messages are: the oldest message the engine's fetch would
    take now (its candidates and batches, slot by slot)."""
    rng = random.Random(7)
    shapes: list[dict[str, Any]] = [
        {}, {}, {"attempt": 1, "next_attempt_at": 60}, {"attempt": 1, "next_attempt_at": -5}, {"state": "paused"},
        {"state": "dead"}, {"expires_at": -1},
    ]
    for number in range(200):
        add(any_store, f"h{rng.randrange(60)}", created_at_offset=-1000 + number, **rng.choice(shapes))
    for mode in (Mode.FAIL_FIRST, Mode.ALL):
        fetched = [m for slot in range(any_store.slot_count) for m in fetch_slot(any_store, slot, mode)]
        expected = min(m.created_at for m in fetched)
        assert any_store.messages_oldest_eligible(range(any_store.slot_count), mode) == expected
        assert any_store.console_oldest_eligible(mode, 50) == expected
    assert any_store.messages_oldest_eligible([], Mode.FAIL_FIRST) is None


def test_expired_messages_are_deleted_in_bounded_chunks(any_store: Store) -> None:
    for i in range(5):
        add(any_store, f"h{i}", expires_at=-1)
    keep = add(any_store, "keep")
    now = any_store.now()
    assert any_store.messages_delete_expired(now=now, limit=2) == 2
    assert any_store.messages_delete_expired(now=now, limit=2) == 2
    assert any_store.messages_delete_expired(now=now, limit=2) == 1
    assert [m.id for m in any_store.messages_list(MessageFilter())] == [keep]


def _explain(store: Store, sql: str, params: dict[str, Any], generic: bool) -> list[dict[str, Any]]:
    """The plan nodes of a statement, run for real; with ``generic`` as a prepared statement's generic plan."""
    with store.engine.connect() as connection:
        if not generic:
            raw = connection.execute(text("EXPLAIN (ANALYZE, FORMAT JSON) " + sql), params).scalar_one()
        else:
            names = list(params)
            for i, name in enumerate(names, 1):
                sql = sql.replace(f":{name}", f"${i}")
            types = [
                "text[]" if isinstance(params[n], list) else "text" if isinstance(params[n], str) else "bigint"
                for n in names
            ]
            connection.execute(text("SET plan_cache_mode = force_generic_plan"))
            connection.exec_driver_sql(f"PREPARE probe({', '.join(types)}) AS {sql}")

            def literal(value: Any) -> str:
                if isinstance(value, list):
                    return "ARRAY[" + ", ".join(map(literal, value)) + "]::text[]"
                if isinstance(value, str):
                    return "'" + value.replace("'", "''") + "'"
                return str(int(value))

            arguments = ", ".join(literal(params[name]) for name in names)
            raw = connection.exec_driver_sql(
                f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE probe({arguments})"
            ).scalar_one()
            connection.exec_driver_sql("DEALLOCATE probe")
            connection.execute(text("RESET plan_cache_mode"))
    plan = raw if isinstance(raw, list) else json.loads(raw)
    return _walk(dict(plan[0]["Plan"]))


def _walk(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(child for sub in node.get("Plans", []) for child in _walk(sub))]


def _touched(nodes: list[dict[str, Any]]) -> float:
    return sum(
        n.get("Actual Rows", 0) * n.get("Actual Loops", 1) + n.get("Rows Removed by Filter", 0)
        + n.get("Rows Removed by Join Filter", 0)
        for n in nodes
    )


@pytest.mark.parametrize("generic", [False, True], ids=["custom-plan", "generic-plan"])
@pytest.mark.parametrize("mode", list(Mode))
def test_a_fetch_costs_what_it_returns_not_the_held_back_rows(store: Store, mode: Mode, generic: bool) -> None:
    """60 000 dead, paused and waiting rows each on a hint of its own, and 60 000 fresh messages queued behind
    one dead head, one waiting retry and one paused message: a fetch of a slot still touches few rows."""
    from worker.db.fetch import _batches_statement, _slot_fetch_sql

    with store.engine.begin() as connection:
        for state, delay in (("dead", None), ("paused", None), ("ready", "1 hour")):
            connection.execute(
                text(
                    "INSERT INTO correlation_message (message_name, correlation_hint, state, attempt, "
                    "next_attempt_at) SELECT 'n', 'stuck-' || :state || g, :state, 1, now() + CAST(:delay AS interval)"
                    " FROM generate_series(1, 60000) g"
                ),
                {"state": state, "delay": delay},
            )
            connection.execute(
                text(
                    "INSERT INTO correlation_message (message_name, correlation_hint, state, attempt, next_attempt_at) "
                    "VALUES ('n', 'behind-' || :state, :state, 1, now() + CAST(:delay AS interval))"
                ),
                {"state": state, "delay": delay},
            )
            connection.execute(
                text(
                    "INSERT INTO correlation_message (message_name, correlation_hint) "
                    "SELECT 'n', 'behind-' || :state FROM generate_series(1, 20000) g"
                ),
                {"state": state},
            )
        connection.execute(
            text(
                "INSERT INTO correlation_message (message_name, correlation_hint) "
                "SELECT 'n', 'live-' || (g % 50) FROM generate_series(1, 500) g"
            )
        )
        connection.execute(text("ANALYZE correlation_message"))
    slots = {0, 7, 63} | {_slot(store, f"behind-{state}") for state in ("dead", "paused", "ready")}
    for slot in sorted(slots):
        candidates = _explain(
            store, _slot_fetch_sql().text, {"slot": slot, "after": "", "budget": 100, "skip": [], "passed": []},
            generic,
        )
        assert not any(n["Node Type"] == "Seq Scan" for n in candidates), "the fetch must not scan the table"
        assert _touched(candidates) < 1_000, f"slot {slot}: finding candidates touched {_touched(candidates)} rows"
        hints = list(store.messages_candidates(slot, "", 100).fresh)
        sql = _batches_statement("postgresql", mode).text
        params = {"hints": hints, "horizon": 2**62, "per_hint": 100, "limit": 100, "page_bytes": 2**62}
        batches = _explain(store, sql, params, generic)
        # correlation_call is empty here, so a scan of it costs nothing; with a backlog in flight the fetch's own
        # settings keep it a probe per row (test_a_fetch_planned_while_few_calls_were_in_flight_...)
        assert not any(
            n["Node Type"] == "Seq Scan" and n.get("Relation Name") != "correlation_call" for n in batches
        )
        assert _touched(batches) < 5_000, f"slot {slot}: reading batches touched {_touched(batches)} rows"


@pytest.mark.parametrize("generic", [False, True], ids=["custom-plan", "generic-plan"])
def test_a_hint_holding_most_of_the_table_does_not_make_the_other_hints_batches_cost_its_rows(
    store: Store, generic: bool
) -> None:
    """100 000 messages behind one dead head, and a few live hints in the same slot: ANALYZE then sees a table of
    few hints, yet reading the live hints' batches must not walk the big hint's rows."""
    from worker.db.fetch import _batches_statement

    slot = _slot(store, "big")
    live = [hint for hint in (f"live-{n}" for n in range(3000)) if _slot(store, hint) == slot][:8]
    with store.engine.begin() as connection:
        for hint in live:
            connection.execute(text("INSERT INTO correlation_message (message_name, correlation_hint) "
                                    "SELECT 'n', :hint FROM generate_series(1, 5)"), {"hint": hint})
        connection.execute(text(
            "INSERT INTO correlation_message (message_name, correlation_hint, state) "
            "SELECT 'n', 'big', CASE WHEN g = 1 THEN 'dead' ELSE 'ready' END FROM generate_series(1, 100000) g"
        ))
        connection.execute(text("ANALYZE correlation_message"))
    params = {"hints": [*live, "big"], "horizon": 2**62, "per_hint": 100, "limit": 100, "page_bytes": 2**62}
    batches = _explain(store, _batches_statement("postgresql", Mode.FAIL_FIRST).text, params, generic)
    assert _touched(batches) < 1_000, f"reading the batches touched {_touched(batches)} rows"


def test_a_fetch_planned_while_few_calls_were_in_flight_probes_the_calls_of_its_rows_only(store: Store) -> None:
    """The batches' statement runs prepared, on a generic plan made at its first run, while correlation_call is
    empty (as autovacuum's statistics found it between two backlogs); a backlog then puts tens of thousands of rows
    in it. Whether each row read is in flight is still one probe of it: the plan made early must neither hash the
    whole call table at each fetch nor scan it for each row. The plan is made and run under the settings each
    fetch sets for its transaction."""
    from worker.db.fetch import _GENERIC_PLANS, _batches_statement

    with store.engine.begin() as connection:
        connection.execute(text("INSERT INTO correlation_message (message_name, correlation_hint) "
                                "SELECT 'n', 'live-' || (g % 20) FROM generate_series(1, 400) g"))
        connection.execute(text("ANALYZE correlation_message"))
        connection.execute(text("ANALYZE correlation_call"))
    hints = [f"live-{n}" for n in range(20)]
    arguments = ("ARRAY[" + ", ".join(f"'{hint}'" for hint in hints)
                 + "]::text[], 4611686018427387904, 100, 100, 4611686018427387904")
    sql = _batches_statement("postgresql", Mode.FAIL_FIRST).text
    for i, name in enumerate(("hints", "horizon", "per_hint", "limit", "page_bytes"), 1):
        sql = sql.replace(f":{name}", f"${i}")
    with store.engine.connect() as connection:
        connection.exec_driver_sql(_GENERIC_PLANS)
        connection.exec_driver_sql(f"PREPARE batches(text[], bigint, int, int, bigint) AS {sql}")
        assert len(connection.exec_driver_sql(f"EXECUTE batches({arguments})").all()) == 100  # the plan is made
        connection.commit()
        connection.exec_driver_sql(
            "INSERT INTO correlation_call (message_id, slot, fence, holder, run_head) "
            "SELECT 1000000 + g, 0, 1, 'r', 1000000 + g FROM generate_series(1, 30000) g"
        )
        connection.commit()
        connection.exec_driver_sql(_GENERIC_PLANS)
        raw = connection.exec_driver_sql(
            f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE batches({arguments})"
        ).scalar_one()
        connection.exec_driver_sql("DEALLOCATE batches")
    nodes = _walk(dict((raw if isinstance(raw, list) else json.loads(raw))[0]["Plan"]))
    calls = [n for n in nodes if n.get("Relation Name") == "correlation_call"]
    assert calls and all(n["Node Type"] != "Seq Scan" for n in calls), calls
    assert _touched(calls) <= 100, f"the page's 100 rows touched {_touched(calls)} rows of correlation_call"


@pytest.mark.parametrize("generic", [False, True], ids=["custom-plan", "generic-plan"])
def test_a_group_commit_costs_what_it_writes(store: Store, generic: bool) -> None:
    """1 000 outcomes among 100 000 messages: every statement of the group commit reaches its rows by primary key,
    on custom and generic plans (prepared statements go generic after a few runs; a join of the batch with itself
    there once cost a million comparisons per flush and stalled every lane for seconds)."""
    from worker.db import calls

    with store.engine.begin() as connection:
        connection.execute(text(
            "INSERT INTO correlation_message (message_name, correlation_hint) "
            "SELECT 'n', 'h' || (g % 1000) FROM generate_series(1, 100000) g"
        ))
        connection.execute(text(
            "INSERT INTO correlation_call (message_id, slot, fence, holder, run_head) "
            "SELECT id, slot, 1, 'r', id FROM correlation_message WHERE id % 100 = 0"
        ))
        connection.execute(text("ANALYZE correlation_message"))
        connection.execute(text("ANALYZE correlation_call"))
    ids = [str(i) for i in range(100, 100001, 100)]
    statements = {
        "calls": (calls._CALLS_OF_PG, {"ids": ids}),
        "lock": (calls._LOCK_MESSAGES_PG, {"ids": ids}),
        "present": (calls._PRESENT_PG, {"ids": ids}),
        "delete": (calls._DELETE_MESSAGES_PG, {"ids": ids}),
        "update": (calls._UPDATE_MESSAGES_PG, {
            "u_ids": ids, "u_attempts": ["1"] * len(ids), "u_next": ["2030-01-01T00:00:00Z"] * len(ids),
            "u_reschedules": ["0"] * len(ids), "u_errors": ["boom"] * len(ids), "u_dead": ["false"] * len(ids),
        }),
        "release": (calls._RELEASE_CALLS_PG, {"ids": ids}),
        "return": (calls._RETURN_CALLS_PG, {"ids": ids}),
        "abandon": (calls._ABANDON_CALLS_PG, {"ids": ids}),
    }
    for name, (statement, params) in statements.items():
        nodes = _explain(store, statement.text, params, generic)
        # correlation_call holds only the calls in flight: here the batch itself, which a scan may read whole
        assert not any(
            n["Node Type"] == "Seq Scan" and n.get("Relation Name") != "correlation_call" for n in nodes
        ), f"{name}: scans the message table"
        # a Sort (the call rows are locked in ascending id) orders rows already counted: it reads no table
        touched = _touched([n for n in nodes if n["Node Type"] != "Sort"])
        assert touched <= 4 * len(ids), f"{name}: touched {touched} rows for {len(ids)} outcomes"


@pytest.mark.parametrize("generic", [False, True], ids=["custom-plan", "generic-plan"])
def test_marking_calls_reads_their_rows_by_primary_key_even_when_statistics_saw_no_row_ready(
    store: Store, generic: bool
) -> None:
    """A backlog analyzed while paused, then resumed: the statistics say no row is ready, which made a partial
    index on ready rows look cheapest for the mark's check that a message is still ready (each mark scanned all
    of it, a replica drained three times slower). The mark reads its messages by primary key whatever they say."""
    from worker.db import calls

    with store.engine.begin() as connection:
        connection.execute(text(
            "INSERT INTO correlation_message (message_name, correlation_hint, state) "
            "SELECT 'n', 'h' || (g % 1000), 'paused' FROM generate_series(1, 100000) g"
        ))
        connection.execute(text("ANALYZE correlation_message"))
        connection.execute(text("UPDATE correlation_message SET state = 'ready'"))
        connection.execute(text(
            "INSERT INTO correlation_lock (name, locked_by, fence, lock_until, locked_at) "
            "SELECT 'slot:' || g, 'r', 1, now() + interval '1 hour', now() FROM generate_series(0, 63) g "
            "ON CONFLICT (name) DO UPDATE SET locked_by = 'r', fence = 1, lock_until = excluded.lock_until"
        ))
        rows = connection.execute(text(
            "SELECT id, slot, correlation_hint FROM correlation_message ORDER BY id LIMIT 200"
        )).all()
    params = {
        "t_names": [f"slot:{n}" for n in range(64)], "t_holders": ["r"] * 64, "t_fences": ["1"] * 64,
        "t_slots": [str(n) for n in range(64)],
        "ids": [str(row.id) for row in rows], "slots": [str(row.slot) for row in rows], "fences": ["1"] * len(rows),
        "holders": ["r"] * len(rows), "heads": [str(rows[0].id)] * len(rows), "states": ["called"] * len(rows),
        "hints": [row.correlation_hint for row in rows],
    }
    nodes = _explain(store, calls._MARK_PG.text, params, generic)
    touched = [n for n in nodes if n.get("Relation Name") == "correlation_message"]
    assert touched and not any("Index Name" in n and n["Index Name"] != "correlation_message_pkey" for n in touched)
    assert _touched(touched) <= 2 * len(rows), f"the mark read {_touched(touched)} message rows for {len(rows)}"


_CONSOLE_INDEXES = {"correlation_message_name_state_id_idx", "correlation_message_held_state_idx"}


def _burst(store: Store, messages: int = 20_000, hints: int = 1000) -> None:
    with store.engine.begin() as connection:
        connection.execute(text(
            "INSERT INTO correlation_message (message_name, correlation_hint) "
            "SELECT 'n', 'hint-' || (g % :hints) FROM generate_series(1, :messages) g"
        ), {"messages": messages, "hints": hints})


@pytest.mark.parametrize("generic", [False, True], ids=["custom-plan", "generic-plan"])
def test_a_burst_after_a_quiet_spell_of_delivery_records_costs_the_engine_what_it_reads(
    store: Store, generic: bool
) -> None:
    """Autovacuum analyzes the table between two bursts, when it holds delivery records only (the default
    retention): the statistics say no row is live. The console's indexes of live messages then looked empty, and
    every statement of the engine could read them (their predicates were the states it names): the next burst's
    probes by hint and the group commit's locks by id each read all of it, and a replica drained a few hundred
    messages a second. The engine's statements reach the burst through their own indexes, whatever is planned."""
    from worker.db import calls
    from worker.db.fetch import _batches_statement, _slot_fetch_sql

    _burst(store)
    with store.engine.begin() as connection:
        connection.execute(text(
            "UPDATE correlation_message SET state = 'delivered', outcome = 'correlated', finished_at = now(), "
            "finished_by = 'r', payload = '{}'"
        ))
        connection.execute(text("ANALYZE correlation_message"))
    _burst(store)
    slot = _slot(store, "hint-7")
    plans = {
        "candidates": _explain(store, _slot_fetch_sql().text,
                               {"slot": slot, "after": "", "budget": 100, "skip": [], "passed": []}, generic),
    }
    hints = list(store.messages_candidates(slot, "", 100).fresh)
    assert len(hints) > 5
    plans["batches"] = _explain(store, _batches_statement("postgresql", Mode.FAIL_FIRST).text,
                                {"hints": hints, "horizon": 2**62, "per_hint": 100, "limit": 100,
                                 "page_bytes": 2**62}, generic)
    with store.engine.begin() as connection:
        rows = connection.execute(text(
            "SELECT id, slot FROM correlation_message WHERE state = 'ready' ORDER BY id LIMIT 500"
        )).all()
        connection.execute(text(
            "INSERT INTO correlation_call (message_id, slot, fence, holder, run_head) "
            "SELECT id, slot, 1, 'r', id FROM correlation_message WHERE state = 'ready' ORDER BY id LIMIT 500"
        ))
    ids = [str(row.id) for row in rows]
    commit = {
        "group commit: calls": (calls._CALLS_OF_PG, {"ids": ids}),
        "group commit: lock": (calls._LOCK_MESSAGES_PG, {"ids": ids}),
        "group commit: present": (calls._PRESENT_PG, {"ids": ids}),
        "group commit: deliver": (
            calls._DELIVER_WITH_RESULTS_PG, {"ids": ids, "results": ["{}"] * len(ids), "by": "r"}
        ),
    }
    for name, (statement, params) in commit.items():
        plans[name] = _explain(store, statement.text, params, generic)
    for name, nodes in plans.items():
        assert not {n.get("Index Name") for n in nodes} & _CONSOLE_INDEXES, f"{name} reads a console index"
    assert _touched(plans["candidates"]) < 1_000, f"candidates touched {_touched(plans['candidates'])} rows"
    assert _touched(plans["batches"]) < 2_000, f"the batches touched {_touched(plans['batches'])} rows"
    for name in commit:
        messages = [n for n in plans[name] if n.get("Relation Name") == "correlation_message"]
        assert _touched(messages) <= 3 * len(rows), f"{name} touched {_touched(messages)} message rows"


def _quiet_after_a_burst(store: Store) -> None:
    """A queue whose successes are deleted (retention PT0S), empty between two bursts and vacuumed so: ANALYZE of
    an empty table keeps the statistics its columns had during the earlier burst."""
    _burst(store)
    with store.engine.connect() as connection:
        autocommit = connection.execution_options(isolation_level="AUTOCOMMIT")
        autocommit.execute(text("ANALYZE correlation_message"))
        autocommit.execute(text("DELETE FROM correlation_message"))
        autocommit.execute(text("VACUUM ANALYZE correlation_message"))


def test_a_fetch_keeps_a_plan_of_the_batches_for_each_size_of_the_table(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batches' statement runs on a generic plan kept for the connection. Made on an empty table, where every
    path costs nothing, it read each hint's batch through the primary key, and the next burst's probes each read
    every row of it until autovacuum came by; planned at every fetch instead, it cost each wake-up about 1.5 ms.
    Its text names the table's size class as the previous fetch saw it on disk: always prepared, it gets a plan of
    its own once the table has grown past the class its plan was made at."""
    import psycopg

    from worker.db.fetch import _PAGE_HINTS, page_size_class

    _quiet_after_a_burst(store)
    runs: list[tuple[int, bool | None]] = []
    execute = psycopg.Cursor.execute

    def recording(cursor: Any, query: Any, params: Any = None, **options: Any) -> Any:
        if isinstance(query, str) and f"current_setting('{_PAGE_HINTS}'" in query:  # the batches' statement
            size_class = int(query.rsplit("table size class ", 1)[1].split()[0])
            runs.append((size_class, options.get("prepare")))
        return execute(cursor, query, params, **options)

    monkeypatch.setattr(psycopg.Cursor, "execute", recording)
    slot = _slot(store, "hint-7")

    def fetch() -> int:
        candidates, fetched = store.messages_fetch_slot(slot, "", 100, per_hint=100, limit=100, mode=Mode.FAIL_FIRST)
        assert candidates.table_bytes is not None
        return len(fetched.messages)

    assert fetch() == 0  # no fetch before it: the class of no size
    empty = page_size_class(store._table_bytes)
    assert fetch() == 0
    _burst(store)
    assert fetch() == 100  # the last fetch saw the table empty: its plan, once
    assert fetch() == 100
    grown = page_size_class(store._table_bytes)
    assert grown >= page_size_class(1 << 20) > empty
    assert runs == [(0, True), (empty, True), (empty, True), (grown, True)]
    assert page_size_class((1 << 20) + 1) == page_size_class(4 << 20) - 1 == page_size_class(1 << 20)  # steps of 4


def test_batches_planned_at_a_bursts_size_read_each_hints_rows_whatever_the_statistics(store: Store) -> None:
    """What a fetch's kept plan is made on (see the test above): a burst in a table whose statistics are those of
    an earlier one, never analyzed since. Run as a fetch runs it (its hints and horizon set for the transaction by
    the candidates' statement), each probe reads its hint's rows only."""
    from worker.db.fetch import _GENERIC_PLANS, _PAGE_HINTS, _PAGE_HORIZON, _page_sql

    _quiet_after_a_burst(store)
    _burst(store)
    hints = "{" + ",".join(f"hint-{n}" for n in range(5)) + "}"
    sql = (_page_sql(Mode.FAIL_FIRST).replace("%(per_hint)s", "$1").replace("%(limit)s", "$2")
           .replace("%(page_bytes)s", "$3"))
    with store.engine.connect() as connection:
        connection.exec_driver_sql(f"PREPARE page(int, int, bigint) AS {sql}")
        connection.exec_driver_sql(_GENERIC_PLANS)
        connection.exec_driver_sql(f"SELECT set_config('{_PAGE_HINTS}', '{hints}', true), "
                                   f"set_config('{_PAGE_HORIZON}', '4611686018427387904', true)")
        raw = connection.exec_driver_sql("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE page(100, 100, 16777216)").scalar_one()
        connection.exec_driver_sql("DEALLOCATE page")
    nodes = _walk(dict((raw if isinstance(raw, list) else json.loads(raw))[0]["Plan"]))
    assert nodes[0]["Actual Rows"] == 100
    read = _touched([n for n in nodes if n.get("Relation Name") == "correlation_message"])
    assert read < 1_000, f"a page of 100 of 5 hints read {read} message rows"


def test_the_consoles_lists_of_live_messages_still_read_their_own_indexes(store: Store) -> None:
    """Revision 0013 made the console's indexes partial on ``finished_at IS NULL``: its reads of live messages
    name it beside the state, so that a name's messages and the dead letters are still ordered index ranges."""
    from sqlalchemy.dialects import postgresql

    from worker.db.console import _ids_in_order

    with store.engine.begin() as connection:
        connection.execute(text(
            "INSERT INTO correlation_message (message_name, correlation_hint, state) "
            "SELECT 'name-' || (g % 500), 'hint-' || g, CASE WHEN g % 97 = 0 THEN 'dead' ELSE 'ready' END "
            "FROM generate_series(1, 60000) g"
        ))
        connection.execute(text("ANALYZE correlation_message"))
    for selection, index in (
        (MessageFilter(name="name-7"), "correlation_message_name_state_id_idx"),
        (MessageFilter(name="name-7", state=MessageState.DEAD), "correlation_message_name_state_id_idx"),
        (MessageFilter(state=MessageState.DEAD), "correlation_message_held_state_idx"),
    ):
        statement = _ids_in_order(selection, 0, 50)
        sql = str(statement.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
        nodes = _explain(store, sql, {}, False)
        assert index in {n.get("Index Name") for n in nodes}, (selection, nodes)
        read = _touched([n for n in nodes if n.get("Relation Name") == "correlation_message"])
        assert read <= 3 * 50, f"{selection}: a page of 50 read {read} rows"


def test_a_connection_an_error_left_in_pipeline_mode_is_let_go_not_reset(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A pipeline that fails while the server goes away can leave its connection in pipeline mode ("cannot exit
    pipeline mode while busy"); such a connection cannot be rolled back: it is let go quietly, not handed to the
    pool's reset (which logged the failed rollback as an error with its traceback), and the next statements run."""
    import psycopg

    from worker.db.errors import StoreError

    def stuck(driver: Any) -> None:
        driver.pgconn.enter_pipeline_mode()
        driver.pgconn.send_query_params(b"SELECT 1", None)
        raise psycopg.OperationalError("cannot exit pipeline mode while busy")

    def through_sqlalchemy(work: Any) -> None:
        store._run(lambda connection: work(connection.connection.driver_connection))

    for run in (store._driver_statements, through_sqlalchemy):
        with caplog.at_level("DEBUG"), pytest.raises(StoreError):
            run(stuck)
        assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text
        assert store.messages_count_by_state() is not None  # the pool hands out a working connection


def test_the_statements_run_by_the_driver_itself_report_an_unreachable_server_as_the_stores_error() -> None:
    """The engine's statements that check a psycopg connection out of the pool directly (the pauses read once a
    second, the looks at quiet slots, the marks) say "database unavailable" as every other statement does: the
    pool's checkout raised the driver's own error, which reached the fetch loop as a bug with its traceback."""
    from datetime import timedelta

    from worker.config import DatabaseSettings
    from worker.db.base import build_engine
    from worker.db.errors import DatabaseUnavailable

    unreachable = Store(build_engine(DatabaseSettings(url="postgresql+psycopg://postgres@127.0.0.1:1/none",
                                                      connect_timeout=timedelta(seconds=1))))
    try:
        with pytest.raises(DatabaseUnavailable):
            unreachable.pauses_list()
        with pytest.raises(DatabaseUnavailable):
            unreachable.messages_look({0: None})
    finally:
        unreachable.close()
