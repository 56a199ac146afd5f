"""Slot balancing is a pure function of the live replicas and their holdings; no database here."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from worker.engine.leases import SlotLeaseConfig, member_lock_name, slot_lock_name, slot_of
from worker.policy.balance import Balance, balance, fair_shares

S = 64


def test_a_lone_replica_takes_every_slot() -> None:
    assert balance(S, "a", [], {}) == Balance(target=64, acquire=64, hand_back=())


def test_a_replica_at_its_share_does_nothing() -> None:
    assert balance(S, "a", list(range(32)), {"b": 32}) == Balance(target=32, acquire=0, hand_back=())


def test_a_new_member_makes_the_holder_hand_back_half() -> None:
    plan = balance(S, "a", list(range(64)), {"b": 0})
    assert plan.target == 32
    assert plan.acquire == 0
    assert plan.hand_back == tuple(range(32, 64))


def test_a_new_member_with_zero_slots_is_short_and_acquires_its_share() -> None:
    assert balance(S, "b", [], {"a": 64}) == Balance(target=32, acquire=32, hand_back=())


def test_lapsed_slots_are_taken_at_once_even_while_another_replica_is_short() -> None:
    # d died holding 16 slots; e replaced it and holds none: a and b are at their share, e is short.
    plan = balance(S, "a", list(range(16)), {"b": 16, "c": 16, "e": 0}, lapsed=16)
    assert plan == Balance(target=16, acquire=16, hand_back=())
    assert balance(S, "a", list(range(16)), {"b": 16, "c": 16, "e": 0}, lapsed=0).acquire == 0  # released: e's


def test_a_replica_above_its_share_takes_lapsed_slots_before_handing_back() -> None:
    plan = balance(S, "a", list(range(30)), {"b": 20, "c": 0}, lapsed=14)
    assert plan == Balance(target=22, acquire=14, hand_back=())  # the surplus goes back at the next rounds
    assert balance(S, "a", list(range(30)), {"b": 20, "c": 0}, lapsed=99).acquire == 14  # never more than free


def test_shares_are_floor_and_ceil_and_add_up_to_every_slot() -> None:
    for replicas in range(1, 70):
        holdings = {f"r{i}": 0 for i in range(replicas)}
        shares = fair_shares(S, holdings)
        assert sum(shares.values()) == S
        assert set(shares.values()) <= {S // replicas, -(-S // replicas)}


def test_the_larger_shares_go_to_the_replicas_holding_most_so_fewest_slots_move() -> None:
    shares = fair_shares(S, {"a": 21, "b": 22, "c": 21})
    assert shares == {"a": 21, "b": 22, "c": 21}


def test_shares_break_ties_by_name_so_that_every_replica_computes_the_same() -> None:
    assert fair_shares(S, {"b": 32, "a": 32, "c": 0}) == {"a": 22, "b": 21, "c": 21}


def test_surplus_that_no_one_needs_is_kept() -> None:
    # A view taken mid-takeover can count more held slots than exist: b is at its share, nobody is short.
    assert balance(S, "a", list(range(40)), {"b": 32}) == Balance(target=32, acquire=0, hand_back=())


def test_free_slots_count_towards_what_a_short_replica_needs() -> None:
    # b needs 32 and 24 are free: a hands back only the 8 the free ones do not cover.
    assert balance(S, "a", list(range(40)), {"b": 0}).hand_back == tuple(range(32, 40))
    # a sees 31 free for b's 32: one slot of a's surplus is needed.
    assert balance(S, "a", list(range(33)), {"b": 0}).hand_back == (32,)


def test_what_the_holders_hand_back_and_the_free_slots_cover_exactly_what_the_short_need() -> None:
    holdings = {"a": 40, "b": 10, "c": 0, "d": 6}  # 8 free
    shares = fair_shares(S, holdings)
    handed_back = sum(
        len(balance(S, me, list(range(held)), {r: n for r, n in holdings.items() if r != me}).hand_back)
        for me, held in holdings.items()
    )
    needed = sum(max(0, shares[r] - n) for r, n in holdings.items())
    assert handed_back + (S - sum(holdings.values())) == needed


def test_a_replica_never_hands_back_below_its_share() -> None:
    plan = balance(S, "a", list(range(30)), {"b": 0, "c": 0, "d": 0})
    assert plan.target == 16
    assert len(plan.hand_back) == 14


def test_more_replicas_than_slots_leaves_some_with_none() -> None:
    shares = fair_shares(2, {"a": 1, "b": 1, "c": 0})
    assert shares == {"a": 1, "b": 1, "c": 0}
    assert balance(2, "c", [], {"a": 1, "b": 1}) == Balance(target=0, acquire=0, hand_back=())


def test_one_slot_of_sqlite_stays_with_its_holder() -> None:
    assert balance(1, "a", [0], {"b": 0}) == Balance(target=1, acquire=0, hand_back=())
    assert balance(1, "b", [], {"a": 1}) == Balance(target=0, acquire=0, hand_back=())


def _simulate(table: dict[int, str | None], replicas: list[str], rng: random.Random) -> None:
    """One round of every replica in random order against an in-memory lock table (release is immediate)."""
    for me in rng.sample(replicas, len(replicas)):
        mine = [slot for slot, holder in table.items() if holder == me]
        others = {replica: 0 for replica in replicas if replica != me}
        for holder in table.values():
            if holder is not None and holder != me:
                others[holder] += 1
        plan = balance(len(table), me, mine, others)
        for slot in plan.hand_back:
            table[slot] = None
        free = [slot for slot, holder in table.items() if holder is None]
        for slot in free[: plan.acquire]:
            table[slot] = me


@pytest.mark.parametrize("seed", range(20))
def test_replicas_joining_and_leaving_converge_to_fair_shares_within_a_few_rounds(seed: int) -> None:
    rng = random.Random(seed)
    table: dict[int, str | None] = dict.fromkeys(range(S))
    replicas = ["r0"]
    for _ in range(8):
        if len(replicas) > 1 and rng.random() < 0.3:
            gone = replicas.pop(rng.randrange(len(replicas)))
            table = {slot: (None if holder == gone else holder) for slot, holder in table.items()}
        else:
            replicas.append(f"r{rng.randrange(10**6)}")
        for _ in range(3):
            _simulate(table, replicas, rng)
        counts = [sum(1 for holder in table.values() if holder == replica) for replica in replicas]
        assert None not in table.values()
        assert sum(counts) == S
        assert max(counts) - min(counts) <= 1, counts
        before = dict(table)
        _simulate(table, replicas, rng)
        assert table == before  # balanced: nothing moves any more


def test_lock_names_of_slots_round_trip_and_members_fit_the_column() -> None:
    assert slot_lock_name(17) == "slot:17"
    assert slot_of("slot:17") == 17
    assert slot_of("cleanup") is None and slot_of("slot:x") is None
    name = member_lock_name("pod-" + "x" * 250)
    assert name.startswith("member:") and len(name) <= 64
    assert member_lock_name("a") != member_lock_name("b")


def test_the_default_lease_config_renews_often_enough_for_a_default_handler_timeout() -> None:
    config = SlotLeaseConfig()
    assert config.lease == timedelta(seconds=40) and config.renew_interval == timedelta(seconds=5)
    # A call of the default handler timeout (PT30S) always fits before the lease could end.
    assert config.lease - config.renew_interval - config.safety_margin >= timedelta(seconds=30)


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"lease": timedelta(0)}, "lease must be positive"),
        ({"renew_interval": timedelta(seconds=14)}, "at most a third of the lease"),
        ({"renew_interval": timedelta(0)}, "must be positive"),
        ({"safety_margin": timedelta(seconds=35)}, "safety margin"),
        ({"safety_margin": timedelta(seconds=-1)}, "safety margin"),
        ({"drain": timedelta(seconds=40)}, "drain"),
    ],
)
def test_a_lease_config_that_cannot_work_is_refused_with_a_reason(
    fields: dict[str, timedelta], complaint: str
) -> None:
    with pytest.raises(ValueError, match=complaint):
        SlotLeaseConfig(**fields)
