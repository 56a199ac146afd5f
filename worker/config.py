"""Configuration: every setting, its default, and the one place that reads the environment.

Settings come from environment variables with the prefix ``CORRELATION_`` (nested sections joined by ``__``,
e.g. ``CORRELATION_POLL__INTERVAL=PT6S``) and from an optional TOML file. Durations are ISO-8601
(``PT6S``, ``PT1M30S``); calendar units (years, months) are refused because their length is not fixed.
A bad value stops startup with one line naming the setting (see :func:`describe_error`).
"""

from __future__ import annotations

import difflib
import os
import re
import socket
from collections.abc import Mapping
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import isodate
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

ENV_PREFIX = "CORRELATION_"
CONFIG_FILE_ENV = "CORRELATION_CONFIG_FILE"
# Variables with these prefixes belong to the test suite and the benchmarks, not to the worker.
FOREIGN_PREFIXES = ("CORRELATION_TEST_", "CORRELATION_BENCH_")


def parse_duration(value: object) -> timedelta:
    """Parse an ISO-8601 duration (``PT6S``) or a number of seconds into a non-negative timedelta."""
    if isinstance(value, timedelta):
        duration = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        duration = timedelta(seconds=value)
    elif isinstance(value, str):
        try:
            parsed = isodate.parse_duration(value.strip().upper())
        except (isodate.ISO8601Error, ValueError) as exc:
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
    return duration


def format_duration(value: timedelta) -> str:
    """Render a timedelta as ISO-8601 (``PT6S``; zero is ``PT0S``)."""
    return "PT0S" if not value else str(isodate.duration_isoformat(value))


Duration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str),
]


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
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} must be a whole number >= 0 or 'unlimited'")
    return value


MaxRetries = Annotated[
    int | None,
    BeforeValidator(_parse_max_retries),
    PlainSerializer(lambda v: "unlimited" if v is None else v),
]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DatabaseSettings(_Section):
    """Where messages live. PostgreSQL for production and clusters; a SQLite file for one replica."""

    url: str = "sqlite:///correlation.db"
    # `run` brings the schema up to date itself; with False it refuses to start on an old schema.
    auto_migrate: bool = True
    pool_size: int = Field(default=5, ge=1)
    connect_timeout: Duration = timedelta(seconds=5)

    @field_validator("url")
    @classmethod
    def _known_backend(cls, url: str) -> str:
        if not url.startswith(("postgresql", "sqlite")):
            raise ValueError(f"{url.split(':', 1)[0]!r} is not supported; use postgresql+psycopg:// or sqlite:///")
        return url


class PollSettings(_Section):
    """The correlation schedule: the first poll after ``initial_delay``, then one every ``interval``."""

    initial_delay: Duration = timedelta(seconds=10)
    interval: Duration = timedelta(seconds=6)
    page_size: int = Field(default=100, ge=1, le=10_000)
    # Batches (hints) correlated at the same time inside one replica; one hint is never run twice at once.
    concurrency: int = Field(default=1, ge=1, le=256)

    @field_validator("interval")
    @classmethod
    def _positive(cls, value: timedelta) -> timedelta:
        if value <= timedelta(0):
            raise ValueError("the poll interval must be greater than zero")
        return value


class CleanupSettings(_Section):
    """The cleanup schedule and how many expired rows one statement removes."""

    initial_delay: Duration = timedelta(minutes=1)
    interval: Duration = timedelta(minutes=1)
    chunk_size: int = Field(default=1000, ge=1, le=100_000)


