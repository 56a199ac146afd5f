"""The ``correlation-worker`` command: run, migrate, check-config, send, and the operator commands.

Every error a user can cause (a bad argument, a bad setting, an unreachable database, a refused row) ends the
command with **one line** on stderr, ``correlation-worker: …``, and exit code 2; never a traceback.

``status``, ``messages list`` and ``messages show`` print a table when stdout is a terminal and JSON when it
is not (a pipe, a file, a script), like ``gh`` and ``docker``'s ``--format``; ``--output table|json`` chooses.
"""

from __future__ import annotations

import gc

# The command's imports (SQLAlchemy, pydantic, psycopg, the endpoint's libraries, the worker's own modules) make a
# few hundred thousand objects that live as long as the process. At its default thresholds the cyclic collector
# scanned them again and again as they came: about 200 collections, a tenth of the time the imports took. They are
# made with the collector paused, then frozen out of every later collection (what a running engine collects is its
# own short-lived objects), and the collector resumes as it was.
_collecting = gc.isenabled()
gc.disable()
try:
    import json
    import logging
    import os
    import pwd
    import sys
    import threading
    from collections.abc import Callable, Sequence
    from datetime import UTC, datetime
    from typing import Any, NoReturn

    import click

    from worker import __version__
    from worker.admin import messages as admin_messages
    from worker.admin import operations as admin
    from worker.admin import pauses as admin_pauses
    from worker.admin import schedule_actions
    from worker.admin import schedules as admin_schedules
    from worker.admin.auth import Caller
    from worker.config import ConfigError, Settings, load_settings, parse_duration
    from worker.correlators import Router
    from worker.db.base import sqlite_file
    from worker.db.console import ConsoleFilter
    from worker.db.schema import check_revision_known
    from worker.db.store import MessageFilter, MessageRejected, NewMessage, Store, StoreError
    from worker.echo import bounded_line
    from worker.message import Message, MessageState
    from worker.policy.cron import CronError
    from worker.policy.text import hint_problem, name_problem, shown
    from worker.redact import redact_text, redact_url
    from worker.service.endpoint import EndpointError
    from worker.service.logs import bound, configure_logging, escape_controls
    from worker.service.tracing import check_environment as check_tracing_environment
    from worker.worker import StartupError, Worker, lease_config, replica_identity
finally:
    gc.freeze()
    if _collecting:
        gc.enable()

PROG = "correlation-worker"
MAX_ID = 2**63 - 1  # bigint
LIST_LIMIT = 10_000
CELL = 60  # characters of one table cell in a list (show prints whole values)
OUTPUTS = ("table", "json")


def _fail(message: str, code: int = 2) -> NoReturn:
    """End the command with one line on stderr (never a multi-line text) and a non-zero exit code."""
    line = bounded_line(" ".join(escape_controls(redact_text(str(message))).split()))
    click.echo(f"{PROG}: {line}", err=True)
    sys.exit(code)


