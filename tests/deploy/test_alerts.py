"""The alerting rules (deploy/alerts.yml, the chart's PrometheusRule) and the KEDA ScaledObject.

The rules are unit-tested by Prometheus' own `promtool test rules` (deploy/alerts.test.yml: a series that fires
each alert and one that must not) and checked with `promtool check rules` however the chart's thresholds are set.
promtool is Debian's `prometheus` package: scripts/test installs it; CORRELATION_TEST_SKIP_PROMTOOL=1 skips these
tests on purpose instead.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from tests.deploy.conftest import metric_names_in

RELEASE = "orders"
NAMESPACE = "correlation"
FULLNAME = f"{RELEASE}-correlation-worker"
URL = {"database": {"url": "postgresql+psycopg://u:p@db:5432/x"}}
PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"

Manifest = dict[str, Any]


@pytest.fixture(scope="session")
def promtool() -> str:
    """The promtool executable (Debian's `prometheus` package)."""
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CORRELATION_TEST_SKIP_PROMTOOL"):
            pytest.skip("CORRELATION_TEST_SKIP_PROMTOOL is set: the alerting rules are not run through promtool")
        pytest.fail("promtool is not installed (apt-get install prometheus; scripts/test does it), "
                    "or set CORRELATION_TEST_SKIP_PROMTOOL=1 to skip these tests on purpose")
    return found


@pytest.fixture(scope="module")
def alerts_module(repo_root: Path) -> ModuleType:
    """deploy/alerts.py, which renders the chart's rules."""
    pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install helm-python-sdk)")
    spec = importlib.util.spec_from_file_location("deploy_alerts", repo_root / "deploy" / "alerts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rules(repo_root: Path) -> list[dict[str, Any]]:
    """The alerting rules of deploy/alerts.yml."""
    groups = yaml.safe_load((repo_root / "deploy" / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _check_rules(promtool: str, groups: list[dict[str, Any]], folder: Path) -> subprocess.CompletedProcess[str]:
    path = folder / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False)


def _only(manifests: list[Manifest], kind: str) -> Manifest:
    found = [manifest for manifest in manifests if manifest["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} manifests"
    return found[0]


# --- deploy/alerts.yml ------------------------------------------------------------------------------------------


def test_promtool_unit_tests_of_every_rule_pass(promtool: str, repo_root: Path) -> None:
    result = subprocess.run(
        [promtool, "test", "rules", "alerts.test.yml"], cwd=repo_root / "deploy",
        capture_output=True, text=True, check=False, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_promtool_unit_tests_fail_for_a_rule_that_does_not_fire(promtool: str, repo_root: Path, tmp_path: Path) -> None:
    # Guards the guard: the same tests against rules with a threshold no series reaches fail.
    broken = (repo_root / "deploy" / "alerts.yml").read_text().replace("> 900", "> 900000")
    assert broken != (repo_root / "deploy" / "alerts.yml").read_text()
    (tmp_path / "alerts.yml").write_text(broken)
    shutil.copy(repo_root / "deploy" / "alerts.test.yml", tmp_path / "alerts.test.yml")
    result = subprocess.run(
        [promtool, "test", "rules", "alerts.test.yml"], cwd=tmp_path, capture_output=True, text=True, check=False,
        timeout=120,
    )
    assert result.returncode != 0
    assert "CorrelationOldestMessageTooOld" in result.stdout + result.stderr


def test_every_alert_has_a_case_that_fires_it_and_one_that_must_not(
    repo_root: Path, rules: list[dict[str, Any]]
) -> None:
    tests = yaml.safe_load((repo_root / "deploy" / "alerts.test.yml").read_text())["tests"]
    fired: set[str] = set()
    silent: set[str] = set()
    for test in tests:
        for case in test["alert_rule_test"]:
            (fired if case.get("exp_alerts") else silent).add(case["alertname"])
    names = {rule["alert"] for rule in rules}
    assert names - fired == set(), "alerts no test fires"
    assert names - silent == set(), "alerts no test expects to stay silent"
    assert fired | silent <= names, "tests of alerts that do not exist"


def test_the_plain_prometheus_rules_are_the_charts_rendered_with_its_defaults(
    alerts_module: ModuleType, repo_root: Path
) -> None:
    committed = (repo_root / "deploy" / "alerts.yml").read_text()
    assert committed == alerts_module.alerts_yaml(), "deploy/alerts.yml is stale: run .venv/bin/python deploy/alerts.py"


def test_every_rule_selects_only_metrics_the_worker_exports(
    rules: list[dict[str, Any]], sample_names: set[str]
) -> None:
    for rule in rules:
        unknown = metric_names_in(rule["expr"]) - sample_names
        assert unknown == set(), f"{rule['alert']} selects metrics the worker does not export: {unknown}"
    # Guards the guard: a misspelt name is caught, label values and functions are not taken for names.
    assert metric_names_in('rate(correlation_mesages_total{outcome="correlation_x"}[5m])') == {
        "correlation_mesages_total"
    }
    assert "correlation_mesages_total" not in sample_names


def test_every_alert_has_a_severity_a_summary_a_description_and_a_runbook(
    rules: list[dict[str, Any]], repo_root: Path
) -> None:
    operations = (repo_root / "docs" / "operations.md").read_text()
    for rule in rules:
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        assert f"\n### {rule['alert']}\n" in operations, f"no runbook section for {rule['alert']} in docs/operations.md"


def test_compose_prometheus_loads_the_rules(promtool: str, repo_root: Path, compose_project: dict[str, Any]) -> None:
    result = subprocess.run(
        [promtool, "check", "config", "prometheus.yml"], cwd=repo_root / "deploy",
        capture_output=True, text=True, check=False, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "21 rules found" in result.stdout or "rules found" in result.stdout
    config = yaml.safe_load((repo_root / "deploy" / "prometheus.yml").read_text())
    (rule_file,) = config["rule_files"]
    mounts = {volume["target"]: volume["source"] for volume in compose_project["services"]["prometheus"]["volumes"]}
    assert Path(mounts[f"/etc/prometheus/{rule_file}"]) == repo_root / "deploy" / "alerts.yml"


# --- the chart's PrometheusRule ---------------------------------------------------------------------------------


def test_no_prometheus_rule_unless_enabled(render: Callable[..., list[Manifest]]) -> None:
    assert [m for m in render(URL) if m["kind"] == "PrometheusRule"] == []


def test_the_prometheus_rule_carries_the_rules_with_their_labels_and_runbooks(
    render: Callable[..., list[Manifest]], values_file: Callable[[str], dict[str, Any]],
    rules: list[dict[str, Any]], promtool: str, tmp_path: Path,
) -> None:
    values = values_file("monitoring-values.yaml")
    rule = _only(render(values), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["name"] == FULLNAME
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert set(rule["spec"]) == {"groups"}
    (group,) = rule["spec"]["groups"]
    assert set(group) == {"name", "rules"}
    rendered = {r["alert"]: r for r in group["rules"]}
    assert rendered.keys() == {r["alert"] for r in rules}
    for name, alert in rendered.items():
        assert set(alert) <= {"alert", "expr", "for", "labels", "annotations"}
        assert alert["labels"]["team"] == "payments"
        assert alert["annotations"]["runbook_url"] == (
            f"https://docs.example.com/correlation-worker/operations/#{name.lower()}"
        )
    assert "> 300" in rendered["CorrelationOldestMessageTooOld"]["expr"]
    checked = _check_rules(promtool, rule["spec"]["groups"], tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_thresholds_disabled_alerts_and_added_labels_come_from_values(
    render: Callable[..., list[Manifest]], promtool: str, tmp_path: Path
) -> None:
    values = {
        **URL,
        "prometheusRule": {
            "enabled": True,
            "disabled": ["CorrelationListenerDown", "CorrelationWorkerDown"],
            "ruleLabels": {"severity": "page", "team": "orders"},
            "thresholds": {"stalledFor": "30m", "slots": 1, "leaseLosses": 10, "targetOpenFor": "2m",
                           "scheduleOverdueSeconds": 600, "handlerTimeouts": 0, "deadWindow": "1h"},
        },
    }
    (group,) = _only(render(values), "PrometheusRule")["spec"]["groups"]
    rendered = {r["alert"]: r for r in group["rules"]}
    assert "CorrelationListenerDown" not in rendered and "CorrelationWorkerDown" not in rendered
    assert "increase(correlation_messages_total[30m])" in rendered["CorrelationBacklogStalled"]["expr"]
    assert rendered["CorrelationBacklogStalled"]["annotations"]["summary"].endswith("for 30m")
    assert rendered["CorrelationSlotsUnheld"]["expr"].endswith("< 1")
    assert rendered["CorrelationLeasesLost"]["expr"].endswith("> 10")
    assert rendered["CorrelationTargetUnreachable"]["for"] == "2m"
    assert rendered["CorrelationScheduleOverdue"]["expr"].endswith("> 600")
    assert "offset 1h" in rendered["CorrelationDeadLetters"]["expr"]
    # The alert's own severity is kept; the other labels are added.
    assert {r["labels"]["severity"] for r in rendered.values()} == {"critical", "warning"}
    assert {r["labels"]["team"] for r in rendered.values()} == {"orders"}
    assert all("runbook_url" not in r["annotations"] for r in rendered.values())
    checked = _check_rules(promtool, [group], tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize(
    "thresholds",
    [
        pytest.param({"stalledFor": "ten minutes"}, id="not-a-duration"),
        pytest.param({"stalledFor": "1.5m"}, id="a-fraction-prometheus-refuses"),
        pytest.param({"slots": 65}, id="more-slots-than-the-schema-has"),
        pytest.param({"oldestMessageSeconds": "900"}, id="a-number-as-text"),
        pytest.param({"oldestMesageSeconds": 900}, id="misspelt"),
    ],
)
def test_the_schema_refuses_a_bad_threshold(chart: Any, thresholds: dict[str, Any]) -> None:
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError, match="prometheusRule"):
        chart.validate_schema({**URL, "prometheusRule": {"enabled": True, "thresholds": thresholds}})


def test_the_schema_refuses_an_unknown_alert_to_leave_out(chart: Any) -> None:
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError, match="disabled"):
        chart.validate_schema({**URL, "prometheusRule": {"disabled": ["ListenerDown"]}})


# --- KEDA ---------------------------------------------------------------------------------------------------


def _keda(**keda: Any) -> dict[str, Any]:
    return {**URL, "keda": {"enabled": True, "prometheus": {"serverAddress": PROMETHEUS}, **keda}}


def test_no_scaled_object_unless_enabled_and_the_deployment_keeps_its_replica_count(
    render: Callable[..., list[Manifest]]
) -> None:
    manifests = render({**URL, "replicaCount": 3})
    assert [m for m in manifests if m["kind"] == "ScaledObject"] == []
    assert _only(manifests, "Deployment")["spec"]["replicas"] == 3


def test_the_scaled_object_scales_the_workers_on_the_ready_backlog_and_owns_their_count(
    render: Callable[..., list[Manifest]], promtool: str, sample_names: set[str], tmp_path: Path
) -> None:
    manifests = render(_keda(maxReplicas=12, readyMessagesPerReplica=500))
    scaled = _only(manifests, "ScaledObject")
    deployment = _only(manifests, "Deployment")
    assert "replicas" not in deployment["spec"], "KEDA owns the replica count: an upgrade must not reset it"
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": deployment["metadata"]["name"]}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 12)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    metadata = trigger["metadata"]
    assert metadata["serverAddress"] == PROMETHEUS
    assert metadata["threshold"] == "500"
    assert all(isinstance(value, str) for value in metadata.values()), "KEDA's trigger metadata are strings"
    query = metadata["query"]
    assert f'namespace="{NAMESPACE}"' in query and f'job="{FULLNAME}"' in query and 'state="ready"' in query
    assert metric_names_in(query) <= sample_names
    checked = _check_rules(promtool, [{"name": "keda", "rules": [{"record": "keda:query", "expr": query}]}], tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_scale_down_lets_a_departed_replicas_slots_be_taken_over_before_the_next_goes(
    render: Callable[..., list[Manifest]]
) -> None:
    spec = _only(render(_keda()), "ScaledObject")["spec"]
    (policy,) = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["policies"]
    assert policy == {"type": "Pods", "value": 1, "periodSeconds": 120}
    assert spec["cooldownPeriod"] == 60 + 45  # terminationGracePeriodSeconds + a lease term


@pytest.mark.parametrize(
    ("keda", "message"),
    [
        pytest.param({"prometheus": {"serverAddress": ""}}, "serverAddress is required", id="no-prometheus"),
        pytest.param({"scaleDown": {"periodSeconds": 60}}, r"periodSeconds \(60\) must be at least", id="too-quick"),
        pytest.param({"minReplicas": 5, "maxReplicas": 3}, "must not exceed", id="min-above-max"),
    ],
)
def test_the_chart_refuses_autoscaling_that_would_break_the_cluster(
    render: Callable[..., list[Manifest]], keda: dict[str, Any], message: str
) -> None:
    import helm_python as helm

    values = _keda(**keda)
    if "prometheus" in keda:
        values["keda"]["prometheus"] = keda["prometheus"]
    with pytest.raises(helm.HelmError, match=message):
        render(values)


@pytest.mark.parametrize(
    "keda",
    [
        pytest.param({"minReplicas": 0}, id="scale-to-zero-stops-the-scheduler"),
        pytest.param({"maxReplicas": 65}, id="more-replicas-than-slots"),
        pytest.param({"prometheus": {"serverAddress": "prometheus:9090"}}, id="address-without-scheme"),
    ],
)
def test_the_schema_refuses_bad_autoscaling_values(chart: Any, keda: dict[str, Any]) -> None:
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError, match="keda"):
        chart.validate_schema({**URL, "keda": {"enabled": True, **keda}})
