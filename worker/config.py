"""Configuration: every setting, its default, and the one place that reads the environment.

Settings come from environment variables with the prefix ``CORRELATION_`` (nested sections joined by ``__``,
e.g. ``CORRELATION_POLL__INTERVAL=PT6S``) and from an optional TOML file. Durations are ISO-8601
(``PT6S``, ``PT1M30S``); calendar units (years, months) are refused because their length is not fixed.
A bad value stops startup with one line naming the setting (see :func:`describe_error`).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import socket
import typing
from collections.abc import Mapping, Sequence
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

import isodate
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from worker.policy.text import name_problem, shown
from worker.redact import MASK, redact_route, redact_url

ENV_PREFIX = "CORRELATION_"
CONFIG_FILE_ENV = "CORRELATION_CONFIG_FILE"
# Variables with these prefixes belong to the test suite and the benchmarks, not to the worker.
FOREIGN_PREFIXES = ("CORRELATION_TEST_", "CORRELATION_BENCH_")


LONGEST_DURATION = timedelta(days=36500)


def parse_duration(value: object) -> timedelta:
    """Parse an ISO-8601 duration (``PT6S``) or a number of seconds into a non-negative timedelta."""
    if isinstance(value, timedelta):
        duration = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value) or abs(value) > LONGEST_DURATION.total_seconds():
            raise ValueError(f"{value!r} seconds is not a duration a setting can use")
        duration = timedelta(seconds=value)
    elif isinstance(value, str):
        try:
            parsed = isodate.parse_duration(value.strip().upper())
        except (isodate.ISO8601Error, ValueError, OverflowError) as exc:
            raise ValueError(f"{value!r} is not an ISO-8601 duration such as PT6S or PT1M30S") from exc
        if isinstance(parsed, isodate.Duration):
            raise ValueError(
                f"{value!r} uses calendar units (years or months) whose length is not fixed; "
                "use days, hours, minutes or seconds (e.g. P30D, PT12H)"
            )
        duration = parsed
    else:
        raise ValueError(f"{value!r} is not an ISO-8601 duration such as PT6S")
    if duration < timedelta(0):
        raise ValueError(f"{value!r} is negative; durations must be zero or more")
    if duration > LONGEST_DURATION:
        raise ValueError(
            f"{value!r} is longer than {format_duration(LONGEST_DURATION)} (100 years), more than any setting can use"
        )
    return duration


def format_duration(value: timedelta) -> str:
    """Render a timedelta as ISO-8601 (``PT6S``; zero is ``PT0S``)."""
    return "PT0S" if not value else str(isodate.duration_isoformat(value))


Duration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str),
]


def _named(setting: str, detail: str) -> PydanticCustomError:
    """A validation error that names its setting itself (for checks across fields)."""
    return PydanticCustomError("named_setting", "{detail}", {"setting": setting, "detail": detail})


class Mode(StrEnum):
    """How a batch reacts to a failure (DESIGN.md §3)."""

    FAIL_FIRST = "fail_first"
    ALL = "all"


class Jitter(StrEnum):
    """Backoff jitter: none, or full (uniform between the unit and the exponential delay)."""

    NONE = "none"
    FULL = "full"


class TimeoutOutcome(StrEnum):
    """What a handler call that exceeds its timeout counts as."""

    RETRY = "retry"
    RESCHEDULE = "reschedule"


def _parse_max_retries(value: object) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() == "unlimited"):
        return None
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError as exc:
            raise ValueError(f"{value!r} is neither a whole number nor 'unlimited'") from exc
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"{value!r} must be a whole number >= 1 (1: dead at the first recorded failure, no retry) or "
            "'unlimited'"
        )
    return value


MaxRetries = Annotated[
    int | None,
    BeforeValidator(_parse_max_retries),
    PlainSerializer(lambda v: "unlimited" if v is None else v),
]


BACKOFF_BASE_MAX = 100.0  # a larger base reaches any cap within two retries: the cap is the setting to use

# Durations the worker runs loops, waits and terms with, and the range each one works in (the bound is named
# when a value is refused). A loop interval shorter than its floor keeps a core busy on an empty table; an
# interval, delay or timeout of more than a day (a lease term: an hour) means a loop that never runs again in
# practice, or a slot or call that waits that long on a dead replica.
SECOND = timedelta(seconds=1)
DAY = timedelta(days=1)
Bounds = dict[str, tuple[timedelta, timedelta, str]]  # a setting's (least, most, why)
DURATION_BOUNDS: Bounds = {
    "database.connect_timeout": (SECOND, timedelta(minutes=10), "libpq counts whole seconds"),
    "database.lock_timeout": (timedelta(milliseconds=1), timedelta(hours=1), ""),
    "database.statement_timeout": (timedelta(milliseconds=1), DAY, ""),
    "database.keepalive": (SECOND, timedelta(hours=1), "TCP keepalives count whole seconds"),
    "poll.initial_delay": (timedelta(0), DAY, ""),
    "poll.interval": (timedelta(milliseconds=100), DAY, "a shorter poll keeps a core busy on an empty table"),
    "cleanup.initial_delay": (timedelta(0), DAY, ""),
    "cleanup.interval": (timedelta(milliseconds=100), DAY, "a shorter interval runs cleanup in a busy loop"),
    "delivery.retention": (timedelta(0), timedelta(days=3660), ""),
    "metrics.gauges_interval": (timedelta(milliseconds=100), DAY, "a shorter interval counts the table in a busy loop"),
    "lease.duration": (SECOND, timedelta(hours=1), "a dead replica's slots wait this long for a new holder"),
    "lease.renew_interval": (timedelta(milliseconds=100), timedelta(minutes=20), ""),
    "order.max_wait": (timedelta(0), timedelta(hours=1), "a later message waits this long behind an open transaction"),
    "notify.sqlite_check_interval": (timedelta(milliseconds=10), timedelta(minutes=1), ""),
    "shutdown.grace": (timedelta(0), timedelta(hours=1), ""),
    "scheduler.reload_interval": (timedelta(milliseconds=100), DAY, ""),
    "scheduler.misfire_threshold": (timedelta(0), timedelta(days=366), ""),
    "admin.session_lifetime": (SECOND, timedelta(days=30), ""),
    "admin.statement_timeout": (timedelta(milliseconds=1), timedelta(hours=1), ""),
}
# The policy's, for the global policy and every per-name override alike.
POLICY_BOUNDS: Bounds = {
    "time_to_live": (timedelta(0), LONGEST_DURATION, ""),
    "backoff_unit": (timedelta(0), timedelta(days=366), ""),
    "backoff_cap": (timedelta(0), timedelta(days=366), ""),
    "handler_timeout": (timedelta(milliseconds=1), DAY, ""),
    "reschedule_delay": (
        SECOND, timedelta(days=366), "a shorter delay calls a handler that answers 'not yet' in a busy loop"
    ),
}


def bound_problem(value: timedelta, bounds: tuple[timedelta, timedelta, str]) -> str | None:
    """Why a duration is outside its setting's range (one sentence naming the bound), or None."""
    low, high, why = bounds
    because = f" ({why})" if why else ""
    if value < low:
        return f"{format_duration(value)} is below the least it may be, {format_duration(low)}{because}"
    if value > high:
        return f"{format_duration(value)} is above the most it may be, {format_duration(high)}{because}"
    return None


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    _bounds: ClassVar[Bounds] = {}

    @field_validator("*")
    @classmethod
    def _in_range(cls, value: Any, info: ValidationInfo) -> Any:
        bounds = cls._bounds.get(info.field_name or "")
        problem = None if bounds is None or value is None else bound_problem(value, bounds)
        if problem is not None:
            raise ValueError(problem)
        return value


