"""The composition root: builds every part from the settings, runs the loops, stops cleanly.

Nothing here decides policy; it wires the store, the correlators, the poller, cleanup, metrics and the HTTP
endpoint together and owns the process lifecycle (signals, schema check, shutdown).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import FrameType

from worker.admin.console import Console
from worker.admin.routes import console_routes
from worker.config import ConfigError, DatabaseSettings, Settings, format_duration
from worker.correlators import Router
from worker.correlators.network import call_loop_stacks
from worker.db.base import sqlite_file
from worker.db.errors import connection_lost, from_database
from worker.db.listener import Listener
from worker.db.schema import check_revision_known, head_revision
from worker.db.store import DatabaseUnavailable, SchemaIncomplete, Store, StoreError
from worker.db.targets import TargetRow
from worker.engine.cleanup import Cleanup
from worker.engine.engine import Engine
from worker.engine.gauges import Gauges
from worker.engine.leases import SingletonLock, SlotLeaseConfig, SlotLeaser
from worker.engine.replicas import ReplicaBoard, cluster_settings
from worker.engine.scheduler import Scheduler, SchedulerConfig
from worker.policy.routing import route_digests
from worker.redact import redact_url
from worker.service.endpoint import Endpoint, Heartbeat
from worker.service.metrics import Metrics
from worker.service.tracing import Tracing, add_trace_ids

logger = logging.getLogger(__name__)

# The console's charts show the last day: samples older than that (and an hour) leave.
SAMPLE_RETENTION = timedelta(hours=25)

# The targets' states: looked at this often, written when one changed, and at least this often (readers show
# rows younger than worker.db.targets.FRESH).
TARGETS_LOOK = timedelta(seconds=1)
TARGETS_REFRESH = timedelta(seconds=30)

STARTUP_RETRY = 2.0  # seconds between attempts to reach the database at startup
HEARTBEAT_SLICE = 1.0  # the loops tick the heartbeat at least this often while they wait
LOOP_TROUBLE_AFTER = 10.0  # seconds of a background loop's runs all failing before readiness says so, at least


def _write_stacks(_signum: int, _frame: FrameType | None) -> None:
    """SIGUSR1: every thread's stack to stderr, by name, then every task's of the call loop (the lanes). A Python
    handler, run between two steps of the main thread with the interpreter held: faulthandler's dump reads the
    other threads' frames while they run, and crashed the process about one time in seven."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    stacks = [
        f"Thread {names.get(ident, ident)} (most recent call last):\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    ]
    stacks += call_loop_stacks()  # the lanes are tasks on the call loop
    sys.stderr.write("\n".join(stacks) + "\n")
    sys.stderr.flush()


def lease_config(settings: Settings) -> SlotLeaseConfig:
    """The slot lease settings (already checked together, and against the handler timeouts, by the settings)."""
    lease = settings.lease
    try:
        return SlotLeaseConfig(lease.duration, lease.renew_interval, lease.safety_margin, lease.drain)
    except ValueError as error:
        raise ConfigError(f"invalid setting CORRELATION_LEASE__*: {error}") from None


def singleton_lease(interval: timedelta) -> timedelta:
    """The term of a cluster-singleton job's lock: it outlasts two runs, so that leadership stays put."""
    return max(2 * interval + timedelta(seconds=10), timedelta(seconds=30))


def _file_identity(path: Path) -> tuple[int, int] | None:
    """The device and inode of a file, or None when there is none at the path."""
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_dev, status.st_ino


class StartupError(Exception):
    """The worker cannot start; the message says why and what to do."""


def replica_identity(name: str) -> str:
    """``locked_by`` for this process: the pod name plus a per-boot random suffix."""
    return f"{name}-{secrets.token_hex(4)}"


ENGINE_CONNECTIONS = 6  # the replica's own sessions at once beside its calls: fetchers, markers, committer, rounds


