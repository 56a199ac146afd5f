"""Log lines: RFC 3339 UTC timestamps, structured fields in JSON, bounded lengths, escaped control characters."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from tests.unit.factories import message as make_message
from worker.config import LogSettings
from worker.service.logs import FIELD_LIMIT, configure_logging, log_fields, rfc3339

RFC3339_MS_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def lines_of(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_timestamps_are_rfc3339_utc_with_milliseconds(capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    configure_logging(LogSettings(format=fmt), "r-1")
    logging.getLogger("shop").info("hello")
    [line] = lines_of(capsys)
    stamp = json.loads(line)["time"] if fmt == "json" else line.split(" ", 1)[0]
    assert RFC3339_MS_UTC.fullmatch(stamp), stamp


def test_rfc3339_is_utc_whatever_the_local_zone() -> None:
    instant = datetime(2026, 11, 22, 13, 40, 5, 815000, tzinfo=UTC)
    assert rfc3339(instant.timestamp()) == "2026-11-22T13:40:05.815Z"


def test_json_lines_carry_a_message_s_fields(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(LogSettings(format="json"), "r-1")
    message = make_message(7, "order-1", name="order.paid", attempt=2, message_id="shop-7", slot=5)
    due = datetime(2026, 11, 22, 13, 40, 5, 815000, tzinfo=UTC)
    fields = log_fields(message, outcome="retry", next_attempt_at=due, timeout=timedelta(seconds=5))
    logging.getLogger("shop").warning("failed", extra=fields)
    [line] = lines_of(capsys)
    record = json.loads(line)
    assert record["message"] == "failed" and record["replica"] == "r-1"
    assert record["message_name"] == "order.paid" and record["message_id"] == "shop-7"
    assert (record["id"], record["hint"], record["attempt"], record["slot"]) == (7, "order-1", 2, message.slot)
    assert record["outcome"] == "retry" and record["next_attempt_at"] == "2026-11-22T13:40:05.815Z"
    assert record["timeout"] == "PT5S"


def test_a_field_named_like_a_record_attribute_does_not_break_the_call(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(LogSettings(format="json"), "r-1")
    logging.getLogger("shop").info("x", extra=log_fields(name="n", msg="m"))
    record = json.loads(lines_of(capsys)[0])
    assert (record["name_"], record["msg_"]) == ("n", "m")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_huge_message_and_traceback_make_a_bounded_line_marked_as_cut(
    capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    configure_logging(LogSettings(format=fmt), "r-1")
    huge = "x" * 5_000_000
    try:
        raise RuntimeError(huge + " the end")
    except RuntimeError:
        logging.getLogger("shop").exception("payload %s", huge, extra=log_fields(hint=huge))
    [line] = lines_of(capsys)
    assert len(line) < 5 * FIELD_LIMIT
    assert "characters cut]" in line
    assert "the end" in line  # a traceback keeps its tail, where the exception is


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_control_characters_are_escaped_never_written_raw(capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    configure_logging(LogSettings(format=fmt), "r-1")
    hostile = "order\x1b[2J\rforged line\x9b\x07\u2028end\u202ediap.redro\u200b\ufeff\u2066"
    logging.getLogger("shop").warning("hint=%s", hostile, extra=log_fields(hint=hostile))
    output = capsys.readouterr().err
    [line] = output.splitlines()
    for raw in ("\x1b", "\r", "\x9b", "\x07", "\u2028", "\u202e", "\u200b", "\ufeff", "\u2066"):
        assert raw not in output
    assert "\\u202e" in line or "\\\\u202e" in line
    assert "\\x1b[2J" in line and "\\r" in line
    if fmt == "json":
        record = json.loads(line)
        assert "\x1b" not in record["message"] and "\x1b" not in record["hint"]


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_credentials_in_logged_urls_are_masked(capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    configure_logging(LogSettings(format=fmt), "r-1")
    logging.getLogger("shop").warning("POST https://bot:s3cret@engine/api?token=s3cret failed")
    output = capsys.readouterr().err
    assert "s3cret" not in output and "bot:***@engine" in output
