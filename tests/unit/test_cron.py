"""Quartz cron: Quartz's documented examples and test-suite cases, seed 004, edge cases, and refusals.

Expected fire times were computed by the brute-force reference in ``cron_reference.py`` (which
:func:`test_the_brute_force_reference_agrees_with_the_table` keeps honest) and checked against Quartz's own
documentation and ``CronExpressionTest``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import islice, pairwise
from zoneinfo import ZoneInfo

import pytest

from tests.unit.cron_reference import Reference
from worker.policy.cron import CronError, is_valid, parse, parse_schedulable

END = None  # no fire time after the ones listed

VALID: list[tuple[str, str, str, list[str | None]]] = [
    # Quartz documentation examples
    ("0 0 12 * * ?", "UTC", "2005-06-01T12:00:00", ["2005-06-02T12:00:00Z", "2005-06-03T12:00:00Z"]),
    ("0 15 10 ? * *", "UTC", "2005-06-01T10:15:00", ["2005-06-02T10:15:00Z", "2005-06-03T10:15:00Z"]),
    ("0 15 10 * * ?", "UTC", "2005-06-01T10:14:59", ["2005-06-01T10:15:00Z", "2005-06-02T10:15:00Z"]),
    ("0 15 10 * * ? *", "UTC", "2005-06-01T10:15:00", ["2005-06-02T10:15:00Z", "2005-06-03T10:15:00Z"]),
    ("0 15 10 * * ? 2005", "UTC", "2005-12-30T12:00:00", ["2005-12-31T10:15:00Z", END]),
    ("0 * 14 * * ?", "UTC", "2005-06-01T14:58:30",
     ["2005-06-01T14:59:00Z", "2005-06-02T14:00:00Z", "2005-06-02T14:01:00Z"]),
    ("0 0/5 14 * * ?", "UTC", "2005-06-01T14:50:00",
     ["2005-06-01T14:55:00Z", "2005-06-02T14:00:00Z", "2005-06-02T14:05:00Z"]),
    ("0 0/5 14,18 * * ?", "UTC", "2005-06-01T14:52:00",
     ["2005-06-01T14:55:00Z", "2005-06-01T18:00:00Z", "2005-06-01T18:05:00Z"]),
    ("0 0-5 14 * * ?", "UTC", "2005-06-01T14:04:00",
     ["2005-06-01T14:05:00Z", "2005-06-02T14:00:00Z", "2005-06-02T14:01:00Z"]),
    ("0 10,44 14 ? 3 WED", "UTC", "2005-03-01T00:00:00",
     ["2005-03-02T14:10:00Z", "2005-03-02T14:44:00Z", "2005-03-09T14:10:00Z"]),
    ("0 15 10 ? * MON-FRI", "UTC", "2005-06-03T11:00:00", ["2005-06-06T10:15:00Z", "2005-06-07T10:15:00Z"]),
    ("0 15 10 15 * ?", "UTC", "2005-06-15T10:15:00", ["2005-07-15T10:15:00Z", "2005-08-15T10:15:00Z"]),
    ("0 15 10 L * ?", "UTC", "2005-01-31T10:15:00",
     ["2005-02-28T10:15:00Z", "2005-03-31T10:15:00Z", "2005-04-30T10:15:00Z"]),
    ("0 15 10 L-2 * ?", "UTC", "2005-02-01T00:00:00",
     ["2005-02-26T10:15:00Z", "2005-03-29T10:15:00Z", "2005-04-28T10:15:00Z"]),
    ("0 15 10 ? * 6L", "UTC", "2005-06-01T00:00:00",
     ["2005-06-24T10:15:00Z", "2005-07-29T10:15:00Z", "2005-08-26T10:15:00Z"]),
    ("0 15 10 ? * 6L 2002-2005", "UTC", "2005-11-01T00:00:00", ["2005-11-25T10:15:00Z", "2005-12-30T10:15:00Z", END]),
    ("0 15 10 ? * 6#3", "UTC", "2005-06-01T00:00:00",
     ["2005-06-17T10:15:00Z", "2005-07-15T10:15:00Z", "2005-08-19T10:15:00Z"]),
    ("0 0 12 1/5 * ?", "UTC", "2005-01-28T00:00:00",
     ["2005-01-31T12:00:00Z", "2005-02-01T12:00:00Z", "2005-02-06T12:00:00Z"]),
    ("0 11 11 11 11 ?", "UTC", "2005-01-01T00:00:00", ["2005-11-11T11:11:00Z", "2006-11-11T11:11:00Z"]),
    ("0 0/2 8-17 * * ?", "UTC", "2005-06-01T17:57:00", ["2005-06-01T17:58:00Z", "2005-06-02T08:00:00Z"]),
    ("0 0/30 8-9 5,20 * ?", "UTC", "2005-06-05T09:30:00",
     ["2005-06-20T08:00:00Z", "2005-06-20T08:30:00Z", "2005-06-20T09:00:00Z"]),
    ("0 0/5 * * * ?", "UTC", "2005-06-01T23:57:00", ["2005-06-02T00:00:00Z", "2005-06-02T00:05:00Z"]),
    ("10 0/5 * * * ?", "UTC", "2005-06-01T10:00:10", ["2005-06-01T10:05:10Z", "2005-06-01T10:10:10Z"]),
    ("0 30 10-13 ? * WED,FRI", "UTC", "2005-06-01T13:30:00",
     ["2005-06-03T10:30:00Z", "2005-06-03T11:30:00Z", "2005-06-03T12:30:00Z"]),
    ("0 0 12 ? * WED", "UTC", "2005-06-01T12:00:00", ["2005-06-08T12:00:00Z", "2005-06-15T12:00:00Z"]),
    # seed 004
    ("0 10 20 * * ?", "UTC", "2005-06-01T20:10:00", ["2005-06-02T20:10:00Z", "2005-06-03T20:10:00Z"]),
    ("0 10 20 ? * 1", "UTC", "2005-06-01T00:00:00", ["2005-06-05T20:10:00Z", "2005-06-12T20:10:00Z"]),
    ("* 10 20 * * ?", "UTC", "2005-06-01T20:10:58",
     ["2005-06-01T20:10:59Z", "2005-06-02T20:10:00Z", "2005-06-02T20:10:01Z"]),
    ("1/10 * * * * ?", "UTC", "2005-06-01T00:00:00",
     ["2005-06-01T00:00:01Z", "2005-06-01T00:00:11Z", "2005-06-01T00:00:21Z"]),
    ("2/10 * * * * ?", "UTC", "2005-06-01T00:00:52", ["2005-06-01T00:01:02Z", "2005-06-01T00:01:12Z"]),
    ("0/15 * * * * ?", "UTC", "2005-06-01T00:00:50", ["2005-06-01T00:01:00Z", "2005-06-01T00:01:15Z"]),
    ("5/15 * * * * ?", "UTC", "2005-06-01T00:00:50", ["2005-06-01T00:01:05Z", "2005-06-01T00:01:20Z"]),
    ("0 0 0 ? 7/6 *", "UTC", "2005-07-01T00:00:00", ["2005-07-02T00:00:00Z", "2005-07-03T00:00:00Z"]),
    ("0 0 0 ? * MON,WED,FRI", "UTC", "2005-06-03T00:00:00",
     ["2005-06-06T00:00:00Z", "2005-06-08T00:00:00Z", "2005-06-10T00:00:00Z"]),
    ("0 0 10-12 * * ?", "UTC", "2005-06-01T12:00:00", ["2005-06-02T10:00:00Z", "2005-06-02T11:00:00Z"]),
    ("0 0 0 15W * ?", "UTC", "2005-01-01T00:00:00",
     ["2005-01-14T00:00:00Z", "2005-02-15T00:00:00Z", "2005-03-15T00:00:00Z"]),
    ("0 0 0 1W * ?", "UTC", "2005-01-01T00:00:00", ["2005-01-03T00:00:00Z", "2005-02-01T00:00:00Z"]),
    ("0 0 0 LW * ?", "UTC", "2005-04-01T00:00:00",
     ["2005-04-29T00:00:00Z", "2005-05-31T00:00:00Z", "2005-06-30T00:00:00Z", "2005-07-29T00:00:00Z"]),
    ("0 0 0 ? * 2#1", "UTC", "2005-06-01T00:00:00", ["2005-06-06T00:00:00Z", "2005-07-04T00:00:00Z"]),
    ("0 0 0 ? * 4#5", "UTC", "2005-06-01T00:00:00",
     ["2005-06-29T00:00:00Z", "2005-08-31T00:00:00Z", "2005-11-30T00:00:00Z"]),
    ("0 0 22-2 * * ?", "UTC", "2005-06-01T12:00:00",
     ["2005-06-01T22:00:00Z", "2005-06-01T23:00:00Z", "2005-06-02T00:00:00Z", "2005-06-02T01:00:00Z",
      "2005-06-02T02:00:00Z", "2005-06-02T22:00:00Z"]),
    ("0 0 0 1 NOV-FEB ?", "UTC", "2005-03-01T00:00:00",
     ["2005-11-01T00:00:00Z", "2005-12-01T00:00:00Z", "2006-01-01T00:00:00Z", "2006-02-01T00:00:00Z",
      "2006-11-01T00:00:00Z"]),
    ("0 0 14-6 ? * FRI-MON", "UTC", "2005-06-01T00:00:00",
     ["2005-06-03T00:00:00Z", "2005-06-03T01:00:00Z", "2005-06-03T02:00:00Z", "2005-06-03T03:00:00Z"]),
    # CronExpressionTest
    ("0 15 10 L-2 * ? 2010", "UTC", "2010-10-01T00:00:00", ["2010-10-29T10:15:00Z", "2010-11-28T10:15:00Z"]),
    ("0 15 10 L-5W * ? 2010", "UTC", "2010-09-01T00:00:00", ["2010-09-24T10:15:00Z", "2010-10-26T10:15:00Z"]),
    ("0 15 10 L-1 * ? 2010", "UTC", "2010-10-01T00:00:00", ["2010-10-30T10:15:00Z"]),
    ("0 15 10 L-1W * ? 2010", "UTC", "2010-10-01T00:00:00", ["2010-10-29T10:15:00Z"]),
    ("0 15 10 1,L * ? 2010", "UTC", "2010-09-30T12:00:00",
     ["2010-10-01T10:15:00Z", "2010-10-31T10:15:00Z", "2010-11-01T10:15:00Z", "2010-11-30T10:15:00Z"]),
    ("0 15 10 L-1W,L-1 * ? 2010", "UTC", "2010-10-01T00:00:00",
     ["2010-10-29T10:15:00Z", "2010-10-30T10:15:00Z", "2010-11-29T10:15:00Z", "2010-12-30T10:15:00Z"]),
    ("0 15 10 2W,16 * ? 2010", "UTC", "2010-09-30T12:00:00",
     ["2010-10-01T10:15:00Z", "2010-10-16T10:15:00Z", "2010-11-02T10:15:00Z", "2010-11-16T10:15:00Z"]),
    ("0 15 10 L * ? 2005", "UTC", "2005-09-01T00:00:00", ["2005-09-30T10:15:00Z", "2005-10-31T10:15:00Z"]),
    ("0 15 10 L 2 ? 2004", "UTC", "2004-01-01T00:00:00", ["2004-02-29T10:15:00Z"]),
    ("0 15 10 L-3 2 ? 2000", "UTC", "2000-01-01T00:00:00", ["2000-02-26T10:15:00Z"]),
    ("0 15 10 L-3 2 ? 2005", "UTC", "2005-01-01T00:00:00", ["2005-02-25T10:15:00Z"]),
    ("19 15 10 4 Apr ?", "UTC", "2005-01-01T00:00:00", ["2005-04-04T10:15:19Z", "2006-04-04T10:15:19Z"]),
    ("0 15 10 12 * ? 2005", "UTC", "2005-12-11T00:00:00", ["2005-12-12T10:15:00Z"]),
    ("0 0 0 L-2 * ? *", "UTC", "2024-01-30T00:00:00",
     ["2024-02-27T00:00:00Z", "2024-03-29T00:00:00Z", "2024-04-28T00:00:00Z", "2024-05-29T00:00:00Z"]),
    ("0 0 0 LW * ? *", "UTC", "2024-05-30T00:00:00",
     ["2024-05-31T00:00:00Z", "2024-06-28T00:00:00Z", "2024-07-31T00:00:00Z", "2024-08-30T00:00:00Z"]),
    ("0 43 9 ? * 5L", "UTC", "2024-01-01T00:00:00",
     ["2024-01-25T09:43:00Z", "2024-02-29T09:43:00Z", "2024-03-28T09:43:00Z"]),
    # month ends and leap years
    ("0 0 0 31 * ?", "UTC", "2024-01-31T00:00:00",
     ["2024-03-31T00:00:00Z", "2024-05-31T00:00:00Z", "2024-07-31T00:00:00Z"]),
    ("0 0 0 30 * ?", "UTC", "2024-01-30T00:00:00",
     ["2024-03-30T00:00:00Z", "2024-04-30T00:00:00Z", "2024-05-30T00:00:00Z"]),
    ("0 0 0 29 2 ?", "UTC", "2096-03-01T00:00:00", ["2104-02-29T00:00:00Z"]),
    ("0 0 0 L 2 ? 2100", "UTC", "2099-12-31T00:00:00", ["2100-02-28T00:00:00Z"]),
    ("0 0 0 L 2 ?", "UTC", "2023-03-01T00:00:00",
     ["2024-02-29T00:00:00Z", "2025-02-28T00:00:00Z", "2026-02-28T00:00:00Z"]),
    ("0 0 0 L-28 * ?", "UTC", "2024-01-01T00:00:00",
     ["2024-01-03T00:00:00Z", "2024-02-01T00:00:00Z", "2024-03-03T00:00:00Z", "2024-04-02T00:00:00Z"]),
    ("0 0 0 L-30 * ?", "UTC", "2024-01-01T00:00:00",
     ["2024-03-01T00:00:00Z", "2024-05-01T00:00:00Z", "2024-07-01T00:00:00Z", "2024-08-01T00:00:00Z"]),
    ("0 0 0 31W * ?", "UTC", "2024-03-01T00:00:00",
     ["2024-03-29T00:00:00Z", "2024-05-31T00:00:00Z", "2024-07-31T00:00:00Z"]),
    ("0 0 0 30 2 ?", "UTC", "2024-01-01T00:00:00", [END]),
    # W edges
    ("0 0 9 1W * ?", "UTC", "2022-09-30T00:00:00",
     ["2022-10-03T09:00:00Z", "2022-11-01T09:00:00Z", "2022-12-01T09:00:00Z"]),
    ("0 0 9 15W * ?", "UTC", "2022-01-01T00:00:00",
     ["2022-01-14T09:00:00Z", "2022-02-15T09:00:00Z", "2022-03-15T09:00:00Z", "2022-04-15T09:00:00Z"]),
    ("0 0 9 LW * ?", "UTC", "2005-07-01T00:00:00", ["2005-07-29T09:00:00Z"]),
    ("0 0 9 L-1W * ?", "UTC", "2024-02-01T00:00:00",
     ["2024-02-28T09:00:00Z", "2024-03-29T09:00:00Z", "2024-04-29T09:00:00Z"]),
    ("0 0 9 30W * ?", "UTC", "2023-09-01T00:00:00", ["2023-09-29T09:00:00Z", "2023-10-30T09:00:00Z"]),
    # # and L in day-of-week
    ("0 0 9 ? * 1#5", "UTC", "2024-01-01T00:00:00",
     ["2024-03-31T09:00:00Z", "2024-06-30T09:00:00Z", "2024-09-29T09:00:00Z"]),
    ("0 0 9 ? * SUN#1", "UTC", "2024-01-01T00:00:00", ["2024-01-07T09:00:00Z", "2024-02-04T09:00:00Z"]),
    ("0 0 9 ? * 1L", "UTC", "2024-01-01T00:00:00",
     ["2024-01-28T09:00:00Z", "2024-02-25T09:00:00Z", "2024-03-31T09:00:00Z"]),
    ("0 0 9 ? * FRIL", "UTC", "2024-01-01T00:00:00", ["2024-01-26T09:00:00Z", "2024-02-23T09:00:00Z"]),
    ("0 0 9 ? * L", "UTC", "2024-01-01T00:00:00", ["2024-01-06T09:00:00Z", "2024-01-13T09:00:00Z"]),
    ("0 0 9 ? 2 5#5", "UTC", "2024-01-01T00:00:00", ["2024-02-29T09:00:00Z", "2052-02-29T09:00:00Z"]),
    # wrapping ranges and steps
    ("0 50-10/5 * * * ?", "UTC", "2024-01-01T00:40:00",
     ["2024-01-01T00:50:00Z", "2024-01-01T00:55:00Z", "2024-01-01T01:00:00Z", "2024-01-01T01:05:00Z",
      "2024-01-01T01:10:00Z", "2024-01-01T01:50:00Z"]),
    ("0 0 0 30-2 * ?", "UTC", "2024-04-28T00:00:00",
     ["2024-04-30T00:00:00Z", "2024-05-01T00:00:00Z", "2024-05-02T00:00:00Z", "2024-05-30T00:00:00Z",
      "2024-05-31T00:00:00Z"]),
    ("0 0 0 1 10-2/3 ?", "UTC", "2024-01-02T00:00:00",
     ["2024-10-01T00:00:00Z", "2025-01-01T00:00:00Z", "2025-10-01T00:00:00Z", "2026-01-01T00:00:00Z"]),
    ("0 0 0 ? * 6-2/2", "UTC", "2024-01-01T00:00:00",
     ["2024-01-05T00:00:00Z", "2024-01-07T00:00:00Z", "2024-01-12T00:00:00Z", "2024-01-14T00:00:00Z"]),
    ("0 0 0 ? * sat-tue", "UTC", "2024-01-03T00:00:00",
     ["2024-01-06T00:00:00Z", "2024-01-07T00:00:00Z", "2024-01-08T00:00:00Z", "2024-01-09T00:00:00Z"]),
    ("58-2 * * * * ?", "UTC", "2024-01-01T00:00:57",
     ["2024-01-01T00:00:58Z", "2024-01-01T00:00:59Z", "2024-01-01T00:01:00Z", "2024-01-01T00:01:01Z",
      "2024-01-01T00:01:02Z"]),
    ("0 0 0/7 * * ?", "UTC", "2024-01-01T00:00:00",
     ["2024-01-01T07:00:00Z", "2024-01-01T14:00:00Z", "2024-01-01T21:00:00Z", "2024-01-02T00:00:00Z",
      "2024-01-02T07:00:00Z"]),
    ("0 0 0 ? * */3", "UTC", "2024-01-01T00:00:00",
     ["2024-01-03T00:00:00Z", "2024-01-06T00:00:00Z", "2024-01-07T00:00:00Z", "2024-01-10T00:00:00Z"]),
    ("0 0 0 1 dec-jan ?", "UTC", "2024-01-02T00:00:00",
     ["2024-12-01T00:00:00Z", "2025-01-01T00:00:00Z", "2025-12-01T00:00:00Z"]),
    ("0 0 0 ? * /2", "UTC", "2024-01-01T00:00:00",
     ["2024-01-02T00:00:00Z", "2024-01-04T00:00:00Z", "2024-01-06T00:00:00Z"]),
    # years
    ("0 0 0 1 1 ? 2150", "UTC", "2024-01-01T00:00:00", ["2150-01-01T00:00:00Z", END]),
    ("0 0 12 ? * 2#1 2199", "UTC", "2199-11-15T00:00:00", ["2199-12-02T12:00:00Z", END]),
    ("59 59 23 31 12 ? 2199", "UTC", "2199-12-31T23:59:58", ["2199-12-31T23:59:59Z", END]),
    ("0 0 0 1 1 ? 2030/10", "UTC", "2024-01-01T00:00:00",
     ["2030-01-01T00:00:00Z", "2040-01-01T00:00:00Z", "2050-01-01T00:00:00Z"]),
    ("0 0 0 1 1 ? 1999,2001,2099-2100", "UTC", "1990-01-01T00:00:00",
     ["1999-01-01T00:00:00Z", "2001-01-01T00:00:00Z", "2099-01-01T00:00:00Z", "2100-01-01T00:00:00Z", END]),
    ("0 0 0 29 2 ? 2100-2105", "UTC", "2090-01-01T00:00:00", ["2104-02-29T00:00:00Z", END]),
    # daylight saving in named zones
    ("0 30 2 * * ?", "Europe/Berlin", "2024-03-30T00:00:00",
     ["2024-03-30T02:30:00+01:00", "2024-04-01T02:30:00+02:00"]),
    ("0 30 2 * * ?", "Europe/Berlin", "2024-10-26T00:00:00",
     ["2024-10-26T02:30:00+02:00", "2024-10-27T02:30:00+02:00", "2024-10-28T02:30:00+01:00"]),
    ("0 0/20 * * * ?", "Europe/Berlin", "2024-10-27T01:30:00",
     ["2024-10-27T01:40:00+02:00", "2024-10-27T02:00:00+02:00", "2024-10-27T02:20:00+02:00",
      "2024-10-27T02:40:00+02:00", "2024-10-27T03:00:00+01:00", "2024-10-27T03:20:00+01:00",
      "2024-10-27T03:40:00+01:00", "2024-10-27T04:00:00+01:00"]),
    ("0 0/30 1-3 * * ?", "Europe/Berlin", "2024-03-31T00:00:00",
     ["2024-03-31T01:00:00+01:00", "2024-03-31T01:30:00+01:00", "2024-03-31T03:00:00+02:00",
      "2024-03-31T03:30:00+02:00"]),
    ("0 30 2 * * ?", "America/New_York", "2024-03-09T12:00:00",
     ["2024-03-11T02:30:00-04:00", "2024-03-12T02:30:00-04:00"]),
    ("0 30 1 * * ?", "America/New_York", "2024-11-02T12:00:00",
     ["2024-11-03T01:30:00-04:00", "2024-11-04T01:30:00-05:00"]),
    ("0 0 * * * ?", "America/New_York", "2024-11-03T00:30:00",
     ["2024-11-03T01:00:00-04:00", "2024-11-03T02:00:00-05:00", "2024-11-03T03:00:00-05:00",
      "2024-11-03T04:00:00-05:00"]),
    ("0 15 2 ? * SUN#2", "America/New_York", "2024-03-01T00:00:00",
     ["2024-04-14T02:15:00-04:00", "2024-05-12T02:15:00-04:00"]),
    ("0 15 2 ? * 1#1", "America/New_York", "2024-11-01T00:00:00",
     ["2024-11-03T02:15:00-05:00", "2024-12-01T02:15:00-05:00"]),
    ("0 45 1-3 * * ?", "Australia/Lord_Howe", "2024-04-06T12:00:00",
     ["2024-04-07T01:45:00+11:00", "2024-04-07T02:45:00+10:30", "2024-04-07T03:45:00+10:30",
      "2024-04-08T01:45:00+10:30", "2024-04-08T02:45:00+10:30"]),
    ("0 0,30 2 * * ?", "Australia/Lord_Howe", "2024-10-05T12:00:00",
     ["2024-10-06T02:30:00+11:00", "2024-10-07T02:00:00+11:00", "2024-10-07T02:30:00+11:00",
      "2024-10-08T02:00:00+11:00"]),
    ("0 0 0 * * ?", "America/Sao_Paulo", "2018-11-03T12:00:00",
     ["2018-11-05T00:00:00-02:00", "2018-11-06T00:00:00-02:00"]),
    ("0 0 12 * * ?", "Pacific/Apia", "2011-12-28T13:00:00",
     ["2011-12-29T12:00:00-10:00", "2011-12-31T12:00:00+14:00", "2012-01-01T12:00:00+14:00"]),
    ("0 30 2 * * ?", "America/St_Johns", "2024-03-09T12:00:00",
     ["2024-03-11T02:30:00-02:30", "2024-03-12T02:30:00-02:30"]),
    ("0 0 9 * * ?", "Asia/Kolkata", "2024-03-09T12:00:00", ["2024-03-10T09:00:00+05:30", "2024-03-11T09:00:00+05:30"]),
    ("0 0 3 ? * 1L", "Europe/London", "2024-03-01T00:00:00",
     ["2024-03-31T03:00:00+01:00", "2024-04-28T03:00:00+01:00"]),
    ("0 30 1 ? * 1L", "Europe/London", "2024-10-01T00:00:00",
     ["2024-10-27T01:30:00+01:00", "2024-11-24T01:30:00+00:00"]),
    ("0 43 9 1,5,29,L * ?", "UTC", "2024-02-01T00:00:00",
     ["2024-02-01T09:43:00Z", "2024-02-05T09:43:00Z", "2024-02-29T09:43:00Z", "2024-03-01T09:43:00Z"]),
]


def _expected(values: list[str | None]) -> list[str | None]:
    return [value.replace("Z", "+00:00") if value else value for value in values]


def _after(zone: str, after: str) -> datetime:
    return datetime.fromisoformat(after).replace(tzinfo=ZoneInfo(zone))


def _row_id(row: tuple[str, str, str, list[str | None]]) -> str:
    return f"{row[0]} @ {row[1]} after {row[2]}"


def test_the_table_has_at_least_80_valid_expressions() -> None:
    assert len(VALID) >= 80


@pytest.mark.parametrize("row", VALID, ids=_row_id)
def test_next_fire_times_agree_with_the_table(row: tuple[str, str, str, list[str | None]]) -> None:
    expression, zone, after, expected = row
    times = parse(expression).fire_times(_after(zone, after), ZoneInfo(zone))
    got: list[str | None] = [fire.isoformat() for fire in islice(times, len(expected))]
    got += [END] * (len(expected) - len(got))
    assert got == _expected(expected)


@pytest.mark.parametrize("row", VALID, ids=_row_id)
def test_the_brute_force_reference_agrees_with_the_table(row: tuple[str, str, str, list[str | None]]) -> None:
    expression, zone_name, after, expected = row
    zone = ZoneInfo(zone_name)
    reference, fire = Reference(expression), _after(zone_name, after)
    got: list[str | None] = []
    for wanted in _expected(expected):
        # Look as far as the wanted time (a day more), or to the end of the years cron can name.
        until = datetime.fromisoformat(wanted) if wanted else datetime(2200, 1, 1, tzinfo=UTC)
        next_fire = reference.next_after(fire, zone, until - fire + timedelta(days=1))
        got.append(next_fire.isoformat() if next_fire else END)
        if next_fire is None:
            break
        fire = next_fire
    assert got == _expected(expected)


# -- Quartz's CronExpressionTest: isSatisfiedBy ------------------------------------------------------------------


def fires_at(expression: str, wall: str, zone: str = "UTC") -> bool:
    """Quartz's isSatisfiedBy: the expression fires at this wall time."""
    moment = _after(zone, wall)
    return parse(expression).next_after(moment - timedelta(seconds=1), ZoneInfo(zone)) == moment


