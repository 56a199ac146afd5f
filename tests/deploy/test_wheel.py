"""The wheel a plain ``pip install .`` builds: silent, and carrying every data file the package reads at run time
(the schema's DDL, the console's templates and static files)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIRECTORIES = {  # where the files are in the source tree -> where the installed package reads them
    REPO_ROOT / "schema" / "ddl": "worker/migrations/ddl",
    REPO_ROOT / "worker" / "admin" / "templates": "worker/admin/templates",
    REPO_ROOT / "worker" / "admin" / "static": "worker/admin/static",
}


def test_the_wheel_builds_without_setuptools_warnings_and_ships_every_data_file(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy, so that the build leaves nothing behind in the work tree
    shutil.copytree(REPO_ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info",
                                                                      "__pycache__", ".pytest_cache"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--verbose", "--no-deps", "--wheel-dir", str(tmp_path), str(source)],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    output = built.stdout + built.stderr
    assert "Package would be ignored" not in output, output[-6000:]
    assert "_Warning" not in output and "SetuptoolsDeprecationWarning" not in output, output[-6000:]

    [wheel] = tmp_path.glob("correlation_worker-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"{installed}/{path.name}"
        for directory, installed in DATA_DIRECTORIES.items()
        for path in directory.iterdir()
        if path.is_file()
    }
    assert len(expected) > 10
    assert expected - shipped == set()
