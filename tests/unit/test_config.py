"""Settings: public names and defaults, ISO-8601 durations, one-line errors naming the setting."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from worker.config import (
    DURATION_BOUNDS,
    LONGEST_DURATION,
    POLICY_BOUNDS,
    ConfigError,
    Jitter,
    Mode,
    format_duration,
    load_settings,
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("CORRELATION_"):
            monkeypatch.delenv(name)


def test_defaults_are_the_documented_ones() -> None:
    s = load_settings()
    assert s.database.url == "sqlite:///correlation.db"
    assert (s.poll.initial_delay, s.poll.interval, s.poll.page_size) == (
        timedelta(seconds=10), timedelta(seconds=6), 100)
    assert (s.cleanup.initial_delay, s.cleanup.interval) == (timedelta(minutes=1), timedelta(minutes=1))
    p = s.policy
    assert (p.mode, p.batch_size, p.time_to_live) == (Mode.FAIL_FIRST, -1, None)
    assert (p.backoff_unit, p.backoff_base, p.backoff_cap, p.jitter) == (
        timedelta(minutes=1), 2.0, timedelta(minutes=180), Jitter.NONE)
    assert (p.max_retries, p.handler_timeout) == (100, timedelta(seconds=30))
    assert s.policies == {} and s.correlators == {"*": "log"} and s.metrics.port == 9464


def test_environment_sets_nested_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRELATION_POLL__INTERVAL", "PT0.5S")
    monkeypatch.setenv("CORRELATION_POLICY__MAX_RETRIES", "unlimited")
    monkeypatch.setenv("CORRELATION_POLICY__MODE", "all")
    s = load_settings()
    assert s.poll.interval == timedelta(milliseconds=500)
    assert s.policy.max_retries is None and s.policy.mode is Mode.ALL


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("CORRELATION_POLL__INTERVAL", "P1M", "calendar units"),
        ("CORRELATION_POLL__INTERVAL", "6 seconds", "not an ISO-8601 duration"),
        ("CORRELATION_POLICY__BACKOFF_CAP", "-PT1S", "negative"),
        ("CORRELATION_POLICY__MAX_RETRIES", "-1", "unlimited"),
        # 0 and 1 would both mean "dead at the first recorded failure": only 1 says so.
        ("CORRELATION_POLICY__MAX_RETRIES", "0", ">= 1 (1: dead at the first recorded failure"),
        ("CORRELATION_POLICIES", '{"invoice.sent": {"max_retries": 0}}', ">= 1"),
        ("CORRELATION_POLICY__BATCH_SIZE", "0", "-1"),
        ("CORRELATION_POLICY__MODE", "some", "fail_first"),
        ("CORRELATION_DATABASE__URL", "mysql://x", "not supported"),
        ("CORRELATION_POLL__PAGE_SIZE", "0", "greater than or equal to 1"),
        # Zero intervals of a loop would spin it.
        ("CORRELATION_POLL__INTERVAL", "PT0S", "below the least it may be, PT0.1S"),
        ("CORRELATION_CLEANUP__INTERVAL", "PT0S", "busy loop"),
        ("CORRELATION_METRICS__GAUGES_INTERVAL", "PT0S", "busy loop"),
        ("CORRELATION_LEASE__RENEW_INTERVAL", "PT0S", "below the least it may be, PT0.1S"),
        ("CORRELATION_LEASE__DURATION", "PT0S", "below the least it may be, PT1S"),
        ("CORRELATION_LEASE__SAFETY_MARGIN", "PT36S", "PT35S"),
        ("CORRELATION_LEASE__DRAIN", "PT40S", "shorter than the lease duration PT40S"),
        ("CORRELATION_DATABASE__CONNECT_TIMEOUT", "PT0S", "below the least it may be, PT1S"),
        # A backoff that retries at every poll, or whose cap silently shortens every delay.
        ("CORRELATION_POLICY__BACKOFF_CAP", "PT0S", "every poll"),
        ("CORRELATION_POLICY__BACKOFF_CAP", "PT30S", "below the backoff unit PT1M"),
        # Database URLs: a port that is not one, an in-memory database, an unknown backend.
        ("CORRELATION_DATABASE__URL", "postgresql://app@db:abc/app", "the port 'abc'"),
        ("CORRELATION_DATABASE__URL", "postgres://app@db:70000/app", "the port '70000'"),
        ("CORRELATION_DATABASE__URL", "postgresql://app@[::1]:0/app", "the port '0'"),
        ("CORRELATION_DATABASE__URL", "sqlite://", "in-memory"),
        ("CORRELATION_DATABASE__URL", "sqlite:///:memory:", "in-memory"),
        ("CORRELATION_DATABASE__URL", "sqlite:///file:x?mode=memory&uri=true", "in-memory"),
        ("CORRELATION_DATABASE__URL", "correlation.db", "is not a URL"),
        # Routes and policies of the wrong JSON shape: one sentence, not one per arm of a union.
        ("CORRELATION_CORRELATORS", '{"*": 5}', "5 is not a route"),
        ("CORRELATION_CORRELATORS", '{"*": null}', "null is not a route"),
        ("CORRELATION_CORRELATORS", "[1]", "[1] is not a JSON object"),
        ("CORRELATION_POLICIES", '{"x": 5}', "5 is not a policy"),
        ("CORRELATION_POLICIES", '"x"', "is not a JSON object"),
        # Values users tried: loops that would spin, waits that never end, numbers no clock can take.
        ("CORRELATION_POLL__INTERVAL", "PT0.0001S", "PT0.1S"),
        ("CORRELATION_POLICY__RESCHEDULE_DELAY", "PT0S", "busy loop"),
        ("CORRELATION_POLL__INITIAL_DELAY", "P36500D", "P1D"),
        ("CORRELATION_POLL__INTERVAL", "P99999999D", "100 years"),
        ("CORRELATION_POLL__INTERVAL", "1e300", "not an ISO-8601 duration"),
        ("CORRELATION_POLICY__BACKOFF_BASE", "inf", "finite"),
        ("CORRELATION_POLICY__BACKOFF_BASE", "nan", "finite"),
        ("CORRELATION_POLICY__BACKOFF_BASE", "1000", "100"),
        ("CORRELATION_DATABASE__CONNECT_TIMEOUT", "PT0.5S", "PT1S"),
        ("CORRELATION_DATABASE__CONNECT_TIMEOUT", "PT2.5S", "whole seconds"),
        # Near misses: keys given twice, names that do not read as they match, blank tokens.
        ("CORRELATION_CORRELATORS", '{"*": "log", "*": "log"}', "the key '*' is given twice"),
        ("CORRELATION_POLICIES", '{"a": {"max_retries": 1}, "a": {"max_retries": 2}}', "the key 'a' is given twice"),
        ("CORRELATION_CORRELATORS", '{"order.paid ": "log"}', "'order.paid ' starts or ends with whitespace"),
        ("CORRELATION_CORRELATORS", '{"   ": "log"}', "is only whitespace"),
        ("CORRELATION_CORRELATORS", '{"order\\u202epaid": "log"}', "invisible or control character U+202E"),
        # The class of near-miss text (worker/policy/text.py): each refused naming the key, as the schema would.
        ("CORRELATION_CORRELATORS", '{"order.paid\\u00a0": "log"}', "'order.paid\\u00a0' starts or ends with"),
        ("CORRELATION_CORRELATORS", '{"\\u3000order": "log"}', "starts or ends with whitespace (U+3000)"),
        ("CORRELATION_CORRELATORS", '{"cafe\\u0301": "log"}', "'cafe\\u0301' is not in Unicode normalisation form NFC"),
        ("CORRELATION_CORRELATORS", '{"order\\udb40\\udc41": "log"}', "U+E0041 (TAG LATIN CAPITAL LETTER A)"),
        ("CORRELATION_CORRELATORS", '{"order\\u200d": "log"}', "starts or ends with a joiner"),
        ("CORRELATION_CORRELATORS", '{"order\\ue000": "log"}', "invisible or control character U+E000"),
        ("CORRELATION_CORRELATORS", '{"order\\u0378": "log"}', "invisible or control character U+0378"),
        ("CORRELATION_CORRELATORS", '{"order\\u2028paid": "log"}', "invisible or control character U+2028"),
        ("CORRELATION_ADMIN__TOKEN", " " * 16, "only blanks"),
        ("CORRELATION_ADMIN__TOKEN_NAME", "ad\nmin", "control character U+000A"),
        ("CORRELATION_ADMIN__READ_TOKEN_NAME", " viewer", "starts or ends with whitespace"),
        (
            "CORRELATION_CORRELATORS", '{"*": {"type": "http", "url": "http://engine", "timeout": "PT1M"}}',
            "longer than the handler timeout PT30S",
        ),
        (
            "CORRELATION_CORRELATORS", '{"*": {"type": "camunda8", "timeout": "PT1M"}}',
            "longer than the handler timeout PT30S",
        ),
    ],
)
def test_a_bad_value_is_one_line_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, expected: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        load_settings()
    message = str(info.value)
    assert "\n" not in message
    assert name in message and expected in message


@pytest.mark.parametrize(
    "name",
    [
        "order paid", "café", "заказ.оплачен", "注文", "\U0001f468\u200d\U0001f469\u200d\U0001f467",  # ZWJ
        "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645", "*",  # Persian with ZWNJ
    ],
)
def test_route_names_in_any_script_with_joiners_inside_are_taken(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv("CORRELATION_CORRELATORS", json.dumps({name: "log"}))
    assert list(load_settings().correlators) == [name]


def test_a_union_typed_setting_gives_one_sentence_without_pydantic_internals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRELATION_CORRELATORS", '{"*": 5}')
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert str(info.value).count("invalid setting") == 1
    assert "dict[" not in str(info.value) and "valid string" not in str(info.value)


def test_a_bad_port_is_refused_without_echoing_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRELATION_DATABASE__URL", "postgresql://app:s3cret@db:54x2/app")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "CORRELATION_DATABASE__URL" in str(info.value) and "s3cret" not in str(info.value)


@pytest.mark.parametrize(
    "url", ["postgres://app@db/app", "postgresql://app@db:5432/app", "postgresql+psycopg2://app@db/app"]
)
def test_postgres_urls_of_every_spelling_are_accepted(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("CORRELATION_DATABASE__URL", url)
    assert load_settings().database.url == url


def test_a_per_name_override_is_checked_merged_with_the_global_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRELATION_POLICIES", '{"invoice.sent": {"backoff_unit": "PT5H"}}')
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert str(info.value) == (
        "invalid setting CORRELATION_POLICIES[invoice.sent].backoff_cap: PT3H is below the backoff unit PT5H, so "
        "every delay would be the cap; use a cap at least as long as the unit "
        "(inherited from CORRELATION_POLICY__BACKOFF_CAP)"
    )


@pytest.mark.parametrize("override", ['{"backoff_cap": "PT0S"}', '{"handler_timeout": "PT0S"}'])
def test_a_per_name_override_cannot_zero_what_the_global_policy_refuses(
    monkeypatch: pytest.MonkeyPatch, override: str
) -> None:
    monkeypatch.setenv("CORRELATION_POLICIES", f'{{"x": {override}}}')
    with pytest.raises(ConfigError, match=r"CORRELATION_POLICIES\[x\]\.\w+: PT0S"):
        load_settings()


def test_unknown_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRELATION_POLL__INTERVALL", "PT1S")
    with pytest.raises(ConfigError, match="CORRELATION_POLL__INTERVALL: is not a known setting"):
        load_settings()


def test_overrides_inherit_every_field_they_do_not_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRELATION_POLICY__BACKOFF_UNIT", "PT5S")
    monkeypatch.setenv("CORRELATION_POLICIES", '{"invoice.sent": {"max_retries": 3, "time_to_live": "PT1H"}}')
    s = load_settings()
    overridden = s.policy_for("invoice.sent")
    assert overridden.max_retries == 3 and overridden.time_to_live == timedelta(hours=1)
    assert overridden.backoff_unit == timedelta(seconds=5)
    assert s.policy_for("other").max_retries == 100


@pytest.mark.parametrize("field", ["mode", "batch_size"])
def test_overriding_batch_shape_per_name_is_refused(monkeypatch: pytest.MonkeyPatch, field: str) -> None:
    monkeypatch.setenv("CORRELATION_POLICIES", f'{{"x": {{"{field}": 1}}}}')
    with pytest.raises(ConfigError, match=f"CORRELATION_POLICIES.*{field}.*global"):
        load_settings()


def test_malformed_json_setting_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRELATION_CORRELATORS", "{not json")
    with pytest.raises(ConfigError, match="CORRELATION_CORRELATORS"):
        load_settings()


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://app:s3cret@db:5432/app",
        "postgres://app@db:5432/app?password=s3cret",
        "postgresql://app@db/app?sslmode=require&PASSWORD=s3cret",
    ],
)
def test_the_password_is_never_shown(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("CORRELATION_DATABASE__URL", url)
    shown = str(load_settings().redacted())
    assert "s3cret" not in shown and "***" in shown


def test_credentials_of_http_routes_are_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    route = {
        "type": "http",
        "url": "https://bot:s3cret1@engine.example/api?token=s3cret2&tenant=acme",
        "headers": {"Authorization": "Bearer s3cret3", "X-Api-Key": "s3cret4", "X-Tenant": "acme"},
    }
    monkeypatch.setenv("CORRELATION_CORRELATORS", json.dumps({"*": route}))
    shown = load_settings().redacted()["correlators"]["*"]
    assert "s3cret" not in shown
    assert "bot:***@engine.example" in shown and "token=***&tenant=acme" in shown
    assert '"Authorization": "***"' in shown and '"X-Api-Key": "***"' in shown and '"X-Tenant": "acme"' in shown


def test_a_toml_file_is_read_and_the_environment_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text('[poll]\ninterval = "PT2S"\npage_size = 7\n')
    monkeypatch.setenv("CORRELATION_CONFIG_FILE", str(config))
    monkeypatch.setenv("CORRELATION_POLL__PAGE_SIZE", "9")
    s = load_settings()
    assert s.poll.interval == timedelta(seconds=2) and s.poll.page_size == 9


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [
        ("CORRELATION_GAUGES_INTERVAL", "CORRELATION_METRICS__GAUGES_INTERVAL"),
        ("CORRELATION_DATABASE_URL", "CORRELATION_DATABASE__URL"),
        ("CORRELATION_POLICY__MAXRETRIES", "CORRELATION_POLICY__MAX_RETRIES"),
    ],
)
def test_a_misspelt_setting_is_refused_with_a_suggestion(
    monkeypatch: pytest.MonkeyPatch, name: str, suggestion: str
) -> None:
    monkeypatch.setenv(name, "1")
    with pytest.raises(ConfigError, match=f"invalid setting {name}: is not a known setting; did you mean {suggestion}"):
        load_settings()


def test_unrelated_variables_with_the_prefix_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRELATION_WORKER_SERVICE_HOST", "10.0.0.1")  # a Kubernetes service link
    monkeypatch.setenv("CORRELATION_TEST_DATABASE_URL", "postgresql://x")  # the test suite's own
    assert load_settings().poll.page_size == 100


async def _async_handler(message: object) -> None:
    return None


def test_an_async_handler_is_refused_when_its_route_is_built() -> None:
    from worker.correlators import Router

    with pytest.raises(ConfigError, match=r"CORRELATION_CORRELATORS\[\*\].*async function"):
        Router.from_settings({"*": "tests.unit.test_config:_async_handler"})


def _env_name(path: str) -> str:
    section, field_name = path.split(".")
    return f"CORRELATION_{section.upper()}__{field_name.upper()}"


def _outside(bounds: tuple[timedelta, timedelta, str]) -> list[tuple[str, str]]:
    """A value just below the least (when there is room below it) and one just above the most."""
    low, high, _ = bounds
    above = "100 years" if high == LONGEST_DURATION else f"the most it may be, {format_duration(high)}"
    values = [(format_duration(high + timedelta(seconds=1)), above)]
    if low > timedelta(0):
        values.append((format_duration(low - low / 10), f"the least it may be, {format_duration(low)}"))
    return values


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        (_env_name(path), value, expected)
        for path, bounds in DURATION_BOUNDS.items() for value, expected in _outside(bounds)
    ] + [
        (f"CORRELATION_POLICY__{field.upper()}", value, expected)
        for field, bounds in POLICY_BOUNDS.items() for value, expected in _outside(bounds)
    ],
)
def test_every_duration_outside_its_range_is_refused_naming_the_bound(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, expected: str
) -> None:
    monkeypatch.setenv(name, value)
    if name == "CORRELATION_LEASE__DURATION":  # the other lease terms must fit into a long one
        monkeypatch.setenv("CORRELATION_POLICY__HANDLER_TIMEOUT", "PT1S")
    with pytest.raises(ConfigError) as info:
        load_settings()
    message = str(info.value)
    assert "\n" not in message and name in message and expected in message, message


def test_a_per_name_override_outside_its_range_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRELATION_POLICIES", '{"order.paid": {"reschedule_delay": "PT0.5S"}}')
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "CORRELATION_POLICIES[order.paid].reschedule_delay: PT0.5S is below the least it may be, PT1S" in str(
        info.value
    )


def test_the_configuration_guide_gives_every_durations_range() -> None:
    guide = Path(__file__).resolve().parents[2] / "docs" / "guides" / "configuration.md"
    readme = guide.read_text(encoding="utf-8")
    rows = {
        _env_name(path): bounds for path, bounds in DURATION_BOUNDS.items()
    } | {f"CORRELATION_POLICY__{field.upper()}": bounds for field, bounds in POLICY_BOUNDS.items()}
    for name, (low, high, _) in rows.items():
        row = f"| `{name}` | `{format_duration(low)}` | `{format_duration(high)}` |"
        assert row in readme, f"the table of ranges in docs/guides/configuration.md lacks {row}"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            {"type": "http", "url": "http://engine", "tiemout": "PT1S"},
            "'tiemout' is not a key of a http route (did you mean 'timeout'?)",
        ),
        ({"type": "python", "handler": "json:dumps", "url": "http://x"}, "'url' is not a key of a python route"),
        ({"type": "http", "url": "http://"}, "names no host"),
        ({"type": "http", "url": "https://:8080/engine"}, "names no host"),
        ({"type": "http", "url": "http://engine", "headers": {"X-Tenant": "a\r\nX-Admin: 1"}}, "line break or NUL"),
        ({"type": "http", "url": "http://engine", "headers": {"X-A\n": "b"}}, "line break or NUL"),
        ("time:time", "cannot be called with one argument"),
        ("os:getpid", "cannot be called with one argument"),
        ("tests.unit.test_config:_two_arguments", "cannot be called with one argument"),
    ],
)
def test_a_route_that_cannot_work_is_refused_when_it_is_built(spec: object, expected: str) -> None:
    from worker.correlators import Router

    with pytest.raises(ConfigError) as info:
        Router.from_settings({"*": spec})  # type: ignore[dict-item]
    assert "CORRELATION_CORRELATORS[*]" in str(info.value) and expected in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("spec", "keys"),
    [
        ({"type": "python"}, ["'handler'", "'target'"]),
        ({"type": "python", "handler": ""}, ["'handler'", "'target'"]),
        ({"type": "python", "transactional": True}, ["'handler'", "'target'"]),
        ({"type": "http"}, ["'url'"]),
        ({"type": "http", "preset": "camunda7"}, ["'url'"]),
        ({"handler": "json:dumps"}, ["'type'", "python"]),
        ({}, ["'type'", "log", "http", "camunda8"]),
        ({"typ": "http", "url": "http://engine"}, ["'typ': did you mean 'type'?"]),
    ],
)
def test_a_route_missing_its_target_names_the_keys_it_needs(spec: dict[str, object], keys: list[str]) -> None:
    from worker.correlators import Router

    with pytest.raises(ConfigError) as info:
        Router.from_settings({"order.paid": spec})
    said = str(info.value)
    assert said.startswith("invalid setting CORRELATION_CORRELATORS[order.paid]: ") and "\n" not in said
    assert all(key in said for key in keys), said


@pytest.mark.parametrize(
    ("toml", "named", "suggestion"),
    [
        ('[polll]\ninterval = "PT1S"\n', "CORRELATION_POLLL", "'poll'"),
        ('[poll]\nintervall = "PT1S"\n', "CORRELATION_POLL__INTERVALL", "'interval'"),
        ('[databse]\nurl = "sqlite:///x"\n', "CORRELATION_DATABSE", "'database'"),
        ('[admin]\ntokken = "x"\n', "CORRELATION_ADMIN__TOKKEN", "'token'"),
        ('[correlator]\n"*" = "log"\n', "CORRELATION_CORRELATOR", "'correlators'"),
        ('[policies."invoice.sent"]\nmax_retrys = 3\n', "CORRELATION_POLICIES[invoice.sent].max_retrys",
         "'max_retries'"),
        ('[policy]\nbackof_cap = "PT1H"\n', "CORRELATION_POLICY__BACKOF_CAP", "'backoff_cap'"),
    ],
)
def test_a_misspelt_section_or_key_of_the_settings_file_gets_a_suggestion(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, toml: str, named: str, suggestion: str
) -> None:
    config = tmp_path / "worker.toml"
    config.write_text(toml, encoding="utf-8")
    monkeypatch.setenv("CORRELATION_CONFIG_FILE", str(config))
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert str(info.value) == f"invalid setting {named}: is not a known setting; did you mean {suggestion}?"


def test_a_key_of_the_settings_file_near_no_known_one_lists_the_known_keys(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = tmp_path / "worker.toml"
    config.write_text('[shutdown]\nzzz = 1\n', encoding="utf-8")
    monkeypatch.setenv("CORRELATION_CONFIG_FILE", str(config))
    with pytest.raises(ConfigError, match=r"CORRELATION_SHUTDOWN__ZZZ: is not a known setting; the known keys there: "):
        load_settings()


def _two_arguments(message: object, other: object) -> None:
    """Not a correlator: it needs two arguments."""


def test_handlers_that_take_a_message_are_accepted() -> None:
    from worker.correlators import Router

    Router.from_settings({"a": "json:dumps", "b": "builtins:print", "c": "tests.unit.test_config:_one_or_more"})


def _one_or_more(message: object, *rest: object, flag: bool = False) -> None:
    """A correlator with optional extras."""


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_a_config_file_that_is_not_a_file_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "absent.toml" if kind == "missing" else tmp_path
    monkeypatch.setenv("CORRELATION_CONFIG_FILE", str(path))
    with pytest.raises(ConfigError) as info:
        load_settings()
    said = "does not exist" if kind == "missing" else "is a directory"
    assert "CORRELATION_CONFIG_FILE" in str(info.value) and said in str(info.value)
