"""The ``correlation-worker`` command: run, migrate, check-config, send, and the operator commands."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, NoReturn

import click

from worker.admin import operations as admin
from worker.admin import schedules as admin_schedules
from worker.config import ConfigError, Settings, load_settings, parse_duration, redact_url
from worker.correlators import Router
from worker.db.store import MessageFilter, MessageRejected, NewMessage, Store, StoreError
from worker.message import MessageState
from worker.policy.cron import CronError
from worker.service.logs import configure_logging
from worker.worker import StartupError, Worker, lease_config, replica_identity


def _fail(message: str) -> None:
    click.echo(f"correlation-worker: {message}", err=True)
    sys.exit(2)


def _exit_after_run(code: int) -> NoReturn:
    """Exit with ``code`` without waiting for correlator calls abandoned at shutdown.

    An abandoned call still runs on a pool thread, and the interpreter joins pool threads at exit: a hung
    handler would keep the process alive past the shutdown grace. Only the logs and stdio are left to flush.
    """
    main_thread = threading.main_thread()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not main_thread):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _settings() -> Settings:
    try:
        return load_settings()
    except ConfigError as error:
        _fail(str(error))
        raise  # unreachable


def _with_store(action: Callable[[Store], Any]) -> Any:
    settings = _settings()
    store = Store.from_settings(settings.database)
    try:
        if store.schema_revision() is None:
            _fail("the database has no correlation-worker schema yet: run `correlation-worker migrate` first")
        return action(store)
    except (StoreError, admin.AdminError) as error:
        _fail(str(error))
    finally:
        store.close()


def _print(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def _json_option(value: str | None, name: str) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError as error:
        raise click.BadParameter(f"{name} is not valid JSON: {error}") from None


def _selection(ids: tuple[int, ...], name: str | None, hint: str | None, state: str | None) -> MessageFilter:
    return MessageFilter(ids=ids, name=name, hint=hint, state=MessageState(state) if state else None)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """correlation-worker: correlate messages inserted with SQL, in order per hint, across replicas.

    Settings come from CORRELATION_* environment variables (see `check-config`).
    """


@main.command()
def run() -> None:
    """Run the worker until SIGTERM or SIGINT."""
    settings = _settings()
    replica_id = replica_identity(settings.replica.name)
    configure_logging(settings.log, replica_id)
    try:
        worker = Worker(settings, replica_id=replica_id)
        worker.install_signal_handlers()
        code = worker.run()
    except (ConfigError, StartupError, StoreError) as error:
        _fail(str(error))
    except OSError as error:  # e.g. the metrics port is taken
        _fail(f"cannot start: {error}")
    _exit_after_run(code)


@main.command()
def migrate() -> None:
    """Create or update the schema, then exit."""
    settings = _settings()
    store = Store.from_settings(settings.database)
    try:
        before, after = store.schema_migrate()
    except StoreError as error:
        _fail(str(error))
    finally:
        store.close()
    if before == after:
        click.echo(f"schema is current (revision {after}) on {redact_url(settings.database.url)}")
    else:
        click.echo(f"schema migrated from {before or 'nothing'} to {after} on {redact_url(settings.database.url)}")


@main.command("check-config")
def check_config() -> None:
    """Validate the settings and print the effective configuration (passwords hidden)."""
    settings = _settings()
    try:
        routes = Router.from_settings(settings.correlators).describe()
        lease_config(settings)
    except ConfigError as error:
        _fail(str(error))
    data = settings.redacted()
    data["correlators"] = routes
    _print(data)


@main.command()
@click.argument("name")
@click.argument("hint")
@click.option("--payload", help="JSON payload (default {}).")
@click.option("--headers", help="JSON object of headers.")
@click.option("--message-id", help="Producer id; sending it twice inserts once.")
@click.option("--ttl", help="Time to live, ISO-8601 (PT30S).")
@click.option("--expires-at", help="ISO-8601 timestamp after which the message is dropped.")
def send(
    name: str,
    hint: str,
    payload: str | None,
    headers: str | None,
    message_id: str | None,
    ttl: str | None,
    expires_at: str | None,
) -> None:
    """Insert one message NAME for correlation hint HINT."""
    try:
        time_to_live = parse_duration(ttl) if ttl else None
        expiry = datetime.fromisoformat(expires_at) if expires_at else None
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    message = NewMessage(
        name=name,
        hint=hint,
        payload=_json_option(payload, "--payload"),
        headers=_json_option(headers, "--headers"),
        message_id=message_id,
        time_to_live=time_to_live,
        expires_at=expiry,
    )

    def insert(store: Store) -> None:
        try:
            row_id = store.messages_insert(message)
        except MessageRejected as error:
            _fail(str(error))
        if row_id is None:
            click.echo(f"message_id {message_id!r} is already there; nothing inserted")
        else:
            click.echo(f"inserted message {row_id}")

    _with_store(insert)


@main.command()
def status() -> None:
    """Messages by state and the age of the oldest eligible one."""
    _print(_with_store(admin.status))


@main.group()
def messages() -> None:
    """List and show messages."""


@messages.command("list")
@click.option("--state", type=click.Choice([s.value for s in MessageState]))
@click.option("--name", help="message_name")
@click.option("--hint", help="correlation_hint")
@click.option("--after", type=int, default=0, show_default=True, help="Only ids above this (paging).")
@click.option("--limit", type=int, default=50, show_default=True)
def messages_list(state: str | None, name: str | None, hint: str | None, after: int, limit: int) -> None:
    """Messages in id order, optionally filtered."""
    selection = _selection((), name, hint, state)
    rows = _with_store(lambda store: store.messages_list(selection, after=after, limit=limit))
    _print([admin.message_as_dict(m) for m in rows])


@messages.command("show")
@click.argument("message_id", type=int)
def messages_show(message_id: int) -> None:
    """One message with its last error."""
    message = _with_store(lambda store: store.messages_get(message_id))
    if message is None:
        _fail(f"no message with id {message_id}")
    _print(admin.message_as_dict(message))


def _bulk_command(name: str, help_text: str, action: Callable[[Store, MessageFilter], int], verb: str) -> None:
    @main.command(name, help=help_text)
    @click.argument("ids", nargs=-1, type=int)
    @click.option("--name", "message_name", help="Every message of this message_name.")
    @click.option("--hint", help="Every message of this correlation_hint.")
    @click.option("--state", type=click.Choice([s.value for s in MessageState]), help="Only in this state.")
    @click.option("--all", "everything", is_flag=True, help="Every message (no filter).")
    def command(
        ids: tuple[int, ...], message_name: str | None, hint: str | None, state: str | None, everything: bool
    ) -> None:
        selection = _selection(ids, message_name, hint, state)

        def apply(store: Store) -> int:
            admin.require_selection(selection, everything, name)
            return action(store, selection)

        click.echo(f"{verb} {_with_store(apply)} messages")


_bulk_command("requeue", "Dead messages back to ready, attempts reset.", Store.messages_requeue, "requeued")
_bulk_command("pause", "Pause ready messages: they and their hints wait.", Store.messages_pause, "paused")
_bulk_command("resume", "Resume paused messages.", Store.messages_resume, "resumed")
_bulk_command("delete", "Delete messages.", Store.messages_delete, "deleted")


# -- schedules (DESIGN.md §7) --------------------------------------------------------------------------------


@main.group()
def schedules() -> None:
    """Schedules: Quartz cron expressions that publish messages (see the README's "Schedules")."""


@schedules.command("list")
def schedules_list() -> None:
    """Every schedule with its next and last fire time and counts, and whether the scheduler is on."""
    _print(_with_store(admin_schedules.schedules_list))


@schedules.command("show")
@click.argument("name")
def schedules_show(name: str) -> None:
    """One schedule: its next 5 fire times, last fire, whether its last message is pending, its last error."""
    _print(_with_store(lambda store: admin_schedules.schedule_show(store, name)))


@schedules.command("add")
@click.argument("name")
@click.option("--cron", required=True, help="Quartz cron expression, seconds first: '0 0/15 8-18 ? * MON-FRI'.")
@click.option("--message-name", required=True, help="message_name of the messages it publishes.")
@click.option("--hint", help="correlation_hint of its messages (default: the schedule's name).")
@click.option("--payload", help="JSON payload of its messages (default {}).")
@click.option("--headers", help="JSON object of headers added to its messages.")
@click.option("--zone", default="UTC", show_default=True, help="IANA time zone of the expression's wall times.")
@click.option("--no-singleton", is_flag=True, help="Fire even while the last message is still pending.")
@click.option(
    "--misfire",
    type=click.Choice(admin_schedules.MISFIRE_POLICIES),
    default="fire_once_now",
    show_default=True,
    help="What to do with fire times missed while no replica ran.",
)
@click.option("--disabled", is_flag=True, help="Add it disabled.")
def schedules_add(
    name: str,
    cron: str,
    message_name: str,
    hint: str | None,
    payload: str | None,
    headers: str | None,
    zone: str,
    no_singleton: bool,
    misfire: str,
    disabled: bool,
) -> None:
    """Add schedule NAME."""
    payload_value = _json_option(payload, "--payload")
    headers_value = _json_option(headers, "--headers")
    _print(
        _with_store(
            lambda store: admin_schedules.schedule_add(
                store,
                name,
                cron,
                message_name,
                hint=hint,
                payload=payload_value,
                headers=headers_value,
                time_zone=zone,
                singleton=not no_singleton,
                misfire=misfire,
                enabled=not disabled,
            )
        )
    )


@schedules.command("enable")
@click.argument("name", required=False)
def schedules_enable(name: str | None) -> None:
    """Enable schedule NAME, or without a name the whole scheduler."""
    _print(_with_store(lambda store: admin_schedules.schedule_set_enabled(store, name, True)))


@schedules.command("disable")
@click.argument("name", required=False)
def schedules_disable(name: str | None) -> None:
    """Disable schedule NAME, or without a name the whole scheduler."""
    _print(_with_store(lambda store: admin_schedules.schedule_set_enabled(store, name, False)))


@schedules.command("fire")
@click.argument("name")
@click.option(
    "--action", type=click.Choice(admin_schedules.ACTIONS), default="start", show_default=True,
    help="The action header of the message.",
)
def schedules_fire(name: str, action: str) -> None:
    """Publish schedule NAME's message now (action_type manual; the singleton rule does not apply)."""
    _print(_with_store(lambda store: admin_schedules.schedule_fire(store, name, action)))


@schedules.command("delete")
@click.argument("name")
def schedules_delete(name: str) -> None:
    """Delete schedule NAME (the messages it published stay)."""
    _print(_with_store(lambda store: admin_schedules.schedule_delete(store, name)))


@schedules.command("next")
@click.argument("expression", nargs=-1, required=True)
@click.option("--after", help="A wall time in --zone, ISO-8601 (2005-06-01T10:15:00); default: now.")
@click.option("--zone", default="UTC", show_default=True, help="IANA time zone.")
@click.option("--count", type=click.IntRange(min=0), default=5, show_default=True, help="How many fire times.")
def schedules_next(expression: tuple[str, ...], after: str | None, zone: str, count: int) -> None:
    """Print the next fire times of a cron EXPRESSION, one per line (nothing when there is none).

    An invalid expression prints one line starting with "invalid cron expression:" and exits with 2.
    """
    try:
        times = admin_schedules.next_fire_times(" ".join(expression), after, zone, count, datetime.now(UTC))
    except CronError as error:
        click.echo(f"invalid cron expression: {error}")
        sys.exit(2)
    except ValueError as error:
        click.echo(f"invalid argument: {error}")
        sys.exit(2)
    for fire_time in times:
        click.echo(fire_time)
