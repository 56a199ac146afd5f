"""The README's first steps, run the way a newcomer types them: its own command blocks, in a shell.

"Two commands" starts the worker on SQLite; "A first message" sends one from a second terminal, then stops that
worker and does the same on PostgreSQL, ending on the ``curl`` of the metrics. The commands are taken from the
README text; only what must differ on a shared test machine is replaced: the ``.venv`` (the test's own), the
metrics port (a free one instead of 9464) and the PostgreSQL database (a fresh one instead of ``postgres``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import wait_until
from sqlalchemy.engine import make_url

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
README_PSQL = "psql -h 127.0.0.1 -U postgres"
README_PORT = "9464"


def section(title: str) -> str:
    """The README text under a ``## title`` heading, up to the next one."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def shell_blocks(title: str) -> list[str]:
    """The ```sh blocks of a section, in order."""
    return re.findall(r"```sh\n(.*?)```", section(title), re.DOTALL)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Newcomer:
    """A shell user in an empty directory with the project installed in ``.venv``."""

    def __init__(self, directory: Path, database_url: str) -> None:
        self.directory = directory
        self.port = str(free_port())
        self.database_url = database_url
        self.env = {key: value for key, value in os.environ.items() if not key.startswith("CORRELATION_")}
        self.env["CORRELATION_METRICS__PORT"] = self.port
        # The README's `.venv/bin/…` is the test's own virtual environment, seen from the newcomer's directory.
        (directory / ".venv").symlink_to(Path(sys.prefix))

    def adapt(self, commands: str) -> str:
        """The README's commands with the test machine's port and database in place of the documented ones."""
        url = make_url(self.database_url)
        psql = f"psql -h {url.host} -p {url.port or 5432} -U {url.username} -d {url.database}"
        assert README_URL in commands or README_PSQL not in commands, "the README's PostgreSQL URL changed"
        return (
            commands.replace(README_URL, url.render_as_string(hide_password=False))
            .replace(README_PSQL, psql)
            .replace(f"localhost:{README_PORT}", f"localhost:{self.port}")
        )

    def shell(self, commands: str, timeout: float) -> subprocess.CompletedProcess[str]:
        """Run the commands in bash, stopping at the first that fails; background jobs end with the shell."""
        script = "set -e\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + self.adapt(commands)
        return subprocess.run(
            ["bash", "-c", script],
            cwd=self.directory,
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


@pytest.fixture
def newcomer(tmp_path: Path, empty_pg_url: str) -> Iterator[Newcomer]:
    yield Newcomer(tmp_path, empty_pg_url)


def test_the_readme_walkthrough_works_as_written_on_sqlite_then_postgresql(newcomer: Newcomer) -> None:
    # "Two commands": the install line ends with `.venv/bin/correlation-worker run`; the install itself is done.
    [install_and_run] = shell_blocks("Two commands")[:1]
    run = install_and_run.strip().split("&&")[-1].strip()
    assert run == ".venv/bin/correlation-worker run"
    log = newcomer.directory / "first-terminal.log"
    with open(log, "wb") as output:
        first = subprocess.Popen(
            ["bash", "-c", newcomer.adapt(run)], cwd=newcomer.directory, env=newcomer.env,
            stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_until(lambda: " polling " in log.read_text(), what="the first worker to start polling")

        # "A first message", in a second terminal next to the running worker.
        second_terminal, on_postgresql = shell_blocks("A first message")
        sent = newcomer.shell(second_terminal, timeout=60)
        assert sent.returncode == 0, sent.stderr
        assert "inserted message 1" in sent.stdout and '"ready": 1' in sent.stdout
        wait_until(
            lambda: "correlated order.paid hint=order-42" in log.read_text(),
            what="the log correlator to print the message",
            timeout=60,
        )
        assert "A first message" in section("A first message") and "Ctrl-C" in section("A first message")
    finally:
        os.killpg(first.pid, signal.SIGINT)  # Ctrl-C in the first terminal
        assert first.wait(timeout=30) == 0, log.read_text()

    # On PostgreSQL, with the metrics port free again.
    done = newcomer.shell(on_postgresql, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "schema migrated from nothing to" in done.stdout
    assert 'correlation_messages_total{message_name="order.paid",outcome="success"} 1.0' in done.stdout
    assert "correlated order.paid hint=order-42" in done.stderr
