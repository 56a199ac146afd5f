"""What the commands answer an operator, tried as one types them: real ``correlation-worker`` processes.

An argument echoed in an error stays one readable line however long it is; every command that names messages
takes ids and message_ids alike; ``send`` reads a payload from a file or standard input; a message_id still held
by a row says which command frees it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import Database, cli, run_cli, worker_env
from test_edges import one_line_error

HUGE = "z" * 100_000
LINE_BOUND = 1_200  # characters of an error line, whatever was sent


@pytest.mark.parametrize(
    "arguments",
    [
        ("messages", "show", HUGE),
        ("messages", "show", "1" * 100_000),
        ("messages", "show", HUGE, "--by", "id"),
        ("messages", "list", "--after", HUGE),
        ("delete", HUGE),
        ("requeue", HUGE),
        ("pause", HUGE),
        ("resume", "a" * 200, HUGE),
        ("send", "order.paid", "order-1", "--payload", HUGE),
        ("send", "order.paid", "order-1", "--ttl", HUGE),
        ("send", "order.paid", "order-1", "--expires-at", HUGE),
        ("send", "order.paid", "order-1", "--headers", f"@{HUGE}"),
        ("send", "order.paid", "order-1", "--payload", "not json " * 10_000),
        ("send", HUGE, "order-1"),
        ("schedules", "show", HUGE),
        ("schedules", "add", "s", "--cron", HUGE, "--message-name", "m"),
        ("status", "--output", HUGE),
        (HUGE,),
    ],
    ids=lambda arguments: " ".join(a[:12] for a in arguments),
)
def test_an_argument_echoed_in_an_error_is_cut_to_a_readable_line(pg_db: Database, arguments: tuple[str, ...]) -> None:
    assert cli(pg_db, "migrate").returncode == 0
    line = one_line_error(cli(pg_db, *arguments))
    assert len(line) <= LINE_BOUND and HUGE[:200] not in line, line[:300]


@pytest.mark.parametrize(
    ("command", "state", "said"),
    [
        (("pause",), "ready", "paused 1 messages"),
        (("resume",), "paused", "resumed 1 messages"),
        (("requeue",), "dead", "requeued 1 messages"),
        (("delete",), "ready", "deleted 1 messages"),
        (("messages", "show"), "ready", '"message_id": "shop-4711-paid"'),
    ],
)
def test_every_command_naming_messages_takes_an_id_or_a_message_id(
    any_db: Database, command: tuple[str, ...], state: str, said: str
) -> None:
    assert cli(any_db, "migrate").returncode == 0
    row_id = int(run_cli(any_db, "send", "order.paid", "order-1", "--message-id", "shop-4711-paid").stdout.split()[-1])
    other = int(run_cli(any_db, "send", "order.paid", "order-2", "--message-id", "shop-4712-paid").stdout.split()[-1])
    any_db.execute(f"UPDATE correlation_message SET state = '{state}' WHERE id IN ({row_id}, {other})")
    assert said in run_cli(any_db, *command, "shop-4711-paid").stdout
    if command != ("messages", "show"):
        assert said in run_cli(any_db, *command, str(other)).stdout
    missing = one_line_error(cli(any_db, *command, "shop-9999"))
    assert "no message with" in missing and "message_id 'shop-9999'" in missing, missing


def send_piped(database: Database, text: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker", "send", *arguments],
        env=worker_env(database), input=text, capture_output=True, text=True, timeout=60, check=False,
    )


def test_send_reads_the_payload_and_headers_from_a_file_or_standard_input(any_db: Database, tmp_path: Path) -> None:
    assert cli(any_db, "migrate").returncode == 0
    (tmp_path / "payload.json").write_text(json.dumps({"amount": 12.5, "items": ["a" * 5000]}), encoding="utf-8")
    (tmp_path / "headers.json").write_text('{"tenantId": "shop-eu"}', encoding="utf-8")
    from_file = run_cli(any_db, "send", "order.paid", "order-1", "--payload", f"@{tmp_path / 'payload.json'}",
                        "--headers", f"@{tmp_path / 'headers.json'}")
    from_stdin = send_piped(any_db, '{"amount": 7}', "order.paid", "order-2", "--payload", "-")
    assert from_stdin.returncode == 0, from_stdin.stderr
    shown = json.loads(run_cli(any_db, "messages", "show", from_file.stdout.split()[-1]).stdout)
    assert shown["payload"] == {"amount": 12.5, "items": ["a" * 5000]} and shown["headers"] == {"tenantId": "shop-eu"}
    assert json.loads(run_cli(any_db, "messages", "show", from_stdin.stdout.split()[-1]).stdout)["payload"] == {
        "amount": 7}
    missing = one_line_error(cli(any_db, "send", "order.paid", "o", "--payload", f"@{tmp_path / 'nope.json'}"))
    assert "--payload" in missing and "nope.json" in missing and "No such file" in missing, missing
    (tmp_path / "bad.json").write_text("{oops", encoding="utf-8")
    bad = one_line_error(cli(any_db, "send", "order.paid", "o", "--payload", f"@{tmp_path / 'bad.json'}"))
    assert "not valid JSON in" in bad and "bad.json" in bad, bad
    assert "from standard input" in one_line_error(send_piped(any_db, "nope", "order.paid", "o", "--payload", "-"))


def test_a_message_id_still_held_says_which_command_frees_it(any_db: Database) -> None:
    assert cli(any_db, "migrate").returncode == 0
    row_id = run_cli(any_db, "send", "order.paid", "order-1", "--message-id", "shop-1").stdout.split()[-1]
    any_db.execute(f"UPDATE correlation_message SET state = 'dead', last_error = 'boom' WHERE id = {row_id}")
    live = run_cli(any_db, "send", "order.paid", "order-1", "--message-id", "shop-1").stdout
    assert f"held by message {row_id} (dead)" in live and f"correlation-worker delete {row_id}" in live, live
    run_cli(any_db, "delete", "shop-1")
    held = run_cli(any_db, "send", "order.paid", "order-1", "--message-id", "shop-1").stdout
    assert "deleted at" in held and "nothing inserted" in held, held
    freeing = held.split("`")[1]
    assert freeing == f"correlation-worker delete --state delivered {row_id}", held
    assert "deleted 1 messages" in run_cli(any_db, *freeing.split()[1:]).stdout
    assert "inserted message" in run_cli(any_db, "send", "order.paid", "order-1", "--message-id", "shop-1").stdout
