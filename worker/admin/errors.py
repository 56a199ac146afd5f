"""Errors an operator's request can meet, each with the HTTP status the API answers it with.

The CLI prints the message as its one line; the API answers ``{"error": message}`` with :attr:`status`; the
pages show the message. Messages are one sentence naming the thing and the fix.
"""

from __future__ import annotations

from worker.echo import bounded_line


class AdminError(Exception):
    """An operator request that cannot be carried out as given (a bad request unless a subclass says more)."""

    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(bounded_line(message))  # it may echo what was sent: at most one readable line


class BadRequest(AdminError):
    """The request is malformed: a bad filter, value or body."""

    status = 400


class Forbidden(AdminError):
    """The caller may read but not act (a read-only token)."""

    status = 403


class NotFound(AdminError):
    """The message, pause or page asked for does not exist."""

    status = 404


class MethodNotAllowed(AdminError):
    """The route exists for other methods (``allow`` names them)."""

    status = 405

    def __init__(self, message: str, allow: list[str]) -> None:
        super().__init__(message)
        self.allow = allow


class Interrupted(AdminError):
    """A bulk action stopped part way by the database (a timeout, a deadlock): what was done stays done."""

    status = 503


class Conflict(AdminError):
    """The request clashes with what is there (a pause that already exists)."""

    status = 409


def refuse_nul(*texts: str) -> None:
    """A NUL character in a request's path or query: no stored text can hold one, so nothing could match it (and
    the database would refuse the query with an error rather than an answer)."""
    if any("\x00" in text for text in texts):
        raise BadRequest("the request holds a NUL character (%00), which no stored text can contain")