class _Commands(click.Group):
    """The top-level group: every usage error is one line (click would print usage, hint and error)."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """Run the command line; a click error becomes one line and exit code 2."""
        kwargs["standalone_mode"] = False
        try:
            return super().main(*args, **kwargs)
        except click.exceptions.NoArgsIsHelpError as error:  # a bare group: its help is the answer
            click.echo(error.format_message(), err=True)
            sys.exit(2)
        except click.ClickException as error:
            where = ""
            context = getattr(error, "ctx", None)
            if context is not None and context.command_path != PROG:
                where = context.command_path.removeprefix(PROG).strip() + ": "
            hint = " (see --help)" if isinstance(error, click.UsageError) else ""
            _fail(f"{where}{error.format_message()}{hint}", error.exit_code or 2)
        except click.exceptions.Abort:
            _fail("aborted", 1)


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


def _with_store(action: Callable[[Store], Any]) -> Any:
    settings = _settings()
    missing_file = sqlite_file(settings.database.url)
    if missing_file is not None and not missing_file.exists():  # opening it would create an empty one
        _fail(
            f"the SQLite database file {missing_file} does not exist: run `correlation-worker migrate` first "
            "(it creates it), or fix CORRELATION_DATABASE__URL"
        )
    store = Store.from_settings(settings.database)
    store.keep_delivery_records(settings.delivery.retention, "cli")
    try:
        revision = store.schema_revision()
        if revision is None:
            _fail("the database has no correlation-worker schema yet: run `correlation-worker migrate` first")
        check_revision_known(revision)
        store.schema_check_complete()
        return action(store)
    except (StoreError, admin.AdminError) as error:
        _fail(str(error))
    finally:
        store.close()


# -- output ----------------------------------------------------------------------------------------------------


def _output_option(command: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--output",
        "-o",
        type=click.Choice(OUTPUTS),
        default=None,
        help="table or json (default: table on a terminal, json otherwise).",
    )(command)


def _wants_table(output: str | None) -> bool:
    return output == "table" if output is not None else sys.stdout.isatty()


def _print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def _cell(value: Any, limit: int | None = CELL) -> str:
    """A table cell: control characters escaped (hints and payloads are producers' text), long text cut."""
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    if limit is not None:
        text = " ".join(text.split())  # one line per row
        text = text if len(text) <= limit else text[: limit - 1] + "…"
    return escape_controls(bound(text))


def _tabulate(rows: Any, **options: Any) -> str:
    """The operator commands' tables; the library is imported only by them (``run`` prints none: its start
    spares the import)."""
    from tabulate import tabulate as table

    return table(rows, **options)


def _status_table(shown: dict[str, Any]) -> str:
    states = shown["messages_by_state"]
    age = shown["oldest_eligible_age_seconds"]
    replicas = shown["slots_per_replica"]
    held = sum(replicas.values())
    parts = [
        _tabulate([(state, count) for state, count in states.items()], headers=["state", "messages"],
                 colalign=("left", "right")),
        "",
        f"oldest eligible message: {'none' if age is None else f'waiting for {age:.3f} s'}",
        "",
        f"slot leases: {held} of {shown['slots']} slots held by {len(replicas)} replicas",
    ]
    if replicas:
        parts.append(_tabulate(sorted(replicas.items()), headers=["replica", "slots held"],
                              colalign=("left", "right")))
    routing = shown["routing"]
    if not routing["agree"]:
        parts += ["", f"routes differ between replicas on {', '.join(routing['disputed'])}: messages of those names "
                  "wait, uncharged, until every replica has the same routes",
                  _tabulate([(r["replica"], r["routes"]) for r in routing["replicas"]],
                            headers=["replica", "routes fingerprint"])]
    for differ in routing["settings_differ"]:
        parts += ["", f"{differ['setting']} differs between replicas:",
                  _tabulate(sorted(differ["values"].items()), headers=["replica", "value"])]
    if shown["targets"]:
        parts += ["", "targets:", _tabulate(
            [(t["target"], t["replica"], t["circuit"], t["since"], t["concurrency_limit"], t["in_flight"],
              _cell(t["reason"])) for t in shown["targets"]],
            headers=["target", "replica", "circuit", "since", "limit", "in flight", "why"],
        )]
    return "\n".join(parts)


LIST_COLUMNS = ("id", "message_id", "message_name", "correlation_hint", "state", "attempt", "next_attempt_at",
                "created_at", "last_error")


def _list_table(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "no messages"
    table = [[_cell(row[column]) for column in LIST_COLUMNS] for row in rows]
    return _tabulate(table, headers=[c.replace("correlation_", "") for c in LIST_COLUMNS], disable_numparse=True)


def _show_table(row: dict[str, Any]) -> str:
    lines = []
    for field, value in row.items():
        shown = json.dumps(value, indent=2, ensure_ascii=False) if isinstance(value, dict | list) else value
        lines.append((field, _cell(shown, limit=None)))
    return _tabulate(lines, tablefmt="plain", disable_numparse=True)


# -- arguments ---------------------------------------------------------------------------------------------------

class _Reference(click.ParamType[str]):
    """A message named by its row id (4711) or its producer's message_id (shop-4711-paid)."""

    name = "id or message_id"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        """The reference as text, or a usage error when it cannot name a message."""
        text = str(value)
        if not text.strip() or len(text) > admin_messages.TEXT_MAX or "\x00" in text:
            self.fail(
                f"{value!r} names no message: give its id (a whole number from 1) or its message_id "
                f"(text of at most {admin_messages.TEXT_MAX} characters)", param, ctx,
            )
        return text


REFERENCE = _Reference()


def _json_option(value: str | None, name: str) -> Any:
    """A JSON option's value, given inline, as ``@path`` (the file's text) or as ``-`` (standard input), like
    curl's ``-d``."""
    if value is None:
        return None
    source = ""
    if value == "-":
        source = " from standard input"
        value = sys.stdin.read()
    elif value.startswith("@"):
        path = value[1:]
        source = f" in {path}"
        try:
            with open(path, encoding="utf-8") as file:
                value = file.read()
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            raise click.BadParameter(f"cannot read {path!r}: {reason}", param_hint=name) from None
    try:
        return json.loads(value)
    except ValueError as error:
        raise click.BadParameter(f"not valid JSON{source} ({error})", param_hint=name) from None


def _timestamp(value: str | None) -> datetime | None:
    """An ISO-8601 timestamp; one without a zone is UTC."""
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not an ISO-8601 timestamp such as 2026-12-31T23:59:00Z", param_hint="--expires-at"
        ) from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed


def _selection(ids: tuple[int, ...], name: str | None, hint: str | None, state: str | None) -> MessageFilter:
    return MessageFilter(ids=ids, name=name, hint=hint, state=MessageState(state) if state else None)


# -- commands ------------------------------------------------------------------------------------------------


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name=PROG, message="%(prog)s %(version)s")
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
    except (ConfigError, StartupError, StoreError, EndpointError) as error:
        _fail(str(error))
    _exit_after_run(code)