SATISFIED = [
    ("0 15 10 * * ? 2005", "2005-06-01T10:15:00", True),
    ("0 15 10 * * ? 2005", "2005-06-30T10:15:00", True),
    ("0 15 10 * * ? 2005", "2006-06-30T10:15:00", False),
    ("0 15 10 * * ? 2005", "2005-06-01T10:16:00", False),
    ("0 15 10 * * ? 2005", "2005-06-01T10:14:00", False),
    ("0 15 10 * * ? 2005", "2005-03-31T10:15:00", True),
    ("0 15 10 * * ? 2005", "2005-02-28T10:15:00", True),
    ("0 15 10 12 * ? 2005", "2005-12-12T10:15:00", True),
    ("0 15 10 12 * ? 2005", "2005-12-11T10:15:00", False),
    ("0 15 10 12 * ? 2005", "2005-12-13T10:15:00", False),
    ("0 15 10 L * ? 2005", "2005-12-31T10:15:00", True),
    ("0 15 10 L * ? 2005", "2005-12-30T10:15:00", False),
    ("0 15 10 L * ? 2005", "2005-09-30T10:15:00", True),
    ("0 15 10 L * ? 2005", "2005-09-29T10:15:00", False),
    ("0 15 10 L 2 ? 2005", "2005-02-28T10:15:00", True),
    ("0 15 10 L 2 ? 2005", "2005-02-27T10:15:00", False),
    ("0 15 10 L 2 ? 2004", "2004-02-29T10:15:00", True),
    ("0 15 10 L 2 ? 2004", "2004-02-28T10:15:00", False),
    ("0 15 10 L-2 * ? 2005", "2005-12-29T10:15:00", True),
    ("0 15 10 L-2 * ? 2005", "2005-12-28T10:15:00", False),
    ("0 15 10 L-2 * ? 2005", "2005-12-30T10:15:00", False),
    ("0 15 10 L-2 * ? 2005", "2005-12-31T10:15:00", False),
    ("0 15 10 L-1 * ? 2005", "2005-09-29T10:15:00", True),
    ("0 15 10 L-1 * ? 2005", "2005-09-28T10:15:00", False),
    ("0 15 10 L-1 * ? 2005", "2005-09-30T10:15:00", False),
    ("0 15 10 L-3 2 ? 2005", "2005-02-25T10:15:00", True),
    ("0 15 10 L-3 2 ? 2005", "2005-02-24T10:15:00", False),
    ("0 15 10 L-3 2 ? 2005", "2005-02-26T10:15:00", False),
    ("0 15 10 L-3 2 ? 2000", "2000-02-26T10:15:00", True),
    ("0 15 10 L-3 2 ? 2000", "2000-02-25T10:15:00", False),
    ("0 15 10 L-3 2 ? 2000", "2000-02-29T10:15:00", False),
    ("0 15 10 L-2 * ? 2010", "2010-10-29T10:15:00", True),
    ("0 15 10 L-2 * ? 2010", "2010-10-28T10:15:00", False),
    ("0 15 10 L-2 * ? 2010", "2010-02-26T10:15:00", True),
    ("0 15 10 L-2 * ? 2010", "2010-02-25T10:15:00", False),
    ("0 15 10 L-2 * ? 2010", "2010-06-28T10:15:00", True),
    ("0 15 10 L-2 * ? 2010", "2010-06-27T10:15:00", False),
    ("0 15 10 L-5W * ? 2010", "2010-10-26T10:15:00", True),
    ("0 15 10 L-5W * ? 2010", "2010-10-25T10:15:00", False),
    ("0 15 10 L-5W * ? 2010", "2010-10-27T10:15:00", False),
    ("0 15 10 L-5W * ? 2010", "2010-09-24T10:15:00", True),
    ("0 15 10 L-5W * ? 2010", "2010-09-23T10:15:00", False),
    ("0 15 10 L-5W * ? 2010", "2010-09-25T10:15:00", False),
    ("0 15 10 L-1 * ? 2010", "2010-10-30T10:15:00", True),
    ("0 15 10 L-1W * ? 2010", "2010-10-29T10:15:00", True),
    ("0 15 10 1,L * ? 2010", "2010-10-01T10:15:00", True),
    ("0 15 10 1,L * ? 2010", "2010-10-31T10:15:00", True),
    ("0 15 10 1,L * ? 2010", "2010-10-30T10:15:00", False),
    ("0 15 10 1,L * ? 2010", "2010-02-01T10:15:00", True),
    ("0 15 10 1,L * ? 2010", "2010-02-28T10:15:00", True),
    ("0 15 10 1,L * ? 2010", "2010-02-27T10:15:00", False),
    ("0 15 10 L-1W,L-1 * ? 2010", "2010-10-29T10:15:00", True),
    ("0 15 10 L-1W,L-1 * ? 2010", "2010-10-30T10:15:00", True),
    ("0 15 10 L-1W,L-1 * ? 2010", "2010-02-26T10:15:00", True),
    ("0 15 10 L-1W,L-1 * ? 2010", "2010-02-27T10:15:00", True),
    ("0 15 10 2W,16 * ? 2010", "2010-10-01T10:15:00", True),
    ("0 15 10 2W,16 * ? 2010", "2010-10-02T10:15:00", False),
    ("0 15 10 2W,16 * ? 2010", "2010-10-16T10:15:00", True),
    ("0 15 10 2W,16 * ? 2010", "2010-11-02T10:15:00", True),
    ("0 15 10 2W,16 * ? 2010", "2010-11-16T10:15:00", True),
]


