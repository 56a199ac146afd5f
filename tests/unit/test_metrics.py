"""Metrics hygiene: bounded message-name labels, no *_created series, the standard process collectors; an endpoint
that costs an idle replica next to nothing."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import pytest
import uvicorn
from prometheus_client import generate_latest

from worker.service.endpoint import Endpoint, Heartbeat
from worker.service.metrics import OTHER, Metrics, NameLabels, top_names


def test_the_first_names_keep_their_label_and_the_rest_are_other() -> None:
    labels = NameLabels(limit=2)
    assert [labels.label(name) for name in ("a", "b", "c", "a", "d")] == ["a", "b", OTHER, "a", OTHER]


def test_the_backlog_keeps_the_largest_names_and_sums_the_rest_as_other() -> None:
    counts = {
        ("big", "ready"): 100, ("big", "dead"): 1, ("mid", "ready"): 10, ("small", "dead"): 2, ("tiny", "ready"): 1
    }
    assert top_names(counts, limit=2) == {
        ("big", "ready"): 100,
        ("big", "dead"): 1,
        ("mid", "ready"): 10,
        (OTHER, "dead"): 2,
        (OTHER, "ready"): 1,
    }


def test_the_registry_has_process_collectors_and_no_created_series() -> None:
    metrics = Metrics()
    metrics.messages.labels("order.paid", "success").inc()
    metrics.observe_call("order.paid", 0.01)
    text = generate_latest(metrics.registry).decode()
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
                 "process_start_time_seconds"):
        assert f"\n{name} " in text, name
    assert "_created" not in text
    assert 'correlation_call_duration_seconds_count{message_name="order.paid"} 1.0' in text


def test_backlog_series_that_vanish_from_the_table_are_removed() -> None:
    metrics = Metrics()
    metrics.set_backlog([(("a", "ready"), 3), (("b", "dead"), 1)])
    metrics.set_backlog([(("a", "ready"), 2)])
    text = generate_latest(metrics.registry).decode()
    assert 'correlation_backlog_messages{message_name="a",state="ready"} 2.0' in text
    assert 'message_name="b"' not in text
    metrics.clear_census()
    assert "correlation_backlog_messages{" not in generate_latest(metrics.registry).decode()


def test_database_errors_are_counted_by_kind() -> None:
    from worker.db.errors import (
        AuthenticationFailed,
        DatabaseBusy,
        DatabaseUnavailable,
        PermissionDenied,
        ValueRefused,
    )

    metrics = Metrics()
    for error in (DatabaseBusy("a lock wait exceeded lock_timeout"), DatabaseBusy("deadlock"),
                  DatabaseUnavailable("refused"), AuthenticationFailed("wrong password"),
                  PermissionDenied("permission denied"), ValueRefused("NUL"), None):
        metrics.database_error(error)

    def count(kind: str) -> float:
        return metrics.registry.get_sample_value("correlation_database_errors_total", {"kind": kind}) or 0.0

    assert [count(kind) for kind in ("timeout", "unavailable", "refused", "other")] == [2, 1, 2, 2]


def test_the_endpoints_server_wakes_once_a_second_when_idle_and_stops_at_once_when_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """uvicorn's loop looks ten times a second whether it should exit; each look takes the interpreter's lock from
    the threads fetching and calling. The endpoint's looks once a second, serves all the same, and a close wakes it."""
    ticks: list[float] = []
    on_tick = uvicorn.Server.on_tick

    async def counted(server: uvicorn.Server, counter: int) -> bool:
        ticks.append(time.monotonic())
        return await on_tick(server, counter)

    monkeypatch.setattr(uvicorn.Server, "on_tick", counted)
    endpoint = Endpoint("127.0.0.1", 0, Metrics(), Heartbeat(), 60.0, lambda: None)
    try:
        time.sleep(2.2)
        idle = len(ticks)
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=5) as response:
            assert response.status == 200 and b"correlation_messages_total" in response.read()
    finally:
        closing = time.monotonic()
        endpoint.close()
        closed = time.monotonic() - closing
    assert 2 <= idle <= 4, f"{idle} looks in 2.2 s (uvicorn's own loop: about 22)"
    assert closed < 0.9, f"closing took {closed:.2f} s: the close did not wake the loop"


def test_the_endpoint_loads_no_websocket_protocol() -> None:
    """No route speaks WebSocket: uvicorn's WebSocket protocol (and its library) is not imported at start."""
    probe = (
        "import sys\n"
        "from worker.service.endpoint import Endpoint, Heartbeat\n"
        "from worker.service.metrics import Metrics\n"
        "endpoint = Endpoint('127.0.0.1', 0, Metrics(), Heartbeat(), 60.0, lambda: None)\n"
        "endpoint.close()\n"
        "print(' '.join(sorted(n for n in sys.modules if n.startswith(('wsproto', 'uvicorn.protocols.websockets')))))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert loaded.stdout.split() == []
