"""The one rule for printable names and hints (worker/policy/text.py), and the schema's SQL derived from it."""

from __future__ import annotations

import unicodedata
from importlib import resources

import pytest

from worker.policy.text import (
    EDGE_RANGES,
    UNICODE_VERSION,
    WHITE_SPACE,
    WHITE_SPACE_RANGES,
    hint_problem,
    name_problem,
    postgresql_class,
    refused_ranges,
    shown,
    sqlite_chars,
)

# (text, name refused, hint refused, what the reason says): members of each class, beyond the ones in the issue.
TABLE: list[tuple[str, bool, bool, str]] = [
    # Taken: any script, inner blanks, joiners between two characters, emoji with modifiers and variation selectors.
    ("order.paid", False, False, ""),
    ("order paid", False, False, ""),
    ("caf\u00e9", False, False, ""),
    ("\u0437\u0430\u043a\u0430\u0437", False, False, ""),
    ("\u6ce8\u6587-1", False, False, ""),
    ("\U0001f468\u200d\U0001f469\u200d\U0001f467", False, False, ""),  # family: ZWJ inside
    ("\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645", False, False, ""),  # Persian: ZWNJ inside
    ("\u0915\u094d\u200d\u0937", False, False, ""),  # Devanagari with ZWJ
    ("\U0001f44d\U0001f3fd", False, False, ""),  # skin tone modifier
    ("\u2764\ufe0f", False, False, ""),  # variation selector (Mn)
    ("  x  ", True, False, "whitespace"),  # a hint's blanks at its ends are its own
    # Whitespace by Unicode's White_Space: at a name's ends, or a whole hint.
    ("order.paid\u00a0", True, False, "whitespace (U+00A0)"),
    ("\u3000order", True, False, "whitespace (U+3000)"),
    ("order\u2009", True, False, "whitespace (U+2009)"),
    ("order\u202f", True, False, "whitespace (U+202F)"),
    ("\u1680order", True, False, "whitespace (U+1680)"),
    ("\u00a0", True, True, "only whitespace"),
    ("\u3000", True, True, "only whitespace"),
    ("\u2007\u205f", True, True, "only whitespace"),
    ("\u00a0\u200d\u00a0", True, True, "only whitespace"),
    # Not NFC: a composed character written decomposed (other normalisation forms alike).
    ("cafe\u0301", True, True, "NFC"),
    ("\u212b", True, True, "NFC"),  # ANGSTROM SIGN (NFC: U+00C5)
    ("\u1100\u1161", True, True, "NFC"),  # Hangul jamo (NFC: U+AC00)
    # Refused characters by category.
    ("order\tpaid", True, True, "U+0009"),  # Cc
    ("order\x85paid", True, True, "U+0085"),  # Cc (and White_Space)
    ("o\u200bk", True, True, "U+200B"),  # Cf: zero width space
    ("o\u202ek", True, True, "U+202E"),  # Cf: right-to-left override
    ("o\u2066k", True, True, "U+2066"),  # Cf: isolate
    ("o\u00adk", True, True, "U+00AD"),  # Cf: soft hyphen
    ("o\ufeffk", True, True, "U+FEFF"),  # Cf: byte order mark
    ("a\U000e0041", True, True, "U+E0041"),  # Cf: TAG LATIN CAPITAL LETTER A
    ("a\U000e0001", True, True, "U+E0001"),  # Cf: LANGUAGE TAG
    ("a\U000e007f", True, True, "U+E007F"),  # Cf: CANCEL TAG
    ("a\U0001d173", True, True, "U+1D173"),  # Cf: musical symbol begin beam
    ("o\ue000k", True, True, "U+E000"),  # Co: private use
    ("o\U000f0000k", True, True, "U+F0000"),  # Co: plane 15
    ("o\u0378k", True, True, "U+0378"),  # Cn: unassigned
    ("o\ufdd0k", True, True, "U+FDD0"),  # Cn: noncharacter
    ("o\U0010ffffk", True, True, "U+10FFFF"),  # Cn: noncharacter
    ("o\u2028k", True, True, "U+2028"),  # Zl
    ("o\u2029k", True, True, "U+2029"),  # Zp
    ("o\ud800k", True, True, "U+D800"),  # Cs: a lone surrogate (Python only: no database stores one)
    # Joiners only between two characters.
    ("\u200dorder", True, True, "joiner"),
    ("order\u200c", True, True, "joiner"),
]


@pytest.mark.parametrize(("value", "name_refused", "hint_refused", "reason"), TABLE)
def test_each_class_of_near_miss_text_is_refused_and_legitimate_text_taken(
    value: str, name_refused: bool, hint_refused: bool, reason: str
) -> None:
    name, hint = name_problem(value), hint_problem(value)
    assert (name is not None, hint is not None) == (name_refused, hint_refused), (name, hint)
    assert reason in (name or hint or "")


def test_the_whitespace_ranges_are_unicodes_white_space_property() -> None:
    # str.isspace() is White_Space plus the four information separators U+001C..U+001F (Cc, refused anyway).
    every = {chr(code) for code in range(0x110000) if chr(code).isspace()} - {chr(c) for c in range(0x1C, 0x20)}
    assert every == WHITE_SPACE


@pytest.mark.skipif(
    unicodedata.unidata_version != UNICODE_VERSION, reason=f"the schema's ranges are Unicode {UNICODE_VERSION}'s"
)
def test_the_schemas_sql_is_derived_from_the_rules_ranges() -> None:
    """Revision 0016 spells the rule's character classes as code point ranges; they are the ones the rule refuses
    (the same in PostgreSQL's regular expressions and SQLite's GLOB patterns)."""
    ddl = resources.files("worker.migrations") / "ddl"
    postgresql = (ddl / "0016_postgresql.sql").read_text()
    sqlite = (ddl / "0016_sqlite.sql").read_text()
    refused = refused_ranges()
    joiners = postgresql_class([(0x200C, 0x200D)])
    assert f"'{postgresql_class(refused)}|^{joiners}|{joiners}$'" in postgresql
    assert f"'^{postgresql_class(WHITE_SPACE_RANGES)}|{postgresql_class(WHITE_SPACE_RANGES)}$'" in postgresql
    assert f"'[^{postgresql_class(EDGE_RANGES)[1:]}'" in postgresql
    assert f"('refused', '*[' || {sqlite_chars(refused)} || ']*')" in sqlite
    assert f"('blank_first', '[' || {sqlite_chars(WHITE_SPACE_RANGES)} || ']*')" in sqlite
    assert f"('not_only_blank', '*[^' || {sqlite_chars(EDGE_RANGES)} || ']*')" in sqlite


def test_an_error_shows_the_characters_that_hide() -> None:
    assert shown("cafe\u0301") == "'cafe\\u0301'"
    assert shown("order.paid\u00a0") == "'order.paid\\u00a0'"
    assert shown("a\U000e0041") == "'a\\U000e0041'"
    assert shown("\u6ce8\u6587 x") == "'\u6ce8\u6587 x'"
