"""What a user sent, as an error shows it back: bounded, so that a 100 000-character argument is still one
readable line.

An error names the value it refuses (``no message with id or message_id 'shop-4711'``); :func:`bounded_line` is
applied where every error leaves (the CLI's one line, the API's ``{"error": ...}``, the console's error page), so
no path can echo an argument whole. A run of text without spaces longer than :data:`WORD_LIMIT` keeps its head
and tail; a whole line longer than :data:`LINE_LIMIT` does too (its tail often says what to do).
"""

from __future__ import annotations

import re

WORD_LIMIT = 120  # characters of one run of text without spaces
LINE_LIMIT = 1000  # characters of one error line

_LONG_WORD = re.compile(rf"\S{{{WORD_LIMIT + 1},}}")


def _cut(text: str, limit: int) -> str:
    half = limit // 2
    return f"{text[:half]}…[{len(text) - 2 * half} characters cut]…{text[-half:]}"


def bounded_line(text: str) -> str:
    """The text with each over-long run of non-space characters, then the whole, cut in the middle."""
    text = _LONG_WORD.sub(lambda match: _cut(match.group(0), WORD_LIMIT // 2), text)
    return text if len(text) <= LINE_LIMIT else _cut(text, LINE_LIMIT)