def _bounds_of(section: str) -> Bounds:
    return {path.split(".")[1]: bounds for path, bounds in DURATION_BOUNDS.items() if path.split(".")[0] == section}


class DatabaseSettings(_Section):
    """Where messages live. PostgreSQL for production and clusters; a SQLite file for one replica."""

    _bounds: ClassVar[Bounds] = _bounds_of("database")

    # postgresql://user:pass@host:5432/db (or postgres://) for production and clusters; a SQLite file for one
    # replica (only migrate and run create a missing file).
    url: str = "sqlite:///correlation.db"
    # `run` brings the schema up to date itself; with False it refuses to start on an old schema.
    auto_migrate: bool = True
    # Connections kept per replica (as many again may be opened under load; a transactional route gets one per
    # lane).
    pool_size: int = Field(default=5, ge=1)
    # How long one connection attempt may take (whole seconds).
    connect_timeout: Duration = timedelta(seconds=5)
    # Every worker statement waits at most this long for a row or table lock held by another session.
    lock_timeout: Duration = timedelta(seconds=2)
    # Every worker statement is cancelled after this long.
    statement_timeout: Duration = timedelta(seconds=30)
    # TCP keepalives: a half-open connection (a peer that vanished) is detected within about 2x this.
    keepalive: Duration = timedelta(seconds=10)

    @field_validator("url")
    @classmethod
    def _known_backend(cls, url: str) -> str:
        check_database_url(url)
        return url

    @field_validator("connect_timeout")
    @classmethod
    def _connect_timeout_positive(cls, value: timedelta) -> timedelta:
        if value.microseconds:
            raise ValueError(f"{format_duration(value)} is not whole seconds, which libpq counts in; use e.g. PT5S")
        return value


POSTGRESQL_SCHEMES = ("postgresql", "postgres")
URL_EXAMPLES = "use postgresql://user:password@host:5432/db or sqlite:///path/to/file.db"


