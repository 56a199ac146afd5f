"""Credentials out of every URL, route and text the worker prints, in every form they come in."""

from __future__ import annotations

import pytest

from worker.redact import redact_headers, redact_route, redact_text, redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://app:s3cret@db:5432/app", "postgresql://app:***@db:5432/app"),
        ("postgresql+psycopg://app:s3cret@db/app?sslmode=require", "postgresql+psycopg://app:***@db/app?sslmode=require"),
        ("postgres://app@db/app?password=s3cret&sslmode=require", "postgres://app@db/app?password=***&sslmode=require"),
        ("postgresql://app:p%40ss@db/app", "postgresql://app:***@db/app"),
        ("postgresql://app:pa:ss@db/app", "postgresql://app:***@db/app"),
        ("postgresql://app@db/app", "postgresql://app@db/app"),  # a user name alone is no secret
        ("sqlite:///var/lib/correlation.db", "sqlite:///var/lib/correlation.db"),
        ("https://bot:s3cret@engine/api", "https://bot:***@engine/api"),
        ("https://ghp_s3cret@engine/api", "https://***@engine/api"),  # a lone userinfo of http is a token
        ("https://engine/api?token=s3cret&tenant=acme", "https://engine/api?token=***&tenant=acme"),
        ("https://engine/api?api_key=s3cret", "https://engine/api?api_key=***"),
        ("https://engine/api?X-Amz-Signature=s3cret&sig=s3cret", "https://engine/api?X-Amz-Signature=***&sig=***"),
        ("https://engine/api?client_secret=s3cret#part", "https://engine/api?client_secret=***#part"),
        ("https://engine/api?access_token", "https://engine/api?access_token"),  # no value, nothing to hide
    ],
)
def test_every_credential_of_a_url_is_masked(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_an_unparsable_url_still_loses_its_password() -> None:
    shown = redact_url("postgresql://app:s3cret@[::1/app?password=s3cret")
    assert "s3cret" not in shown


def test_urls_and_password_pairs_in_free_text_are_masked() -> None:
    text = (
        "POST https://bot:s3cret@engine/api?token=s3cret failed; "
        "connection 'host=db user=app password=s3cret dbname=app' refused"
    )
    shown = redact_text(text)
    assert "s3cret" not in shown
    assert "https://bot:***@engine/api?token=***" in shown and "password=***" in shown


def test_credential_headers_keep_their_names_and_lose_their_values() -> None:
    headers = {
        "Authorization": "Bearer s3cret",
        "Proxy-Authorization": "Basic s3cret",
        "X-Api-Key": "s3cret",
        "X-Auth-Token": "s3cret",
        "Cookie": "session=s3cret",
        "X-Tenant": "acme",
    }
    shown = redact_headers(headers)
    assert set(shown) == set(headers)
    assert shown["X-Tenant"] == "acme"
    assert all(value == "***" for name, value in shown.items() if name != "X-Tenant")


def test_a_route_is_one_line_with_its_credentials_masked() -> None:
    route = {
        "type": "http",
        "url": "https://bot:s3cret@engine/api?token=s3cret",
        "headers": {"Authorization": "Bearer s3cret"},
        "timeout": "PT5S",
    }
    shown = redact_route(route)
    assert shown == (
        'type=http, url=https://bot:***@engine/api?token=***, headers={"Authorization": "***"}, timeout=PT5S'
    )
    assert redact_route("shop.handlers:on_paid") == "shop.handlers:on_paid"
