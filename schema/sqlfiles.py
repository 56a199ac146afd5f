"""Reads the DDL of a revision for the database at hand from ``schema/ddl/<revision>_<dialect>.sql``."""

from __future__ import annotations

import re
from importlib import resources

from alembic import op

# A dollar-quoted body (``$$ … $$`` or ``$tag$ … $tag$``): its semicolons do not end a statement.
_DOLLAR_QUOTE = re.compile(r"\$([A-Za-z_]*)\$")


def statements(revision: str, dialect: str) -> list[str]:
    """The statements of one DDL file, comment lines dropped, split on semicolons outside dollar quotes."""
    text = (resources.files("worker.migrations") / "ddl" / f"{revision}_{dialect}.sql").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("--")]
    return split("\n".join(lines))


# A trigger's body (``CREATE TRIGGER … BEGIN …; END``): its semicolons end the trigger only after ``END``.
_TRIGGER = re.compile(r"^\s*CREATE\s+TRIGGER\b", re.IGNORECASE)
_TRIGGER_END = re.compile(r"\bEND\s*$", re.IGNORECASE)


def _inside_trigger(statement: str) -> bool:
    return bool(_TRIGGER.match(statement)) and not _TRIGGER_END.search(statement)


def split(text: str) -> list[str]:
    """Split SQL text on the semicolons that end statements (not those inside ``$$`` function bodies or a
    trigger's ``BEGIN … END``)."""
    result: list[str] = []
    start = position = 0
    while position < len(text):
        quote = _DOLLAR_QUOTE.match(text, position)
        if quote:
            end = text.find(quote.group(0), quote.end())
            if end < 0:
                raise ValueError(f"unterminated dollar quote {quote.group(0)} in DDL")
            position = end + len(quote.group(0))
            continue
        if text[position] == ";" and not _inside_trigger(text[start:position]):
            result.append(text[start:position].strip())
            start = position + 1
        position += 1
    result.append(text[start:].strip())
    return [statement for statement in result if statement]


def apply(revision: str) -> None:
    """Run a revision's DDL for the database the migration is connected to."""
    for statement in statements(revision, op.get_bind().dialect.name):
        op.execute(statement)
