"""What a database failure means for the worker: driver errors translated into the store's own exceptions.

The store calls :func:`translate` at its boundary (``Store._transaction`` and the ``schema_*`` methods), so that
nothing above the ``db`` layer sees a driver exception, and every message a user may read is one sentence
that names the thing and the fix, with credentials masked:

==================================  ===========================  ==========================================
driver error                        store exception              what the worker does
==================================  ===========================  ==========================================
connection refused, reset, timeout  :class:`DatabaseUnavailable`  waits and retries (transient)
lock or statement timeout,          :class:`DatabaseBusy`         waits and retries (transient)
deadlock, serialization failure
wrong password, unknown role,       :class:`DatabaseAccessDenied`  stops with one line (retrying cannot help)
unknown database, no pg_hba entry
insufficient privilege (42501)      :class:`PermissionDenied`     the operation fails with one line
a constraint refused a row          :class:`MessageRejected`      the producer's insert fails, naming it
a value the column cannot hold      :class:`ValueRefused`         the operation fails with one line
a read-only database (25006)        :class:`DatabaseReadOnly`     not ready; the operation fails, counted
a table or column gone (42P01)      :class:`SchemaIncomplete`     not ready; the operation fails, counted
==================================  ===========================  ==========================================

A schema migrated by a newer release is :class:`SchemaTooNew` (raised by the schema module, not translated); one
that lacks tables or columns its revision has is :class:`SchemaIncomplete` (raised by the store's schema check);
a database whose encoding is not UTF-8, or whose search path misses the tables another schema holds, is
:class:`DatabaseUnsuitable` (raised by the store as it logs in or reads the schema).
"""

from __future__ import annotations

import re

from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, InterfaceError, OperationalError

from worker.redact import redact_text

URL_SETTING = "CORRELATION_DATABASE__URL"


class StoreError(Exception):
    """A database operation failed; the message says what and how to fix it."""


class DatabaseUnavailable(StoreError):
    """The database cannot be reached (or the connection broke); retry later."""


class DatabaseBusy(StoreError):
    """A statement waited too long for a lock, ran past its timeout, or lost a deadlock; retry later."""


class LeaseLost(StoreError):
    """A fenced write found that this replica no longer holds the lease; nothing was written."""


class InvalidLockName(StoreError, ValueError):
    """A lock name (or holder) that the lock table cannot store as given; it is never truncated."""


class DatabaseAccessDenied(StoreError):
    """The database answered and refused this worker's login or database name: retrying cannot help."""


class AuthenticationFailed(DatabaseAccessDenied):
    """The user name or password in the database URL is wrong."""


class PermissionDenied(StoreError):
    """The database user lacks a privilege the operation needs (e.g. a SELECT-only user writing)."""


class MessageRejected(StoreError):
    """The schema refused a row; ``constraint`` names the rule it broke."""

    def __init__(self, message: str, constraint: str | None = None) -> None:
        super().__init__(message)
        self.constraint = constraint


class ValueRefused(StoreError):
    """The database refused a value its column cannot hold (e.g. a NUL character in JSON)."""


class DatabaseReadOnly(StoreError):
    """The database refused a write because it is read-only (a standby after a failover, or read-only set on it)."""


class SchemaTooNew(StoreError):
    """The database schema was migrated by a newer release than this one."""


class SchemaIncomplete(StoreError):
    """The database records the newest revision but lacks tables or columns of it (dropped or altered by hand)."""


class DatabaseUnsuitable(StoreError):
    """The database is one the worker cannot work with as it is (an encoding other than UTF-8, a search path that
    misses the worker's tables): fixed by an operator, never by retrying."""


_CONSTRAINT = re.compile(r'constraint "?([a-z_0-9]+)"?', re.IGNORECASE)
_SQLITE_CHECK = re.compile(r"CHECK constraint failed: ([a-z_0-9]+)", re.IGNORECASE)
# SQLSTATEs of a statement that waited or ran too long, or lost to a concurrent transaction: transient.
_BUSY_STATES = {
    "55P03": "a lock wait exceeded lock_timeout",
    "57014": "a statement exceeded statement_timeout",
    "40P01": "a deadlock was detected",
    "40001": "a serialization conflict",
}
_FATAL = re.compile(r"FATAL:\s+(.*)")

# libpq reports a failed login without an SQLSTATE; these are its (and the server's) words for one.
_AUTHENTICATION = (
    "password authentication failed",
    "authentication failed for user",
    "no password supplied",
    "fe_sendauth",
    "role \"",  # role "x" does not exist
    "invalid password",
)
_ACCESS = (
    "no pg_hba.conf entry",
    "does not exist",  # database "x" does not exist
    "is not permitted to log in",
    "permission denied for database",
)
_AUTH_SQLSTATES = {"28000", "28P01"}


