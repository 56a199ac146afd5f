"""Fixtures of the acceptance tests: databases with the recorder's journal, and worker processes.

The worker's log goes to a file that is attached to the report of a failing test; at teardown every worker
gets SIGTERM and must exit with code 0. The harness itself is in ``harness.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import (
    Database,
    PostgresDatabase,
    SqliteDatabase,
    StartReplicas,
    StartWorker,
    WorkerProcess,
    worker_env,
)


@pytest.fixture
def pg_db(pg_url: str) -> Iterator[Database]:
    """A fresh PostgreSQL database with the recorder's table."""
    database = PostgresDatabase(pg_url)
    try:
        yield database
    finally:
        database.close()


@pytest.fixture
def sqlite_db(sqlite_url: str, tmp_path: Path) -> Iterator[Database]:
    """A fresh SQLite database with a journal file for the recorder."""
    database = SqliteDatabase(sqlite_url, tmp_path / "calls.jsonl")
    try:
        yield database
    finally:
        database.close()


@pytest.fixture(params=["postgresql", "sqlite"])
def any_db(request: pytest.FixtureRequest) -> Database:
    """A fresh database, PostgreSQL and SQLite in turn."""
    database: Database = request.getfixturevalue("pg_db" if request.param == "postgresql" else "sqlite_db")
    return database


WORKERS = pytest.StashKey[list[WorkerProcess]]()


@pytest.fixture
def start_worker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StartWorker]:
    """Start worker processes: ``start_worker(database, policy__mode="all")``; each must exit 0 on SIGTERM."""
    workers: list[WorkerProcess] = []
    request.node.stash[WORKERS] = workers

    def start(database: Database, **settings: str) -> WorkerProcess:
        worker = launch(database, **settings)
        worker.wait_ready()
        return worker

    def launch(database: Database, **settings: str) -> WorkerProcess:
        log_path = tmp_path / f"worker-{len(workers) + 1}.log"
        worker = WorkerProcess(worker_env(database, **settings), log_path, tmp_path)
        workers.append(worker)
        return worker

    request.node.stash[LAUNCH] = launch
    yield start
    problems = []
    for number, worker in enumerate(workers, 1):
        if worker.killed:
            continue
        was_running = worker.running()
        code = worker.stop()
        if code != 0:
            how = "after SIGTERM" if was_running else "before teardown"
            problems.append(f"worker {number} exited with {code} {how}; its log:\n{worker.log()[-6000:]}")
    assert not problems, "\n".join(problems)


LAUNCH = pytest.StashKey[StartWorker]()


@pytest.fixture
def start_replicas(request: pytest.FixtureRequest, start_worker: StartWorker) -> StartReplicas:
    """Start several workers at once: ``start_replicas(database, 3, poll__concurrency="2")``.

    Each gets its own CORRELATION_REPLICA__NAME (``replica-<n>``, numbered across the test, unless
    ``replica__name`` is given); the call returns once every one is polling.
    """
    launch = request.node.stash[LAUNCH]

    def start(database: Database, count: int, **settings: str) -> list[WorkerProcess]:
        replicas = [
            launch(database, **{"replica__name": f"replica-{len(request.node.stash[WORKERS]) + 1}", **settings})
            for _ in range(count)
        ]
        for replica in replicas:
            replica.wait_ready()
        return replicas

    return start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Attach the workers' logs to the report of a failing test."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed:
        none: list[WorkerProcess] = []
        workers = item.stash.get(WORKERS, none)
        for number, worker in enumerate(workers, 1):
            report.sections.append((f"worker {number} log ({report.when})", worker.log()[-20000:]))
