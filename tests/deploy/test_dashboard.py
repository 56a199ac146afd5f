"""The Grafana dashboard (deploy/grafana/dashboard.py), its committed JSON, the chart's ConfigMap and Compose's Grafana.

The dashboard is built with Grafana's own builders (PyPI `grafana-foundation-sdk`); the JSON it writes is checked
here for drift, for metric names the worker does not export, and for PromQL that Prometheus' own parser
(`promtool`, Debian's `prometheus` package) refuses.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.deploy.conftest import metric_names_in

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboard.py"
JSON_FILES = ("deploy/grafana/correlation-worker.json", "helm/correlation-worker/dashboards/correlation-worker.json")
CONFIGMAP_KEY = "correlation-worker.json"
# Grafana's variables as a range query sees them: the rate interval a duration, the job and replicas regexes.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "${datasource}": "prometheus",
    "$datasource": "prometheus",
    "$job": ".+",
    "$instance": ".+",
}

Manifest = dict[str, Any]

# The SDK's classic `dashboard` builders warn on import that it prefers its v2 schema (see dashboard.py's docstring).
pytestmark = pytest.mark.filterwarnings("ignore:Prefer using dashboardv2:DeprecationWarning")


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("correlation_worker_dashboard", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script() -> ModuleType:
    """deploy/grafana/dashboard.py as a module (it is a script, not a package)."""
    pytest.importorskip(
        "grafana_foundation_sdk", reason="grafana-foundation-sdk is not installed (pip install grafana-foundation-sdk)"
    )
    return _load_script()


@pytest.fixture(scope="module")
def generated(script: ModuleType) -> str:
    """The JSON text the script generates now."""
    text: str = script.dashboard_json()
    return text


@pytest.fixture(scope="module")
def board(repo_root: Path) -> dict[str, Any]:
    """The committed dashboard (deploy/grafana/correlation-worker.json)."""
    loaded: dict[str, Any] = json.loads((repo_root / JSON_FILES[0]).read_text(encoding="utf-8"))
    return loaded


def _panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def _expressions(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expression) of every panel target."""
    found = []
    for panel in _panels(board):
        for target in panel.get("targets", []):
            found.append((f"{panel['title']} / {target.get('refId', '?')}", target["expr"]))
    return found


def _substitute(expression: str) -> str:
    for variable in sorted(GRAFANA_VARIABLES, key=len, reverse=True):  # $__rate_interval before $__range
        expression = expression.replace(variable, GRAFANA_VARIABLES[variable])
    return expression


# --- the committed JSON --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", JSON_FILES)
def test_committed_json_is_what_the_script_generates(repo_root: Path, generated: str, path: str) -> None:
    committed = (repo_root / path).read_text(encoding="utf-8")
    assert committed == generated, f"{path} is out of date: run .venv/bin/python deploy/grafana/dashboard.py"


def test_generation_is_deterministic(script: ModuleType, generated: str) -> None:
    assert script.dashboard_json() == generated
    assert generated.endswith("}\n")
    assert generated == json.dumps(json.loads(generated), sort_keys=True, indent=2, ensure_ascii=False) + "\n"


# --- what the dashboard shows --------------------------------------------------------------------------------


def test_every_expression_names_only_metrics_the_worker_exports(
    board: dict[str, Any], sample_names: set[str]
) -> None:
    expressions = _expressions(board)
    variables = [(f"variable {v['name']}", v["query"]) for v in board["templating"]["list"] if v["type"] == "query"]
    assert len(expressions) > 40
    unknown = {where: sorted(metric_names_in(expr) - sample_names) for where, expr in expressions + variables}
    assert {where: names for where, names in unknown.items() if names} == {}


def test_the_metric_name_check_catches_a_made_up_name(sample_names: set[str]) -> None:
    expression = 'sum(rate(correlation_mesages_total{job=~"$job"}[$__rate_interval])) / on() correlation_slots_held'
    assert metric_names_in(expression) - sample_names == {"correlation_mesages_total"}


