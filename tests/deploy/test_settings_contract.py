"""The environment the deployment files give the worker is one the application accepts.

Every CORRELATION_* variable that docker-compose.yml or the Helm chart sets must name a real setting (the
application ignores unknown ones silently, so a typo would go unnoticed), and the whole environment must load
through the application's own configuration. Needs the application's dependencies (`pip install .`).
"""

from __future__ import annotations

import base64
import os
from collections.abc import Callable
from typing import Any

import pytest

config = pytest.importorskip(
    "worker.config", reason="the application's dependencies are not installed (pip install .)"
)

PREFIX = "CORRELATION_"
POD_NAME = "orders-correlation-worker-7d9c-abcde"

Manifest = dict[str, Any]


def _assert_names_a_setting(variable: str) -> None:
    assert variable.startswith(PREFIX), variable
    model: Any = config.Settings
    for part in variable[len(PREFIX) :].lower().split("__"):
        fields = getattr(model, "model_fields", None)
        assert fields is not None and part in fields, f"{variable}: no setting {part!r}"
        model = fields[part].annotation


def _pod_environment(workload: Manifest, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The environment Kubernetes would give the workload's container."""
    environment: dict[str, str] = {}
    for variable in workload["spec"]["template"]["spec"]["containers"][0]["env"]:
        if "value" in variable:
            environment[variable["name"]] = variable["value"]
        elif "secretKeyRef" in variable["valueFrom"]:
            ref = variable["valueFrom"]["secretKeyRef"]
            environment[variable["name"]] = secrets[ref["name"]][ref["key"]]
        elif variable["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name":
            environment[variable["name"]] = POD_NAME
    return environment


def _load(monkeypatch: pytest.MonkeyPatch, environment: dict[str, str]) -> Any:
    for name in list(os.environ):
        if name.startswith(PREFIX):
            monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    return config.load_settings()


def test_compose_workers_and_migrate_get_settings_the_application_accepts(
    compose_project: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("migrate", "worker-1", "worker-2"):
        environment = compose_project["services"][name]["environment"]
        for variable in environment:
            if variable.startswith(PREFIX):
                _assert_names_a_setting(variable)
        settings = _load(monkeypatch, environment)
        assert settings.database.url.startswith("postgresql+psycopg://")
        assert settings.metrics.port == 9464
        assert settings.log.format == "json"


def test_helm_workers_and_migration_job_get_settings_the_application_accepts(
    render: Callable[..., list[Manifest]],
    values_file: Callable[[str], dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    values = values_file("url-values.yaml")
    values["env"] = {"CORRELATION_POLL__INTERVAL": "PT2S"}
    values["correlators"] = {"*": "log"}
    values["policies"] = {"order.paid": {"max_retries": 5}}
    manifests = render(values)
    secrets = {
        manifest["metadata"]["name"]: {
            key: base64.b64decode(data).decode() for key, data in manifest["data"].items()
        }
        for manifest in manifests
        if manifest["kind"] == "Secret"
    }
    for workload in (manifest for manifest in manifests if manifest["kind"] in ("Deployment", "Job")):
        environment = _pod_environment(workload, secrets)
        for variable in environment:
            _assert_names_a_setting(variable)
        settings = _load(monkeypatch, environment)
        assert settings.database.url == values["database"]["url"]
        assert settings.database.auto_migrate is False
        assert settings.replica.name == POD_NAME
        assert settings.metrics.port == 9464
        assert settings.shutdown.grace.total_seconds() == 30
        assert settings.poll.interval.total_seconds() == 2
