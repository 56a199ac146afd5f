"""Names and hints that read as they match: the one rule for "printable text".

A message name picks its route by exact match and a correlation hint picks its conversation; both are shown in
logs, metrics and the console. Text that looks the same as another but is not (a trailing no-break space, ``café``
with a combining accent where the route has the precomposed one, an invisible TAG character) would silently go
to the ``*`` route or to another conversation. The rule, the same for the schema (PostgreSQL and SQLite), the
route names of ``CORRELATION_CORRELATORS``, ``correlation-worker send`` and the worker reading a row:

- the text is in Unicode normalisation form NFC (``unicodedata.normalize("NFC", text) == text``);
- it holds no character of the categories Cc (controls), Cf (invisible formatting, TAG characters included),
  Cs (surrogates), Co (private use), Cn (unassigned, noncharacters), Zl and Zp (line and paragraph separators),
  except the joiners ZWJ U+200D and ZWNJ U+200C (an emoji family, Persian and Indic text need them), and those
  only inside the text, never first or last;
- a name has no whitespace (Unicode's White_Space property: U+0020, U+00A0, U+3000, …) at either end; a hint is
  not only whitespace (and joiners).

The categories are Unicode's as of :data:`UNICODE_VERSION` (the schema's SQL spells them as code point ranges,
derived from :func:`refused_ranges`; ``tests/unit/test_text.py`` checks the two agree).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable

# The Unicode version whose categories the schema's ranges (revision 0016) were derived from.
UNICODE_VERSION = "14.0.0"
REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
JOINERS = frozenset({"\u200c", "\u200d"})  # ZWNJ, ZWJ: allowed between two characters
# Unicode's White_Space property (PropList.txt; stable since Unicode 6.3).
WHITE_SPACE_RANGES: tuple[tuple[int, int], ...] = (
    (0x0009, 0x000D), (0x0020, 0x0020), (0x0085, 0x0085), (0x00A0, 0x00A0), (0x1680, 0x1680),
    (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
)
WHITE_SPACE = frozenset(chr(c) for start, end in WHITE_SPACE_RANGES for c in range(start, end + 1))
# Characters that may not stand at either end of a name: whitespace and the joiners.
EDGE_RANGES: tuple[tuple[int, int], ...] = tuple(
    sorted(WHITE_SPACE_RANGES + tuple((ord(j), ord(j)) for j in JOINERS))
)


def refused(char: str) -> bool:
    """Whether a character is refused anywhere in a name or hint (the joiners are judged by their place)."""
    return char not in JOINERS and unicodedata.category(char) in REFUSED_CATEGORIES


def refused_ranges() -> list[tuple[int, int]]:
    """The code points :func:`refused` refuses, as inclusive ranges (the schema's SQL is derived from these)."""
    ranges: list[tuple[int, int]] = []
    start: int | None = None
    for code in range(0x110000):
        if refused(chr(code)):
            if start is None:
                start = code
        elif start is not None:
            ranges.append((start, code - 1))
            start = None
    if start is not None:
        ranges.append((start, 0x10FFFF))
    return ranges


def _shown(char: str) -> str:
    return f"U+{ord(char):04X}"


def printable_problem(value: str) -> str | None:
    """Why a text would not read as it matches (not NFC, a refused character, a joiner at an end), or None."""
    if value.isascii():  # the common case: controls are the only refused ASCII characters
        if value.isprintable():
            return None
        bad = next(char for char in value if not char.isprintable())
        return f"holds the control character {_shown(bad)}"
    for char in value:
        if refused(char):
            name = unicodedata.name(char, "") or unicodedata.category(char)
            return f"holds the invisible or control character {_shown(char)} ({name})"
    if value[:1] in JOINERS or value[-1:] in JOINERS:
        return "starts or ends with a joiner (U+200C, U+200D are allowed only between two characters)"
    if not unicodedata.is_normalized("NFC", value):
        return "is not in Unicode normalisation form NFC (a composed character is written decomposed)"
    return None


def name_problem(value: str) -> str | None:
    """Why a message name (or a route's name) would not read as it matches, or None."""
    if not value:
        return "is empty"
    if value[0] in WHITE_SPACE or value[-1] in WHITE_SPACE:
        if all(char in WHITE_SPACE or char in JOINERS for char in value):
            return "is only whitespace"
        return f"starts or ends with whitespace ({_shown(value[0] if value[0] in WHITE_SPACE else value[-1])})"
    return printable_problem(value)


def hint_problem(value: str) -> str | None:
    """Why a correlation hint would not read as it matches, or None (whitespace at its ends is its own)."""
    if not value:
        return "is empty"
    if all(char in WHITE_SPACE or char in JOINERS for char in value):
        return "is only whitespace"
    return printable_problem(value)


def _encodable(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges without NUL (``text`` cannot hold it) and without surrogates (UTF-8 cannot encode them)."""
    kept = []
    for start, end in ranges:
        start = max(start, 1)
        if 0xD800 <= start <= 0xDFFF:
            start = 0xE000
        if 0xD800 <= end <= 0xDFFF:
            end = 0xD7FF
        if start <= end:
            kept.append((start, end))
    return kept


def postgresql_class(ranges: Iterable[tuple[int, int]]) -> str:
    """A PostgreSQL regular expression bracket expression matching these code points (``[\\u0001-\\u001f…]``)."""
    parts = [_pg_char(s) if s == e else f"{_pg_char(s)}-{_pg_char(e)}" for s, e in _encodable(ranges)]
    return "[" + "".join(parts) + "]"


def _pg_char(code: int) -> str:
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


# SQLite reads U+FFFE and U+FFFF as U+FFFD (its UTF-8 decoder's substitution), in a pattern and in the text alike:
# its SQL cannot tell them, and the worker dead-letters a message holding one (as one not in NFC).
SQLITE_UNSEEN = (0xFFFE, 0xFFFF)


def sqlite_chars(ranges: Iterable[tuple[int, int]]) -> str:
    """A SQLite expression spelling a GLOB bracket's contents for these code points: ``char(1, 45, 31, …)`` (45
    is ``-``), in calls of at most 100 arguments joined by ``||`` (SQLite takes no more than 127)."""
    codes: list[int] = []
    for start, end in _encodable(ranges):
        if SQLITE_UNSEEN[0] <= start and end <= SQLITE_UNSEEN[1]:
            continue
        codes.extend([start] if start == end else [start, 45, end])
    calls = [codes[i : i + 100] for i in range(0, len(codes), 100)]
    return " || ".join("char(" + ",".join(str(code) for code in call) + ")" for call in calls)


def shown(value: str) -> str:
    """A text quoted for an error message, with every character that could hide what it is escaped: refused
    characters, whitespace other than a space, the joiners and combining marks (``'cafe\\u0301'``)."""
    escaped = "".join(
        char if char == " " or not (
            refused(char) or char in WHITE_SPACE or char in JOINERS or unicodedata.category(char).startswith("M")
        ) else (f"\\u{ord(char):04x}" if ord(char) <= 0xFFFF else f"\\U{ord(char):08x}")
        for char in value
    )
    return "'" + escaped.replace("'", "\\'") + "'"