def test_every_expression_parses_as_promql(board: dict[str, Any], tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian's prometheus package: apt-get install prometheus)")
    expressions = _expressions(board)
    rules = [
        {"record": f"dashboard:panel_{index}", "expr": _substitute(expr)}
        for index, (_, expr) in enumerate(expressions)
    ]
    leftover = [rule["expr"] for rule in rules if "$" in rule["expr"]]
    assert leftover == [], "a Grafana variable the test does not substitute"
    rules_file = tmp_path / "dashboard.rules.yml"
    rules_file.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}, indent=2))
    result = subprocess.run(
        [promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_promtool_check_refuses_broken_promql(tmp_path: Path) -> None:
    # Guards the guard: a panel's typo would fail, not pass unparsed.
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian's prometheus package: apt-get install prometheus)")
    rules_file = tmp_path / "broken.rules.yml"
    rules = [{"record": "dashboard:broken", "expr": _substitute("sum by (outcome (rate(x[$__rate_interval]))")}]
    rules_file.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        [promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode != 0


def test_dashboard_identity_and_variables(board: dict[str, Any]) -> None:
    assert board["uid"] == "correlation-worker"
    assert board["title"] == "correlation-worker"
    assert "correlation-worker" in board["tags"]
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["type"] == variables["instance"]["type"] == "query"
    assert variables["instance"]["includeAll"] is True
    for panel in _panels(board):
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            for target in panel["targets"]:
                assert target["datasource"] == panel["datasource"]


def test_panel_ids_are_unique_and_every_panel_is_described(board: dict[str, Any]) -> None:
    panels = list(_panels(board))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel.get("description", "").strip(), f"{panel['title']} has no description"
        assert "\n" not in panel["description"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_rates_use_the_rate_interval(board: dict[str, Any]) -> None:
    for where, expression in _expressions(board):
        for window in re.findall(r"\[([^\]]*)\]", expression):
            assert window.startswith("$__rate_interval"), f"{where}: [{window}]"


def test_no_panel_overlaps_another(board: dict[str, Any]) -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


AREAS: dict[str, tuple[str, ...]] = {
    # area: patterns of which some panel's expressions must match every one
    "throughput out by outcome": (r"sum by \(outcome\) \(rate\(correlation_messages_total",),
    "throughput in (estimated)": (r"deriv\(", r"correlation_messages_by_state", r'outcome="success"'),
    "backlog by state": (r"max by \(state\) \(correlation_messages_by_state",),
    "oldest eligible message": (r"max\(correlation_oldest_eligible_message_age_seconds",),
    "backlog by message name": (r"correlation_backlog_messages",),
    "outcomes by message name": (r"sum by \(message_name, outcome\) \(rate\(correlation_messages_total",),
    "call latency p50": (
        r"histogram_quantile\(0\.5, sum by \(message_name, le\) .*correlation_call_duration_seconds_bucket",
    ),
    "call latency p90": (r"histogram_quantile\(0\.9, sum by \(message_name, le\)",),
    "call latency p99": (r"histogram_quantile\(0\.99, sum by \(message_name, le\)",),
    "retries and dead letters": (r'outcome=~"retry\|dead\|buffered\|rescheduled"',),
    "poison messages": (r"correlation_poison_messages_total",),
    "slots per replica": (r"sum by \(instance\) \(correlation_slots_held",),
    "lease acquisitions": (r"correlation_lease_acquisitions_total",),
    "lease losses": (r"correlation_lease_losses_total",),
    "stalled slots": (r"correlation_stalled_slots",),
    "hung calls": (r"correlation_hung_calls",),
    "busy lanes": (r"correlation_busy_lanes",),
    "target circuit": (r"correlation_target_open",),
    "target answers": (r"sum by \(target, answer\) .*correlation_target_answers_total",),
    "target held": (r"correlation_target_held_total",),
    "target concurrency": (r"correlation_target_concurrency_limit",),
    "target auth failures": (r"correlation_target_auth_failures_total",),
    "database errors by kind": (r"sum by \(kind\) \(rate\(correlation_database_errors_total",),
    "schedule fires": (r"correlation_schedule_fires_total",),
    "schedule misfires": (r"correlation_schedule_misfires_total",),
    "invalid schedules": (r"correlation_schedules_invalid",),
    "scheduler enabled": (r"correlation_scheduler_enabled",),
    "next fire": (r"correlation_schedule_next_fire_timestamp_seconds",),
}


@pytest.mark.parametrize("area", sorted(AREAS))
def test_the_dashboard_shows_what_an_operator_needs(board: dict[str, Any], area: str) -> None:
    panels = [panel for panel in _panels(board) if panel["type"] != "row"]
    matching = [
        panel["title"]
        for panel in panels
        if all(
            any(re.search(pattern, target["expr"]) for target in panel["targets"]) for pattern in AREAS[area]
        )
    ]
    assert matching, f"no panel shows {area}"


def test_rows_group_the_areas(board: dict[str, Any]) -> None:
    rows = [panel["title"] for panel in board["panels"] if panel["type"] == "row"]
    for title in ("Throughput", "Backlog", "Call latency", "Retries, dead letters and poison", "Database", "Schedules"):
        assert title in rows
    assert any("Slots" in row for row in rows) and any("Targets" in row for row in rows)


# --- Helm ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url_values(values_file: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """The minimal values of an install: a database URL."""
    return values_file("url-values.yaml")


def _configmaps(manifests: list[Manifest]) -> list[Manifest]:
    return [
        manifest
        for manifest in manifests
        if manifest["kind"] == "ConfigMap" and CONFIGMAP_KEY in manifest.get("data", {})
    ]


def test_chart_renders_no_dashboard_by_default(
    render: Callable[..., list[Manifest]], url_values: dict[str, Any]
) -> None:
    assert [manifest for manifest in render(url_values) if manifest["kind"] == "ConfigMap"] == []


def test_chart_renders_the_dashboard_for_the_grafana_sidecar(
    render: Callable[..., list[Manifest]], url_values: dict[str, Any], repo_root: Path
) -> None:
    (configmap,) = _configmaps(render({**url_values, "grafanaDashboard": {"enabled": True}}))
    metadata = configmap["metadata"]
    assert metadata["name"] == "orders-correlation-worker-dashboard"
    assert metadata["namespace"] == "correlation"
    assert metadata["labels"]["grafana_dashboard"] == "1"
    assert metadata["labels"]["app.kubernetes.io/instance"] == "orders"
    assert "annotations" not in metadata
    shipped = (repo_root / JSON_FILES[1]).read_text(encoding="utf-8")
    assert configmap["data"][CONFIGMAP_KEY] == shipped.rstrip("\n")
    assert json.loads(configmap["data"][CONFIGMAP_KEY])["uid"] == "correlation-worker"


def test_dashboard_configmap_honours_namespace_labels_and_annotations(
    render: Callable[..., list[Manifest]], url_values: dict[str, Any]
) -> None:
    values = {
        **url_values,
        "grafanaDashboard": {
            "enabled": True,
            "namespace": "monitoring",
            "labels": {"grafana_dashboard": "correlation"},
            "annotations": {"grafana_folder": "Correlation"},
        },
    }
    (configmap,) = _configmaps(render(values))
    metadata = configmap["metadata"]
    assert metadata["namespace"] == "monitoring"
    assert metadata["labels"]["grafana_dashboard"] == "correlation"
    assert metadata["annotations"] == {"grafana_folder": "Correlation"}


@pytest.mark.parametrize("kubernetes_version", ["1.25.0", "latest"])
def test_dashboard_configmap_is_a_valid_kubernetes_object(
    render: Callable[..., list[Manifest]], url_values: dict[str, Any], kubernetes_version: str
) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (pip install kubernetes-validate)"
    )
    if kubernetes_version == "latest":
        kubernetes_version = kubernetes_validate.utils.latest_version()
    values = {**url_values, "grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "Correlation"}}}
    (configmap,) = _configmaps(render(values))
    try:
        kubernetes_validate.validate(configmap, kubernetes_version, strict=True)
    except kubernetes_validate.ValidationError as error:
        pytest.fail(f"ConfigMap: {'.'.join(str(part) for part in error.path)}: {error.message}")
    assert len(json.dumps(configmap)) < 1024 * 1024  # a ConfigMap holds at most 1 MiB


def test_chart_with_the_dashboard_lints_and_the_schema_refuses_a_bad_setting(
    helm: Any, chart: Any, url_values: dict[str, Any], repo_root: Path
) -> None:
    chart_dir = repo_root / "helm" / "correlation-worker"
    enabled = {**url_values, "grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "Correlation"}}}
    report = helm.lint(chart_dir, enabled, strict=True, namespace="correlation")
    assert report["errors"] == []
    assert [message for message in report["messages"] if message["severity"] >= 2] == []
    chart.validate_schema(enabled)
    bad_settings: list[dict[str, Any]] = [
        {"enabled": "yes"},
        {"namespace": "Not A Namespace"},
        {"label": {}},
        {"labels": {"a": 1}},
    ]
    for bad in bad_settings:
        with pytest.raises(helm.HelmValuesError, match="/grafanaDashboard"):
            chart.validate_schema({**url_values, "grafanaDashboard": bad})


def test_helmignore_keeps_the_dashboards(repo_root: Path) -> None:
    patterns = (repo_root / "helm" / "correlation-worker" / ".helmignore").read_text().split()
    assert not any(pattern.strip("/") in ("dashboards", "*.json") for pattern in patterns)


# --- Compose -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grafana(compose_project: dict[str, Any]) -> dict[str, Any]:
    """The resolved grafana service."""
    service: dict[str, Any] = compose_project["services"]["grafana"]
    return service


def test_compose_grafana_is_a_pinned_image_on_localhost_3000(grafana: dict[str, Any]) -> None:
    image, _, tag = grafana["image"].partition(":")
    assert image in ("grafana/grafana", "docker.io/grafana/grafana")
    assert re.fullmatch(r"\d+\.\d+\.\d+", tag), grafana["image"]
    (port,) = grafana["ports"]
    assert (port["host_ip"], port["published"], port["target"]) == ("127.0.0.1", "3000", 3000)
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_started"


def test_compose_grafana_mounts_the_provisioning_and_the_dashboard_read_only(
    grafana: dict[str, Any], repo_root: Path
) -> None:
    binds = {
        volume["target"]: volume
        for volume in grafana["volumes"]
        if volume["type"] == "bind"
    }
    provisioning = binds["/etc/grafana/provisioning"]
    assert Path(provisioning["source"]) == repo_root / "deploy" / "grafana" / "provisioning"
    dashboard = binds["/etc/grafana/dashboards/correlation-worker.json"]
    assert Path(dashboard["source"]) == repo_root / JSON_FILES[0]
    assert provisioning["read_only"] and dashboard["read_only"]


def test_grafana_provisions_the_prometheus_service_and_the_dashboard_folder(
    load_yaml: Callable[[str], list[Any]], repo_root: Path, compose_project: dict[str, Any]
) -> None:
    provisioning = repo_root / "deploy" / "grafana" / "provisioning"
    (datasources,) = load_yaml((provisioning / "datasources" / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    assert "prometheus" in compose_project["services"]
    assert source["uid"] and source["isDefault"] is True
    (dashboards,) = load_yaml((provisioning / "dashboards" / "correlation-worker.yml").read_text())
    (provider,) = dashboards["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/etc/grafana/dashboards"