@pytest.mark.parametrize(("expression", "wall", "fires"), SATISFIED)
def test_quartz_is_satisfied_by_cases(expression: str, wall: str, fires: bool) -> None:
    assert fires_at(expression, wall) is fires


@pytest.mark.parametrize("expression", ["0 0 0 L-2 * ? *", "0 0 0 LW * ? *"])
def test_last_day_offsets_never_repeat_a_fire_time_qtz_259(expression: str) -> None:
    times = list(islice(parse(expression).fire_times(_after("UTC", "2024-01-01T00:00:00"), UTC), 26))
    assert len(times) == 26 and all(a < b for a, b in pairwise(times))


def test_quartz_571_month_names_parse_and_compute() -> None:
    assert parse("19 15 10 4 Apr ? ").next_after(datetime(2005, 1, 1, tzinfo=UTC), UTC) == datetime(
        2005, 4, 4, 10, 15, 19, tzinfo=UTC
    )


# -- refusals -------------------------------------------------------------------------------------------------

REFUSED = [
    # Quartz's CronExpressionTest
    ("0 0 * * * *", "day-of-week", "both given"),
    ("0 0 * 4 * *", "day-of-week", "both given"),
    ("0 0 * * * 4", "day-of-week", "both given"),
    ("0 43 9 ? * SAT,SUN,L", "day-of-week", "'L' must be the whole field"),
    ("0 43 9 ? * 6,7,L", "day-of-week", "'L' must be the whole field"),
    ("0/5 * * 32W 1 ?", "day-of-month", "1 to 31"),
    ("* * * * Foo ?", "month", "not a known name"),
    ("* * * * Jan-Foo ?", "month", "not a known name"),
    ("0 15 10 * * ? 2005 *", None, "8 fields"),
    ("/120 0 8-18 ? * 2-6", "seconds", "larger than the field allows (59)"),
    ("0/120 0 8-18 ? * 2-6", "seconds", "larger than the field allows (59)"),
    ("/ 0 8-18 ? * 2-6", "seconds", "'/' must be followed by a number"),
    ("0/ 0 8-18 ? * 2-6", "seconds", "'/' must be followed by a number"),
    ("0 /120 8-18 ? * 2-6", "minutes", "larger than the field allows (59)"),
    ("0 0/120 8-18 ? * 2-6", "minutes", "larger than the field allows (59)"),
    ("0 / 8-18 ? * 2-6", "minutes", "'/' must be followed by a number"),
    ("0 0/ 8-18 ? * 2-6", "minutes", "'/' must be followed by a number"),
    ("0 0 /120 ? * 2-6", "hours", "larger than the field allows (23)"),
    ("0 0 0/120 ? * 2-6", "hours", "larger than the field allows (23)"),
    ("0 0 / ? * 2-6", "hours", "'/' must be followed by a number"),
    ("0 0 0/ ? * 2-6", "hours", "'/' must be followed by a number"),
    ("0 0 0 /120 * ?", "day-of-month", "larger than the field allows (31)"),
    ("0 0 0 0/120 * ?", "day-of-month", "larger than the field allows (31)"),
    ("0 0 0 / * ?", "day-of-month", "'/' must be followed by a number"),
    ("0 0 0 1/ * ?", "day-of-month", "'/' must be followed by a number"),
    ("0 0 0 ? /120 2-6", "month", "larger than the field allows (12)"),
    ("0 0 0 ? 1/120 2-6", "month", "larger than the field allows (12)"),
    ("0 0 0 ? / 2-6", "month", "'/' must be followed by a number"),
    ("0 0 0 ? 1/ 2-6", "month", "'/' must be followed by a number"),
    ("0 0 0 ? * /120", "day-of-week", "larger than the field allows (7)"),
    ("0 0 0 ? * 1/120", "day-of-week", "larger than the field allows (7)"),
    ("0 0 0 ? * /", "day-of-week", "'/' must be followed by a number"),
    ("0 0 0 ? * 1/", "day-of-week", "'/' must be followed by a number"),
    # seed 004 and Quartz's documentation
    ("0 10 20 * * 1", "day-of-week", "both given"),
    ("0 10 20 ? ? SUN", "month", "'?' is only allowed in day-of-month or day-of-week"),
    ("0 0 12 ? * 3#1,6#3", "day-of-week", "'#' must be the whole field"),
    ("* * * * ? *", "month", "'?' is only allowed"),  # printed as an example in some manuals
    ("0 0/5 14,18,3-39,52 ? JAN,MAR,SEP MON-FRI 2002-2010", "hours", "out of range"),  # likewise
    # the number of fields
    ("", None, "empty"),
    ("   ", None, "empty"),
    ("0 0 12 * *", None, "5 fields"),
    ("0 0 12 * * ? 2005 2006", None, "8 fields"),
    # values out of range
    ("60 0 12 * * ?", "seconds", "out of range"),
    ("0 60 12 * * ?", "minutes", "out of range"),
    ("0 0 24 * * ?", "hours", "out of range"),
    ("0 0 12 0 * ?", "day-of-month", "out of range"),
    ("0 0 12 32 * ?", "day-of-month", "out of range"),
    ("0 0 12 ? 0 MON", "month", "out of range"),
    ("0 0 12 ? 13 MON", "month", "out of range"),
    ("0 0 12 ? * 0", "day-of-week", "out of range"),
    ("0 0 12 ? * 8", "day-of-week", "out of range"),
    ("0 0 12 * * ? 1969", "year", "out of range"),
    ("0 0 12 * * ? 2200", "year", "out of range"),
    ("0 0 12 * * ? 2000-2300", "year", "out of range"),
    ("5-60 0 12 * * ?", "seconds", "out of range"),
    ("0 0 12 ? * 6#6", "day-of-week", "from 1 to 5"),
    ("0 0 12 ? * 6#0", "day-of-week", "from 1 to 5"),
    ("0 0 12 L-31 * ?", "day-of-month", "at most 30"),
    # day-of-month and day-of-week
    ("0 0 12 ? * ?", "day-of-week", "both day-of-month and day-of-week"),
    ("0 0 12 ?,5 * MON", "day-of-month", "'?' must be the whole field"),
    ("0 0 12 ? ? MON", "month", "'?' is only allowed"),
    ("? 0 12 * * ?", "seconds", "'?' is only allowed"),
    ("0 0 12 * * ? ?", "year", "'?' is only allowed"),
    ("0 0 12 1-5W * ?", "day-of-month", "'W' takes a single day"),
    ("0 0 12 */5W * ?", "day-of-month", "'W' takes a single day"),
    ("0 0 12 ? * 5W", "day-of-week", "'W' is only allowed in day-of-month"),
    ("0 0 12 5L * ?", "day-of-month", "'L' in day-of-month"),
    ("0 0 12 L/2 * ?", "day-of-month", "after 'L'"),
    ("0 0 12 LW-2 * ?", "day-of-month", "after 'L'"),
    ("0 0 12 3#2 * ?", "day-of-month", "'#' is only allowed in day-of-week"),
    ("0 0 12 ? * #3", "day-of-week", "'#' takes a single day"),
    ("0 0 12 ? * 6#", "day-of-week", "from 1 to 5"),
    ("0 0 12 ? * 6#2#3", "day-of-week", "from 1 to 5"),
    ("0 0 12 ? * MON#2,FRI", "day-of-week", "'#' must be the whole field"),
    ("0 0 12 ? * 5L,6", "day-of-week", "'L' must be the whole field"),
    # Quartz's lenient accidents: accepted there, then ignored or misread
    ("0/0 * * * * ?", "seconds", "a step of 0"),
    ("0 0 12 1-31/0 * ?", "day-of-month", "a step of 0"),
    ("0 0 12 ?X * MON", "day-of-month", "unexpected characters after '?'"),
    ("0 0 12 * * ?X", "day-of-week", "unexpected characters after '?'"),
    ("0 0 12 ? * L-2", "day-of-week", "'L-n' is only for day-of-month"),
    ("0 0 12 ? * 1-3#2", "day-of-week", "'#' takes a single day"),
    ("0 0 12 ? * MONDAY", "day-of-week", "not a value, range or step"),
    ("0 0 12 ? * MON-FRI/2", "day-of-week", "ignores a step after a name"),
    ("0 0 12 1 JAN/2 ?", "month", "ignores a step after a name"),
    ("0 0 12 0W * ?", "day-of-month", "1 to 31"),
    ("0 0 12 ? * 1-FRI", "day-of-week", "mixes a name and a number"),
    ("0 0 12 ? * MON-5", "day-of-week", "mixes a name and a number"),
    ("0 0 12 * * ? 2010-2005", "year", "must go forward"),
    ("0 0 12 ? * 5L-2", "day-of-week", "'L' in day-of-week"),
    # malformed lists and terms
    ("0 0 12 1,,2 * ?", "day-of-month", "empty element"),
    ("0 0 12 1, * ?", "day-of-month", "empty element"),
    ("0 0 12 -5 * ?", "day-of-month", "not a value, range or step"),
    ("0 0 12 1- * ?", "day-of-month", "not a value, range or step"),
    ("0 0 12 *-5 * ?", "day-of-month", "'*' cannot start a range"),
    ("0 0 12 ? JANUARY *", "month", "not a value, range or step"),
    ("a 0 12 * * ?", "seconds", "not a value, range or step"),
    ("0 0 MON * * ?", "hours", "not a number"),
    ("0 0 12 1 * ?\n5", "day-of-week", "unexpected characters after '?'"),
]


