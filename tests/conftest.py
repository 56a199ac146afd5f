"""Test databases: a real PostgreSQL server, a migrated template, and a fresh database per test.

The server is, in order: ``CORRELATION_TEST_DATABASE_URL`` (a URL whose user may create databases), the
local server on 127.0.0.1:5432 (user postgres), or a throwaway server started from the PostgreSQL binaries
(as the ``postgres`` user when running as root, since PostgreSQL refuses root). Each test gets its own
database, cloned from a template that was migrated once per session (as procrastinate's conftest does).
"""

from __future__ import annotations

import contextlib
import glob
import os
import queue
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from worker.config import DatabaseSettings
from worker.db.store import Store, build_engine
from worker.message import MessageState

TEST_URL_ENV = "CORRELATION_TEST_DATABASE_URL"
LOCAL_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


def _conninfo(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _reachable(url: str) -> bool:
    try:
        with psycopg.connect(_conninfo(url), connect_timeout=3, autocommit=True) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ThrowawayServer:
    """A PostgreSQL server in a temporary directory: for machines without one, and for tests that stop it."""

    def __init__(self) -> None:
        candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb")) or [shutil.which("initdb") or ""]
        initdb = candidates[-1]
        if not initdb:
            pytest.exit("no PostgreSQL server: set CORRELATION_TEST_DATABASE_URL or install postgresql", 2)
        self.bin = Path(initdb).parent
        self.dir = Path(tempfile.mkdtemp(prefix="cw-pg-"))
        self.port = _free_port()
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            shutil.chown(self.dir, "postgres", "postgres")
        self.data = self.dir / "data"
        self._run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "--no-sync"])
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.start()

    def _run(self, command: list[str]) -> None:
        if self.as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True)

    def start(self) -> None:
        """Start the server (again) on the same port and data."""
        self._run(
            [
                str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-w", "start",
                "-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off",
            ]
        )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server; ``immediate`` is a crash, ``fast`` a clean shutdown that ends sessions."""
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"])

    def destroy(self) -> None:
        """Stop the server and remove its files."""
        with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


def _encodable(text: str) -> str:
    """The text with what UTF-8 cannot hold (a lone surrogate, say) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Reports that a parallel run can send between its processes: tests feed the worker strings UTF-8 cannot
    hold (lone surrogates), and what was logged of them is in the report's captured sections (and, for a failing
    acceptance test, the workers' logs attached to it)."""
    report.sections = [(title, _encodable(text)) for title, text in report.sections]
    if isinstance(report.longrepr, str):
        report.longrepr = _encodable(report.longrepr)


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """A URL of a PostgreSQL server where the tests may create databases."""
    configured = os.environ.get(TEST_URL_ENV)
    if configured:
        yield configured
        return
    if _reachable(LOCAL_URL):
        yield LOCAL_URL
        return
    server = ThrowawayServer()
    try:
        yield server.url
    finally:
        server.destroy()


def _admin(server_url: str, statement: str) -> None:
    with psycopg.connect(_conninfo(server_url), autocommit=True) as conn:
        conn.execute(statement)


def _database_url(server_url: str, name: str) -> str:
    return make_url(server_url).set(drivername="postgresql+psycopg", database=name).render_as_string(
        hide_password=False
    )


