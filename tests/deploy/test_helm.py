"""The Helm chart under helm/correlation-worker, rendered and linted offline.

Helm runs as a library (PyPI `helm-python-sdk`: Helm v4's Go SDK behind a C ABI; no `helm` binary, no
cluster). Every rendered manifest is checked against the Kubernetes OpenAPI schemas (PyPI
`kubernetes-validate`) in strict mode, so that a misspelt field fails; the ServiceMonitor is a CRD and is
checked field by field here instead.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

try:
    import helm_python as helm
except (ImportError, OSError) as error:  # OSError: the bundled libhelm_c.so does not load on this platform
    pytest.skip(
        f"helm-python-sdk is not usable (pip install helm-python-sdk): {error}", allow_module_level=True
    )

# The release and namespace the conftest `render` fixture uses.
RELEASE = "orders"
NAMESPACE = "correlation"
FULLNAME = f"{RELEASE}-correlation-worker"
# The chart's lowest supported Kubernetes (Chart.yaml kubeVersion) and the newest schema set available.
KUBERNETES_VERSIONS = ("1.25.0", "latest")
CRD_API_GROUPS = ("monitoring.coreos.com/", "keda.sh/")
# Values files under the chart's ci/ folder (the chart-testing convention): each one a supported install.
CI_VALUES = [
    "url-values.yaml", "existing-secret-values.yaml", "servicemonitor-values.yaml", "camunda8-values.yaml",
    "monitoring-values.yaml",
]

Manifest = dict[str, Any]


@pytest.fixture(scope="module")
def chart_dir(repo_root: Path) -> Path:
    """The chart's directory."""
    return repo_root / "helm" / "correlation-worker"


