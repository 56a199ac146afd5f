"""A brute-force reference for Quartz cron, written apart from ``worker.policy.cron`` to check it.

Nothing here builds value sets or searches field by field: every term is a predicate on one value, and the next
fire time is found by walking the instants after ``after`` one second at a time (skipping whole days, hours and
minutes the fields rule out), converting each to the zone's wall clock. An instant fires when its wall time
matches and is the wall time's first occurrence (``fold == 0``): wall times the clocks skip never show up, and
repeated ones fire once. Only valid expressions are given to it.
"""

from __future__ import annotations

import calendar
from datetime import UTC, date, datetime, timedelta, tzinfo

MONTHS = ["JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"]
DAYS = ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"]
ONE_SECOND = timedelta(seconds=1)


def _number(token: str, names: list[str]) -> int:
    return names.index(token) + 1 if token in names else int(token)


def _term_allows(term: str, value: int, low: int, high: int, names: list[str]) -> bool:
    """Whether one list element (``*``, ``a``, ``a-b``, ``a/k``, ``*/k``, ``/k``, ``a-b/k``) allows ``value``."""
    base, slash, step_text = term.partition("/")
    step = int(step_text) if slash else 1
    if base in ("*", ""):
        first, last = low, high
    elif "-" in base:
        a, b = base.split("-")
        first, last = _number(a, names), _number(b, names)
    else:
        first = _number(base, names)
        last = high if slash else first
    size = high - low + 1
    span = last - first if last >= first else last + size - first
    distance = value - first if value >= first else value + size - first  # walking up from first, wrapping
    return distance <= span and distance % step == 0


def _field_allows(field: str, value: int, low: int, high: int, names: list[str] | None = None) -> bool:
    return any(_term_allows(term, value, low, high, names or []) for term in field.split(","))


def _closest_weekday(day: date) -> date:
    """The Monday-to-Friday date of the same month closest to ``day`` (there is never a tie)."""
    last = calendar.monthrange(day.year, day.month)[1]
    weekdays = [date(day.year, day.month, d) for d in range(1, last + 1) if date(day.year, day.month, d).weekday() < 5]
    return min(weekdays, key=lambda candidate: abs((candidate - day).days))


def _day_of_month_allows(field: str, day: date) -> bool:
    last = calendar.monthrange(day.year, day.month)[1]
    for term in field.split(","):
        if term.startswith("L"):
            offset = int(term[2:].rstrip("W") or 0) if term.startswith("L-") else 0
            target = last - offset
            if target < 1:
                continue
            if term.endswith("W"):
                if _closest_weekday(date(day.year, day.month, target)) == day:
                    return True
            elif day.day == target:
                return True
        elif term.endswith("W"):
            target = int(term[:-1])
            if target <= last and _closest_weekday(date(day.year, day.month, target)) == day:
                return True
        elif _term_allows(term, day.day, 1, 31, []):
            return True
    return False


def _day_of_week_allows(field: str, day: date) -> bool:
    weekday = (day.weekday() + 1) % 7 + 1  # Monday is 2, Sunday 1, Saturday 7
    last = calendar.monthrange(day.year, day.month)[1]
    if field == "L":
        return weekday == 7
    if "#" in field:
        wanted, nth = field.split("#")
        return weekday == _number(wanted, DAYS) and (day.day - 1) // 7 + 1 == int(nth)
    if field.endswith("L"):
        return weekday == _number(field[:-1], DAYS) and day.day + 7 > last
    return _field_allows(field, weekday, 1, 7, DAYS)


class Reference:
    """One valid expression, matched wall time by wall time."""

    def __init__(self, expression: str) -> None:
        fields = expression.upper().split()
        self.second, self.minute, self.hour, self.dom, self.month, self.dow = fields[:6]
        self.year = fields[6] if len(fields) == 7 else "*"

    def day_matches(self, day: date) -> bool:
        """Whether the date fields allow this day."""
        if not _field_allows(self.year, day.year, 1970, 2199):
            return False
        if not _field_allows(self.month, day.month, 1, 12, MONTHS):
            return False
        if self.dom != "?":
            return _day_of_month_allows(self.dom, day)
        return _day_of_week_allows(self.dow, day)

    def next_after(self, after: datetime, zone: tzinfo, horizon: timedelta) -> datetime | None:
        """The first fire time after ``after`` within ``horizon``, walking second by second; None if none."""
        instant = after.astimezone(UTC).replace(microsecond=0) + ONE_SECOND
        end = instant + horizon
        while instant <= end:
            local = instant.astimezone(zone)
            wall = local.replace(tzinfo=None)
            if not self.day_matches(wall.date()):
                instant = _jump(instant, datetime.combine(wall.date() + timedelta(days=1), datetime.min.time()), zone)
            elif not _field_allows(self.hour, wall.hour, 0, 23):
                instant = _jump(instant, wall.replace(minute=0, second=0) + timedelta(hours=1), zone)
            elif not _field_allows(self.minute, wall.minute, 0, 59):
                instant = _jump(instant, wall.replace(second=0) + timedelta(minutes=1), zone)
            elif local.fold == 0 and _field_allows(self.second, wall.second, 0, 59):
                return local
            else:
                instant += ONE_SECOND
        return None


def _jump(instant: datetime, wall: datetime, zone: tzinfo) -> datetime:
    """The earliest instant that can show the wall time ``wall`` (never going back); whatever lies between shows
    earlier wall times only."""
    candidates = [wall.replace(tzinfo=zone, fold=fold).astimezone(UTC) for fold in (0, 1)]
    return max(instant + ONE_SECOND, min(candidates))