@main.command()
def migrate() -> None:
    """Create or update the schema, then exit."""
    settings = _settings()
    store = Store.from_settings(settings.database)
    try:
        before, after = store.schema_migrate()
        store.schema_check_complete()  # a revision recorded as current may name tables dropped since
        schema = store.schema_name()
    except StoreError as error:
        _fail(str(error))
    finally:
        store.close()
    where = redact_url(settings.database.url)
    where = where if schema is None else f"schema {schema} of {where}"
    if before == after:
        click.echo(f"schema is current (revision {after}) on {where}")
    else:
        click.echo(f"schema migrated from {before or 'nothing'} to {after} on {where}")


@main.command("check-config")
def check_config() -> None:
    """Validate the settings and print the effective configuration (credentials hidden)."""
    settings = _settings()
    try:
        for warning in check_tracing_environment():
            click.echo(f"{PROG}: warning: {warning}", err=True)
        routes = Router.from_settings(settings.correlators).describe()
        lease_config(settings)
    except ConfigError as error:
        _fail(str(error))
    data = settings.redacted()
    data["correlators"] = routes
    _print_json(data)


@main.command()
@click.argument("name")
@click.argument("hint")
@click.option("--payload", help="JSON payload (default {}); @path reads it from a file, - from standard input.")
@click.option("--headers", help="JSON object of headers; @path reads it from a file, - from standard input.")
@click.option(
    "--message-id",
    help="Producer id, unique while its message is in the table: sending it again meanwhile inserts nothing; "
    "once the message is correlated (deleted), the same id is a new message.",
)
@click.option("--ttl", help="Time to live, ISO-8601 (PT30S).")
@click.option("--expires-at", help="ISO-8601 timestamp after which the message is dropped (UTC if no zone).")
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
    for value, problem, param in ((name, name_problem(name), "NAME"), (hint, hint_problem(hint), "HINT")):
        if problem is not None:
            raise click.BadParameter(f"{shown(value)} {problem}", param_hint=param)
    try:
        time_to_live = parse_duration(ttl) if ttl is not None else None
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--ttl") from None
    header_values = _json_option(headers, "--headers")
    if header_values is not None and not isinstance(header_values, dict):
        raise click.BadParameter(
            f'must be a JSON object such as {{"tenant": "acme"}}, not {headers}', param_hint="--headers"
        )
    message = NewMessage(
        name=name,
        hint=hint,
        payload=_json_option(payload, "--payload"),
        headers=header_values,
        message_id=message_id,
        time_to_live=time_to_live,
        expires_at=_timestamp(expires_at),
    )

    def insert(store: Store) -> None:
        try:
            row_id = store.messages_insert(message)
        except MessageRejected as error:
            _fail(str(error))
        if row_id is None:
            assert message_id is not None
            holder = store.messages_get_by_message_id(message_id)
            click.echo(admin_messages.held_message_id(message_id, holder))
        else:
            click.echo(f"inserted message {row_id}")

    _with_store(insert)


