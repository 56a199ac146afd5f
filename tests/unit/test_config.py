"""Settings: public names and defaults, ISO-8601 durations, one-line errors naming the setting."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from worker.config import ConfigError, Jitter, Mode, load_settings


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
        ("CORRELATION_POLICY__BATCH_SIZE", "0", "-1"),
        ("CORRELATION_POLICY__MODE", "some", "fail_first"),
        ("CORRELATION_DATABASE__URL", "mysql://x", "not supported"),
        ("CORRELATION_POLL__PAGE_SIZE", "0", "greater than or equal to 1"),
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


def test_the_password_is_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRELATION_DATABASE__URL", "postgresql+psycopg://app:s3cret@db:5432/app")
    shown = str(load_settings().redacted())
    assert "s3cret" not in shown and "***" in shown


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
