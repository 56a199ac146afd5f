"""When the committer writes queued outcomes (worker.engine.committer.Committer), by its own clock."""

from __future__ import annotations

from typing import Any

from worker.engine.committer import GROUP_WINDOW, Committer, Outcomes
from worker.service.metrics import Metrics


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def committer(clock: Clock) -> Committer:
    store: Any = None  # not written to: only when the queue is due is asked
    return Committer(store, Metrics(), monotonic=clock)


def outcomes() -> Outcomes:
    return Outcomes(3, None, [], lambda ended: None)


def test_a_runs_outcomes_wait_a_group_window_for_company() -> None:
    clock = Clock()
    recorder = committer(clock)
    recorder.record(outcomes())
    assert not recorder._due()
    clock.now += GROUP_WINDOW / 2
    recorder.record(outcomes())
    assert not recorder._due(), "a later run's outcomes do not move the first one's window"
    clock.now = 100.0 + GROUP_WINDOW
    assert recorder._due()


def test_the_outcome_of_a_call_made_alone_is_written_at_once_with_what_waits_before_it() -> None:
    """No other call may start until a lone call's outcome is written: it waits for no company (a replica
    taking over many lost calls, each called alone, would wait a window for each)."""
    clock = Clock()
    recorder = committer(clock)
    recorder.record(outcomes())
    recorder.record(outcomes(), now=True)
    assert recorder._due()
    taken, left = recorder._take_queued()
    assert len(taken) == 2 and not left