@main.command()
@_output_option
def status(output: str | None) -> None:
    """Messages by state, the oldest eligible message's age, the slots each replica holds, and the network
    targets' circuits."""
    shown = _with_store(admin.status)
    click.echo(_status_table(shown)) if _wants_table(output) else _print_json(shown)


@main.group()
def messages() -> None:
    """List and show messages."""


@messages.command("list")
@click.option(
    "--state",
    type=click.Choice([s.value for s in MessageState] + list(admin_messages.CENSUS_STATES)),
    help="Only in this state (waiting: ready, due later; expired: past expires_at), as `status` counts them.",
)
@click.option("--name", help="message_name")
@click.option("--hint", help="correlation_hint")
@click.option("--after", type=click.IntRange(0, MAX_ID), default=0, show_default=True,
              help="Only ids above this (paging).")
@click.option("--limit", type=click.IntRange(1, LIST_LIMIT), default=50, show_default=True)
@_output_option
def messages_list(
    state: str | None, name: str | None, hint: str | None, after: int, limit: int, output: str | None
) -> None:
    """Messages in id order, optionally filtered."""
    if state in admin_messages.CENSUS_STATES:
        query = {"state": state, "name": name or "", "hint": hint or ""}
        wanted, _, _ = admin_messages.parse_listing(query)

        def census_page(store: Store) -> list[Message]:
            found: list[Message] = []
            cursor: int | None = after
            while cursor is not None and len(found) < limit:  # a window may come back short: read on
                page = store.console_messages(
                    wanted, after=cursor, limit=limit - len(found), scan=admin_messages.SCAN_WINDOW
                )
                found += [listed.message for listed in page.rows]
                cursor = page.next
            return found

        rows = _with_store(census_page)
    else:
        # The console's keyset pages: a name or hint without a state is read as one index range per state.
        wanted = ConsoleFilter(_selection((), name, hint, state))
        rows = _with_store(
            lambda store: [
                listed.message for listed in store.console_messages(wanted, after=after, limit=limit, scan=0).rows
            ]
        )
    shown = [admin.message_as_dict(m) for m in rows]
    click.echo(_list_table(shown)) if _wants_table(output) else _print_json(shown)


@messages.command("show")
@click.argument("reference")
@click.option(
    "--by",
    type=click.Choice(["auto", "id", "message_id"]),
    default="auto",
    show_default=True,
    help="What REFERENCE is: the row id, the producer's message_id, or (auto) whichever matches.",
)
@_output_option
def messages_show(reference: str, by: str, output: str | None) -> None:
    """One message with its last error, by its id (4711) or its producer's message_id (shop-4711-paid)."""
    if by == "id" and not admin_messages.is_row_id(reference):
        raise click.BadParameter(f"{reference!r} is not a message id (a number from 1)", param_hint="REFERENCE")

    def find(store: Store) -> Message | None:
        by_id = store.messages_get(int(reference)) if by != "message_id" and _is_row_id(reference) else None
        by_message_id = store.messages_get_by_message_id(reference) if by != "id" else None
        if by_id is not None and by_message_id is not None and by_id.id != by_message_id.id:
            _fail(
                f"{reference!r} is the id of message {by_id.id} and the message_id of message {by_message_id.id}: "
                "say which with --by id or --by message_id"
            )
        return by_id or by_message_id

    message = _with_store(find)
    if message is None:
        what = {"id": "id", "message_id": "message_id"}.get(by, "id or message_id")
        _fail(f"no message with {what} {reference!r}")
    shown = admin.message_as_dict(message)
    click.echo(_show_table(shown)) if _wants_table(output) else _print_json(shown)


def _is_row_id(reference: str) -> bool:
    return admin_messages.is_row_id(reference)


def _cli_caller() -> Caller:
    """The CLI's audit identity: ``cli:<operating system user>``."""
    try:
        user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        user = str(os.getuid())
    return Caller(f"cli:{user}", "cli", can_write=True)


