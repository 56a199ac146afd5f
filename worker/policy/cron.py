"""Quartz cron expressions: parse, validate, and compute fire times in an IANA time zone, pure.

An expression has six or seven fields separated by spaces or tabs::

    seconds  minutes  hours  day-of-month  month  day-of-week  [year]
    0-59     0-59     0-23   1-31          1-12   1-7          1970-2199
                             ? L W         JAN-DEC SUN-SAT ? L #

Every field takes ``*`` (every value), a value, a range ``a-b``, a step ``a/k`` (from ``a`` every ``k``, up to the
field's end: ``7/6`` in months is July only), ``*/k`` (or ``/k``), ``a-b/k``, and lists of those joined by ``,``.
A range whose end is smaller than its start wraps around (``22-2`` in hours is 22, 23, 0, 1, 2; ``NOV-FEB``;
``FRI-MON``); a range of years must go forward. Month and day names are three letters in any case; day-of-week
counts from 1 = SUN to 7 = SAT.

Exactly one of day-of-month and day-of-week is ``?`` ("no specific value"). Day-of-month also takes ``L`` (the last
day of the month), ``L-n`` (n days before it, n ≤ 30), ``nW`` (the weekday nearest to day n, never crossing into
another month: a Saturday 1st moves to Monday the 3rd, a Sunday last day to Friday), ``LW`` and ``L-nW``, alone or in
a list (``1,L``; ``2W,16``) as current Quartz allows. Day-of-week also takes, each as the whole field: ``L``
(Saturday), ``nL`` (the last day n of the month, ``6L`` the last Friday) and ``n#k`` (the k-th day n of the month,
k = 1…5; no fire in a month without one).

**Refused** with a reason naming the field (:class:`CronError`): whatever Quartz refuses (a wrong number of fields,
values out of range, day-of-month and day-of-week both given or both ``?``, ``?`` in another field, ``L`` or ``#``
in a day-of-week list, ``W`` on a range or list element other than a single day, a step larger than the field,
unknown names) and also what Quartz accepts by accident and then ignores or misreads: a step of 0, characters after
``?`` or after a name (``?X``, ``MONDAY``, ``MON-FRI/2``), ``?`` inside a list, ``L-n`` in day-of-week, ``#`` inside
a range, ``0W``, years outside 1970-2199.

**Daylight saving** (Quartz's policy): fire times are wall-clock times of the zone. A wall time that does not
exist because the clocks spring forward is skipped (``0 30 2 * * ?`` in Europe/Berlin does not fire on the last
Sunday of March). A wall time that occurs twice because the clocks fall back fires once, at its first occurrence
(``0 30 2 * * ?`` fires at 02:30 CEST, not again at 02:30 CET; an every-minute expression is silent during the
repeated hour).
"""

from __future__ import annotations

import bisect
import calendar
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta, tzinfo

SECOND = timedelta(seconds=1)

MIN_YEAR = 1970
MAX_YEAR = 2199

