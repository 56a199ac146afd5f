"""Correlators for the schedule acceptance tests; worker processes import them as ``schedule_handlers:<name>``.

``hold_until_released`` fails (a retry) every call of a schedule's message until the test inserts the schedule's
name into ``acceptance_release`` of the PostgreSQL database the recorder uses, then succeeds.
"""

from __future__ import annotations

import os

import psycopg
from recorder import DSN_ENV

from worker import Message

RELEASE_TABLE_DDL = "CREATE TABLE IF NOT EXISTS acceptance_release (schedule text PRIMARY KEY)"


def hold_until_released(message: Message) -> None:
    """Fail until the message's schedule is released by the test, then succeed."""
    schedule = message.headers["schedule"]
    with psycopg.connect(os.environ[DSN_ENV], autocommit=True) as connection:
        released = connection.execute("SELECT 1 FROM acceptance_release WHERE schedule = %s", (schedule,)).fetchone()
    if released is None:
        raise RuntimeError(f"job {message.headers['job_number']} of schedule {schedule} is held by the test")
