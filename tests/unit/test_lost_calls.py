"""What a lost call means for its message: counted, a crash if it was under way, poison only when it ran alone."""

from __future__ import annotations

from worker.policy.outcomes import COUNTER_MAX, settle_lost_call


def settle(lost: int, crashes: int, *, crashed: bool = True, alone: bool = False, poison_after: int = 3):  # type: ignore[no-untyped-def]
    return settle_lost_call(lost, crashes, "earlier", crashed=crashed, alone=alone, poison_after=poison_after)


def test_a_call_lost_beside_others_is_a_crash_but_never_makes_its_message_dead() -> None:
    outcome = settle(5, 5, poison_after=3)
    assert (outcome.lost_calls, outcome.crashed_calls, outcome.dead) == (6, 6, False)
    assert outcome.last_error == "earlier"


def test_a_call_that_ran_alone_makes_its_message_dead_at_poison_after_crashes() -> None:
    assert not settle(0, 0, alone=True).dead and not settle(1, 1, alone=True).dead
    outcome = settle(2, 2, alone=True)
    assert outcome.dead and outcome.crashed_calls == 3
    assert outcome.last_error is not None and "poison_after=3" in outcome.last_error


def test_the_first_crash_beside_others_counts_towards_poison_after() -> None:
    outcome = settle(1, 1, alone=True, poison_after=2)  # once beside others, then alone
    assert outcome.dead and outcome.crashed_calls == 2


def test_a_call_not_under_way_at_the_death_is_lost_but_not_a_crash() -> None:
    outcome = settle(2, 2, crashed=False, alone=True, poison_after=1)  # given up at shutdown, or not started
    assert (outcome.lost_calls, outcome.crashed_calls, outcome.dead) == (3, 2, False)


def test_poison_after_zero_never_makes_a_message_dead() -> None:
    assert not settle(100, 100, alone=True, poison_after=0).dead


def test_counts_stop_at_the_schemas_bound() -> None:
    outcome = settle(COUNTER_MAX, COUNTER_MAX)
    assert outcome.lost_calls == COUNTER_MAX and outcome.crashed_calls == COUNTER_MAX
