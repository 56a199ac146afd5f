"""Every setting `check-config` shows is documented in the table of docs/guides/configuration.md."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from worker.config import ENV_PREFIX, Settings

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "configuration.md"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("CORRELATION_"):
            monkeypatch.delenv(name)


def shown_settings(data: dict[str, Any]) -> list[str]:
    """The environment variable of every setting in check-config's output (sections one level deep)."""
    names = []
    for key, value in data.items():
        if isinstance(value, dict) and key not in ("policies", "correlators"):
            names += [f"{ENV_PREFIX}{key}__{field}".upper() for field in value]
        else:
            names.append(f"{ENV_PREFIX}{key}".upper())
    return names


def documented_settings() -> set[str]:
    """Settings named in the guide's table, with `CORRELATION_X__A` / `__B` shorthands expanded."""
    documented: set[str] = set()
    for row in GUIDE.read_text(encoding="utf-8").splitlines():
        if not row.startswith("| `CORRELATION_"):
            continue
        first_cell = row.split("|")[1]
        names = re.findall(r"`(CORRELATION_[A-Z_]+|__[A-Z_]+)`", first_cell)
        section = names[0].rsplit("__", 1)[0]
        documented.update(name if name.startswith(ENV_PREFIX) else section + name for name in names)
    return documented


def test_every_setting_check_config_shows_is_in_the_configuration_guides_table() -> None:
    missing = set(shown_settings(Settings().redacted())) - documented_settings()
    assert not missing, f"not documented in the table of docs/guides/configuration.md: {sorted(missing)}"
