"""Every command and API call the README and the documentation pages (docs/) show works as shown.

The API calls (``curl … /api/v1/…``) are sent to the console's application over a database holding what they
name (message 4711, message_id shop-4711-paid, hint order-4711, pause 3); the ``correlation-worker`` commands
are parsed by the command line itself, so an option or command the documentation names and the CLI lacks fails
here. The shell blocks of the README's "A first message" and of docs/getting-started.md are checked whole: bash
parses them, and the getting-started page shows the very blocks tests/acceptance/test_readme.py runs.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import click
import pytest
from sqlalchemy import text

from tests.integration.test_api import auth, console_app
from worker import cli
from worker.db.store import NewMessage, Store

README = Path(__file__).resolve().parents[2] / "README.md"
GETTING_STARTED = README.parent / "docs" / "getting-started.md"
# The written pages; docs/reference/ is generated from the command line itself (usage lines, not examples).
DOCS = [README, *sorted(path for path in (README.parent / "docs").rglob("*.md") if "reference" not in path.parts)]


def shell_blocks(text: str) -> list[str]:
    """The ```sh, ```bash and ```console blocks of a Markdown text, in order."""
    return re.findall(r"```(?:sh|bash|console)\n(.*?)```", text, re.DOTALL)


def section(path: Path, title: str) -> str:
    """The text under a ``## title`` heading, up to the next one."""
    text = path.read_text(encoding="utf-8")
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def shell_lines(path: Path) -> list[str]:
    """The shell blocks' lines with continuations joined, comments dropped."""
    lines: list[str] = []
    for block in shell_blocks(path.read_text(encoding="utf-8")):
        joined = block.replace("\\\n", " ")
        lines += [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]
    return lines


def api_calls() -> list[str]:
    """The console's API calls the README and docs/ show."""
    return [
        line
        for path in DOCS
        for line in shell_lines(path)
        if line.startswith("curl") and ("/api/v1" in line or "$CW" in line)
    ]


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


def test_every_extra_and_script_the_documentation_installs_or_runs_is_there() -> None:
    project = (README.parent / "pyproject.toml").read_text(encoding="utf-8")
    extras = set(re.findall(r"^(\w+) = \[", project.split("[project.optional-dependencies]", 1)[1], re.MULTILINE))
    lines = [line for path in DOCS for line in shell_lines(path)]
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


def test_the_documentation_shows_its_api_calls() -> None:
    assert len(api_calls()) >= 20 and any("after=0" in call for call in api_calls())


@pytest.mark.parametrize("line", api_calls())
def test_every_api_call_the_documentation_shows_answers(line: str, store: Store) -> None:
    with store.engine.begin() as connection:  # the ids the documentation names
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


def first_steps() -> list[tuple[str, str]]:
    """(where, block) for every shell block of the README's "A first message" and of docs/getting-started.md."""
    blocks = [("README.md A first message", block) for block in shell_blocks(section(README, "A first message"))]
    blocks += [(f"docs/getting-started.md #{n}", block) for n, block in enumerate(shell_blocks(
        GETTING_STARTED.read_text(encoding="utf-8")))]
    return blocks


def test_the_first_steps_show_shell_blocks() -> None:
    assert len([where for where, _ in first_steps() if where.startswith("README")]) == 2
    assert len([where for where, _ in first_steps() if where.startswith("docs/")]) >= 4


@pytest.mark.parametrize(("where", "block"), first_steps(), ids=[where for where, _ in first_steps()])
def test_every_first_step_block_parses_in_bash_and_its_commands_in_the_cli(where: str, block: str) -> None:
    checked = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True, check=False)
    assert checked.returncode == 0, f"{where}: {checked.stderr}"
    joined = block.replace("\\\n", " ")
    commands = re.findall(r"(?:^|\.venv/bin/)(correlation-worker [^&|;\n]*)", joined, re.MULTILINE)
    assert commands or "./scripts/test" in block, where
    for line in commands:
        test_every_command_the_documentation_shows_parses(" ".join(line.split("  #")[0].split()))


def test_the_getting_started_page_shows_the_blocks_the_readme_walkthrough_runs() -> None:
    """tests/acceptance/test_readme.py runs the README's blocks; the getting-started page shows the same ones."""
    page = GETTING_STARTED.read_text(encoding="utf-8")
    for title in ("Two commands", "A first message"):
        readme_blocks = shell_blocks(section(README, title))
        page_blocks = shell_blocks(section(GETTING_STARTED, title))
        assert readme_blocks == page_blocks, f"the {title!r} blocks differ between README.md and {GETTING_STARTED.name}"
    assert "Ctrl-C" in page


def sql_blocks(path: Path) -> list[str]:
    """The ```sql blocks of a Markdown page, in order."""
    return re.findall(r"```sql\n(.*?)```", path.read_text(encoding="utf-8"), re.DOTALL)


PRODUCING = README.parent / "docs" / "guides" / "producing.md"


@pytest.mark.parametrize("path", [README, PRODUCING], ids=["README", "producing"])
def test_every_sql_block_a_producer_is_shown_runs_on_postgresql_and_produces_its_message(
    path: Path, store: Store
) -> None:
    """A producer's statements as shown: each block runs as one transaction on a migrated database and inserts
    the message it names (run twice: ``ON CONFLICT`` makes the second a no-op)."""
    blocks = sql_blocks(path)
    assert blocks, f"{path.name} shows how to produce a message with SQL"
    for block in blocks:
        for _ in range(2):
            with store.engine.begin() as connection:
                connection.exec_driver_sql(block.replace("%", "%%"))
    with store.engine.connect() as connection:
        rows = connection.execute(text("SELECT message_id, message_name, correlation_hint FROM correlation_message"))
        inserted = sorted(tuple(row) for row in rows)
    shown = sorted(set(re.findall(r"VALUES \('([^']*)', '([^']+)', '([^']+)'", "".join(blocks))))
    assert inserted == shown