def check_database_url(url: str) -> None:
    """Refuse a database URL the worker cannot use, with a reason that never echoes its password.

    ``postgresql://`` and ``postgres://`` (with any driver name: psycopg 3 is used) and a SQLite *file* are
    accepted; an in-memory SQLite database is refused, since it would vanish with the process and could not
    be shared with the CLI or a second process.
    """
    try:
        parts = urlsplit(url)
    except ValueError as error:
        raise ValueError(f"{redact_url(url)!r} is not a URL ({error}); {URL_EXAMPLES}") from None
    backend = parts.scheme.split("+", 1)[0].lower()
    if not parts.scheme or "://" not in url:
        raise ValueError(f"{redact_url(url)!r} is not a URL; {URL_EXAMPLES}")
    if backend in POSTGRESQL_SCHEMES:
        port = parts.netloc.rpartition("@")[2]
        if port.startswith("["):  # [IPv6]:port
            port = port.partition("]")[2]
        _, colon, number = port.rpartition(":")
        if colon and number and not (number.isdigit() and 1 <= int(number) <= 65535):
            raise ValueError(
                f"the port {number!r} in the URL is not a number from 1 to 65535; PostgreSQL's is usually 5432"
            )
        return
    if backend == "sqlite":
        path = url.split("://", 1)[1].lstrip("/").split("?", 1)[0]
        in_memory = not path or path == ":memory:" or path.startswith("file::memory:") or "mode=memory" in url
        if in_memory:
            raise ValueError(
                "an in-memory SQLite database vanishes with the process and cannot be shared with the CLI or "
                "another replica; name a file, e.g. sqlite:///correlation.db"
            )
        return
    raise ValueError(f"{parts.scheme!r} is not supported; {URL_EXAMPLES}")


class PollSettings(_Section):
    """The correlation schedule: the first poll after ``initial_delay``, then one every ``interval``."""

    _bounds: ClassVar[Bounds] = _bounds_of("poll")

    # The engine starts fetching this long after the replica starts.
    initial_delay: Duration = timedelta(seconds=10)
    # Every slot is fetched, or looked at when its last fetch found it empty, at least once per interval: the
    # backstop of wake-ups and the pace of buffered retries.
    interval: Duration = timedelta(seconds=6)
    # Messages one fetch of a slot reads at most.
    page_size: int = Field(default=100, ge=1, le=10_000)
    # A fetch takes no further message once its payloads reach this many bytes (its first message always). The
    # default is what a page of the default page_size can hold at most (1 MiB a payload): its fetch is unbounded.
    page_bytes: int = Field(default=100 * 1024 * 1024, ge=1024, le=10 * 1024 * 1024 * 1024)
    # Correlator calls running at the same time inside one replica, across all its slots (one lane per hint;
    # one hint never has two calls at once).
    concurrency: int = Field(default=8, ge=1, le=256)



class CleanupSettings(_Section):
    """The cleanup schedule and how many expired rows one statement removes."""

    _bounds: ClassVar[Bounds] = _bounds_of("cleanup")

    # The first cleanup runs this long after the replica starts.
    initial_delay: Duration = timedelta(minutes=1)
    # How often one replica (the holder of the cleanup lock) removes expired messages and delivery records past
    # their retention.
    interval: Duration = timedelta(minutes=1)
    # Expired rows (and delivery records) removed per statement.
    chunk_size: int = Field(default=1000, ge=1, le=100_000)


class DeliverySettings(_Section):
    """How long a message that left the table (correlated, expired, deleted) is kept as a record, its
    ``message_id`` refused meanwhile (the deduplication window). ``PT0S``: no record, no window."""

    _bounds: ClassVar[Bounds] = _bounds_of("delivery")

    # How long a message that left the table stays as its delivery record, its message_id refused meanwhile; PT0S:
    # no record, no deduplication window.
    retention: Duration = timedelta(days=7)



class PolicyOverride(_Section):
    """Per-``message_name`` policy: every field left unset is inherited from the global policy."""

    _bounds: ClassVar[Bounds] = POLICY_BOUNDS

    time_to_live: Duration | None = None
    backoff_unit: Duration | None = None
    backoff_base: float | None = Field(default=None, ge=1.0, le=BACKOFF_BASE_MAX, allow_inf_nan=False)
    backoff_cap: Duration | None = None
    jitter: Jitter | None = None
    max_retries: MaxRetries = Field(default=None)
    handler_timeout: Duration | None = None
    timeout_outcome: TimeoutOutcome | None = None
    reschedule_delay: Duration | None = None
    poison_after: int | None = Field(default=None, ge=0, le=1000)

    @model_validator(mode="before")
    @classmethod
    def _refuse_batch_shape(cls, data: Any) -> Any:
        if not isinstance(data, dict | PolicyOverride):
            raise ValueError(
                f"{json.dumps(data, default=str)} is not a policy; use an object of policy fields such as "
                '{"max_retries": 3, "time_to_live": "PT1H"}'
            )
        if isinstance(data, dict):
            for name in ("mode", "batch_size"):
                if name in data:
                    raise ValueError(
                        f"'{name}' shapes a whole batch, whose messages may have different names; "
                        "it is global and cannot be overridden per message name"
                    )
        return data


