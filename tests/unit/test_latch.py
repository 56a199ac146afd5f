"""The one-shot latch a run's mark and outcomes are waited on with (worker.engine.committer.Latch)."""

from __future__ import annotations

import threading
import time

from worker.engine.committer import Latch


def test_a_latch_is_unset_until_set_and_a_wait_times_out() -> None:
    latch = Latch()
    assert not latch.is_set()
    started = time.monotonic()
    assert latch.wait(0.05) is False
    assert time.monotonic() - started >= 0.04
    latch.set()
    assert latch.is_set()
    assert latch.wait(0) is True
    assert latch.wait() is True


def test_setting_a_latch_twice_changes_nothing() -> None:
    latch = Latch()
    latch.set()
    latch.set()
    assert latch.wait(0) is True
    assert latch.wait(0) is True  # a wait passes the lock on: the next one passes too


def test_every_waiter_wakes_when_the_latch_is_set() -> None:
    latch = Latch()
    woke: list[bool] = []
    lock = threading.Lock()

    def waiter() -> None:
        result = latch.wait(10)
        with lock:
            woke.append(result)

    threads = [threading.Thread(target=waiter) for _ in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(0.05)  # let them block (a waiter that comes late passes at once: the test holds either way)
    assert woke == []
    latch.set()
    for thread in threads:
        thread.join(5)
    assert woke == [True] * 8
    assert not any(thread.is_alive() for thread in threads)


def test_a_waiter_with_a_timeout_returns_as_soon_as_the_latch_is_set() -> None:
    latch = Latch()
    threading.Timer(0.05, latch.set).start()
    started = time.monotonic()
    assert latch.wait(10) is True
    assert time.monotonic() - started < 5
