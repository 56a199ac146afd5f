"""Property test: the cron module agrees with the brute-force reference on generated expressions, zones and times.

Expressions are built from every construct Quartz allows (lists, wrapping ranges, steps, names, ``L``, ``L-n``,
``W``, ``LW``, ``nL``, ``n#k``, years), times are drawn at random and around daylight-saving transitions of zones
with unusual rules (half-hour shifts, midnight gaps, a skipped day).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from functools import cache
from zoneinfo import ZoneInfo

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.cron_reference import DAYS, MONTHS, Reference
from worker.policy.cron import parse

HORIZON = timedelta(days=800)
FIRES_COMPARED = 20  # consecutive fire times per example: enough to walk through a transition
ZONES = [
    "UTC",
    "Europe/Berlin",
    "America/New_York",
    "Australia/Lord_Howe",  # half-hour shift
    "America/Sao_Paulo",  # midnight gaps until 2019
    "Pacific/Apia",  # skipped 30 December 2011
    "America/St_Johns",
    "Pacific/Chatham",
    "Asia/Kolkata",
]


def _terms(low: int, high: int, max_step: int, names: list[str] | None = None) -> st.SearchStrategy[str]:
    value = st.integers(low, high)
    number = value.map(str)
    plain = [
        number,
        st.tuples(value, value).map(lambda r: f"{r[0]}-{r[1]}"),
        st.tuples(value, st.integers(1, max_step)).map(lambda r: f"{r[0]}/{r[1]}"),
        st.integers(1, max_step).map(lambda k: f"*/{k}"),
        st.tuples(value, value, st.integers(1, max_step)).map(lambda r: f"{r[0]}-{r[1]}/{r[2]}"),
    ]
    if names:
        name = st.sampled_from(names)
        plain += [name, st.tuples(name, name).map(lambda r: f"{r[0]}-{r[1]}")]
    term = st.one_of(plain)
    return st.one_of(st.just("*"), st.lists(term, min_size=1, max_size=3).map(",".join))


def _day_of_month() -> st.SearchStrategy[str]:
    special = st.one_of(
        st.just("L"),
        st.integers(0, 30).map(lambda n: f"L-{n}"),
        st.integers(1, 31).map(lambda d: f"{d}W"),
        st.just("LW"),
        st.integers(0, 30).map(lambda n: f"L-{n}W"),
    )
    number = st.integers(1, 31).map(str)
    mixed = st.lists(st.one_of(special, number), min_size=1, max_size=3).map(",".join)
    return st.one_of(_terms(1, 31, 31), special, mixed)


def _day_of_week() -> st.SearchStrategy[str]:
    day = st.one_of(st.integers(1, 7).map(str), st.sampled_from(DAYS))
    return st.one_of(
        _terms(1, 7, 7, DAYS),
        st.just("L"),
        day.map(lambda d: f"{d}L"),
        st.tuples(day, st.integers(1, 5)).map(lambda r: f"{r[0]}#{r[1]}"),
    )


def _years() -> st.SearchStrategy[str]:
    year = st.integers(1999, 2045)
    return st.one_of(
        st.just(""),
        st.just(" *"),
        st.lists(year, min_size=1, max_size=3).map(lambda ys: " " + ",".join(map(str, ys))),
        st.tuples(year, st.integers(0, 10)).map(lambda r: f" {r[0]}-{r[0] + r[1]}"),
        st.tuples(year, st.integers(1, 5)).map(lambda r: f" {r[0]}/{r[1]}"),
    )


@st.composite
def expressions(draw: st.DrawFn, around: datetime | None = None) -> str:
    """A valid Quartz expression built from every construct; ``around`` (a wall time) makes it fire that day,
    in that hour and the next (so that daylight-saving transitions are crossed)."""
    seconds = draw(st.one_of(st.just("0"), _terms(0, 59, 59)))
    minutes = draw(_terms(0, 59, 59))
    hours = draw(_terms(0, 23, 23))
    month = draw(_terms(1, 12, 12, MONTHS))
    if around is not None:
        hours = ",".join([hours, str(around.hour), str((around.hour + 1) % 24)])
        month = "*"
        days = f"{draw(st.sampled_from(['*', str(around.day)]))} {month} ?"
    elif draw(st.booleans()):
        days = f"{draw(_day_of_month())} {month} ?"
    else:
        days = f"? {month} {draw(_day_of_week())}"
    expression = f"{seconds} {minutes} {hours} {days}{draw(_years()) if around is None else ''}"
    return expression.lower() if draw(st.booleans()) else expression


@cache
def _transitions(zone_name: str) -> list[datetime]:
    """The instants the zone's offset changes, 2005-2030 (scanned hour by hour)."""
    zone = ZoneInfo(zone_name)
    found, instant = [], datetime(2005, 1, 1, tzinfo=UTC)
    offset = instant.astimezone(zone).utcoffset()
    while instant.year < 2031:
        instant += timedelta(hours=1)
        current = instant.astimezone(zone).utcoffset()
        if current != offset:
            found.append(instant)
            offset = current
    return found


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, str, datetime]:
    """An expression, a zone and an instant: anywhere in 2000-2040, or close to one of the zone's transitions
    with an expression that fires around it."""
    zone = draw(st.sampled_from(ZONES))
    transitions = _transitions(zone)
    if transitions and draw(st.booleans()):
        near = draw(st.sampled_from(transitions))
        offset = st.one_of(st.integers(-120, 60), st.integers(-3600, 600), st.integers(-4 * 3600, 4 * 3600))
        instant = near + timedelta(seconds=draw(offset))
        wall_before = (near - timedelta(seconds=1)).astimezone(ZoneInfo(zone))
        return draw(expressions(around=wall_before)), zone, instant
    instant = draw(st.datetimes(datetime(2000, 1, 1), datetime(2040, 12, 31), timezones=st.just(UTC)))
    return draw(expressions()), zone, instant


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_next_fire_times_match_the_brute_force_reference(case: tuple[str, str, datetime]) -> None:
    expression, zone_name, after = case
    zone = ZoneInfo(zone_name)
    parsed, reference = parse(expression), Reference(expression)
    for _ in range(FIRES_COMPARED):
        fire = parsed.next_after(after, zone)
        expected = reference.next_after(after, zone, HORIZON)
        if expected is None:  # none within the horizon: the module must not find one either
            assert fire is None or fire.astimezone(UTC) > after.astimezone(UTC) + HORIZON
            return
        assert fire is not None
        assert fire.isoformat() == expected.isoformat(), (expression, zone_name, after.isoformat())
        after = fire