def test_the_table_has_at_least_50_refused_expressions() -> None:
    assert len(REFUSED) >= 50


@pytest.mark.parametrize(("expression", "field", "reason"), REFUSED, ids=[row[0] or "empty" for row in REFUSED])
def test_refused_with_a_reason_naming_the_field(expression: str, field: str | None, reason: str) -> None:
    with pytest.raises(CronError) as refused:
        parse(expression)
    assert refused.value.field == field
    assert reason in str(refused.value)
    if field:
        assert str(refused.value).startswith(f"{field}: ")
    assert not is_valid(expression)


def test_names_and_letters_are_read_in_any_case() -> None:
    lower = parse("0 15 10 ? jan-Mar fRi#3")
    assert lower.months == (1, 2, 3)
    assert parse("0 0 12 lw * ?").next_after(datetime(2005, 4, 1, tzinfo=UTC), UTC) == datetime(
        2005, 4, 29, 12, tzinfo=UTC
    )


def test_tabs_and_surrounding_whitespace_separate_fields() -> None:
    assert parse("\t0\t15 10  * * ?  ").hours == (10,)


# -- daylight saving ------------------------------------------------------------------------------------------

BERLIN = ZoneInfo("Europe/Berlin")


def test_a_wall_time_in_the_spring_forward_gap_is_skipped() -> None:
    fire = parse("0 30 2 * * ?").next_after(datetime(2024, 3, 31, 0, 0, tzinfo=BERLIN), BERLIN)
    assert fire is not None and fire.isoformat() == "2024-04-01T02:30:00+02:00"


