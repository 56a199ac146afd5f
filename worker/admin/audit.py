"""The audit trail: every mutating action of an operator (API, pages, CLI) is a row of ``correlation_audit``
with who (the token's name, never the secret), through which face, what, which filter, how many, and when.

The actions write their rows themselves (:mod:`worker.admin.messages`, :mod:`worker.admin.pauses`); this module
reads them back, newest first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worker.admin.errors import BadRequest
from worker.admin.messages import is_row_id, whole_number
from worker.db.console import AuditEntry
from worker.db.store import Store

DEFAULT_LIMIT = 50
MAX_LIMIT = 500


def entry_as_dict(entry: AuditEntry) -> dict[str, Any]:
    """An audit row as JSON-ready data."""
    return {
        "id": entry.id,
        "at": entry.at.isoformat(),
        "actor": entry.actor,
        "via": entry.via,
        "action": entry.action,
        "target": entry.target,
        "affected": entry.affected,
        "error": entry.error,
    }


def parse_page(params: Mapping[str, str]) -> tuple[int | None, int]:
    """``after`` (the ``next`` of the previous page: rows older than it) and ``limit`` from query parameters."""
    unknown = sorted(set(params) - {"after", "limit"})
    if unknown:
        raise BadRequest(f"unknown parameter(s) {', '.join(unknown)}; use after and limit")
    after = params.get("after") or None
    if after is not None and not is_row_id(after):
        raise BadRequest(f"'after' must be the 'next' of a previous page (a whole number), not {after!r}")
    limit_text = params.get("limit") or str(DEFAULT_LIMIT)
    if not whole_number(limit_text, MAX_LIMIT):
        raise BadRequest(f"'limit' must be a whole number from 1 to {MAX_LIMIT}, not {limit_text!r}")
    return (None if after is None else int(after)), int(limit_text)


def audit_page(store: Store, before: int | None, limit: int) -> dict[str, Any]:
    """A page of the audit trail, newest first: ``{"items": [...], "next": cursor or None}``."""
    rows, cursor = store.audit_page(before=before, limit=limit)
    return {"items": [entry_as_dict(row) for row in rows], "next": cursor}
