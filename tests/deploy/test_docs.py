"""The documentation site: its generated reference pages say what the code does, and it builds without a warning.

The pages under docs/reference/ are written by docs/gen_reference.py from the code; a change to a setting, a
metric, a command or a route that is not followed by running the script fails here with the diff. The site is
built by MkDocs itself with --strict, so that a link to a page or an anchor that does not exist fails too.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from worker import config

REPO_ROOT = Path(__file__).resolve().parents[2]
GENERATOR = REPO_ROOT / "docs" / "gen_reference.py"
SETTINGS_PAGE = REPO_ROOT / "docs" / "reference" / "settings.md"
HEADING = re.compile(r"^### `(CORRELATION_[^`]+)`$", re.MULTILINE)


def generate(*arguments: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GENERATOR), *map(str, arguments)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False,
    )


def test_the_committed_reference_pages_are_what_the_code_generates() -> None:
    result = generate("--check")
    assert result.returncode == 0, (
        f"{result.stdout}{result.stderr}\nthe reference pages differ from the code: run "
        ".venv/bin/python docs/gen_reference.py and commit the pages"
    )


def test_a_page_that_differs_from_the_code_fails_the_check_with_a_diff(tmp_path: Path) -> None:
    assert generate("--dir", tmp_path).returncode == 0
    page = tmp_path / "metrics.md"
    page.write_text(page.read_text(encoding="utf-8").replace("| counter |", "| gauge |", 1), encoding="utf-8")

    result = generate("--check", "--dir", tmp_path)

    assert result.returncode == 1
    assert "-| `correlation_" in result.stdout and "| gauge |" in result.stdout
    assert "+| `correlation_" in result.stdout and "| counter |" in result.stdout
    assert "1 reference page(s) differ from the code" in result.stdout


def test_the_site_builds_with_no_warning(tmp_path: Path) -> None:
    pytest.importorskip("material", reason="mkdocs-material is not installed (pip install -e '.[test]')")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO_ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for page in ("index.html", "getting-started/index.html", "reference/settings/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    assert not (tmp_path / "site" / "gen_reference.py").exists()


def walked_settings() -> list[str]:
    """Every setting of the model, walked here independently of the generator."""
    names = []
    for section, field in config.Settings.model_fields.items():
        annotation: Any = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, config.BaseModel):
            names += [f"CORRELATION_{section}__{name}".upper() for name in annotation.model_fields]
        elif section == "policies":
            names += [f"CORRELATION_POLICIES[<message_name>].{name}" for name in config.PolicyOverride.model_fields]
        else:
            names.append(f"CORRELATION_{section}".upper())
    return names


def documented() -> list[tuple[str, str | None]]:
    """(the variable, its documented default as written in the environment, or None) of every setting on the page."""
    text = SETTINGS_PAGE.read_text(encoding="utf-8")
    found = []
    for match in HEADING.finditer(text):
        block = text[match.end():].split("\n### ", 1)[0]
        default = re.search(r"^- Default: `(.*)`$", block, re.MULTILINE)
        found.append((match.group(1), default.group(1) if default else None))
    return found


def test_the_settings_page_lists_every_setting_once() -> None:
    variables = [variable for variable, _ in documented()]
    assert len(variables) == len(set(variables))
    assert variables == walked_settings()


def test_every_documented_setting_is_accepted_with_its_documented_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("CORRELATION_")]:
        monkeypatch.delenv(name)
    known = config.known_variables()
    checked = 0
    for variable, default in documented():
        if variable.startswith("CORRELATION_POLICIES["):
            field = variable.rsplit(".", 1)[1]
            assert field in config.PolicyOverride.model_fields, variable
            continue
        assert variable in known, f"{variable} is not a setting the worker reads"
        config.check_unknown_variables({variable: "x"})
        if default is None:
            continue
        monkeypatch.setenv(variable, default)
        settings = config.Settings()
        monkeypatch.delenv(variable)
        parts = variable.removeprefix("CORRELATION_").lower().split("__")
        value: Any = settings
        expected: Any = config.Settings()
        for part in parts:
            value, expected = getattr(value, part), getattr(expected, part)
        assert value == expected, f"{variable}={default} reads as {value!r}, the default is {expected!r}"
        checked += 1
    assert checked > 50


def test_the_reference_pages_hold_nothing_of_this_machine() -> None:
    text = "".join(
        (REPO_ROOT / "docs" / "reference" / name).read_text(encoding="utf-8")
        for name in ("settings.md", "metrics.md", "cli.md", "api.md")
    )
    assert f"`{socket.gethostname()}`" not in text  # the replica name's default reads "the host name"
    assert str(REPO_ROOT) not in text
    assert not re.search(r"0x[0-9a-f]{6,}", text)  # no object's address