def _filter_options(command: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(
        [
            click.argument("ids", nargs=-1, type=REFERENCE),
            click.option("--name", "message_name", help="Every message of this message_name."),
            click.option("--hint", help="Every message of this correlation_hint."),
            click.option("--state", type=click.Choice([s.value for s in MessageState]), help="Only in this state."),
            click.option("--all", "everything", is_flag=True, help="Every message (no filter)."),
        ]
    ):
        command = option(command)
    return command


def _present_rows(action: str, references: tuple[str, ...], name: str | None, hint: str | None, state: str | None,
                  everything: bool) -> int:
    """Apply a bulk action to the messages present now (in chunks, audited); returns how many changed. The
    messages are named by id or message_id, alike."""

    def apply(store: Store) -> int:
        selection = _selection(admin_messages.resolve_references(store, references), name, hint, state)
        admin.require_selection(selection, everything, action)
        result = admin_messages.bulk(store, _cli_caller(), action, selection, everything)
        return int(result["affected"])

    return int(_with_store(apply))


def _durable_scope(name: str | None, hint: str | None, everything: bool) -> tuple[str, str]:
    chosen = [(scope, value) for scope, value in (("name", name), ("hint", hint)) if value is not None]
    if everything:
        chosen.append(("all", ""))
    if len(chosen) != 1:
        raise click.UsageError(
            "give one of --name, --hint or --all for a durable pause; add --only-present (or give ids "
            "or --state) to act on the messages present now"
        )
    return chosen[0]


def _bulk_command(name: str, help_text: str, verb: str) -> None:
    @main.command(name, help=help_text)
    @_filter_options
    def command(
        ids: tuple[str, ...], message_name: str | None, hint: str | None, state: str | None, everything: bool
    ) -> None:
        click.echo(f"{verb} {_present_rows(name, ids, message_name, hint, state, everything)} messages")


_bulk_command("requeue", "Dead messages back to ready, attempts reset (in chunks; audited).", "requeued")
_bulk_command("delete", "Delete messages (in chunks; audited).", "deleted")


@main.command("pause")
@_filter_options
@click.option("--reason", default="", help="Why (shown with the pause and in the hint's view).")
@click.option("--only-present", is_flag=True, help="Pause only the messages present now (not a durable pause).")
def pause(
    ids: tuple[str, ...], message_name: str | None, hint: str | None, state: str | None, everything: bool,
    reason: str, only_present: bool,
) -> None:
    """Pause a message name (--name), a hint (--hint) or everything (--all) durably: also messages inserted
    later wait until `resume`. With message ids, --state or --only-present: pause the ready messages present
    now that match."""
    if ids or state is not None or only_present:
        click.echo(f"paused {_present_rows('pause', ids, message_name, hint, state, everything)} messages")
        return
    scope, target = _durable_scope(message_name, hint, everything)

    def create(store: Store) -> dict[str, Any]:
        return admin_pauses.add_pause(store, _cli_caller(), scope, target, reason)

    shown = _with_store(create)
    selector = {"name": f"--name {target}", "hint": f"--hint {target}", "all": "--all"}[scope]
    click.echo(
        f"paused {admin_pauses.describe(scope, target)} (pause {shown['id']}): its messages wait, also those "
        f"inserted later, until `{PROG} resume {selector}`"
    )


def _lift_chunk() -> int:
    """Messages a lift resumes per transaction: the console's chunk size (CORRELATION_ADMIN__CHUNK_SIZE)."""
    return _settings().admin.chunk_size


@main.command("resume")
@_filter_options
@click.option("--pause", "pause_id", type=click.IntRange(1, MAX_ID), help="Lift the durable pause with this id.")
@click.option("--only-present", is_flag=True, help="Resume the paused messages present now (not a durable pause).")
def resume(
    ids: tuple[str, ...], message_name: str | None, hint: str | None, state: str | None, everything: bool,
    pause_id: int | None, only_present: bool,
) -> None:
    """Lift the durable pause of a message name (--name), a hint (--hint), everything (--all) or by id (--pause):
    the messages it paused are resumed. With message ids, --state or --only-present: resume the paused
    messages present now that match."""
    if pause_id is not None:
        if ids or message_name or hint or state or everything or only_present:
            raise click.UsageError("--pause takes no other filter")
        result = _with_store(
            lambda store: admin_pauses.lift_pause(store, _cli_caller(), pause_id, chunk=_lift_chunk())
        )
    elif ids or state is not None or only_present:
        click.echo(f"resumed {_present_rows('resume', ids, message_name, hint, state, everything)} messages")
        return
    else:
        scope, target = _durable_scope(message_name, hint, everything)
        result = _with_store(
            lambda store: admin_pauses.lift_pause_of(store, _cli_caller(), scope, target, chunk=_lift_chunk())
        )
    lifted = result["lifted"]
    click.echo(
        f"lifted pause {lifted['id']} of {admin_pauses.describe(lifted['scope'], lifted['target'] or '')}; "
        f"resumed {result['resumed']} messages it had paused"
    )


@main.command("pauses")
@_output_option
def pauses_list(output: str | None) -> None:
    """The durable pauses: what each holds back, why, who paused it and when."""
    shown = _with_store(admin_pauses.list_pauses)
    if not _wants_table(output):
        _print_json(shown)
        return
    if not shown:
        click.echo("nothing is paused")
        return
    rows = [
        [p["id"], "everything" if p["scope"] == "all" else f"{p['scope']} {_cell(p['target'])}", _cell(p["reason"]),
         _cell(p["created_by"]), p["created_at"]]
        for p in shown
    ]
    click.echo(_tabulate(rows, headers=["id", "pauses", "reason", "by", "since"], disable_numparse=True))


# -- schedules (DESIGN.md §7) --------------------------------------------------------------------------------


@main.group()
def schedules() -> None:
    """Schedules: Quartz cron expressions that publish messages (see docs/guides/schedules.md)."""


@schedules.command("list")
def schedules_list() -> None:
    """Every schedule with its next and last fire time and counts, and whether the scheduler is on."""
    _print_json(_with_store(admin_schedules.schedules_list))


@schedules.command("show")
@click.argument("name")
def schedules_show(name: str) -> None:
    """One schedule: its next 5 fire times, last fire, whether its last message is pending, its last error."""
    _print_json(_with_store(lambda store: admin_schedules.schedule_show(store, name)))


@schedules.command("add")
@click.argument("name")
@click.option("--cron", required=True, help="Quartz cron expression, seconds first: '0 0/15 8-18 ? * MON-FRI'.")
@click.option("--message-name", required=True, help="message_name of the messages it publishes.")
@click.option("--hint", help="correlation_hint of its messages (default: the schedule's name).")
@click.option("--payload", help="JSON payload of its messages (default {}); @path: from a file, -: from stdin.")
@click.option("--headers", help="JSON object of headers added to its messages; @path: from a file, -: from stdin.")
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
    _print_json(
        _with_store(
            lambda store: schedule_actions.add(
                store,
                _cli_caller(),
                {
                    "name": name,
                    "cron": cron,
                    "message_name": message_name,
                    "correlation_hint": hint,
                    "payload": payload_value,
                    "headers": headers_value,
                    "time_zone": zone,
                    "singleton": not no_singleton,
                    "misfire": misfire,
                    "enabled": not disabled,
                },
            )
        )
    )


@schedules.command("enable")
@click.argument("name", required=False)
def schedules_enable(name: str | None) -> None:
    """Enable schedule NAME, or without a name the whole scheduler."""
    _print_json(_with_store(lambda store: schedule_actions.set_enabled(store, _cli_caller(), name, True)))


@schedules.command("disable")
@click.argument("name", required=False)
def schedules_disable(name: str | None) -> None:
    """Disable schedule NAME, or without a name the whole scheduler."""
    _print_json(_with_store(lambda store: schedule_actions.set_enabled(store, _cli_caller(), name, False)))


@schedules.command("fire")
@click.argument("name")
@click.option(
    "--action", type=click.Choice(admin_schedules.ACTIONS), default="start", show_default=True,
    help="The action header of the message.",
)
def schedules_fire(name: str, action: str) -> None:
    """Publish schedule NAME's message now (action_type manual; the singleton rule does not apply)."""
    _print_json(_with_store(lambda store: schedule_actions.fire(store, _cli_caller(), name, action)))


@schedules.command("delete")
@click.argument("name")
def schedules_delete(name: str) -> None:
    """Delete schedule NAME (the messages it published stay)."""
    _print_json(_with_store(lambda store: schedule_actions.delete(store, _cli_caller(), name)))


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