MONTH_NAMES = {name: number for number, name in enumerate(
    ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"), start=1)}
DAY_NAMES = {name: number for number, name in enumerate(("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"), start=1)}

FIELD_NAMES = ("seconds", "minutes", "hours", "day-of-month", "month", "day-of-week", "year")

MAX_LAST_DAY_OFFSET = 30  # L-30 at most, as Quartz
MAX_NTH = 5  # n#5 at most: no month has six of a weekday


class CronError(ValueError):
    """An expression that is not valid Quartz cron; the message names the field and says why."""

    def __init__(self, reason: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.reason = reason
        self.field = field


@dataclass(frozen=True, slots=True)
class _Field:
    """The allowed values of one field, and how they are written."""

    name: str
    low: int
    high: int
    names: dict[str, int] | None = None

    @property
    def size(self) -> int:
        return self.high - self.low + 1

    def describe(self) -> str:
        allowed = f"{self.low}-{self.high}"
        if self.names:
            names = list(self.names)
            allowed += f" or {names[0]}-{names[-1]}"
        return allowed


_SECONDS = _Field("seconds", 0, 59)
_MINUTES = _Field("minutes", 0, 59)
_HOURS = _Field("hours", 0, 23)
_DAY_OF_MONTH = _Field("day-of-month", 1, 31)
_MONTH = _Field("month", 1, 12, MONTH_NAMES)
_DAY_OF_WEEK = _Field("day-of-week", 1, 7, DAY_NAMES)
_YEAR = _Field("year", MIN_YEAR, MAX_YEAR)

# The largest step each field accepts (Quartz: "Increment > 60" and so on); years take any step.
_MAX_STEP = {"seconds": 59, "minutes": 59, "hours": 23, "day-of-month": 31, "month": 12, "day-of-week": 7}

_VALUE = r"(?:\d+|[A-Z]{3})"
_TERM = re.compile(rf"(?P<start>\*|{_VALUE})?(?:-(?P<end>{_VALUE}))?(?:/(?P<step>\d*))?")
_LAST_DAY = re.compile(r"L(?:-(?P<offset>\d+))?(?P<weekday>W)?")
_NEAREST_WEEKDAY = re.compile(r"(?P<day>\d+)W")
_NTH_DAY = re.compile(rf"(?P<day>{_VALUE})#(?P<nth>.*)")
_LAST_WEEKDAY_OF_MONTH = re.compile(rf"(?P<day>{_VALUE})L")


@dataclass(frozen=True, slots=True)
class DayOfMonth:
    """The day-of-month field: plain days, ``L-n`` offsets, ``nW`` days and ``L-nW`` offsets (``L`` is offset 0)."""

    days: frozenset[int] = frozenset()
    last_offsets: frozenset[int] = frozenset()
    nearest_weekdays: frozenset[int] = frozenset()
    last_weekday_offsets: frozenset[int] = frozenset()

    def days_in(self, year: int, month: int) -> list[int]:
        """The matching days of a month, in order."""
        last = calendar.monthrange(year, month)[1]
        matching = {day for day in self.days if day <= last}
        matching.update(last - offset for offset in self.last_offsets if last - offset >= 1)
        for day in self.nearest_weekdays:
            if day <= last:
                matching.add(_nearest_weekday(year, month, day, last))
        for offset in self.last_weekday_offsets:
            if last - offset >= 1:
                matching.add(_nearest_weekday(year, month, last - offset, last))
        return sorted(matching)


@dataclass(frozen=True, slots=True)
class DayOfWeek:
    """The day-of-week field (1 = SUN … 7 = SAT): a set of days, or the last or the n-th of one day."""

    days: frozenset[int] = frozenset()
    last_of_month: int | None = None  # nL
    nth_of_month: tuple[int, int] | None = None  # n#k as (n, k)

    def days_in(self, year: int, month: int) -> list[int]:
        """The matching days of a month, in order."""
        last = calendar.monthrange(year, month)[1]
        first_weekday = quartz_weekday(date(year, month, 1))
        if self.nth_of_month is not None:
            weekday, nth = self.nth_of_month
            day = 1 + (weekday - first_weekday) % 7 + 7 * (nth - 1)
            return [day] if day <= last else []
        if self.last_of_month is not None:
            last_weekday = quartz_weekday(date(year, month, last))
            return [last - (last_weekday - self.last_of_month) % 7]
        return [day for day in range(1, last + 1) if (first_weekday + day - 2) % 7 + 1 in self.days]


def quartz_weekday(day: date) -> int:
    """Quartz's day-of-week number of a date: 1 = Sunday … 7 = Saturday."""
    return day.isoweekday() % 7 + 1


def _nearest_weekday(year: int, month: int, day: int, last: int) -> int:
    """The weekday (Monday-Friday) nearest to ``day``, staying inside the month."""
    weekday = date(year, month, day).weekday()  # Monday = 0
    if weekday == 5:  # Saturday: the Friday before, unless that is in the previous month
        return day - 1 if day > 1 else day + 2
    if weekday == 6:  # Sunday: the Monday after, unless that is in the next month
        return day + 1 if day < last else day - 2
    return day


@dataclass(frozen=True, slots=True)
class CronExpression:
    """A parsed Quartz cron expression: the values each field allows. Build it with :func:`parse`."""

    text: str
    seconds: tuple[int, ...]
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    day_of_month: DayOfMonth | None  # None: '?'
    months: tuple[int, ...]
    day_of_week: DayOfWeek | None  # None: '?'
    years: tuple[int, ...]

    def __str__(self) -> str:
        return self.text

    def days_in(self, year: int, month: int) -> list[int]:
        """The days of a month the day fields allow, in order (the month and year fields aside)."""
        if self.day_of_month is not None:
            return self.day_of_month.days_in(year, month)
        assert self.day_of_week is not None
        return self.day_of_week.days_in(year, month)

    def next_after(
        self, after: datetime, zone: tzinfo, skipped: list[datetime] | None = None
    ) -> datetime | None:
        """The first fire time strictly after the instant ``after``, as an aware time in ``zone``; None if none.

        Fire times are whole seconds of wall-clock time in ``zone``; see the module's daylight-saving policy.
        ``skipped`` receives the wall times (naive) passed over on the way because the zone's clocks skip them.
        """
        if after.tzinfo is None:
            raise ValueError("next_after needs an aware datetime (an instant), not a naive one")
        after_utc = after.astimezone(UTC)
        wall = after.astimezone(zone).replace(tzinfo=None, fold=0, microsecond=0)
        start: datetime | None = wall + SECOND
        while start is not None:
            candidate = self._next_wall_time(start)
            if candidate is None:
                return None
            fire = _first_occurrence(candidate, zone)
            if fire is None:  # skipped: the clocks sprang forward over it
                if skipped is not None:
                    skipped.append(candidate)
                start = _plus_second(candidate)
            elif fire.astimezone(UTC) <= after_utc:
                # ``after`` lies in the second pass of a repeated hour; its wall times fired in the first pass.
                start = _end_of_repetition(candidate, zone)
            else:
                return fire
        return None

    def fire_times(self, after: datetime, zone: tzinfo) -> Iterator[datetime]:
        """Every fire time strictly after ``after``, in order (a generator; it ends with the last one)."""
        fire = self.next_after(after, zone)
        while fire is not None:
            yield fire
            fire = self.next_after(fire, zone)

    def _next_wall_time(self, start: datetime) -> datetime | None:
        """The first wall time at or after ``start`` (naive, whole seconds) that every field allows."""
        for year in self.years[bisect.bisect_left(self.years, start.year):]:
            in_start_year = year == start.year
            for month in self.months[bisect.bisect_left(self.months, start.month) if in_start_year else 0:]:
                in_start_month = in_start_year and month == start.month
                days = self.days_in(year, month)
                for day in days[bisect.bisect_left(days, start.day) if in_start_month else 0:]:
                    found = self._first_time_of_day(start, in_start_month and day == start.day)
                    if found is not None:
                        hour, minute, second = found
                        return datetime(year, month, day, hour, minute, second)
        return None

    def _first_time_of_day(self, start: datetime, on_start_day: bool) -> tuple[int, int, int] | None:
        """The first allowed (hour, minute, second) of a day; on the start day, not before the start's time."""
        if not on_start_day:
            return self.hours[0], self.minutes[0], self.seconds[0]
        for hour in self.hours[bisect.bisect_left(self.hours, start.hour):]:
            in_start_hour = hour == start.hour
            for minute in self.minutes[bisect.bisect_left(self.minutes, start.minute) if in_start_hour else 0:]:
                if in_start_hour and minute == start.minute:
                    index = bisect.bisect_left(self.seconds, start.second)
                    if index == len(self.seconds):
                        continue
                    return hour, minute, self.seconds[index]
                return hour, minute, self.seconds[0]
        return None


def _plus_second(wall: datetime) -> datetime | None:
    try:
        return wall + SECOND
    except OverflowError:
        return None


def _first_occurrence(wall: datetime, zone: tzinfo) -> datetime | None:
    """The instant a wall time first occurs in ``zone`` (aware, in ``zone``), or None if the clocks skip it."""
    earlier = wall.replace(tzinfo=zone, fold=0)
    if earlier.astimezone(UTC).astimezone(zone).replace(tzinfo=None) != wall:
        return None
    return earlier


def _repeated(wall: datetime, zone: tzinfo) -> bool:
    """True when the wall time occurs twice (the clocks fall back over it)."""
    return wall.replace(tzinfo=zone, fold=0).utcoffset() != wall.replace(tzinfo=zone, fold=1).utcoffset()


def _end_of_repetition(wall: datetime, zone: tzinfo) -> datetime | None:
    """The first wall time after ``wall`` that occurs only once (``wall`` is inside a repeated stretch)."""
    low, high = wall, wall + timedelta(hours=1)
    while _repeated(high, zone):  # a repeated stretch lasts hours at most
        low, high = high, high + timedelta(hours=1)
    while high - low > SECOND:  # the repeated stretch is contiguous: bisect its end to the second
        middle = low + timedelta(seconds=(high - low) // SECOND // 2)
        if _repeated(middle, zone):
            low = middle
        else:
            high = middle
    return high


# -- parsing ------------------------------------------------------------------------------------------------


def parse(text: str) -> CronExpression:
    """Parse and validate a Quartz cron expression; raise :class:`CronError` naming the field and the reason."""
    if not isinstance(text, str):
        raise CronError(f"an expression is text, not {type(text).__name__}")
    fields = [field for field in re.split(r"[ \t]+", text.strip()) if field]
    if not fields:
        raise CronError("the expression is empty; it needs 6 or 7 fields: seconds minutes hours day-of-month "
                        "month day-of-week [year]")
    if len(fields) < 6 or len(fields) > 7:
        raise CronError(
            f"{len(fields)} fields given; an expression has 6 or 7: seconds minutes hours day-of-month month "
            "day-of-week [year]"
        )
    upper = [field.upper() for field in fields]
    seconds = _numbers(upper[0], _SECONDS)
    minutes = _numbers(upper[1], _MINUTES)
    hours = _numbers(upper[2], _HOURS)
    day_of_month = _day_of_month(upper[3])
    months = _numbers(upper[4], _MONTH)
    day_of_week = _day_of_week(upper[5])
    years = _numbers(upper[6], _YEAR) if len(upper) == 7 else tuple(range(MIN_YEAR, MAX_YEAR + 1))
    if day_of_month is None and day_of_week is None:
        raise CronError("'?' is in both day-of-month and day-of-week; give one of them", "day-of-week")
    if day_of_month is not None and day_of_week is not None:
        raise CronError(
            f"day-of-month {fields[3]!r} and day-of-week {fields[5]!r} are both given; Quartz supports only one: "
            "put '?' in the other",
            "day-of-week",
        )
    return CronExpression(text.strip(), seconds, minutes, hours, day_of_month, months, day_of_week, years)


def parse_schedulable(text: str) -> CronExpression:
    """:func:`parse`, refusing as well an expression no date matches at all (31 February, 30 February in any
    year, 29 February only in years that have none): Quartz accepts such an expression and never fires it."""
    expression = parse(text)
    for year in expression.years:
        for month in expression.months:
            if expression.days_in(year, month):
                return expression
    raise CronError(
        "no date matches its day-of-month or day-of-week, month and year fields together (such as 31 February): "
        "it would never fire",
        "day-of-month" if expression.day_of_month is not None else "day-of-week",
    )


def is_valid(text: str) -> bool:
    """True when ``text`` is a valid Quartz cron expression."""
    try:
        parse(text)
    except CronError:
        return False
    return True


def _check_not_question_mark(text: str, field: _Field) -> None:
    if "?" in text:
        if field in (_DAY_OF_MONTH, _DAY_OF_WEEK):
            if text.startswith("?") and "," not in text:
                raise CronError(f"unexpected characters after '?' in {text!r}", field.name)
            raise CronError(f"'?' must be the whole field, not part of {text!r}", field.name)
        raise CronError("'?' is only allowed in day-of-month or day-of-week", field.name)


def _terms(text: str, field: _Field) -> list[str]:
    terms = text.split(",")
    if any(not term for term in terms):
        raise CronError(f"{text!r} has an empty element in its list", field.name)
    return terms


def _numbers(text: str, field: _Field) -> tuple[int, ...]:
    """The values a plain field allows (seconds, minutes, hours, month, year)."""
    _check_not_question_mark(text, field)
    values: set[int] = set()
    for term in _terms(text, field):
        values.update(_term_values(term, field))
    return tuple(sorted(values))


def _value(token: str, field: _Field, term: str) -> int:
    where = "" if token == term else f" in {term!r}"
    if token.isdigit():
        number = int(token)
        if not field.low <= number <= field.high:
            raise CronError(f"{number}{where} is out of range; allowed: {field.describe()}", field.name)
        return number
    if field.names is None:
        raise CronError(f"{token!r}{where} is not a number; allowed: {field.describe()}", field.name)
    if token not in field.names:
        raise CronError(f"{token!r}{where} is not a known name; allowed: {field.describe()}", field.name)
    return field.names[token]


def _term_values(term: str, field: _Field) -> list[int]:
    """The values of one list element: ``*``, ``a``, ``a-b``, ``a/k``, ``*/k``, ``/k``, ``a-b/k``."""
    match = _TERM.fullmatch(term)
    if match is None:
        raise CronError(f"{term!r} is not a value, range or step; allowed: {field.describe()}, * , - /",
                        field.name)
    start_token, end_token, step_token = match.group("start"), match.group("end"), match.group("step")
    if start_token is None and (end_token is not None or step_token is None):
        raise CronError(f"{term!r} is not a value, range or step", field.name)
    if start_token == "*" and end_token is not None:
        raise CronError(f"{term!r}: '*' cannot start a range", field.name)
    named = [token for token in (start_token, end_token) if token and token != "*" and not token.isdigit()]
    if named and end_token is not None and len(named) == 1:
        raise CronError(f"{term!r} mixes a name and a number in one range; use two names or two numbers",
                        field.name)
    if named and step_token is not None:
        raise CronError(f"{term!r}: Quartz ignores a step after a name; write the range in numbers", field.name)
    step = 1
    if step_token is not None:
        if not step_token:
            raise CronError(f"{term!r}: '/' must be followed by a number", field.name)
        step = int(step_token)
        if step == 0:
            raise CronError(f"{term!r}: a step of 0 never advances; use 1 or more", field.name)
        limit = _MAX_STEP.get(field.name)
        if limit is not None and step > limit:
            raise CronError(f"{term!r}: the step {step} is larger than the field allows ({limit})", field.name)
    if start_token in (None, "*"):
        start, end = field.low, field.high
    else:
        start = _value(start_token, field, term)
        if end_token is not None:
            end = _value(end_token, field, term)
        elif step_token is not None:
            end = field.high  # a/k: from a every k to the end of the field, without wrapping (7/6 in months: July)
        else:
            end = start
    if end < start:
        if field is _YEAR:
            raise CronError(f"{term!r}: a range of years must go forward", field.name)
        end += field.size  # a range that wraps: 22-2 in hours is 22, 23, 0, 1, 2
    return [field.low + (value - field.low) % field.size for value in range(start, end + 1, step)]


def _day_of_month(text: str) -> DayOfMonth | None:
    """The day-of-month field; None for '?'."""
    if text == "?":
        return None
    field = _DAY_OF_MONTH
    _check_not_question_mark(text, field)
    days: set[int] = set()
    last_offsets: set[int] = set()
    nearest: set[int] = set()
    last_weekday_offsets: set[int] = set()
    for term in _terms(text, field):
        if term.startswith("L"):
            match = _LAST_DAY.fullmatch(term)
            if match is None:
                raise CronError(f"{term!r}: after 'L' only '-n' (n days before the last) and 'W' may follow",
                                field.name)
            offset = int(match.group("offset") or 0)
            if offset > MAX_LAST_DAY_OFFSET:
                raise CronError(f"{term!r}: the offset from the last day is at most {MAX_LAST_DAY_OFFSET}",
                                field.name)
            (last_weekday_offsets if match.group("weekday") else last_offsets).add(offset)
        elif "W" in term:
            match = _NEAREST_WEEKDAY.fullmatch(term)
            if match is None:
                raise CronError(f"{term!r}: 'W' takes a single day (such as 15W), not a range, step or list",
                                field.name)
            day = int(match.group("day"))
            if not 1 <= day <= 31:
                raise CronError(f"{term!r}: the day before 'W' must be 1 to 31", field.name)
            nearest.add(day)
        elif "L" in term:
            raise CronError(f"{term!r}: 'L' in day-of-month is 'L', 'L-n', 'LW' or 'L-nW'", field.name)
        elif "#" in term:
            raise CronError(f"{term!r}: '#' is only allowed in day-of-week", field.name)
        else:
            days.update(_term_values(term, field))
    return DayOfMonth(frozenset(days), frozenset(last_offsets), frozenset(nearest), frozenset(last_weekday_offsets))


def _day_of_week(text: str) -> DayOfWeek | None:
    """The day-of-week field; None for '?'."""
    if text == "?":
        return None
    field = _DAY_OF_WEEK
    _check_not_question_mark(text, field)
    if "W" in text.replace("WED", ""):
        raise CronError(f"{text!r}: 'W' is only allowed in day-of-month", field.name)
    if "#" in text:
        if "," in text:
            raise CronError(f"{text!r}: '#' must be the whole field, not part of a list", field.name)
        match = _NTH_DAY.fullmatch(text)
        if match is None:
            raise CronError(f"{text!r}: '#' takes a single day (such as 6#3), not a range or step", field.name)
        nth = match.group("nth")
        if not nth.isdigit() or not 1 <= int(nth) <= MAX_NTH:
            raise CronError(f"{text!r}: a number from 1 to {MAX_NTH} must follow '#'", field.name)
        return DayOfWeek(nth_of_month=(_value(match.group("day"), field, text), int(nth)))
    if "L" in text:
        if "," in text:
            raise CronError(f"{text!r}: 'L' must be the whole field, not part of a list", field.name)
        if text == "L":
            return DayOfWeek(days=frozenset({7}))  # 'L' alone is Saturday, the last day of the week
        match = _LAST_WEEKDAY_OF_MONTH.fullmatch(text)
        if match is None:
            raise CronError(
                f"{text!r}: 'L' in day-of-week is 'L' (Saturday) or 'nL' (the last day n of the month); "
                "'L-n' is only for day-of-month",
                field.name,
            )
        return DayOfWeek(last_of_month=_value(match.group("day"), field, text))
    days: set[int] = set()
    for term in _terms(text, field):
        days.update(_term_values(term, field))
    return DayOfWeek(days=frozenset(days))
