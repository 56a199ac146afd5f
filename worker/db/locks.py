"""Statements on ``correlation_lock``: ShedLock-style named locks with a fence, the slot leases' rows.

A term is decided by the database clock inside the statement that grants, renews, checks or ends it, never by
a replica's clock. Taking a lock never waits on another session: rows are created (only when missing) in a
transaction of their own, and free or expired rows are taken with ``FOR UPDATE SKIP LOCKED``; a renewal never
waits for a row another session holds (PostgreSQL: every term in one statement skipping such rows; SQLite: each
term in a transaction of its own), so that one busy row delays only itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.sql import TextClause
from sqlalchemy.sql.expression import TextualSelect

from worker.db.base import Fence, LockRow, StoreBase, driver_rows, text_array
from worker.db.errors import DatabaseBusy, InvalidLockName, LeaseLost, StoreError
from worker.db.schema import LOCK_NAME_MAX_LENGTH, UtcDateTime, lock_table


class LockStatements(StoreBase):
    """Every statement on the lock table."""

    def locks_list(self) -> list[LockRow]:
        """Every row of the lock table, by name."""
        statement = select(lock_table).order_by(lock_table.c.name)
        return self._run(
            lambda c: [
                LockRow(r.name, r.lock_until, r.locked_at, r.locked_by, r.fence) for r in c.execute(statement)
            ]
        )

    def locks_count_lapsed(self, prefix: str) -> int:
        """Rows of a prefix whose term ran out without being renewed or released (their holder stopped)."""
        params = {"prefix": prefix, "prefix_length": len(prefix)}
        statement = _lock_statements(self.dialect).lapsed
        return int(self._run(lambda c: c.execute(statement, params).scalar_one()))

    def locks_list_held(self) -> list[LockRow]:
        """The rows whose term is still running by the database clock, by name."""
        statement = _lock_statements(self.dialect).held
        return self._run(lambda c: [_lock_row(r) for r in c.execute(statement)])

    def locks_view(self) -> tuple[list[LockRow], datetime]:
        """The rows whose term is still running, by name, and the database clock they were read at."""
        statement = _lock_statements(self.dialect).held

        def work(connection: Connection) -> tuple[list[LockRow], datetime]:
            return [_lock_row(r) for r in connection.execute(statement)], self._now(connection)

        return self._run(work)

    def lock_try_acquire(self, name: str, holder: str, lock_at_most_for: timedelta) -> Fence | None:
        """Take the named lock if it is free or expired (creating its row if missing); None if it is held.

        The term runs until ``now() + lock_at_most_for`` by the database clock, and the fence goes up by one.
        """
        _check_lock_name(name)
        params = {"name": name, "holder": _checked_holder(holder), "at_most": _seconds(lock_at_most_for)}
        statement = _lock_statements(self.dialect).acquire
        row = self._write(lambda c: c.execute(statement, params).first())
        return None if row is None else Fence(name, holder, int(row.fence))

    def lock_try_acquire_many(
        self, names: Sequence[str], holder: str, lock_at_most_for: timedelta, limit: int
    ) -> list[Fence]:
        """Take up to ``limit`` of the named locks that are free or expired, skipping rows others are taking.

        Missing rows are created free first (the slot rows exist from the migration on, so usually none).
        Returns the terms acquired, by name.
        """
        for name in names:
            _check_lock_name(name)
        params = {"holder": _checked_holder(holder), "at_most": _seconds(lock_at_most_for), "limit": limit}
        if not names or limit <= 0:
            return []
        statements = _lock_statements(self.dialect)
        wanted = sorted(set(names))  # one order for every replica: concurrent creators never deadlock
        present = set(self._run(lambda c: c.execute(statements.existing, {"names": wanted}).scalars().all()))
        missing = [name for name in wanted if name not in present]
        if missing:  # its own transaction, so that the rows exist for everyone before anyone locks them
            self._write(lambda c: c.execute(statements.create, [{"name": name} for name in missing]))
        rows = self._write(lambda c: c.execute(statements.acquire_many, {**params, "names": wanted}).all())
        return sorted((Fence(row.name, holder, int(row.fence)) for row in rows), key=lambda f: f.name)

    def lock_extend(self, fence: Fence, lock_at_most_for: timedelta) -> bool:
        """Renew a term to ``now() + lock_at_most_for``; False when it expired, was released or taken over."""
        statement = _lock_statements(self.dialect).extend
        params = {**_term(fence), "at_most": _seconds(lock_at_most_for)}
        return bool(self._write(lambda c: c.execute(statement, params).rowcount == 1))

    def lock_extend_each(
        self, fences: Sequence[Fence], lock_at_most_for: timedelta
    ) -> tuple[list[Fence], list[Fence]]:
        """Renew the terms, a busy row delaying only its own (PostgreSQL: one statement skipping rows other
        sessions hold; SQLite: a transaction each); returns (renewed, busy).

        A term that could not be renewed because its row was locked past the lock timeout is *busy*: neither
        renewed nor lost (it may be renewed at the next round). The rest are lost.
        """
        if self.dialect == "postgresql" and fences:
            return self._extend_together(fences, lock_at_most_for)
        renewed: list[Fence] = []
        busy: list[Fence] = []
        for fence in sorted(fences, key=lambda fence: fence.name):
            try:
                if self.lock_extend(fence, lock_at_most_for):
                    renewed.append(fence)
            except DatabaseBusy:
                busy.append(fence)
        return renewed, busy

    def _extend_together(
        self, fences: Sequence[Fence], lock_at_most_for: timedelta
    ) -> tuple[list[Fence], list[Fence]]:
        """PostgreSQL: every term in one statement, its own transaction, skipping the rows other sessions hold
        (each such term is busy, never waited for: no row lock holds up the renewal of the others)."""
        params = {
            "names": text_array(fence.name for fence in fences),
            "holders": text_array(fence.holder for fence in fences),
            "fences": "{" + ",".join(str(fence.fence) for fence in fences) + "}",
            "at_most": _seconds(lock_at_most_for),
        }
        rows = self._driver_statements(lambda driver: driver_rows(driver, _EXTEND_TOGETHER_PG, params))
        renewed = {name for name, kind in rows if kind == "renewed"}
        busy = {name for name, kind in rows if kind == "busy"}
        ordered = sorted(fences, key=lambda fence: fence.name)
        return [f for f in ordered if f.name in renewed], [f for f in ordered if f.name in busy]

    def lock_extend_many(self, fences: Sequence[Fence], lock_at_most_for: timedelta) -> list[Fence]:
        """Renew several terms (as :meth:`lock_extend_each`); returns those renewed."""
        return self.lock_extend_each(fences, lock_at_most_for)[0]

    def lock_release(self, fence: Fence, lock_at_least_for: timedelta = timedelta(0)) -> bool:
        """End a term, though never before ``locked_at + lock_at_least_for``; False if it was not held."""
        params = {**_term(fence), "at_least": _seconds(lock_at_least_for, allow_zero=True)}
        statement = _lock_statements(self.dialect).release
        return bool(self._write(lambda c: c.execute(statement, params).rowcount == 1))

    def locks_delete_expired(self, prefix: str, expired_for: timedelta) -> int:
        """Delete rows named ``prefix…`` that expired more than ``expired_for`` ago; returns how many.

        Only for rows that never fence anything (such as replica membership): a deleted row starts again
        at fence 1.
        """
        if not prefix:
            raise ValueError("deleting expired locks needs a name prefix (such as 'member:')")
        ago = _seconds(expired_for, allow_zero=True)
        params = {"prefix": prefix, "prefix_length": len(prefix), "ago": ago}
        statement = _lock_statements(self.dialect).delete_expired
        return self._write(lambda c: c.execute(statement, params).rowcount)

    def lock_check_fence(self, connection: Connection, fence: Fence) -> None:
        """Lock a lease row for the rest of a transaction; LeaseLost unless the term still runs."""
        row = connection.execute(_lock_statements(self.dialect).fence_check, {"name": fence.name}).first()
        if row is None or row.locked_by != fence.holder or row.fence != fence.fence or not row.held:
            raise LeaseLost(f"lease {fence.name} is no longer held by {fence.holder} (fence {fence.fence})")


# -- lock statements ------------------------------------------------------------------------------------
# A term is decided by the database clock inside the statement that grants, renews, checks or ends it, never
# by a replica's clock: replicas whose clocks disagree still agree on who holds what. PostgreSQL's now() is
# the start of the (short, one-statement) transaction; SQLite gets the same fixed-width UTC text that
# UtcDateTime stores, so that its text comparisons order times correctly.

HOLDER_MAX_LENGTH = 255  # correlation_lock.locked_by

# Renew running terms of their holders and fences, skipping rows another session holds locked: those still
# running in the statement's snapshot are busy (renewed at a later round, or lost if they run out meanwhile).
_EXTEND_TOGETHER_PG = text(
    """
    WITH t AS MATERIALIZED (
        SELECT * FROM unnest(CAST(:names AS text[]), CAST(:holders AS text[]), CAST(:fences AS bigint[]))
            AS t(name, holder, fence)
    ), running AS MATERIALIZED (
        SELECT l.name FROM correlation_lock l JOIN t ON l.name = t.name
         WHERE l.locked_by = t.holder AND l.fence = t.fence AND l.lock_until > now()
    ), mine AS MATERIALIZED (
        SELECT l.name FROM correlation_lock l
         WHERE l.name = ANY(ARRAY(SELECT name FROM running)) ORDER BY l.name FOR UPDATE SKIP LOCKED
    ), renewed AS (
        UPDATE correlation_lock l SET lock_until = now() + make_interval(secs => :at_most)
          FROM t, mine
         WHERE l.name = mine.name AND l.name = t.name AND l.locked_by = t.holder AND l.fence = t.fence
           AND l.lock_until > now()
        RETURNING l.name
    )
    SELECT name, 'renewed' FROM renewed
    UNION ALL
    SELECT name, 'busy' FROM running WHERE name NOT IN (SELECT name FROM mine)
    """
)


@dataclass(frozen=True, slots=True)
class _LockStatements:
    """The lease statements of one dialect."""

    acquire: TextClause
    create: TextClause
    acquire_many: TextClause
    extend: TextClause
    release: TextClause
    fence_check: TextClause
    lapsed: TextClause
    held: TextualSelect
    delete_expired: TextClause
    existing: TextClause


def _build_lock_statements(dialect: str) -> _LockStatements:
    if dialect == "postgresql":
        now = "now()"

        def plus(time: str, seconds: str) -> str:
            return f"{time} + make_interval(secs => :{seconds})"

        def minus(time: str, seconds: str) -> str:
            return f"{time} - make_interval(secs => :{seconds})"

        greatest, now_arg = "greatest", "now()"
        skip_locked, for_update = "FOR UPDATE SKIP LOCKED", "FOR UPDATE"
    else:
        now = "strftime('%Y-%m-%d %H:%M:%f000', 'now')"

        def plus(time: str, seconds: str) -> str:
            return f"strftime('%Y-%m-%d %H:%M:%f000', {time}, printf('%+.6f seconds', :{seconds}))"

        def minus(time: str, seconds: str) -> str:
            return f"strftime('%Y-%m-%d %H:%M:%f000', {time}, printf('%+.6f seconds', -:{seconds}))"

        # SQLite runs one writer at a time, so a plain UPDATE already excludes concurrent takers.
        greatest, now_arg, skip_locked, for_update = "max", "'now'", "", ""
    until = plus(now_arg, "at_most")
    columns = {"lock_until": UtcDateTime, "locked_at": UtcDateTime}
    return _LockStatements(
        # Take one lock: create it held, or take it over when its term has ended; the fence counts terms.
        acquire=text(
            f"""
            INSERT INTO correlation_lock (name, lock_until, locked_at, locked_by, fence)
            VALUES (:name, {until}, {now}, :holder, 1)
            ON CONFLICT (name) DO UPDATE
               SET lock_until = excluded.lock_until, locked_at = excluded.locked_at,
                   locked_by = excluded.locked_by, fence = correlation_lock.fence + 1
             WHERE correlation_lock.lock_until <= {now}
            RETURNING fence
            """
        ),
        # Create missing lock rows free (ended now, never held: fence 0).
        create=text(
            f"""
            INSERT INTO correlation_lock (name, lock_until, locked_at, locked_by, fence)
            VALUES (:name, {now}, {now}, '', 0)
            ON CONFLICT (name) DO NOTHING
            """
        ),
        # Take up to :limit of the named locks whose term has ended, skipping rows another replica is taking;
        # lapsed ones first (their holder stopped: their work waits), then released ones.
        acquire_many=text(
            f"""
            WITH free AS {"MATERIALIZED" if skip_locked else ""} (
                SELECT name FROM correlation_lock
                 WHERE name IN :names AND lock_until <= {now}
                 ORDER BY locked_by = '', name LIMIT :limit
                 {skip_locked}
            )
            UPDATE correlation_lock
               SET lock_until = {until}, locked_at = {now}, locked_by = :holder, fence = fence + 1
             WHERE name IN (SELECT name FROM free)
            RETURNING name, fence
            """
        ).bindparams(bindparam("names", expanding=True)),
        # Renew a running term of this holder and fence.
        extend=text(
            f"""
            UPDATE correlation_lock SET lock_until = {until}
             WHERE name = :name AND locked_by = :holder AND fence = :fence AND lock_until > {now}
            """
        ),
        # End a running term of this holder and fence, though not before locked_at + :at_least. A term ended
        # now is released without a holder: only a term that ran out unrenewed keeps one (it lapsed).
        release=text(
            f"""
            UPDATE correlation_lock SET lock_until = {greatest}({now}, {plus("locked_at", "at_least")}),
                   locked_by = CASE WHEN {plus("locked_at", "at_least")} <= {now} THEN '' ELSE locked_by END
             WHERE name = :name AND locked_by = :holder AND fence = :fence AND lock_until > {now}
            """
        ),
        # How many rows of a prefix lapsed: ended unrenewed, their holder still named.
        lapsed=text(
            f"""
            SELECT count(*) FROM correlation_lock
             WHERE substr(name, 1, :prefix_length) = :prefix AND lock_until <= {now} AND locked_by <> ''
            """
        ),
        # Lock a lease row for the rest of a transaction and tell whether its term still runs.
        fence_check=text(
            f"""
            SELECT locked_by, fence, lock_until > {now} AS held FROM correlation_lock
             WHERE name = :name {for_update}
            """
        ),
        # Rows whose term still runs.
        held=text(
            f"""
            SELECT name, lock_until, locked_at, locked_by, fence FROM correlation_lock
             WHERE lock_until > {now} ORDER BY name
            """
        ).columns(**columns),
        # Which of these lock rows exist (a plain read: it never waits on anyone's locks).
        existing=text("SELECT name FROM correlation_lock WHERE name IN :names").bindparams(
            bindparam("names", expanding=True)
        ),
        # Rows of a prefix whose term ended more than :ago seconds ago.
        delete_expired=text(
            f"""
            DELETE FROM correlation_lock
             WHERE substr(name, 1, :prefix_length) = :prefix AND lock_until < {minus(now_arg, "ago")}
            """
        ),
    )


_LOCK_STATEMENTS = {dialect: _build_lock_statements(dialect) for dialect in ("postgresql", "sqlite")}


def _lock_statements(dialect: str) -> _LockStatements:
    try:
        return _LOCK_STATEMENTS[dialect]
    except KeyError:
        raise StoreError(f"leases are not implemented for {dialect}; use PostgreSQL or SQLite") from None


def _lock_row(row: Any) -> LockRow:
    return LockRow(row.name, row.lock_until, row.locked_at, row.locked_by, int(row.fence))


def _check_lock_name(name: str) -> str:
    if not name:
        raise InvalidLockName("a lock name must not be empty")
    if len(name) > LOCK_NAME_MAX_LENGTH:
        raise InvalidLockName(
            f"lock name {name[:20]!r}… is {len(name)} characters long; the lock table stores at most "
            f"{LOCK_NAME_MAX_LENGTH}: use a shorter name"
        )
    return name


def _checked_holder(holder: str) -> str:
    if not holder or len(holder) > HOLDER_MAX_LENGTH:
        raise InvalidLockName(
            f"a lock holder must be 1 to {HOLDER_MAX_LENGTH} characters long, not {len(holder)}: "
            "use a shorter replica name"
        )
    return holder


def _seconds(duration: timedelta, *, allow_zero: bool = False) -> float:
    seconds = duration.total_seconds()
    if seconds < 0 or (seconds == 0 and not allow_zero):
        expected = "zero or more" if allow_zero else "positive"
        raise ValueError(f"a lock duration must be {expected}, not {duration}")
    return seconds


def _term(fence: Fence) -> dict[str, Any]:
    return {"name": fence.name, "holder": fence.holder, "fence": fence.fence}
