"""The commit-order horizon is a pure function of the sequence's last id, the open producer transactions
(pins) and how long each has been seen; no database here."""

from __future__ import annotations

from worker.policy.horizon import Pin, PinClock, horizon, overdue


def test_with_no_open_producer_every_id_handed_out_may_be_correlated() -> None:
    result = horizon(100, [], PinClock(), now=0.0, max_wait=5.0)
    assert result.id == 100 and not result.held and result.wait_left is None


def test_the_oldest_open_producer_bounds_the_horizon() -> None:
    clock = PinClock()
    result = horizon(100, [Pin(40, "3/7"), Pin(70, "4/2")], clock, now=0.0, max_wait=5.0)
    assert result.id == 40 and result.held and result.wait_left == 5.0


def test_a_producer_registered_after_the_last_id_holds_nothing_back() -> None:
    result = horizon(100, [Pin(100, "3/7")], PinClock(), now=0.0, max_wait=5.0)
    assert result.id == 100 and not result.held


def test_a_producer_open_longer_than_the_bound_is_passed_over_once_and_counted_once() -> None:
    clock = PinClock()
    slow, quick = Pin(10, "3/7"), Pin(50, "4/2")
    assert horizon(100, [slow], clock, now=0.0, max_wait=5.0).id == 10
    first = horizon(100, [slow, quick], clock, now=5.5, max_wait=5.0)
    assert first.id == 50 and first.passed_over == 1  # quick is new: it holds the horizon now
    again = horizon(100, [slow, quick], clock, now=6.0, max_wait=5.0)
    assert again.id == 50 and again.passed_over == 0
    assert horizon(100, [slow], clock, now=11.0, max_wait=5.0).id == 100


def test_a_pin_that_ended_is_forgotten_and_a_new_one_waits_its_full_bound() -> None:
    clock = PinClock()
    pin = Pin(10, "3/7")
    horizon(100, [pin], clock, now=0.0, max_wait=5.0)
    horizon(100, [], clock, now=1.0, max_wait=5.0)
    assert clock.first_seen == {}
    assert horizon(100, [pin], clock, now=10.0, max_wait=5.0).id == 10  # seen anew at 10


def test_the_pins_a_reading_now_would_pass_over_are_those_seen_longer_than_the_bound() -> None:
    """A statement that works out the horizon itself leaves out exactly the pins the reading would pass over."""
    clock = PinClock()
    old, young = Pin(10, "3/7"), Pin(50, "4/2")
    horizon(100, [old], clock, now=0.0, max_wait=5.0)
    horizon(100, [old, young], clock, now=3.0, max_wait=5.0)
    assert overdue(clock, now=5.0, max_wait=5.0) == []  # not longer than the bound yet
    assert overdue(clock, now=6.0, max_wait=5.0) == [old]
    honoured = [pin for pin in (old, young) if pin not in overdue(clock, now=6.0, max_wait=5.0)]
    assert horizon(100, [old, young], clock, now=6.0, max_wait=5.0).id == min(pin.after for pin in honoured)
    assert sorted(overdue(clock, now=9.0, max_wait=5.0), key=lambda pin: pin.after) == [old, young]
