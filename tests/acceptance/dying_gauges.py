"""A route module whose import breaks the worker's gauges loop: its next round ends the thread with an exception
nothing below it handles (as a bug would). For the supervision test only."""

from __future__ import annotations

from typing import Any

import worker.worker


class ThreadKiller(BaseException):
    """Not an Exception: the loop's own handler does not catch it."""


def _broken_gauges(self: Any) -> None:
    raise ThreadKiller("the gauges loop broke")


worker.worker.Worker._gauges = _broken_gauges  # type: ignore[method-assign]


def handle(message: Any) -> None:
    return None