def test_a_wall_time_in_the_fall_back_overlap_fires_once_at_its_first_occurrence() -> None:
    times = list(islice(parse("0 30 2 * * ?").fire_times(datetime(2024, 10, 27, tzinfo=BERLIN), BERLIN), 2))
    assert [t.isoformat() for t in times] == ["2024-10-27T02:30:00+02:00", "2024-10-28T02:30:00+01:00"]


def test_after_an_instant_in_the_repeated_hour_its_wall_times_are_not_fired_again() -> None:
    second_pass = datetime(2024, 10, 27, 1, 10, tzinfo=UTC)  # 02:10 CET, the second 02:10 of the night
    fire = parse("0 * * * * ?").next_after(second_pass, BERLIN)
    assert fire is not None and fire.isoformat() == "2024-10-27T03:00:00+01:00"


def test_next_after_needs_an_instant_and_looks_strictly_after_it() -> None:
    expression = parse("0 15 10 * * ?")
    with pytest.raises(ValueError, match="aware"):
        expression.next_after(datetime(2005, 6, 1), UTC)
    just_after = datetime(2005, 6, 1, 10, 15, 0, 500_000, tzinfo=UTC)
    assert expression.next_after(just_after, UTC) == datetime(2005, 6, 2, 10, 15, tzinfo=UTC)
    just_before = datetime(2005, 6, 1, 10, 14, 59, 999_999, tzinfo=UTC)
    assert expression.next_after(just_before, UTC) == datetime(2005, 6, 1, 10, 15, tzinfo=UTC)


