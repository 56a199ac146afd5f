"""Every command and API call the README shows works as shown.

The API calls (``curl … /api/v1/…``) are sent to the console's application over a database holding what they
name (message 4711, message_id shop-4711-paid, hint order-4711, pause 3); the ``correlation-worker`` commands
are parsed by the command line itself, so an option or command the README names and the CLI lacks fails here.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import click
import pytest
from sqlalchemy import text

from tests.integration.test_api import auth, console_app
from worker import cli
from worker.db.store import NewMessage, Store

README = Path(__file__).resolve().parents[2] / "README.md"
DOCS = [README, *sorted((README.parent / "docs").glob("*.md"))]


def shell_lines(path: Path) -> list[str]:
    """The shell blocks' lines with continuations joined, comments dropped."""
    lines: list[str] = []
    for block in re.findall(r"```(?:sh|bash|console)\n(.*?)```", path.read_text(encoding="utf-8"), re.DOTALL):
        joined = block.replace("\\\n", " ")
        lines += [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]
    return lines


def api_calls() -> list[str]:
    return [line for line in shell_lines(README) if line.startswith("curl") and ("/api/v1" in line or "$CW" in line)]


def command_lines() -> list[str]:
    """``correlation-worker …`` from the shell blocks and the inline code of the README and docs/."""
    found: list[str] = []
    for path in DOCS:
        for line in shell_lines(path):
            found += re.findall(r"(?:^|\.venv/bin/)(correlation-worker [^&|;]*)", line)
        found += re.findall(r"`(correlation-worker [^`]*)`", path.read_text(encoding="utf-8"))
    return sorted({" ".join(line.split()) for line in found if "[" not in line})


def _placeholder(token: str) -> str:
    """What a reader puts in for ``<name>``, ``N`` or ``ID``."""
    if re.fullmatch(r"<[^>]+>", token):
        return "x"
    return "1" if re.fullmatch(r"[A-Z]{1,4}", token) else token


def test_every_extra_and_script_the_readme_installs_or_runs_is_there() -> None:
    project = (README.parent / "pyproject.toml").read_text(encoding="utf-8")
    extras = set(re.findall(r"^(\w+) = \[", project.split("[project.optional-dependencies]", 1)[1], re.MULTILINE))
    lines = shell_lines(README)
    installed = [extra for line in lines for extra in re.findall(r"pip install '\.\[(\w+)\]'", line)]
    assert installed and set(installed) <= extras, (installed, extras)
    assert not [line for line in lines if re.search(r"pip install '?correlation-worker", line)], "not on PyPI"
    scripts = [re.search(r"python ([\w/]+\.py)(.*)", line) for line in lines]
    for found in filter(None, scripts):
        path = README.parent / found.group(1)
        assert path.is_file(), found.group(1)
        source = path.read_text(encoding="utf-8")
        for flag in re.findall(r"--[\w-]+", found.group(2)):
            assert f'"{flag}"' in source, f"{found.group(1)} takes no {flag}"


@pytest.mark.parametrize("line", command_lines())
def test_every_command_the_documentation_shows_parses(line: str) -> None:
    tokens = [_placeholder(token) for token in shlex.split(line)[1:]]
    command: click.Command = cli.main
    while isinstance(command, click.Group) and tokens and not tokens[0].startswith("-"):
        name = tokens.pop(0)
        found = command.commands.get(name)
        assert found is not None, f"{line!r}: {command.name} has no command {name!r}"
        command = found
    if isinstance(command, click.Group) and not tokens:
        return  # a group named in the text, e.g. `correlation-worker schedules`
    try:
        command.make_context(command.name or "correlation-worker", tokens)  # a usage error fails the test
    except click.exceptions.Exit as done:  # --version, --help
        assert done.exit_code == 0


def _request(line: str) -> tuple[str, str, object | None]:
    tokens = shlex.split(line.replace("$CW", "localhost:9464/api/v1"))
    method, body, path = "GET", None, ""
    for index, token in enumerate(tokens):
        if token == "-X":
            method = tokens[index + 1]
        elif token == "-d":
            body = json.loads(tokens[index + 1])
        elif "localhost:9464" in token:
            path = token.split("localhost:9464", 1)[1]
    return method, path, body


def test_the_readme_shows_its_api_calls() -> None:
    assert len(api_calls()) >= 20 and any("after=0" in call for call in api_calls())


@pytest.mark.parametrize("line", api_calls())
def test_every_api_call_the_readme_shows_answers(line: str, store: Store) -> None:
    with store.engine.begin() as connection:  # the ids the README names
        connection.execute(text("SELECT setval('correlation_message_id_seq', 4710)"))
    store.messages_insert(NewMessage(name="invoice.sent", hint="order-4711", payload={}))  # id 4711
    store.messages_insert(NewMessage(name="order.paid", hint="order-4711", payload={}, message_id="shop-4711-paid"))
    with console_app(store) as client:
        for _ in range(3):  # pause 3
            pause = client.post("/api/v1/pauses", headers=auth(), json={"hint": f"h-{_}", "reason": "r"})
            assert pause.status_code == 201, pause.text
        client.delete("/api/v1/pauses/1", headers=auth())
        if "/schedules/nightly" in line:
            body = {"name": "nightly", "cron": "0 0 3 * * ?", "message_name": "report.due"}
            assert client.post("/api/v1/schedules", headers=auth(), json=body).status_code == 201
        method, path, body = _request(line)
        response = client.request(method, path, headers={**auth(), "Content-Type": "application/json"},
                                  content=None if body is None else json.dumps(body))
    assert response.status_code in (200, 201), f"{line}: {response.status_code} {response.text}"