def first_line(error: BaseException) -> str:
    """The first line of a driver error's own message (without SQLAlchemy's statement dump), redacted."""
    original = getattr(error, "orig", None)
    text = str(original if original is not None else error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return redact_text(line)


def _sqlstate(error: DBAPIError) -> str | None:
    state = getattr(error.orig, "sqlstate", None) or getattr(error.orig, "pgcode", None)
    return str(state) if state else None


def _server_reason(error: DBAPIError) -> str:
    """The server's FATAL reason when there is one (``password authentication failed for user "app"``)."""
    text = str(error.orig if error.orig is not None else error)
    found = _FATAL.search(text)
    return redact_text(found.group(1).strip()) if found else first_line(error)


def rejected(error: IntegrityError) -> MessageRejected:
    """A row refused by a constraint, naming the constraint when the driver says which."""
    detail = first_line(error)
    match = _SQLITE_CHECK.search(detail) or _CONSTRAINT.search(detail)
    constraint = match.group(1) if match else None
    if "UNIQUE" in detail.upper() or "duplicate key" in detail:
        constraint = constraint or "correlation_message_message_id_key"
    return MessageRejected(f"the database refused the message: {detail}", constraint)


def unavailable(error: DBAPIError) -> DatabaseUnavailable:
    """The database could not be reached or the connection broke."""
    return DatabaseUnavailable(f"database unavailable: {first_line(error)}")


def _login_refused(error: DBAPIError) -> DatabaseAccessDenied | None:
    text = str(error.orig if error.orig is not None else error).lower()
    state = _sqlstate(error)
    reason = _server_reason(error)
    if state in _AUTH_SQLSTATES or any(marker in text for marker in _AUTHENTICATION):
        return AuthenticationFailed(
            f"database authentication failed: {reason}; check the user name and password in {URL_SETTING}"
        )
    refused = "connection failed" in text and any(marker in text for marker in _ACCESS)
    if refused or state == "3D000":
        return DatabaseAccessDenied(
            f"the database server refused the connection: {reason}; fix {URL_SETTING} "
            "(or create the database, or allow this client in pg_hba.conf)"
        )
    return None


def connection_lost(error: StoreError) -> bool:
    """True when a statement failed because its pooled connection's session had ended (a server restart, a
    failover, sessions ended by an operator): the pool replaces the connections opened before, so a second try
    meets a fresh one."""
    cause = error.__cause__
    return isinstance(cause, DBAPIError) and bool(cause.connection_invalidated)


def from_database(error: BaseException) -> bool:
    """True when an error the store did not translate came from the database (its driver raised it), rather than
    from the worker's own code."""
    import sqlite3

    import psycopg

    return isinstance(error, DBAPIError | psycopg.Error | sqlite3.Error)


def translate(error: DBAPIError) -> StoreError | None:
    """The store exception a driver error stands for; None for an error that is a bug (re-raise it as is)."""
    if isinstance(error, IntegrityError):
        return rejected(error)
    state = _sqlstate(error)
    if state in _BUSY_STATES:
        return DatabaseBusy(f"database busy ({_BUSY_STATES[state]}): {first_line(error)}")
    if state == "25006" or "readonly database" in first_line(error):
        return DatabaseReadOnly(
            f"the database is read-only: {first_line(error)}; point {URL_SETTING} at the primary (a failover may "
            "have left this replica on a standby)"
        )
    if state in ("42P01", "42703") or first_line(error).startswith(("no such table", "no such column")):
        return SchemaIncomplete(
            f"the database schema lacks a table or column the worker uses: {first_line(error)}; see "
            "`correlation-worker migrate`"
        )
    if "database is locked" in first_line(error):  # SQLite: another process held the file past busy_timeout
        return DatabaseBusy(f"database busy: {first_line(error)}")
    if isinstance(error, OperationalError | InterfaceError):
        return _login_refused(error) or unavailable(error)
    if _sqlstate(error) == "42501":
        return PermissionDenied(
            f"the database user may not do this: {first_line(error)}; grant it the privileges that "
            "`correlation-worker migrate` gives the schema's owner (SELECT, INSERT, UPDATE, DELETE on the "
            "correlation_* tables)"
        )
    if isinstance(error, DataError):
        return ValueRefused(f"the database refused a value: {first_line(error)}")
    if error.connection_invalidated:
        return unavailable(error)
    return None