class PolicyOverride(_Section):
    """Per-``message_name`` policy: every field left unset is inherited from the global policy."""

    time_to_live: Duration | None = None
    backoff_unit: Duration | None = None
    backoff_base: float | None = Field(default=None, ge=1.0)
    backoff_cap: Duration | None = None
    jitter: Jitter | None = None
    max_retries: MaxRetries = Field(default=None)
    handler_timeout: Duration | None = None
    timeout_outcome: TimeoutOutcome | None = None
    reschedule_delay: Duration | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_batch_shape(cls, data: Any) -> Any:
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

    mode: Mode = Mode.FAIL_FIRST
    # -1: every eligible message of a hint per poll; 1: only the head; N: up to N.
    batch_size: int = -1
    time_to_live: Duration | None = None
    backoff_unit: Duration = timedelta(minutes=1)
    backoff_base: float = Field(default=2.0, ge=1.0)
    backoff_cap: Duration = timedelta(minutes=180)
    jitter: Jitter = Jitter.NONE
    max_retries: MaxRetries = 100
    handler_timeout: Duration = timedelta(seconds=30)
    timeout_outcome: TimeoutOutcome = TimeoutOutcome.RETRY
    reschedule_delay: Duration = timedelta(minutes=1)

    @field_validator("batch_size")
    @classmethod
    def _batch_size(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("must be -1 (the whole batch) or a number >= 1")
        return value

    @field_validator("handler_timeout")
    @classmethod
    def _timeout_positive(cls, value: timedelta) -> timedelta:
        if value <= timedelta(0):
            raise ValueError("the handler timeout must be greater than zero")
        return value

    def merged(self, override: PolicyOverride | None) -> Policy:
        """This policy with every field the override sets replaced."""
        if override is None:
            return self
        changes = {name: getattr(override, name) for name in override.model_fields_set}
        return self.model_copy(update=changes)


class MetricsSettings(_Section):
    """The HTTP endpoint for /metrics, /healthz and /readyz."""

    host: str = "0.0.0.0"
    port: int = Field(default=9464, ge=0, le=65535)
    enabled: bool = True
    # How often one replica counts the table for the state gauges.
    gauges_interval: Duration = timedelta(seconds=15)


class LogSettings(_Section):
    """One event per line, as text or JSON."""

    format: Literal["text", "json"] = "text"
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value


class ReplicaSettings(_Section):
    """Who this process is: a pod name (a per-boot random suffix is added to make ``locked_by`` unique)."""

    name: str = Field(default_factory=socket.gethostname, min_length=1, max_length=200)


class LeaseSettings(_Section):
    """Slot leases on PostgreSQL: how long a term lasts and how it is kept (DESIGN.md §4).

    A crashed replica's slots are taken over within ``duration + renew_interval``.
    """

    duration: Duration = timedelta(seconds=30)
    # At most a third of the duration, so that two renewals can fail before a term ends.
    renew_interval: Duration = timedelta(seconds=10)
    # A slot stops being polled this long before its term could end.
    safety_margin: Duration = timedelta(seconds=5)
    # A slot handed back to balance the cluster is withheld this long before release (a page may be in flight).
    drain: Duration = timedelta(seconds=5)


class ShutdownSettings(_Section):
    """How long SIGTERM waits for the current message before abandoning it."""

    grace: Duration = timedelta(seconds=30)


class SchedulerSettings(_Section):
    """Schedules (DESIGN.md §7): rows of ``correlation_schedule`` whose Quartz cron publishes messages.

    ``enabled`` says whether this replica takes part; the switch of the whole cluster's scheduler is the row of
    ``correlation_scheduler`` (``correlation-worker schedules disable``).
    """

    enabled: bool = True
    # Schedules added, changed or deleted with SQL take effect within this interval.
    reload_interval: Duration = timedelta(seconds=10)
    # A fire time later than this is a misfire: the schedule's misfire policy decides (Quartz's default: 1 min).
    misfire_threshold: Duration = timedelta(minutes=1)
    # fire_all publishes at most this many missed fire times (the most recent ones).
    fire_all_limit: int = Field(default=100, ge=1, le=1000)

    @field_validator("reload_interval")
    @classmethod
    def _reload_positive(cls, value: timedelta) -> timedelta:
        if value <= timedelta(0):
            raise ValueError("the reload interval must be greater than zero")
        return value


def _default_routes() -> dict[str, str | dict[str, Any]]:
    return {"*": "log"}


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
    policy: Policy = Policy()
    policies: dict[str, PolicyOverride] = Field(default_factory=dict)
    correlators: dict[str, str | dict[str, Any]] = Field(default_factory=_default_routes)
    metrics: MetricsSettings = MetricsSettings()
    log: LogSettings = LogSettings()
    replica: ReplicaSettings = ReplicaSettings()
    lease: LeaseSettings = LeaseSettings()
    shutdown: ShutdownSettings = ShutdownSettings()
    scheduler: SchedulerSettings = SchedulerSettings()

    @field_validator("correlators")
    @classmethod
    def _routes_not_empty(cls, value: dict[str, Any]) -> dict[str, Any]:
        if not value:
            raise ValueError('at least one route is needed, e.g. {"*": "log"}')
        return value

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
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get(CONFIG_FILE_ENV)
        if config_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(config_file)))
        return tuple(sources)

    def policy_for(self, message_name: str) -> Policy:
        """The effective policy of a message name: the global one with its override applied."""
        return self.policy.merged(self.policies.get(message_name))

    def redacted(self) -> dict[str, Any]:
        """The effective configuration as JSON-ready data, with the database password hidden."""
        data = self.model_dump(mode="json")
        data["database"]["url"] = redact_url(self.database.url)
        return data


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***``."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # an unparsable URL is reported elsewhere; never echo it whole
        return "<unparsable database URL>"


class ConfigError(Exception):
    """A setting is invalid; the message is one line naming it."""


def describe_error(error: ValidationError) -> str:
    """One line per problem, each naming the environment variable to fix."""
    lines = []
    for problem in error.errors():
        location = [str(part) for part in problem["loc"]]
        if location and location[0] in ("policies", "correlators"):
            name = ENV_PREFIX + location[0].upper()
            detail = "[" + "].[".join(location[1:]) + "]" if len(location) > 1 else ""
            name += detail
        else:
            name = ENV_PREFIX + "__".join(part.upper() for part in location)
        message = str(problem["msg"]).removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            message = "is not a known setting"
        lines.append(f"invalid setting {name}: {message}")
    return "; ".join(lines)


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
            raise ConfigError(f"invalid setting {name}: the value is not valid JSON") from None
        raise ConfigError(f"invalid configuration: {error}") from None