class Policy(_Section):
    """The global retry and batching policy (DESIGN.md §3)."""

    _bounds: ClassVar[Bounds] = POLICY_BOUNDS

    mode: Mode = Mode.FAIL_FIRST
    # -1: every eligible message of a hint per poll; 1: only the head; N: up to N.
    batch_size: int = -1
    # A message older than this is not called any more (expired); failures inside it are not recorded. None: no time
    # to live.
    time_to_live: Duration | None = None
    # The first retry's delay; each later one is backoff_base times longer, up to backoff_cap. PT0S retries at every
    # poll.
    backoff_unit: Duration = timedelta(minutes=1)
    # The factor between two retries' delays.
    backoff_base: float = Field(default=2.0, ge=1.0, le=BACKOFF_BASE_MAX, allow_inf_nan=False)
    # The longest delay between two retries.
    backoff_cap: Duration = timedelta(minutes=180)
    jitter: Jitter = Jitter.NONE
    # The recorded failure at which a message is dead (1: no retry), or unlimited.
    max_retries: MaxRetries = 100
    # How long a correlator call may take; past it the call is given up on and charged as timeout_outcome says. Must
    # fit in the lease: duration - renew interval - safety margin.
    handler_timeout: Duration = timedelta(seconds=30)
    timeout_outcome: TimeoutOutcome = TimeoutOutcome.RETRY
    # The delay of a Reschedule raised without one of its own.
    reschedule_delay: Duration = timedelta(minutes=1)
    # A message during whose calls its replica died this many times is dead (0: never).
    poison_after: int = Field(default=3, ge=0, le=1000)

    @field_validator("batch_size")
    @classmethod
    def _batch_size(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("must be -1 (the whole batch) or a number >= 1")
        return value

    @model_validator(mode="after")
    def _backoff_sound(self) -> Policy:
        problem = backoff_problem(self)
        if problem is not None:
            field_name, detail = problem
            raise _named(f"{ENV_PREFIX}POLICY__{field_name.upper()}", detail)
        return self

    def merged(self, override: PolicyOverride | None) -> Policy:
        """This policy with every field the override sets replaced."""
        if override is None:
            return self
        changes = {name: getattr(override, name) for name in override.model_fields_set}
        return self.model_copy(update=changes)


def backoff_problem(policy: Policy) -> tuple[str, str] | None:
    """Why this (merged) policy's backoff cannot work, as (the field to fix, one sentence); None if it can.

    A zero cap retries every failing message at every poll whatever the unit says (a zero *unit* does the
    same on purpose and is allowed: no backoff, paced by the poll interval); a cap below the unit silently
    shortens every delay to the cap.
    """
    unit, cap = policy.backoff_unit, policy.backoff_cap
    if cap <= timedelta(0):
        return "backoff_cap", "PT0S would retry a failing message at every poll; use e.g. PT3H"
    if cap < unit:
        return "backoff_cap", (
            f"{format_duration(cap)} is below the backoff unit {format_duration(unit)}, so every delay would be "
            "the cap; use a cap at least as long as the unit"
        )
    if policy.handler_timeout <= timedelta(0):
        return "handler_timeout", "PT0S would time out every call at once; use e.g. PT30S"
    return None


class MetricsSettings(_Section):
    """The HTTP endpoint for /metrics, /healthz and /readyz."""

    _bounds: ClassVar[Bounds] = _bounds_of("metrics")

    # The address the /metrics, /healthz, /readyz and console endpoint listens on.
    host: str = "0.0.0.0"
    # Its port (0: any free port, logged at startup).
    port: int = Field(default=9464, ge=0, le=65535)
    # False: no endpoint at all (no probes, no metrics, no console).
    enabled: bool = True
    # How often one replica counts the table for the state gauges.
    gauges_interval: Duration = timedelta(seconds=15)



class LogSettings(_Section):
    """One event per line, as text or JSON."""

    # text, or json for one JSON object per line.
    format: Literal["text", "json"] = "text"
    # The least severe level logged.
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value


class ReplicaSettings(_Section):
    """Who this process is: a pod name (a per-boot random suffix is added to make ``locked_by`` unique)."""

    # The replica's name (the pod name by default: the host name); a per-boot random id is added.
    name: str = Field(default_factory=socket.gethostname, min_length=1, max_length=200)


class LeaseSettings(_Section):
    """Slot leases on PostgreSQL: how long a term lasts and how it is kept (DESIGN.md §4).

    A crashed replica's slots are taken over within ``duration + renew_interval``. A correlator call never
    starts unless it can end (its handler timeout) before the lease could: the handler timeout must fit in
    ``duration - renew_interval - safety_margin``.
    """

    _bounds: ClassVar[Bounds] = _bounds_of("lease")

    # A slot lease's term: a dead replica's slots wait this long (plus a renewal) for a new holder.
    duration: Duration = timedelta(seconds=40)
    # At most a third of the duration, so that two renewals can fail before a term ends.
    renew_interval: Duration = timedelta(seconds=5)
    # A slot stops being polled this long before its term could end.
    safety_margin: Duration = timedelta(seconds=5)
    # A slot handed back to balance the cluster is withheld this long before release (a page may be in flight).
    drain: Duration = timedelta(seconds=5)

    @model_validator(mode="after")
    def _terms_fit(self) -> LeaseSettings:
        # The same rules as the leaser's own (engine/leases.py), here so that every command refuses them early.
        name = ENV_PREFIX + "LEASE__"
        duration, renew = self.duration, self.renew_interval
        if duration <= timedelta(0):
            raise _named(name + "DURATION", "PT0S: a lease must last; use e.g. PT30S")
        if renew <= timedelta(0) or renew * 3 > duration:
            raise _named(
                name + "RENEW_INTERVAL",
                f"{format_duration(renew)} must be greater than zero and at most a third of the lease duration "
                f"{format_duration(duration)}, so that two renewals can fail before a term ends",
            )
        if self.safety_margin >= duration - renew:
            raise _named(
                name + "SAFETY_MARGIN",
                f"{format_duration(self.safety_margin)} must be less than the lease duration minus the renew "
                f"interval ({format_duration(duration - renew)}), or slots would stop being polled between two "
                "renewals",
            )
        if self.drain >= duration:
            raise _named(
                name + "DRAIN",
                f"{format_duration(self.drain)} must be shorter than the lease duration {format_duration(duration)}",
            )
        return self


class OrderSettings(_Section):
    """The commit-order horizon: how long a running producer transaction may hold back later messages."""

    _bounds: ClassVar[Bounds] = _bounds_of("order")

    # A message is never correlated while an earlier id of its hint may still commit; a producer transaction
    # open longer than this stops holding the others back (DESIGN.md §3, docs/explanations/processing.md "Order").
    max_wait: Duration = timedelta(seconds=5)


class NotifySettings(_Section):
    """Wake-ups: LISTEN for the producers' NOTIFY on PostgreSQL; watch the file's version on SQLite."""

    _bounds: ClassVar[Bounds] = _bounds_of("notify")

    # PostgreSQL: LISTEN for the producers' NOTIFY and fetch the slots it names at once; SQLite: watch the file for
    # other processes' commits.
    enabled: bool = True
    # SQLite: how often the file is checked for commits by other processes.
    sqlite_check_interval: Duration = timedelta(milliseconds=100)


TOKEN_MIN_LENGTH = 16


class AdminSettings(_Section):
    """The console: the JSON API under ``/api/v1`` and the pages under ``/ui`` on the metrics port.

    Off unless a token is set (secure by default). ``token`` may read and act; ``read_token`` may only read.
    The audit names who acted by the token's name, never by the secret.
    """

    _bounds: ClassVar[Bounds] = _bounds_of("admin")

    # The console's read-and-act token (at least 16 characters); without a token /api and /ui answer 404.
    token: SecretStr | None = None
    # The console's read-only token (at least 16 characters).
    read_token: SecretStr | None = None
    # The name the audit records for the read-and-act token (never the token).
    token_name: str = Field(default="admin", min_length=1, max_length=100)
    # The name the audit records for the read-only token.
    read_token_name: str = Field(default="read-only", min_length=1, max_length=100)
    # How long a login to the pages lasts.
    session_lifetime: Duration = timedelta(hours=8)
    # Every console query is cancelled after this long (bulk actions: each chunk).
    statement_timeout: Duration = timedelta(seconds=5)
    # Rows a bulk action changes per transaction.
    chunk_size: int = Field(default=1000, ge=1, le=100_000)
    # Counts stop here and show as e.g. "10000+" (a count never reads more than this many rows).
    count_limit: int = Field(default=10_000, ge=100, le=1_000_000)

    @field_validator("token_name", "read_token_name")
    @classmethod
    def _printable(cls, value: str) -> str:
        problem = name_problem(value)
        if problem is not None:
            raise ValueError(f"{shown(value)} {problem}; the audit writes this name into every entry")
        return value

    @field_validator("token", "read_token")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError(
                "is only blanks; make a token with `python3 -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        if value is not None and len(value.get_secret_value()) < TOKEN_MIN_LENGTH:
            raise ValueError(
                f"a token must have at least {TOKEN_MIN_LENGTH} characters; make one with "
                "`python3 -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        return value

    @model_validator(mode="after")
    def _distinct(self) -> AdminSettings:
        if (
            self.token is not None
            and self.read_token is not None
            and self.token.get_secret_value() == self.read_token.get_secret_value()
        ):
            raise _named(
                f"{ENV_PREFIX}ADMIN__READ_TOKEN",
                "is the same as CORRELATION_ADMIN__TOKEN; a read-only token must differ from the one that may act",
            )
        if self.token_name == self.read_token_name:
            raise _named(
                f"{ENV_PREFIX}ADMIN__READ_TOKEN_NAME", "must differ from __TOKEN_NAME (the audit tells them apart)"
            )
        return self

    @property
    def enabled(self) -> bool:
        """True when a token is set: the console is served."""
        return self.token is not None or self.read_token is not None


class ShutdownSettings(_Section):
    """How long SIGTERM waits for the current message before abandoning it."""

    _bounds: ClassVar[Bounds] = _bounds_of("shutdown")

    # How long SIGTERM waits for the calls under way before giving them up (delivered again by the slot's next
    # holder).
    grace: Duration = timedelta(seconds=30)


class TracingSettings(_Section):
    """OpenTelemetry traces (the ``otel`` extra), configured by the SDK's ``OTEL_*`` variables; this only says how
    a message's producer context (its ``traceparent`` header) relates to the call span."""

    # How a message's traceparent relates to its call span: link (the messaging conventions' way) or parent (the
    # call joins the producer's trace).
    producer_context: Literal["link", "parent"] = "link"


class SchedulerSettings(_Section):
    """Schedules (DESIGN.md §7): rows of ``correlation_schedule`` whose Quartz cron publishes messages.

    ``enabled`` says whether this replica takes part; the switch of the whole cluster's scheduler is the row of
    ``correlation_scheduler`` (``correlation-worker schedules disable``).
    """

    _bounds: ClassVar[Bounds] = _bounds_of("scheduler")

    # Whether this replica runs the scheduler (the cluster-wide switch is the correlation_scheduler row).
    enabled: bool = True
    # Schedules added, changed or deleted with SQL take effect within this interval.
    reload_interval: Duration = timedelta(seconds=10)
    # A fire time later than this is a misfire: the schedule's misfire policy decides (Quartz's default: 1 min).
    misfire_threshold: Duration = timedelta(minutes=1)
    # fire_all publishes at most this many missed fire times (the most recent ones).
    fire_all_limit: int = Field(default=100, ge=1, le=1000)



def _default_routes() -> dict[str, str | dict[str, Any]]:
    return {"*": "log"}


def _route_shape(value: object) -> object:
    """A route is a string or an object; anything else is refused in one sentence (not one per union arm)."""
    if isinstance(value, str | dict):
        return value
    shown = json.dumps(value) if isinstance(value, int | float | bool | list) or value is None else repr(value)
    raise ValueError(
        f"{shown} is not a route; use \"log\", \"module:function\" or an object such as "
        '{"type": "http", "url": "https://..."}'
    )


Route = Annotated[str | dict[str, Any], BeforeValidator(_route_shape)]


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"the key {twice[0]!r} is given twice (JSON keeps only the last); give each key once")
    return dict(pairs)


class _StrictJsonEnvSource(EnvSettingsSource):
    """The environment, with JSON values whose duplicate keys are refused instead of silently collapsed."""

    def decode_complex_value(self, field_name: str, field: Any, value: Any) -> Any:
        return json.loads(value, object_pairs_hook=_refuse_duplicate_keys)


class Settings(BaseSettings):
    """Every setting of correlation-worker. Build it with :func:`load_settings`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    database: DatabaseSettings = DatabaseSettings()
    poll: PollSettings = PollSettings()
    cleanup: CleanupSettings = CleanupSettings()
    delivery: DeliverySettings = DeliverySettings()
    policy: Policy = Policy()
    policies: dict[str, PolicyOverride] = Field(default_factory=dict)
    correlators: dict[str, Route] = Field(default_factory=_default_routes)
    metrics: MetricsSettings = MetricsSettings()
    log: LogSettings = LogSettings()
    replica: ReplicaSettings = ReplicaSettings()
    lease: LeaseSettings = LeaseSettings()
    order: OrderSettings = OrderSettings()
    notify: NotifySettings = NotifySettings()
    shutdown: ShutdownSettings = ShutdownSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    admin: AdminSettings = AdminSettings()
    tracing: TracingSettings = TracingSettings()

    @field_validator("correlators", "policies", mode="before")
    @classmethod
    def _an_object(cls, value: object, info: ValidationInfo) -> object:
        if not isinstance(value, dict):
            example = '{"order.paid": "shop.handlers:on_paid", "*": "log"}' if info.field_name == "correlators" else (
                '{"invoice.sent": {"max_retries": 3}}'
            )
            raise ValueError(f"{json.dumps(value, default=str)} is not a JSON object; use e.g. {example}")
        return value

    @field_validator("correlators")
    @classmethod
    def _routes_not_empty(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not value:
            raise ValueError('at least one route is needed, e.g. {"*": "log"}')
        for name in value:
            problem = name_problem(name)
            if problem is not None:
                raise ValueError(f"the route name {shown(name)} {problem}; a route is named by a message_name exactly")
        return value

    @model_validator(mode="after")
    def _http_timeouts_fit(self) -> Settings:
        # An HTTP call allowed to outlast its handler timeout is abandoned as hung first, its answer never read.
        for name, spec in self.correlators.items():
            if not isinstance(spec, dict) or spec.get("type") not in ("http", "camunda8"):
                continue
            try:
                timeout = parse_duration(spec.get("timeout", "PT10S"))
            except ValueError:
                continue  # the route itself says what is wrong with it when it is built
            handler_timeout = self.policy_for(name).handler_timeout
            if timeout > handler_timeout:
                raise _named(
                    f"{ENV_PREFIX}CORRELATORS[{name}]",
                    f"its timeout {format_duration(timeout)} is longer than the handler timeout "
                    f"{format_duration(handler_timeout)}: the call would be given up as hung before its answer "
                    "came; make the route's timeout shorter or the policy's handler_timeout longer",
                )
        return self

    @model_validator(mode="after")
    def _overrides_sound(self) -> Settings:
        # An override is checked merged with the global policy: its own values may be fine alone and still
        # make a broken whole (a unit raised above the inherited cap).
        for name, override in self.policies.items():
            problem = backoff_problem(self.policy.merged(override))
            if problem is not None:
                field_name, detail = problem
                inherited = "" if field_name in override.model_fields_set else (
                    f" (inherited from {ENV_PREFIX}POLICY__{field_name.upper()})"
                )
                raise _named(f"{ENV_PREFIX}POLICIES[{name}].{field_name}", f"{detail}{inherited}")
        return self

    @model_validator(mode="after")
    def _calls_fit_in_the_lease(self) -> Settings:
        # A call never starts unless it can end before its slot's lease could: with renewals on time, a lease
        # is always safe for duration - renew_interval - safety_margin.
        timeout, setting = self.longest_handler_timeout()
        lease = self.lease
        room = lease.duration - lease.renew_interval - lease.safety_margin
        if timeout > room:
            raise _named(
                setting,
                f"a call may take {format_duration(timeout)} but must end before its slot lease could: at most "
                f"{ENV_PREFIX}LEASE__DURATION ({format_duration(lease.duration)}) minus __RENEW_INTERVAL "
                f"({format_duration(lease.renew_interval)}) minus __SAFETY_MARGIN "
                f"({format_duration(lease.safety_margin)}) = {format_duration(room)}; shorten the timeout or "
                "lengthen the lease",
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments win over the environment, which wins over the TOML file."""
        sources: list[PydanticBaseSettingsSource] = [init_settings, _StrictJsonEnvSource(settings_cls)]
        config_file = os.environ.get(CONFIG_FILE_ENV)
        if config_file:
            path = Path(config_file)
            if not path.is_file():
                what = "is a directory" if path.is_dir() else "does not exist"
                raise ValueError(f"{CONFIG_FILE_ENV}: {config_file} {what}; name a TOML file, or unset it")
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        return tuple(sources)

    def policy_for(self, message_name: str) -> Policy:
        """The effective policy of a message name: the global one with its override applied."""
        return self.policy.merged(self.policies.get(message_name))

    def longest_handler_timeout(self) -> tuple[timedelta, str]:
        """The longest handler timeout of any policy, and the setting that gives it."""
        longest, setting = self.policy.handler_timeout, f"{ENV_PREFIX}POLICY__HANDLER_TIMEOUT"
        for name, override in self.policies.items():
            if override.handler_timeout is not None and override.handler_timeout > longest:
                longest, setting = override.handler_timeout, f"{ENV_PREFIX}POLICIES[{name}].handler_timeout"
        return longest, setting

    def shortest_handler_timeout(self) -> timedelta:
        """The shortest handler timeout of any policy."""
        overrides = (override.handler_timeout for override in self.policies.values() if override.handler_timeout)
        return min([self.policy.handler_timeout, *overrides])

    def redacted(self) -> dict[str, Any]:
        """The effective configuration as JSON-ready data, with every credential hidden (URL and routes)."""
        data = self.model_dump(mode="json")
        data["database"]["url"] = redact_url(self.database.url)
        data["correlators"] = {name: redact_route(spec) for name, spec in self.correlators.items()}
        for name in ("token", "read_token"):
            data["admin"][name] = None if getattr(self.admin, name) is None else MASK
        return data


class ConfigError(Exception):
    """A setting is invalid; the message is one line naming it."""


def describe_error(error: ValidationError) -> str:
    """One line per problem, each naming the environment variable to fix."""
    lines = []
    for problem in error.errors():
        location = [str(part) for part in problem["loc"]]
        if problem["type"] == "named_setting":
            lines.append(f"invalid setting {problem['ctx']['setting']}: {problem['ctx']['detail']}")
            continue
        if location and location[0] in ("policies", "correlators"):
            name = ENV_PREFIX + location[0].upper()
            if len(location) > 1:
                name += f"[{location[1]}]" + "".join(f".{part}" for part in location[2:])
        else:
            name = ENV_PREFIX + "__".join(part.upper() for part in location)
        message = str(problem["msg"]).removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            message = "is not a known setting" + _did_you_mean(location)
        lines.append(f"invalid setting {name}: {message}")
    return "; ".join(lines)


def _model_at(location: Sequence[str]) -> type[BaseModel] | None:
    """The settings model whose keys hold the last part of ``location`` (a section, or a policy override)."""
    model: type[BaseModel] = Settings
    parts = list(location[:-1])
    while parts:
        field = model.model_fields.get(parts.pop(0))
        if field is None:
            return None
        annotation = field.annotation
        if typing.get_origin(annotation) is dict:  # policies: {message name: override}, the name is any text
            annotation = typing.get_args(annotation)[1]
            if not parts:
                return None
            parts.pop(0)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _did_you_mean(location: Sequence[str]) -> str:
    """``; did you mean 'interval'?`` for a misspelt key of the settings (a TOML section or key, a policy's key),
    the known keys at that place compared with difflib; empty when none is close."""
    model = _model_at(location)
    if model is None or not location:
        return ""
    known = list(model.model_fields)
    near = difflib.get_close_matches(location[-1].lower(), known, n=1, cutoff=0.6)
    if not near:
        return f"; the known keys there: {', '.join(known)}"
    return f"; did you mean {near[0]!r}?"


def known_variables() -> list[str]:
    """Every environment variable the settings read."""
    names = [CONFIG_FILE_ENV]
    for field_name, field in Settings.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            names += [f"{ENV_PREFIX}{field_name}__{sub}".upper() for sub in annotation.model_fields]
        else:
            names.append(f"{ENV_PREFIX}{field_name}".upper())
    return names


# The variables Kubernetes gives every pod for each service of its namespace (a service ``camunda`` makes
# ``CAMUNDA_SERVICE_HOST``, ``CAMUNDA_PORT_8080_TCP_ADDR``, …): never a misspelt setting.
SERVICE_LINK = re.compile(
    r"_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)$"
)


def kubernetes_service_link(name: str) -> bool:
    """True for a variable Kubernetes sets for a service (``<SERVICE>_SERVICE_HOST``, ``<SERVICE>_PORT_…``)."""
    return SERVICE_LINK.search(name.upper()) is not None


def check_unknown_variables(environ: Mapping[str, str]) -> None:
    """Refuse a misspelt setting instead of silently ignoring it.

    A variable of a known section with an unknown field is refused; so is any other ``CORRELATION_*`` variable
    close to a known name. Others (e.g. Kubernetes service links of a service named ``correlation-*``) pass.
    """
    known = known_variables()
    sections = {name.split("__", 1)[0] for name in known if "__" in name}
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in known or upper.startswith(FOREIGN_PREFIXES):
            continue
        guess = difflib.get_close_matches(upper, known, n=1, cutoff=0.8)
        if upper.split("__", 1)[0] in sections or guess:
            hint = f"; did you mean {guess[0]}?" if guess else ""
            raise ConfigError(f"invalid setting {name}: is not a known setting{hint}")


def load_settings(**overrides: Any) -> Settings:
    """Read the settings from the environment (and the optional file); raise ConfigError on a bad value."""
    check_unknown_variables(os.environ)
    try:
        return Settings(**overrides)
    except ValidationError as error:
        raise ConfigError(describe_error(error)) from None
    except (ValueError, OSError) as error:  # a malformed JSON value or an unreadable config file
        field = re.search(r'field "([a-z_]+)"', str(error))
        if field:
            name = ENV_PREFIX + field.group(1).upper()
            twice = re.search(r"the key .* given twice.*", f"{error} {error.__cause__}")
            detail = twice.group(0) if twice else "the value is not valid JSON"
            raise ConfigError(f"invalid setting {name}: {detail}") from None
        raise ConfigError(f"invalid configuration: {error}") from None


def secret_from_environment(spec: Mapping[str, Any], key: str, setting: str) -> str:
    """The value of the environment variable a correlator route names under ``key`` (``token_env``,
    ``password_env``, ``client_secret_env``): the secret never sits in the route itself."""
    name = spec.get(key)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"invalid setting {setting}: auth needs '{key}', the name of an environment variable")
    value = os.environ.get(name)
    if not value:
        raise ConfigError(f"invalid setting {setting}: auth '{key}' names {name}, which is not set or empty")
    return value
