"""The console's stylesheet keeps every state pill readable: white text on a ground dark enough (WCAG AA)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from worker.message import MessageState

CSS = (Path(__file__).resolve().parents[2] / "worker" / "admin" / "static" / "console.css").read_text(encoding="utf-8")
AA = 4.5  # the contrast normal text needs (WCAG 2.1 AA)


def _luminance(colour: str) -> float:
    digits = colour.lstrip("#")
    if len(digits) == 3:
        digits = "".join(c * 2 for c in digits)
    channels = [int(digits[i : i + 2], 16) / 255 for i in (0, 2, 4)]
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(one: str, other: str) -> float:
    light, dark = sorted((_luminance(one), _luminance(other)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def _resolve(value: str) -> str:
    variable = re.fullmatch(r"var\((--[\w-]+)\)", value.strip())
    if variable is None:
        return value.strip()
    found = re.search(rf"{variable.group(1)}:\s*(#[0-9a-fA-F]{{3,6}})", CSS)
    assert found is not None, f"{variable.group(1)} is not defined"
    return found.group(1)


def pill_colours(state: str) -> tuple[str, str]:
    """The text colour and the ground of ``<span class="pill STATE">``: the state's rule, else the pill's own."""
    base = re.search(r"\.pill \{([^}]*)\}", CSS)
    assert base is not None
    text = re.search(r"(?<![-\w])color:\s*([^;]+);", base.group(1))
    ground = re.search(r"background:\s*([^;]+);", base.group(1))
    own = re.search(rf"\.pill\.{state} \{{\s*background:\s*([^;]+);", CSS)
    assert text is not None and (own or ground) is not None, f"a {state} pill has no ground of its own or default"
    return _resolve(text.group(1)), _resolve((own or ground).group(1))  # type: ignore[union-attr]


@pytest.mark.parametrize("state", [*(state.value for state in MessageState), "a-state-added-later"])
def test_every_state_pill_is_readable_on_the_page(state: str) -> None:
    text, ground = pill_colours(state)
    assert contrast(text, ground) >= AA, f"{state}: {text} on {ground} is {contrast(text, ground):.2f}:1"
    assert contrast(ground, "#f6f8fa") >= 3, f"{state}: the pill's ground disappears into the page"