def test_no_fire_time_after_the_last_year() -> None:
    assert parse("0 0 0 1 1 ? 2005").next_after(datetime(2005, 1, 1, tzinfo=UTC), UTC) is None
    assert parse("0 0 0 1 1 ?").next_after(datetime(2199, 1, 1, tzinfo=UTC), UTC) is None


@pytest.mark.parametrize(
    "expression",
    ["0 0 0 31 2 ?", "0 0 0 30 2 ?", "0 0 0 29 2 ? 2100", "0 0 0 31 4,6,9,11 ?", "0 0 0 ? 2 5#5 2021", "0 0 0 30W 2 ?"],
)
def test_an_expression_no_date_matches_is_refused_for_a_schedule(expression: str) -> None:
    parse(expression)  # Quartz accepts it...
    with pytest.raises(CronError, match=r"no date matches .* never fire"):
        parse_schedulable(expression)  # ...and never fires it: a schedule refuses it


@pytest.mark.parametrize("expression", ["0 0 0 29 2 ?", "0 0 0 L 2 ?", "0 0 0 31 1-12 ?", "0 0 0 ? 2 5#5"])
def test_an_expression_that_fires_some_day_is_schedulable(expression: str) -> None:
    assert parse_schedulable(expression).next_after(datetime(2026, 1, 1, tzinfo=UTC), UTC) is not None