def _pool_for(settings: Settings, router: Router) -> DatabaseSettings:
    """The database settings, the pool grown to a connection per lane when a route is transactional: each such
    call holds one for its length, and lanes waiting for one would time out (PostgreSQL; SQLite has one writer)."""
    database = settings.database
    needed = settings.poll.concurrency + ENGINE_CONNECTIONS
    if not router.transactional() or not database.url.startswith("postgresql") or database.pool_size >= needed:
        return database
    logger.info(
        "transactional route: the database pool holds %d connections (one per lane, and the replica's own) rather "
        "than CORRELATION_DATABASE__POOL_SIZE=%d", needed, database.pool_size,
    )
    return database.model_copy(update={"pool_size": needed})


def _lanes_for(settings: Settings, router: Router, dialect: str) -> Settings:
    """On SQLite a transactional call holds the file's one write lock for its length: the lanes beside it would
    wait for it past their handler timeouts, so a replica with a transactional route makes one call at a time."""
    if dialect != "sqlite" or not router.transactional() or settings.poll.concurrency <= 1:
        return settings
    logger.info(
        "transactional route on SQLite: one call at a time (CORRELATION_POLL__CONCURRENCY=%d is for PostgreSQL: "
        "a transactional call holds SQLite's one write lock)", settings.poll.concurrency,
    )
    return settings.model_copy(update={"poll": settings.poll.model_copy(update={"concurrency": 1})})