@pytest.fixture(scope="session")
def pg_template(pg_server_url: str) -> Iterator[str]:
    """A migrated database to clone per test."""
    name = f"cw_template_{uuid.uuid4().hex[:10]}"
    _admin(pg_server_url, f'CREATE DATABASE "{name}"')
    store = Store(build_engine(DatabaseSettings(url=_database_url(pg_server_url, name))))
    store.schema_migrate()
    store.close()
    try:
        yield name
    finally:
        _admin(pg_server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _fresh_pg_url(pg_server_url: str, template: str) -> tuple[str, str]:
    name = f"cw_test_{uuid.uuid4().hex[:12]}"
    for attempt in range(20):  # the template is briefly busy while another clone is made
        try:
            # A file copy of a small template is quicker to make and to drop than a WAL-logged one.
            _admin(pg_server_url, f'CREATE DATABASE "{name}" TEMPLATE "{template}" STRATEGY FILE_COPY')
            break
        except psycopg.errors.ObjectInUse:
            time.sleep(0.05 * (attempt + 1))
    return name, _database_url(pg_server_url, name)


class _Dropper:
    """Drops the databases of finished tests on a thread of its own (the next test need not wait)."""

    def __init__(self, server_url: str) -> None:
        self.server_url = server_url
        self.names: queue.Queue[str | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="database-dropper", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (name := self.names.get()) is not None:
            _admin(self.server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def close(self) -> None:
        self.names.put(None)
        self.thread.join()


@pytest.fixture(scope="session")
def _dropper(pg_server_url: str) -> Iterator[_Dropper]:
    dropper = _Dropper(pg_server_url)
    try:
        yield dropper
    finally:
        dropper.close()


@pytest.fixture
def pg_url(pg_server_url: str, pg_template: str, _dropper: _Dropper) -> Iterator[str]:
    """The URL of a fresh, migrated PostgreSQL database of this test's own."""
    name, url = _fresh_pg_url(pg_server_url, pg_template)
    try:
        yield url
    finally:
        # Nothing may use it any more: WITH (FORCE) ends a session left behind before the drop.
        _dropper.names.put(name)


@pytest.fixture
def empty_pg_url(pg_server_url: str) -> Iterator[str]:
    """The URL of a fresh PostgreSQL database with no schema."""
    name = f"cw_empty_{uuid.uuid4().hex[:12]}"
    _admin(pg_server_url, f'CREATE DATABASE "{name}"')
    try:
        yield _database_url(pg_server_url, name)
    finally:
        _admin(pg_server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def private_pg() -> Iterator[tuple[ThrowawayServer, str]]:
    """A PostgreSQL server of this test's own (which it may stop and start) and a migrated database URL."""
    server = ThrowawayServer()
    try:
        _admin(server.url, "CREATE DATABASE correlation")
        url = _database_url(server.url, "correlation")
        store = Store(build_engine(DatabaseSettings(url=url)))
        store.schema_migrate()
        store.close()
        yield server, url
    finally:
        server.destroy()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """The URL of a fresh, migrated SQLite file."""
    url = f"sqlite:///{tmp_path / 'correlation.db'}"
    store = Store(build_engine(DatabaseSettings(url=url)))
    store.schema_migrate()
    store.close()
    return url


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    """A fresh migrated database, once on PostgreSQL and once on SQLite."""
    fixture = "pg_url" if request.param == "postgresql" else "sqlite_url"
    return str(request.getfixturevalue(fixture))


@pytest.fixture
def store(pg_url: str) -> Iterator[Store]:
    """A store on a fresh PostgreSQL database."""
    store = Store(build_engine(DatabaseSettings(url=pg_url)))
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def any_store(db_url: str) -> Iterator[Store]:
    """A store on a fresh database, PostgreSQL and SQLite in turn."""
    store = Store(build_engine(DatabaseSettings(url=db_url)))
    try:
        yield store
    finally:
        store.close()


_REQUEST: list[pytest.FixtureRequest] = []


@pytest.fixture(autouse=True)
def _current_request(request: pytest.FixtureRequest) -> Iterator[None]:
    """The running test's request, for helpers that must clean up before its fixtures do."""
    _REQUEST.append(request)
    try:
        yield
    finally:
        _REQUEST.pop()


def stop_at_teardown(stop: Callable[[], None]) -> None:
    """Call ``stop`` when the running test ends, before its fixtures (its database) are torn down."""
    _REQUEST[-1].node.addfinalizer(stop)  # the item's stack: runs before the fixtures set up earlier


def left(store: Store, row_id: int) -> bool:
    """True once the message left the table: deleted, or kept as its delivery record (state delivered)."""
    message = store.messages_get(row_id)
    return message is None or message.state is MessageState.DELIVERED
