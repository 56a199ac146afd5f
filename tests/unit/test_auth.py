"""The console's tokens, sessions and CSRF tokens: who may read, who may act, and what is refused."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from worker.admin.auth import Auth, Caller
from worker.admin.overview import Throughput
from worker.config import AdminSettings, ConfigError, load_settings

WRITE = "write-token-0123456789"
READ = "read-token-0123456789"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock | None = None, **admin: object) -> Auth:
    settings = AdminSettings(token=SecretStr(WRITE), read_token=SecretStr(READ), **admin)  # type: ignore[arg-type]
    return Auth(settings, clock or Clock())


def test_bearer_tokens_stand_for_their_named_callers() -> None:
    auth = make(token_name="ops")
    assert auth.bearer(f"Bearer {WRITE}") == Caller("ops", "api", can_write=True)
    assert auth.bearer(f"bearer {READ}") == Caller("read-only", "api", can_write=False)
    for header in (None, "", "Bearer", f"Basic {WRITE}", "Bearer wrong", f"Bearer {WRITE}x", f"Bearer {WRITE[:-1]}"):
        assert auth.bearer(header) is None


def test_a_session_lasts_its_lifetime_and_a_forged_or_foreign_cookie_is_refused() -> None:
    clock = Clock()
    auth = make(clock)
    caller = auth.check_token(WRITE, "ui")
    assert caller is not None
    cookie = auth.new_session(caller)
    session = auth.session(cookie)
    assert session is not None and session.caller == Caller("admin", "ui", can_write=True)

    role, expires, nonce, mac = cookie.split(".")
    assert auth.session(f"r.{expires}.{nonce}.{mac}") is None  # a read session cannot be turned into a write one
    assert auth.session(f"{role}.{int(expires) + 999}.{nonce}.{mac}") is None
    assert auth.session("garbage") is None and auth.session(None) is None
    other = Auth(AdminSettings(token=SecretStr("another-token-0123456789")), clock)
    assert other.session(cookie) is None  # another token (or a changed one) ends every session

    clock.now += 8 * 3600 + 1
    assert auth.session(cookie) is None


def test_csrf_tokens_belong_to_their_session() -> None:
    auth = make()
    read_caller = auth.check_token(READ, "ui")
    assert read_caller is not None and not read_caller.can_write
    one = auth.session(auth.new_session(read_caller))
    two = auth.session(auth.new_session(read_caller))
    assert one is not None and two is not None
    assert auth.csrf_ok(one, auth.csrf_token(one))
    assert not auth.csrf_ok(one, auth.csrf_token(two))
    assert not auth.csrf_ok(one, None) and not auth.csrf_ok(one, "")
    assert Auth.login_nonce_ok("abc", "abc") and not Auth.login_nonce_ok("abc", "abd")
    assert not Auth.login_nonce_ok(None, "abc") and not Auth.login_nonce_ok("", "")


def test_the_console_is_off_without_a_token_and_tokens_are_hidden_in_check_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not AdminSettings().enabled
    monkeypatch.setenv("CORRELATION_ADMIN__TOKEN", WRITE)
    settings = load_settings()
    assert settings.admin.enabled
    shown = settings.redacted()["admin"]
    assert shown["token"] == "***" and shown["read_token"] is None
    assert WRITE not in str(settings.redacted())


@pytest.mark.parametrize(
    ("variables", "complaint"),
    [
        ({"CORRELATION_ADMIN__TOKEN": "short"}, "CORRELATION_ADMIN__TOKEN: a token must have at least 16"),
        ({"CORRELATION_ADMIN__TOKEN": WRITE, "CORRELATION_ADMIN__READ_TOKEN": WRITE},
         "CORRELATION_ADMIN__READ_TOKEN: is the same as CORRELATION_ADMIN__TOKEN"),
        ({"CORRELATION_ADMIN__SESSION_LIFETIME": "PT0S"}, "CORRELATION_ADMIN__SESSION_LIFETIME"),
        ({"CORRELATION_ADMIN__TOKEN_NAME": "x", "CORRELATION_ADMIN__READ_TOKEN_NAME": "x"},
         "CORRELATION_ADMIN__READ_TOKEN_NAME"),
    ],
)
def test_bad_console_settings_are_one_line_naming_them(
    monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], complaint: str
) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=complaint.replace("(", r"\(")) as raised:
        load_settings()
    assert "\n" not in str(raised.value) and "short" not in str(raised.value).split(":", 1)[1][:5]


def test_throughput_is_the_rate_over_the_window_once_two_samples_are_a_second_apart() -> None:
    clock = Clock()
    rates = Throughput(window=60, monotonic=clock)
    assert rates.observe(0.0, 100)["inserted_per_second"] is None
    clock.now += 10
    shown = rates.observe(50.0, 300)
    assert shown == {"correlated_per_second": 5.0, "inserted_per_second": 20.0, "over_seconds": 10.0}
    clock.now += 100
    assert rates.observe(50.0, 300)["inserted_per_second"] == 0.0