@pytest.fixture(scope="module")
def url_values(values_file: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """The minimal values of an install: a database URL."""
    return values_file("url-values.yaml")


@pytest.fixture(scope="module")
def default_manifests(render: Callable[..., list[Manifest]], url_values: dict[str, Any]) -> list[Manifest]:
    """The chart rendered with its defaults plus the required database URL."""
    return render(url_values)


@pytest.fixture(scope="module")
def existing_secret_manifests(
    render: Callable[..., list[Manifest]], values_file: Callable[[str], dict[str, Any]]
) -> list[Manifest]:
    """The chart rendered with database.existingSecret."""
    return render(values_file("existing-secret-values.yaml"))


def _only(manifests: list[Manifest], kind: str) -> Manifest:
    found = [manifest for manifest in manifests if manifest["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _named(manifests: list[Manifest], kind: str, name: str) -> Manifest | None:
    for manifest in manifests:
        if manifest["kind"] == kind and manifest["metadata"]["name"] == name:
            return manifest
    return None


def _hook_events(manifest: Manifest) -> set[str]:
    annotation = manifest["metadata"].get("annotations", {}).get("helm.sh/hook", "")
    return {event.strip() for event in annotation.split(",") if event.strip()}


def _hook_weight(manifest: Manifest) -> int:
    return int(manifest["metadata"].get("annotations", {}).get("helm.sh/hook-weight", "0"))


def _hook_delete_policies(manifest: Manifest) -> set[str]:
    annotation = manifest["metadata"].get("annotations", {}).get("helm.sh/hook-delete-policy", "")
    return {policy.strip() for policy in annotation.split(",") if policy.strip()}


def _container(workload: Manifest) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def _env(workload: Manifest) -> dict[str, dict[str, Any]]:
    return {variable["name"]: variable for variable in _container(workload)["env"]}


def _database_secret_ref(workload: Manifest) -> dict[str, Any]:
    ref: dict[str, Any] = _env(workload)["CORRELATION_DATABASE__URL"]["valueFrom"]["secretKeyRef"]
    return ref


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


# --- lint and schema ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("values_name", CI_VALUES)
def test_chart_lints_without_warnings_for_every_ci_values_file(
    chart_dir: Path, values_file: Callable[[str], dict[str, Any]], values_name: str
) -> None:
    report = helm.lint(chart_dir, values_file(values_name), strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [message for message in report["messages"] if message["severity"] >= 2] == []


def test_schema_refuses_an_install_that_names_no_database(
    chart: Any, render: Callable[..., list[Manifest]]
) -> None:
    with pytest.raises(helm.HelmValuesError, match="/database"):
        chart.validate_schema(None)
    with pytest.raises(helm.HelmValuesError, match="/database"):
        render(None)


def test_schema_refuses_the_bad_values_file_naming_every_offending_setting(
    chart: Any,
    chart_dir: Path,
    values_file: Callable[[str], dict[str, Any]],
    render: Callable[..., list[Manifest]],
) -> None:
    bad = values_file("bad-values.yaml")
    with pytest.raises(helm.HelmValuesError) as refused:
        chart.validate_schema(bad)
    for path in (
        "/replicaCount",
        "/database",
        "/log/format",
        "/metrics/port",
        "/podDisruptionBudget/maxUnavailable",
        "CORRELATION_DATABASE__URL",  # the env key the chart owns
    ):
        assert path in str(refused.value), path
    with pytest.raises(helm.HelmValuesError):
        render(bad)
    assert helm.lint(chart_dir, bad)["errors"]


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(
            {"database": {"url": "postgresql+psycopg://u:p@db/x", "existingSecret": "db"}},
            id="url-and-secret",
        ),
        pytest.param({"database": {"existingSecret": "db", "existingSecretKey": ""}}, id="secret-no-key"),
        pytest.param({"database": {"url": "db.example:5432/x"}}, id="url-without-scheme"),
        pytest.param({"database": {"url": 5432}}, id="url-not-a-string"),
        pytest.param({"replicaCount": "2"}, id="replicas-as-string"),
        pytest.param({"replicas": 2}, id="misspelt-top-level-key"),
        pytest.param({"env": {"CORRELATION_REPLICA__NAME": "x"}}, id="env-overrides-a-chart-owned-variable"),
        pytest.param({"serviceMonitor": {"enabled": "yes"}}, id="flag-not-a-boolean"),
        pytest.param({"terminationGracePeriodSeconds": "60"}, id="grace-as-string"),
        pytest.param({"image": {"pullPolicy": "Sometimes"}}, id="unknown-pull-policy"),
    ],
)
def test_schema_refuses_a_mistyped_setting(chart: Any, overrides: dict[str, Any]) -> None:
    values = {"database": {"url": "postgresql+psycopg://u:p@db:5432/x"}}
    values.update(overrides)
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values)


def test_chart_refuses_a_termination_grace_that_does_not_exceed_the_shutdown_grace(
    render: Callable[..., list[Manifest]], url_values: dict[str, Any]
) -> None:
    with pytest.raises(helm.HelmError, match="terminationGracePeriodSeconds"):
        render({**url_values, "terminationGracePeriodSeconds": 30, "shutdown": {"graceSeconds": 30}})


# --- Kubernetes validity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("values_name", CI_VALUES)
def test_every_rendered_manifest_is_a_valid_kubernetes_object(
    render: Callable[..., list[Manifest]],
    values_file: Callable[[str], dict[str, Any]],
    values_name: str,
    kubernetes_version: str,
) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (pip install kubernetes-validate)"
    )
    if kubernetes_version == "latest":
        kubernetes_version = kubernetes_validate.utils.latest_version()
    manifests = render(values_file(values_name))
    assert manifests
    for manifest in manifests:
        if manifest["apiVersion"].startswith(CRD_API_GROUPS):
            continue  # a CRD: no upstream schema; see the ServiceMonitor tests and test_alerts.py
        try:
            kubernetes_validate.validate(manifest, kubernetes_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            pytest.fail(f"{manifest['kind']}/{manifest['metadata']['name']}: {path}: {error.message}")


def test_every_manifest_carries_the_release_labels(default_manifests: list[Manifest]) -> None:
    for manifest in default_manifests:
        labels = manifest["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/name"] == "correlation-worker"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"


# --- migration hook and the database Secret ---------------------------------------------------------------


def test_migration_job_runs_migrate_before_install_and_upgrade(default_manifests: list[Manifest]) -> None:
    job = _only(default_manifests, "Job")
    assert _hook_events(job) == {"pre-install", "pre-upgrade"}
    assert _hook_delete_policies(job) == {"before-hook-creation", "hook-succeeded"}
    container = _container(job)
    assert container.get("args", []) + container.get("command", []) == ["migrate"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def test_chart_created_secret_reaches_the_migration_hook_before_the_job_runs(
    default_manifests: list[Manifest], url_values: dict[str, Any]
) -> None:
    # A pre-install hook runs before the release's ordinary resources exist: the Secret the Job reads must
    # be a hook of the same events with a lower weight, or the Job's pod never starts on a first install.
    job = _only(default_manifests, "Job")
    ref = _database_secret_ref(job)
    secret = _named(default_manifests, "Secret", ref["name"])
    assert secret is not None, "the migration Job reads a Secret the chart does not render"
    assert _hook_events(secret) >= _hook_events(job)
    assert _hook_weight(secret) < _hook_weight(job)
    assert "before-hook-creation" in _hook_delete_policies(secret)
    assert base64.b64decode(secret["data"][ref["key"]]).decode() == url_values["database"]["url"]


def test_workers_read_the_url_from_a_secret_that_lives_as_long_as_the_release(
    default_manifests: list[Manifest], url_values: dict[str, Any]
) -> None:
    deployment = _only(default_manifests, "Deployment")
    ref = _database_secret_ref(deployment)
    secret = _named(default_manifests, "Secret", ref["name"])
    assert secret is not None
    # A hook resource is not part of the release: uninstall would leave it behind.
    assert _hook_events(secret) == set()
    assert base64.b64decode(secret["data"][ref["key"]]).decode() == url_values["database"]["url"]
    assert "checksum/database" in deployment["spec"]["template"]["metadata"]["annotations"]


def test_existing_secret_is_read_by_job_and_workers_and_the_chart_creates_none(
    existing_secret_manifests: list[Manifest], values_file: Callable[[str], dict[str, Any]]
) -> None:
    database = values_file("existing-secret-values.yaml")["database"]
    expected = {"name": database["existingSecret"], "key": database["existingSecretKey"]}
    assert _database_secret_ref(_only(existing_secret_manifests, "Job")) == expected
    assert _database_secret_ref(_only(existing_secret_manifests, "Deployment")) == expected
    assert [manifest for manifest in existing_secret_manifests if manifest["kind"] == "Secret"] == []


def test_migration_job_needs_nothing_the_release_creates_after_the_hooks(
    default_manifests: list[Manifest],
) -> None:
    job = _only(default_manifests, "Job")
    late = {
        (manifest["kind"], manifest["metadata"]["name"])
        for manifest in default_manifests
        if not _hook_events(manifest)
    }
    pod = job["spec"]["template"]["spec"]
    assert ("ServiceAccount", pod.get("serviceAccountName", "default")) not in late
    for variable in _container(job)["env"]:
        secret_ref = variable.get("valueFrom", {}).get("secretKeyRef")
        if secret_ref:
            assert ("Secret", secret_ref["name"]) not in late, variable["name"]


def test_migration_pod_is_not_selected_by_the_service_or_the_disruption_budget(
    default_manifests: list[Manifest],
) -> None:
    job_labels = _only(default_manifests, "Job")["spec"]["template"]["metadata"]["labels"]
    assert not _matches(_only(default_manifests, "Service")["spec"]["selector"], job_labels)
    assert not _matches(
        _only(default_manifests, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], job_labels
    )


# --- the worker Deployment --------------------------------------------------------------------------------


def test_replicas_image_and_settings_come_from_values(
    render: Callable[..., list[Manifest]], url_values: dict[str, Any]
) -> None:
    manifests = render(
        {
            **url_values,
            "replicaCount": 4,
            "image": {"repository": "registry.example/correlation-worker", "tag": "1.2.3"},
            "env": {"CORRELATION_POLL__INTERVAL": "PT2S", "CORRELATION_POLL__PAGE_SIZE": 500},
            "correlators": {"*": "log", "order.paid": {"type": "http", "url": "http://engine/message"}},
            "log": {"format": "text"},
            "shutdown": {"graceSeconds": 20},
        }
    )
    deployment = _only(manifests, "Deployment")
    assert deployment["spec"]["replicas"] == 4
    assert _container(deployment)["image"] == "registry.example/correlation-worker:1.2.3"
    env = _env(deployment)
    assert env["CORRELATION_POLL__INTERVAL"]["value"] == "PT2S"
    assert env["CORRELATION_POLL__PAGE_SIZE"]["value"] == "500"
    assert env["CORRELATION_LOG__FORMAT"]["value"] == "text"
    assert env["CORRELATION_SHUTDOWN__GRACE"]["value"] == "PT20S"
    assert json.loads(env["CORRELATION_CORRELATORS"]["value"]) == {
        "*": "log",
        "order.paid": {"type": "http", "url": "http://engine/message"},
    }


def test_workers_leave_the_schema_to_the_migration_hook_by_default(
    default_manifests: list[Manifest],
) -> None:
    assert (
        _env(_only(default_manifests, "Deployment"))["CORRELATION_DATABASE__AUTO_MIGRATE"]["value"] == "false"
    )


def test_image_tag_defaults_to_the_chart_app_version(chart: Any, default_manifests: list[Manifest]) -> None:
    image = _container(_only(default_manifests, "Deployment"))["image"]
    assert image.endswith(":" + chart.metadata["appVersion"])


def test_each_pod_names_itself_from_the_downward_api(default_manifests: list[Manifest]) -> None:
    for kind in ("Deployment", "Job"):
        variable = _env(_only(default_manifests, kind))["CORRELATION_REPLICA__NAME"]
        assert variable["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_probes_ask_healthz_and_readyz_on_the_metrics_port(default_manifests: list[Manifest]) -> None:
    container = _container(_only(default_manifests, "Deployment"))
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"metrics": 9464}
    assert _env(_only(default_manifests, "Deployment"))["CORRELATION_METRICS__PORT"]["value"] == "9464"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}


def test_metrics_port_setting_moves_the_container_port_and_the_environment(
    render: Callable[..., list[Manifest]], url_values: dict[str, Any]
) -> None:
    deployment = _only(render({**url_values, "metrics": {"port": 9100}}), "Deployment")
    assert _container(deployment)["ports"][0]["containerPort"] == 9100
    assert _env(deployment)["CORRELATION_METRICS__PORT"]["value"] == "9100"


@pytest.mark.parametrize("kind", ["Deployment", "Job"])
def test_pods_run_as_non_root_with_a_read_only_root_and_no_capabilities(
    default_manifests: list[Manifest], kind: str
) -> None:
    workload = _only(default_manifests, kind)
    pod = workload["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = _container(workload)["securityContext"]
    assert container["runAsNonRoot"] is True
    assert container["readOnlyRootFilesystem"] is True
    assert container["allowPrivilegeEscalation"] is False
    assert container["capabilities"]["drop"] == ["ALL"]
    assert "add" not in container["capabilities"]
    assert container["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("kind", ["Deployment", "Job"])
def test_tmp_is_a_writable_empty_dir(default_manifests: list[Manifest], kind: str) -> None:
    workload = _only(default_manifests, kind)
    mounts = {mount["mountPath"]: mount["name"] for mount in _container(workload)["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in workload["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]


def test_kubernetes_waits_longer_than_the_worker_s_shutdown_grace(default_manifests: list[Manifest]) -> None:
    deployment = _only(default_manifests, "Deployment")
    grace = _env(deployment)["CORRELATION_SHUTDOWN__GRACE"]["value"]
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > int(grace[2:-1])
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60


def test_workers_use_the_chart_service_account(default_manifests: list[Manifest]) -> None:
    account = _only(default_manifests, "ServiceAccount")
    deployment = _only(default_manifests, "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
    assert account["automountServiceAccountToken"] is False


def test_resources_are_requested_and_memory_is_limited(default_manifests: list[Manifest]) -> None:
    resources = _container(_only(default_manifests, "Deployment"))["resources"]
    assert {"cpu", "memory"} <= resources["requests"].keys()
    assert "memory" in resources["limits"]


# --- Service, PodDisruptionBudget, ServiceMonitor ---------------------------------------------------------


def test_service_exposes_the_metrics_port_of_the_worker_pods(default_manifests: list[Manifest]) -> None:
    service = _only(default_manifests, "Service")
    deployment = _only(default_manifests, "Deployment")
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9464, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert _matches(service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert _matches(
        deployment["spec"]["selector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"]
    )


def test_disruption_budget_lets_one_worker_go_at_a_time(default_manifests: list[Manifest]) -> None:
    budget = _only(default_manifests, "PodDisruptionBudget")
    deployment = _only(default_manifests, "Deployment")
    assert budget["apiVersion"] == "policy/v1"
    assert budget["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": deployment["spec"]["selector"]["matchLabels"]},
    }


def test_disruption_budget_can_require_a_minimum_instead_or_be_left_out(
    render: Callable[..., list[Manifest]], url_values: dict[str, Any]
) -> None:
    budget = _only(render({**url_values, "podDisruptionBudget": {"minAvailable": 2}}), "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 2
    assert "maxUnavailable" not in budget["spec"]
    disabled = render({**url_values, "podDisruptionBudget": {"enabled": False}})
    assert [manifest for manifest in disabled if manifest["kind"] == "PodDisruptionBudget"] == []


def test_service_monitor_is_rendered_only_when_enabled(default_manifests: list[Manifest]) -> None:
    assert [manifest for manifest in default_manifests if manifest["kind"] == "ServiceMonitor"] == []


def test_service_monitor_scrapes_the_metrics_port_of_the_service(
    render: Callable[..., list[Manifest]], values_file: Callable[[str], dict[str, Any]]
) -> None:
    values = values_file("servicemonitor-values.yaml")
    manifests = render(values)
    monitor = _only(manifests, "ServiceMonitor")
    service = _only(manifests, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["name"] == FULLNAME
    assert monitor["metadata"]["labels"]["release"] == values["serviceMonitor"]["labels"]["release"]
    assert _matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    service_ports = {port["name"] for port in service["spec"]["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in service_ports
    assert endpoint["path"] == "/metrics"
    assert endpoint["interval"] == values["serviceMonitor"]["interval"]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}


# --- Camunda 8 ------------------------------------------------------------------------------------------------


def test_camunda_settings_become_the_sdks_variables_and_credentials_come_from_the_existing_secret(
    render: Callable[..., list[Manifest]], values_file: Callable[[str], dict[str, Any]]
) -> None:
    env = _env(_only(render(values_file("camunda8-values.yaml")), "Deployment"))
    assert env["CAMUNDA_REST_ADDRESS"]["value"] == "http://camunda-zeebe-gateway:8080/v2"
    assert env["CAMUNDA_AUTH_STRATEGY"]["value"] == "OAUTH"
    assert env["CAMUNDA_TOKEN_AUDIENCE"]["value"] == "orchestration-api"
    assert env["CAMUNDA_TENANT_ID"]["value"] == "shop-eu"
    assert env["CAMUNDA_OAUTH_URL"]["value"].startswith("http://camunda-keycloak/")
    for name, key in (("CAMUNDA_CLIENT_ID", "client-id"), ("CAMUNDA_CLIENT_SECRET", "client-secret")):
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "camunda-credentials", "key": key}
        assert "value" not in env[name]
    assert "CAMUNDA_BASIC_AUTH_PASSWORD" not in env
    assert json.loads(env["CORRELATION_CORRELATORS"]["value"]) == {"*": {"type": "camunda8", "mode": "publish"}}


def test_basic_auth_reads_user_and_password_from_the_secret_and_no_camunda_setting_means_no_variable(
    render: Callable[..., list[Manifest]], url_values: dict[str, Any], default_manifests: list[Manifest]
) -> None:
    values = {**url_values, "camunda": {"authStrategy": "BASIC", "existingSecret": "camunda-basic",
                                        "existingSecretKeys": {"username": "user", "password": "pass"}}}
    env = _env(_only(render(values), "Deployment"))
    assert env["CAMUNDA_BASIC_AUTH_USERNAME"]["valueFrom"]["secretKeyRef"] == {"name": "camunda-basic", "key": "user"}
    assert env["CAMUNDA_BASIC_AUTH_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "camunda-basic", "key": "pass"}
    assert "CAMUNDA_CLIENT_SECRET" not in env and "CAMUNDA_REST_ADDRESS" not in env
    assert not [name for name in _env(_only(default_manifests, "Deployment")) if name.startswith("CAMUNDA_")]
    job = _only(default_manifests, "Job")  # the migration needs no engine
    assert not [name for name in _env(job) if name.startswith("CAMUNDA_")]


@pytest.mark.parametrize(
    "camunda", [{"authStrategy": "KERBEROS"}, {"restAddress": "camunda:8080"}, {"clientSecret": "inline"}]
)
def test_schema_refuses_a_bad_camunda_setting_or_an_inline_secret(
    chart: Any, url_values: dict[str, Any], camunda: dict[str, Any]
) -> None:
    with pytest.raises(Exception, match="camunda"):
        chart.render({**url_values, "camunda": camunda}, name=RELEASE, namespace=NAMESPACE, is_install=True)