class Worker:
    """One replica: polls, correlates, cleans up and serves metrics until told to stop."""

    def __init__(
        self,
        settings: Settings,
        store: Store | None = None,
        metrics: Metrics | None = None,
        replica_id: str | None = None,
    ) -> None:
        self.settings = settings
        self.replica_id = replica_id or replica_identity(settings.replica.name)
        self.metrics = metrics or Metrics()
        # Traces (the otel extra, OTEL_* variables): before the routes, whose HTTP client sessions it instruments.
        self.tracing = Tracing.from_environment(
            replica=self.replica_id, producer_context=settings.tracing.producer_context
        )
        if self.tracing is not None:
            add_trace_ids(text=settings.log.format == "text")
        self.router = Router.from_settings(settings.correlators)
        self.store = store or Store.from_settings(_pool_for(settings, self.router))
        settings = self.settings = _lanes_for(settings, self.router, self.store.dialect)
        self.heartbeat = Heartbeat()
        self._targets_shown: list[tuple[str, str, str, int]] | None = None  # the targets' states last written
        self._targets_written = 0.0
        self.stopping = threading.Event()
        # SQLite: the file this replica opened, by identity; deleted or replaced under it, the replica exits.
        self.sqlite_path = sqlite_file(settings.database.url)
        self._sqlite_identity: tuple[int, int] | None = None
        self.exit_code = 0
        # Slots are leased, fenced, on PostgreSQL (64 of them) and on SQLite (one: a second process on the same
        # file waits instead of correlating the same hints).
        self.leaser = SlotLeaser(self.store, self.replica_id, lease_config(settings), self.metrics)
        self.engine = Engine(
            self.store, self.router, settings, self.leaser, self.metrics, self.replica_id, tick=self.heartbeat.tick,
            tracing=self.tracing,
        )
        self.leaser.in_use = self.engine.slots_in_use
        self.leaser.on_acquired = self.engine.acquired
        self.leaser.on_renewed = self.engine.renewed
        self.leaser.fetched_under = self.engine.fetched_under
        # The replicas' routes and cluster-wide settings: a name the live replicas route differently waits.
        self.board = ReplicaBoard(
            self.store, self.replica_id, route_digests(self.router.describe()), cluster_settings(settings),
            settings.lease.duration, self.metrics, on_look=self.engine.routes_seen,
        )
        self.engine.routing = self.board.routing  # nothing is called before the board's first look
        self.listener = (
            Listener(settings.database, settings.notify, self.engine.wake, self.metrics)
            if settings.notify.enabled
            else None
        )
        # The leases are kept until the engine has stopped (a call may run through the shutdown grace).
        self.leases_done = threading.Event()
        self.store.keep_delivery_records(settings.delivery.retention, self.replica_id)
        self.cleanup = Cleanup(self.store, settings.cleanup, self.metrics, settings.delivery.retention)
        self.gauges = Gauges(self.store, self.metrics, settings.policy.mode)
        self.cleanup_lock = SingletonLock(
            self.store, "cleanup", self.replica_id, singleton_lease(settings.cleanup.interval)
        )
        self.gauges_lock = SingletonLock(
            self.store, "gauges", self.replica_id, singleton_lease(settings.metrics.gauges_interval)
        )
        # Schedules (DESIGN.md §7): every replica runs the scheduler; fire times are claimed in the database.
        self.scheduler = Scheduler(
            self.store, SchedulerConfig.from_settings(settings.scheduler), self.metrics, tracing=self.tracing
        )
        self.endpoint: Endpoint | None = None
        # The console (API and pages) on the endpoint, with a store of its own (its statement timeout).
        self.console = (
            Console.from_settings(settings, correlated=self.correlated_so_far)
            if settings.admin.enabled and settings.metrics.enabled
            else None
        )
        self._signals = 0
        # Background loops whose every run fails: since when (monotonic), how long until that is trouble, and why.
        self._loops_failing: dict[str, tuple[float, float, str]] = {}
        self._loops_lock = threading.Lock()

    # -- lifecycle --------------------------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: stop gracefully; a second one: exit at once. SIGUSR1: every thread's stack to stderr
        (where a replica that does not stop, or does not move, is waiting), and the replica goes on."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGUSR1, _write_stacks)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals > 1:
            logger.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(1)
        logger.info("%s: finishing the current message, then stopping", signal.Signals(signum).name)
        self.stop()

    def stop(self) -> None:
        """Stop correlating; the current calls finish (or are abandoned after the shutdown grace)."""
        self.stopping.set()

    def prepare_schema(self) -> None:
        """Wait for the database, then migrate (``auto_migrate``) or refuse an out-of-date schema."""
        while not self.stopping.is_set():
            try:
                revision = self.store.schema_revision()
                break
            except DatabaseUnavailable as error:
                self.metrics.database_error(error)
                logger.warning("%s; retrying in %.0fs", error, STARTUP_RETRY)
                self._wait(STARTUP_RETRY, self.heartbeat.tick)
        else:
            return
        head = head_revision()
        if revision == head:
            self._check_schema_complete()
            return
        check_revision_known(revision)  # a newer release's schema: one line saying so, not advice to migrate
        if not self.settings.database.auto_migrate:
            raise StartupError(
                f"the database schema is at revision {revision or 'none'} but this version needs {head}: "
                "run `correlation-worker migrate` (or set CORRELATION_DATABASE__AUTO_MIGRATE=true)"
            )
        before, after = self.store.schema_migrate()
        schema = self.store.schema_name()
        where = f" in schema {schema}" if schema else ""
        logger.info("schema migrated from %s to %s%s", before or "nothing", after, where)
        self._check_schema_complete()

    def _check_schema_complete(self) -> None:
        try:
            self.store.schema_check_complete()
        except SchemaIncomplete as error:
            raise StartupError(str(error)) from None

    def sqlite_file_trouble(self) -> str | None:
        """Why the SQLite file this replica opened is no longer the one at its path (deleted or replaced), or None.

        The replica keeps the old file open and would never see what is written to a new one at the path.
        """
        if self.sqlite_path is None or self._sqlite_identity is None:
            return None
        if _file_identity(self.sqlite_path) == self._sqlite_identity:
            return None
        return (
            f"the SQLite database file {self.sqlite_path} was deleted or replaced while this replica ran: it cannot "
            "see what is written to the file now at that path; exiting (exit code 1) so that it is started again"
        )

    def readiness(self) -> str | None:
        """None when ready; otherwise why not (for /readyz)."""
        trouble = self.sqlite_file_trouble() or self._unrecordable()
        if trouble is not None:
            return trouble
        try:
            return self._database_readiness()
        except StoreError as error:
            if not connection_lost(error):
                return str(error)
        # A pooled connection whose session ended (a server restart, a failover, sessions ended by an operator)
        # fails its first statement, and the pool then replaces the connections opened before: ask once more.
        try:
            return self._database_readiness()
        except StoreError as error:
            return str(error)

    def _unrecordable(self) -> str | None:
        """Outcomes the database refused to record, even as dead: their hints wait, unfetched, for a restart."""
        stuck = self.engine.committer.unrecordable()
        if not stuck:
            return None
        first, (_, hint, why) = next(iter(stuck.items()))
        said = why.splitlines()[0] if why else "no reason given"
        return (
            f"{len(stuck)} outcome(s) could not be recorded, not even as dead (message {first} of hint {hint!r}: "
            f"{said}); their hints are not called again until this replica restarts: fix what "
            "refuses the update (a trigger, a constraint on correlation_message), then restart it"
        )

    def _database_readiness(self) -> str | None:
        """Why the database keeps this replica from working (None: it does not)."""
        revision = self.store.schema_revision()
        if revision is None:
            return "the database has no correlation-worker schema: run `correlation-worker migrate`"
        if revision != head_revision():
            return (
                f"the database schema is at revision {revision}, this version needs {head_revision()}: "
                "run `correlation-worker migrate` (a newer schema needs a newer release)"
            )
        if self.store.database_read_only():
            return (
                "the database is read-only (a standby, or default_transaction_read_only is on): this replica "
                "cannot record outcomes; point CORRELATION_DATABASE__URL at the primary"
            )
        absent = self.store.schema_missing()
        if absent:
            return (
                f"the database schema lacks {', '.join(absent)} (dropped or altered by hand): this replica "
                "cannot work; see `correlation-worker migrate`"
            )
        missing = self.store.privileges_missing()
        if missing:
            return (
                f"the database user lacks privileges the worker needs: {', '.join(missing)}; grant them "
                "(see \"Database user\" in docs/deployment.md)"
            )
        return self.leaser.trouble() or self.loops_trouble()

    def health(self) -> str | None:
        """None when the replica can do its job; otherwise why not (for /healthz, beside the heartbeat)."""
        return self.engine.health()

    def correlated_so_far(self) -> float:
        """Correlator calls of this replica that ended in success so far (the console's throughput)."""
        return sum(
            sample.value
            for metric in self.metrics.messages.collect()
            for sample in metric.samples
            if sample.name.endswith("_total") and sample.labels.get("outcome") == "success"
        )

    def run(self) -> int:
        """Run until stopped; returns the process exit code."""
        metrics_settings = self.settings.metrics
        if metrics_settings.enabled:  # first, so that probes answer while the database is awaited
            window = max(60.0, 3 * self.settings.poll.interval.total_seconds())
            self.endpoint = Endpoint(
                metrics_settings.host,
                metrics_settings.port,
                self.metrics,
                self.heartbeat,
                window,
                self.readiness,
                self.health,
                console=console_routes(self.console) if self.console is not None else (),
            )
            if self.console is None:
                logger.info(
                    "the console (/api/v1 and /ui) is off: set CORRELATION_ADMIN__TOKEN (and optionally "
                    "CORRELATION_ADMIN__READ_TOKEN) to a secret of at least 16 characters to turn it on"
                )
        elif self.settings.admin.enabled:
            logger.warning(
                "the console is off because CORRELATION_METRICS__ENABLED=false: it is served on the metrics port"
            )
        try:
            self.prepare_schema()
        except BaseException:
            self._close_endpoint()
            raise
        if self.stopping.is_set():
            self._close_endpoint()
            return 0
        if self.sqlite_path is not None:
            self._sqlite_identity = _file_identity(self.sqlite_path)
        logger.info(
            "replica %s polling %s every %s (%d slots), routes %s",
            self.replica_id,
            redact_url(self.settings.database.url),
            format_duration(self.settings.poll.interval),
            self.store.slot_count,
            self.router.describe(),
        )
        with contextlib.suppress(StoreError):  # else its first look in the background lets calls start
            self.board.run_once()
        supervised = self.engine.supervisor.thread
        background = [
            supervised(self._every, "replicas", "replicas", self.settings.lease.renew_interval,
                       self.settings.lease.renew_interval, self.board.run_once, until=self.leases_done),
            supervised(self._every, "leases", "leases", timedelta(0), self.settings.lease.renew_interval,
                       self.leaser.run_once, until=self.leases_done, sooner=self.leaser.next_round_in),
            supervised(self._every, "cleanup", "cleanup", self.settings.cleanup.initial_delay,
                       self.settings.cleanup.interval, self._cleanup),
            supervised(self._every, "gauges", "gauges", timedelta(0), metrics_settings.gauges_interval, self._gauges),
        ]
        if self.router.destinations():  # network routes: their states where status and the console read them
            background.append(supervised(self._every, "targets", "targets", timedelta(0), TARGETS_LOOK, self._targets))
        if self.listener is not None:
            background.append(supervised(self.listener.run, "listener"))
        if self.settings.scheduler.enabled:
            background.append(supervised(self.scheduler.run, "scheduler", self.stopping))
        for thread in background:
            thread.start()
        try:
            self._wait(self.settings.poll.initial_delay.total_seconds(), self.heartbeat.tick)
            if not self.stopping.is_set():
                self.engine.start()
            while not self.stopping.is_set():  # the engine's fetch loop ticks the heartbeat meanwhile
                self.stopping.wait(HEARTBEAT_SLICE)
                trouble = self.sqlite_file_trouble() or self.engine.supervisor.failure() or self.engine.lanes.health()
                if trouble is not None and not self.stopping.is_set():
                    logger.error("%s; stopping", trouble)
                    self.exit_code = 1
                    self.stop()
        finally:
            # Stopped: no new call; running ones get the grace, then are given up on; outcomes are written.
            self.engine.stop(self.settings.shutdown.grace.total_seconds())
            try:
                self.router.close()  # the calls are over: the targets' connections close
            except Exception as error:  # a connection that will not close is let go with the process
                logger.warning("could not close the targets' connections: %s", error)
            self.leases_done.set()
            released = self.leaser.release_all()
            logger.info("released %d slot leases", released)
            if self.router.destinations():
                with contextlib.suppress(StoreError):  # else they age out
                    self.store.targets_record(self.replica_id, [])
            with contextlib.suppress(StoreError):  # else it ages out, and names it routed differently wait until then
                self.board.stop()
            if self.listener is not None:
                self.listener.stop()
            for thread in background:
                thread.join(timeout=5)
            self.cleanup_lock.release()
            self.gauges_lock.release()
            self._close_endpoint()
            self.store.close()
            if self.tracing is not None:
                self.tracing.shutdown()  # the spans still buffered are sent
            logger.info("replica %s stopped", self.replica_id)
        return self.exit_code

    def _close_endpoint(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        if self.console is not None:
            self.console.close()

    # -- loops ------------------------------------------------------------------------------------------------

    def _every(
        self,
        name: str,
        initial_delay: timedelta,
        interval: timedelta,
        work: Callable[[], None],
        alive: Callable[[], None] = lambda: None,
        until: threading.Event | None = None,
        sooner: Callable[[], float | None] = lambda: None,
    ) -> None:
        """Run ``work`` after the initial delay, then every interval, until ``until`` (default: stopping) is set.

        ``alive`` is called at least every second: liveness. ``sooner`` may ask for the next run earlier than
        the interval (in seconds from now).
        """
        done = until or self.stopping
        self._wait(initial_delay.total_seconds(), alive, done)
        while not done.is_set():
            alive()
            try:
                work()
                self._loop_succeeded(name)
            except StoreError as error:  # unavailable, busy, a login or privilege refused: one line, then again
                self.metrics.database_error(error)
                logger.warning("%s: %s", name, error)
                self._loop_failed(name, interval, str(error))
            except Exception as error:  # a bug must not kill the loop; it is logged and the loop goes on
                logger.exception("%s failed", name)
                if from_database(error):  # a database error the store does not know: counted as `other`
                    self.metrics.database_error(error)
                lines = str(error).strip().splitlines()
                self._loop_failed(name, interval, f"{type(error).__name__}: {lines[0] if lines else ''}")
            earlier = sooner()
            wait = interval.total_seconds()
            self._wait(wait if earlier is None else min(wait, earlier), alive, done)

    def _loop_succeeded(self, name: str) -> None:
        with self._loops_lock:
            self._loops_failing.pop(name, None)

    def _loop_failed(self, name: str, interval: timedelta, reason: str) -> None:
        """A run of a background loop failed; runs failing for three intervals (ten seconds at least) are trouble."""
        with self._loops_lock:
            since = self._loops_failing.get(name, (time.monotonic(), 0.0, ""))[0]
            self._loops_failing[name] = (since, max(LOOP_TROUBLE_AFTER, 3 * interval.total_seconds()), reason)

    def loops_trouble(self) -> str | None:
        """Why a background loop is not doing its job: every run of it failed for three of its intervals."""
        now = time.monotonic()
        with self._loops_lock:
            failing = sorted(self._loops_failing.items())
        for name, (since, after, reason) in failing:
            if now - since > after:
                return f"every {name} run has failed for {now - since:.0f}s: {reason}"
        return None

    def _wait(self, seconds: float, alive: Callable[[], None], done: threading.Event | None = None) -> None:
        event = done or self.stopping
        remaining = seconds
        while remaining > 0 and not event.is_set():
            step = min(HEARTBEAT_SLICE, remaining)
            event.wait(step)
            remaining -= step
            alive()

    def _targets(self) -> None:
        """Write the targets' states when one changed, and every TARGETS_REFRESH besides (their rows' age)."""
        rows = [
            TargetRow(self.replica_id, state["target"], state["circuit"], state["reason"], state["limit"],
                      state["in_flight"])
            for state in self.engine.lanes.targets()
        ]
        shown = [(row.target, row.circuit, row.reason, row.concurrency_limit) for row in rows]
        now = time.monotonic()
        if shown == self._targets_shown and now - self._targets_written < TARGETS_REFRESH.total_seconds():
            return
        self.store.targets_record(self.replica_id, rows)
        self._targets_shown, self._targets_written = shown, now

    def _gauges(self) -> None:
        census = None
        if self.gauges_lock.acquire():
            census = self.gauges.run_once()
        else:  # another replica reports the table; do not export stale copies of its numbers
            self.gauges.clear()
        # The console's charts: every replica's calls by outcome, and the census from its holder.
        self.store.samples_record(
            self.replica_id, self.engine.lanes.tally(), None if census is None else census.counts,
            None if census is None else self.store.messages_last_id(),
        )
        if census is not None:
            self.store.samples_prune(SAMPLE_RETENTION)

    def _cleanup(self) -> None:
        if not self.cleanup_lock.acquire():
            return
        result = self.cleanup.run_once()
        if result.expired_removed:
            logger.info("cleanup removed %d expired messages", result.expired_removed)
        if result.records_removed:
            logger.info("cleanup removed %d delivery records past their retention", result.records_removed)
